"""Anthropic's Messages API (``/v1/messages``), a thin translator over the chat route."""
from __future__ import annotations

from pagoda.entrypoints.anthropic.routes import install

__all__ = ["install"]
