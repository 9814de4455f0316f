"""EngineClient: the asyncio side's handle on the synchronous engine.

The engine is single-threaded and not thread-safe, so exactly one background thread owns it: the
thread builds it (the model loads while the HTTP server already answers, /health says 503), then
loops: apply the commands posted since the last step (add, abort, call), run one `step()` while
any request is unfinished, and sleep on a condition when there is nothing to do. Results go back
to the event loop with `call_soon_threadsafe`, one asyncio queue per API request (the n engine
requests of one API request share it).

Every engine access, including read-only ones like `intervals`, goes through that thread.
The only attributes read from other threads are the ones fixed at construction (tokenizer,
generation_config, model_config).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from ninfer_runtime.engine.request import EngineRequest, RequestOutput, RequestStats

log = logging.getLogger("ninfer_serve")
T = TypeVar("T")
LoadState = Literal["loading", "ready", "failed", "stopped"]


class Engine(Protocol):
    """What the server needs from `ninfer_runtime.engine.Engine`."""

    tokenizer: Any
    generation_config: dict
    model_config: Any

    def add_request(self, req: EngineRequest) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def intervals(self, since: float | None) -> list[dict]: ...
    def queue_depth(self) -> int: ...


class EngineUnavailable(RuntimeError):
    """The engine is still loading, failed to load, or was stopped."""


@dataclass(frozen=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]

    def put(self, output: RequestOutput) -> bool:
        """Hand `output` to the event loop; False when that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the loop was closed (server shut down)
            return False
        return True


@dataclass(frozen=True)
class Load:
    running: int  # admitted requests (prefilling or decoding)
    waiting: int  # submitted, not yet scheduled


class EngineClient:
    def __init__(self, engine_factory: Callable[[], Engine],
                 on_load_error: Callable[[BaseException], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        self._factory = engine_factory
        self._on_load_error = on_load_error
        self._on_ready = on_ready
        self._cond = threading.Condition()
        self._inbox: list[Callable[[Engine], None]] = []
        self._pending_adds = 0  # add commands posted, not yet applied
        self._sinks: dict[str, _Sink] = {}  # changed on the engine thread, under the lock
        self._queue_depth = 0  # engine.queue_depth() after the last step
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.state: LoadState = "loading"
        self.error: str | None = None
        self.engine: Engine | None = None

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = "stopped"

    def ready_engine(self) -> Engine:
        """The engine, or EngineUnavailable naming why there is none."""
        if self.state == "ready" and self.engine is not None:
            return self.engine
        if self.state == "failed":
            raise EngineUnavailable(f"the model failed to load: {self.error}")
        raise EngineUnavailable(f"the model is {self.state}")

    # ---- asyncio side ----

    async def add(self, request: EngineRequest, queue: asyncio.Queue[RequestOutput]) -> None:
        """Submit a request whose outputs go to `queue`; raises AdmissionError if it can never
        run. Returns once the engine has accepted it."""
        self.ready_engine()
        sink = _Sink(asyncio.get_running_loop(), queue)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._post(lambda engine: self._admit(engine, request, sink, done), adds=1)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request.request_id)  # posted after the add: applied after it
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request and free its resources; no output follows. Safe to call from any
        thread, for finished or unknown ids too."""
        self._post(lambda engine: self._abort(engine, request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread, between steps."""
        self.ready_engine()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run(engine: Engine) -> None:
            try:
                done.set_result(fn(engine))
            except Exception as e:  # handed to the awaiting coroutine
                done.set_exception(e)

        self._post(run)
        return await asyncio.wrap_future(done)

    def load(self) -> Load:
        with self._cond:
            active = len(self._sinks)
            waiting = min(self._queue_depth, active) + self._pending_adds
        return Load(running=active - min(self._queue_depth, active), waiting=waiting)

    def _post(self, command: Callable[[Engine], None], adds: int = 0) -> None:
        with self._cond:
            self._inbox.append(command)
            self._pending_adds += adds
            self._cond.notify()

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            engine = self._factory()
        except Exception as e:
            log.exception("model load failed")
            self.error = f"{type(e).__name__}: {e}"
            self.state = "failed"
            if self._on_load_error is not None:
                self._on_load_error(e)
            return
        self.engine = engine
        self.state = "ready"
        log.info("model loaded")
        if self._on_ready is not None:
            self._on_ready()
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, []
            for command in commands:
                try:
                    command(engine)
                except Exception:  # one bad command must not stop the loop
                    log.exception("engine command failed")
            if engine.has_unfinished():
                self._step(engine)
            with self._cond:
                self._queue_depth = engine.queue_depth()

    def _step(self, engine: Engine) -> None:
        try:
            outputs = engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(engine, f"engine fault: {type(e).__name__}: {e}")
            return
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if not sink.put(output) or output.finished:
                self._drop(output.request_id)
                if not output.finished:
                    engine.abort_request(output.request_id)

    def _admit(self, engine: Engine, request: EngineRequest, sink: _Sink,
               done: concurrent.futures.Future[None]) -> None:
        with self._cond:
            self._pending_adds -= 1
        try:
            engine.add_request(request)
        except Exception as e:  # AdmissionError, or a fault: the caller tells them apart
            done.set_exception(e)
            return
        with self._cond:
            self._sinks[request.request_id] = sink
        done.set_result(None)

    def _abort(self, engine: Engine, request_id: str) -> None:
        if request_id in self._sinks:
            self._drop(request_id)
            engine.abort_request(request_id)

    def _drop(self, request_id: str) -> None:
        with self._cond:
            self._sinks.pop(request_id, None)

    def _fail_all(self, engine: Engine, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            sink.put(RequestOutput(request_id, (), None, True, "error", RequestStats(), message))
            try:
                engine.abort_request(request_id)
            except Exception:
                log.exception("abort of %s after a fault failed", request_id)
            self._drop(request_id)
