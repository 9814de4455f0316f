"""A fresh ninfer-serve per measured point: started, waited for, and always stopped.

The server runs in its own process group (its own session), so stopping it reaches whatever it
started, and a Ctrl-C in the terminal reaches only the bench, which then stops the server in its
`finally`. Its output goes to a log file beside the results; a server that exits or does not
become healthy in time is reported with the end of that log.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from ninfer_bench.settings import KV_DTYPE, MODES, PREFILL_CHUNK

HEALTH_POLL_S = 0.25
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 30


class ServerError(RuntimeError):
    """ninfer-serve exited, or did not become healthy within the startup timeout."""


@dataclass(frozen=True)
class ServerSpec:
    serve: tuple[str, ...]  # the command, e.g. ("ninfer-serve",)
    artifact: Path
    name: str  # served model name
    mode: str
    max_context: int
    max_concurrency: int
    kv_capacity: str

    def command(self, port: int) -> list[str]:
        return [*self.serve, str(self.artifact), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", self.name, "--max-context", str(self.max_context),
                "--prefill-chunk", str(PREFILL_CHUNK), "--kv-dtype", KV_DTYPE,
                "--kv-capacity", self.kv_capacity,
                "--max-concurrency", str(self.max_concurrency), *MODES[self.mode]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if process.poll() is not None:
            raise ServerError(f"ninfer-serve exited with status {process.returncode}; "
                              f"the end of {log}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise ServerError(f"ninfer-serve was not healthy within {timeout_s:.0f} s; "
                              f"the end of {log}:\n{log_tail(log)}")
        time.sleep(HEALTH_POLL_S)


def stop(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's process group (uvicorn shuts down as on Ctrl-C), SIGKILL to
    whatever is left of the group after `grace_s`."""
    with suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(process.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        process.wait(grace_s)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextmanager
def running(spec: ServerSpec, log: Path, startup_timeout_s: float) -> Iterator[tuple[str, str]]:
    """Start `spec`, wait for /health, yield its base URL and command line; stop it however
    the block ends."""
    port = free_port()
    command = spec.command(port)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(shlex.join(command) + "\n")
        out.flush()
        try:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise ServerError(f"cannot start {command[0]!r}: {e}") from e
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, startup_timeout_s, log)
        yield url, shlex.join(command)
    finally:
        stop(process)
