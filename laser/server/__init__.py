"""OpenAI-compatible HTTP server: ``build_app(AsyncEngine(engine))``; ``laser serve`` runs it."""

from __future__ import annotations


def build_app(*args, **kwargs):
    """See :func:`laser.server.app.build_app` (imported lazily: FastAPI is only needed to serve)."""
    from .app import build_app as _build

    return _build(*args, **kwargs)


__all__ = ["build_app"]
