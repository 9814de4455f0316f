"""ninfer-serve: OpenAI-compatible HTTP over the NInfer engine."""

from ninfer_serve.app import create_app
from ninfer_serve.client import EngineClient
from ninfer_serve.config import ServeConfig

__all__ = ["EngineClient", "ServeConfig", "create_app"]
