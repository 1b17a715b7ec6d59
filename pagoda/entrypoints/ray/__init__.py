"""pagoda on Ray Serve: engine replicas behind one OpenAI-compatible endpoint.

``args`` (the ``pagoda serve`` scale-out flags) and ``routing`` (the routing policies) import
no Ray; ``deployments``, ``router``, ``app`` and ``server`` need ``pip install 'pagoda[ray]'``.
The public application builder is ``pagoda.ray:build_app``.
"""
