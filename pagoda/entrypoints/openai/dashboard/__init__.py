"""The live dashboard: ``GET /dashboard`` (a page served from this package's ``static/``),
``GET /dashboard/api/state`` (the JSON snapshot it polls, also read by ``pagoda top``).

The page and its assets hold no data and are open; the snapshot needs the API key like the rest
of the API (the page asks for the key in a form and sends it as a bearer token). This module
names the paths only, so ``pagoda top`` can import it without the server's dependencies;
``history`` and ``routes`` hold the code.
"""
DASHBOARD_PATH = "/dashboard"
STATE_PATH = "/dashboard/api/state"
STATIC_PREFIX = "/dashboard/static/"
