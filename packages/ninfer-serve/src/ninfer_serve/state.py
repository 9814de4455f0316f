"""What the routes share, kept on `app.state.ninfer` (no module globals, STYLE.md §15)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from ninfer_serve.client import EngineClient
from ninfer_serve.config import ServeConfig
from ninfer_serve.metrics import Metrics


@dataclass(frozen=True)
class ServerState:
    config: ServeConfig
    client: EngineClient
    metrics: Metrics
    created: int  # unix time the app was built (the model's "created" in /v1/models)


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state of the app serving `request`."""
    return request.app.state.ninfer


State = Annotated[ServerState, Depends(server_state)]
