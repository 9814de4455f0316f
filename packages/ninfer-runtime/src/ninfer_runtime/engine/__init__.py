"""The continuous-batching engine: requests in, tokens out, one scheduler step at a time.

`Engine` is imported lazily so that the light modules here (config, request, batch, which the
server and the model layer import) do not pull in the model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.request import (
    AdmissionError,
    EngineRequest,
    RequestOutput,
    RequestStats,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from ninfer_runtime.engine.engine import Engine

__all__ = ["AdmissionError", "Engine", "EngineConfig", "EngineRequest", "RequestOutput",
           "RequestStats", "SamplingParams", "TokenLogprob"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from ninfer_runtime.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'ninfer_runtime.engine' has no attribute {name!r}")
