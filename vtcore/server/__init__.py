"""The OpenAI-compatible HTTP server: ``build_app`` (the FastAPI app) and ``vtcore serve``."""
from __future__ import annotations

__all__ = ["build_app"]


def __getattr__(name: str):  # the app pulls in FastAPI: import it only when asked
    if name == "build_app":
        from vtcore.server.app import build_app

        return build_app
    raise AttributeError(f"module 'vtcore.server' has no attribute {name!r}")
