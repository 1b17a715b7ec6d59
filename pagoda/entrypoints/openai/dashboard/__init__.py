"""The live dashboard: ``GET /dashboard`` (a page served from this package's ``static/``),
``GET /dashboard/api/state`` (the JSON snapshot it polls, also read by ``pagoda top``).

The page and its assets hold no data and are open; the snapshot needs the API key like the rest
of the API (the page asks for the key in a form and sends it as a bearer token).
"""
from pagoda.entrypoints.openai.dashboard.history import DashboardHistory
from pagoda.entrypoints.openai.dashboard.routes import DASHBOARD_PATH, STATE_PATH, STATIC_PREFIX, dashboard_routes

__all__ = ["DashboardHistory", "dashboard_routes", "DASHBOARD_PATH", "STATE_PATH", "STATIC_PREFIX"]
