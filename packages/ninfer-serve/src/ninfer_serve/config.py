"""Server settings, resolved by the CLI (or a test) before the app is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_runtime.engine.config import EngineConfig

MAX_BODY_BYTES = 32 * 2**20


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_key: str | None = None  # when set, every route but /health and /metrics needs it
    max_body_bytes: int = MAX_BODY_BYTES
