"""The OpenAI-compatible HTTP service (FastAPI): `create_app(settings)`; `csd serve` runs it."""

from service.api.app import create_app

__all__ = ["create_app"]
