"""Server test helpers: a real uvicorn server on a free loopback port, in a thread.

`make_engine` is the one place that decides which engine the end-to-end tests drive; the tests
written against it assert only what any engine must satisfy. Tests of scripted behaviour
(reasoning, tool calls, faults) use `FakeEngine` explicitly through `start_server`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fake_engine import FakeEngine

from ninfer_runtime.engine.config import EngineConfig
from ninfer_serve import ServeConfig, create_app
from ninfer_serve.client import Engine

MODEL = "tiny-test"
ENGINE_CONFIG = EngineConfig(max_context=2048, max_concurrency=4, max_queue=8, device="cpu")


def make_engine() -> Engine:
    """The engine behind the `server` fixture. To run the end-to-end tests on the real engine:
    return Engine.from_artifact(default_artifact(), ENGINE_CONFIG)."""
    return FakeEngine(ENGINE_CONFIG, step_delay=0.002)


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    app: object

    @property
    def api(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def start_server(engine_factory: Callable[[], Engine], config: ServeConfig,
                 wait_ready: bool = True) -> Iterator[Server]:
    """Run the app under uvicorn in a thread until the block exits."""
    app = create_app(config, engine_factory)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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
