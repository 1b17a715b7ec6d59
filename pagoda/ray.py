"""pagoda on Ray Serve: ``serve run pagoda.ray:build_app model=DIR num_replicas=2``.

``build_app`` takes ``pagoda serve``'s flags as Serve application args (``num_replicas: 2``
for ``--num-replicas 2``) and returns the application: an ingress in front of pagoda engine
replicas with prefix-aware routing. Needs ``pip install 'pagoda[ray]'``.
"""
from __future__ import annotations

from pagoda.entrypoints.ray.app import build_app, build_application, parse_config

__all__ = ["build_app", "build_application", "parse_config"]
