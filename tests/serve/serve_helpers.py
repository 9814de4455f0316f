"""Server test helpers: a real uvicorn server on a free loopback port, in a thread.

The end-to-end tests drive the real engine (`real_engine`) on the embedded default model (the
tiny_dense profile, random weights, NVFP4), so they assert only what holds for any text: greedy
determinism, token counts, finish reasons, errors. Tests that need known text (reasoning, tool
calls) use the scripted `FakeEngine` through `start_server`.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

from ninfer_runtime.engine import Engine, EngineConfig, EngineRequest
from ninfer_serve import ServeConfig, create_app
from ninfer_serve.state import ServerState

T = TypeVar("T")
MODEL = "tiny-test"
# Random weights rarely hit eos: every request gives a small max_tokens (or is aborted).
ENGINE_CONFIG = EngineConfig(max_context=2048, max_concurrency=4, max_queue=8, device="cpu")
FAULT_TRIGGER = "please crash"  # a prompt containing this makes the faulty engine's step raise


def real_engine(artifact: Path, config: EngineConfig = ENGINE_CONFIG) -> Callable[[], Engine]:
    """A factory of the real engine on `artifact` (what `ninfer-serve ARTIFACT` runs)."""
    return lambda: Engine.from_artifact(artifact, config)


def faulty_engine(artifact: Path, config: EngineConfig = ENGINE_CONFIG) -> Callable[[], Engine]:
    """A factory of the real engine whose model raises in the middle of a step (after admission
    reserved pages and a state slot) while a request whose prompt contains FAULT_TRIGGER runs."""

    def build() -> Engine:
        engine = Engine.from_artifact(artifact, config)
        assert engine.tokenizer is not None
        faulty: set[str] = set()
        add_request, forward_taps = engine.add_request, engine.model.forward_taps

        def add(req: EngineRequest) -> None:
            if FAULT_TRIGGER in engine.tokenizer.decode(list(req.prompt_token_ids)):
                faulty.add(req.request_id)
            add_request(req)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if faulty & engine.scheduler.running.keys():
                raise RuntimeError("injected fault")
            return forward_taps(*args, **kwargs)

        engine.add_request = add  # type: ignore[method-assign]
        engine.model.forward_taps = forward  # type: ignore[method-assign]
        return engine

    return build


@dataclass(frozen=True)
class PoolState:
    """What a request holds in the engine while it lives; equal to the idle values when none."""

    running: int
    waiting: int
    free_pages: int
    free_slots: int


def pool_state(engine: Engine) -> PoolState:
    return PoolState(engine.num_running(), engine.queue_depth(),
                     engine.kv_pool.allocator.num_free, engine.state_pool.allocator.num_free)


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    app: Any

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def on_engine(self, fn: Callable[[Any], T]) -> T:
        """`fn(engine)` run on the server's engine thread, between steps (the engine is not
        thread-safe, so tests read its pools only through here)."""
        state: ServerState = self.app.state.ninfer
        return asyncio.run(state.client.call(fn))


@contextmanager
def start_server(engine_factory: Callable[[], Any], config: ServeConfig,
                 wait_ready: bool = True) -> Iterator[Server]:
    """Run the app under uvicorn in a thread until the block exits."""
    app = create_app(config, engine_factory)
    # IPPROTO_TCP explicitly, as uvicorn's own sockets have it: asyncio sets TCP_NODELAY only on
    # connections of such sockets, and without it every response waits out a delayed ACK (40 ms)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: server.started, "server start")
        if wait_ready:
            _wait(lambda: httpx.get(f"{url}/health").status_code == 200, "model load")
        yield Server(url, app)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _wait(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll until `condition` holds (a bound on waiting, never a timing assertion)."""
    _wait(condition, what, timeout)
