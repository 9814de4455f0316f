"""Server lifecycle: every server the bench starts is stopped with everything it started, when
the warm-up fails, when it never becomes healthy, when it exits, and on Ctrl-C; --url measures
a running server instead (here the stand-in of fake_server.py, which reports no NInfer timings).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from ninfer_bench.suites.common import Run

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
FAKE = shlex.join([sys.executable, str(FAKE_SERVER)])


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_stopped(pids_file: Path) -> None:
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2  # the server and its child
    deadline = time.monotonic() + 10  # init reaps the orphaned child in its own time
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


@pytest.fixture
def dummy_artifact(tmp_path: Path) -> Path:
    path = tmp_path / "fake.ninfer"
    path.write_bytes(b"not read by the fake server")
    return path


def corpus_args(artifact: Path, out: Path, *extra: str) -> list[str | Path]:
    return ["corpus", "--serve", FAKE, "--artifact", f"fake={artifact}", "--fixtures",
            "code_c_ringbuf", "--seeds", "1", "--output", out, *extra]


@pytest.mark.parametrize(("mode", "message"), [
    ("chat-500", "the warm-up failed: HTTP 500: injected failure"),
    ("hang", "was not healthy within 1 s"),
    ("exit", "exited with status 3"),
])
def test_a_failing_server_is_stopped_and_named(mode: str, message: str, bench: Callable,
                                               fake_serve: Callable, dummy_artifact: Path,
                                               tmp_path: Path) -> None:
    pids = fake_serve(mode)
    result = bench(*corpus_args(dummy_artifact, tmp_path / "out", "--startup-timeout", "1"))
    assert result.exit_code == 1
    assert message in result.output
    if mode == "exit":
        assert "fake server starting" in result.output  # the end of the server's log
    assert_stopped(pids)
    assert (tmp_path / "out" / "logs" / "corpus-fake-c1.log").is_file()


def test_ctrl_c_stops_the_server(bench: Callable, fake_serve: Callable, dummy_artifact: Path,
                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = fake_serve("ok")

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Run, "execute", interrupted)
    result = bench(*corpus_args(dummy_artifact, tmp_path / "out"))
    assert result.exit_code == 1 and "Aborted" in result.output
    assert_stopped(pids)
    assert (tmp_path / "out" / "summary.json").is_file()  # what was measured is kept


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_url_measures_a_running_server_without_ninfer_timings(
        bench: Callable, fake_serve: Callable, tmp_path: Path) -> None:
    fake_serve("ok")
    port = _free_port()
    server = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port)],
                              start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        out = tmp_path / "out"
        result = bench("corpus", "--url", url, "--fixtures", "code_c_ringbuf", "--seeds", "2",
                       "--output", out)
        assert result.exit_code == 0, result.output
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the server and its child
        server.wait()
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert all(r["ninfer"] is None and set(r["metrics"].values()) == {None} for r in records)
    assert [r["completion_tokens"] for r in records] == [3, 3]  # from usage
    summary = json.loads((out / "summary.json").read_text())
    [point] = summary["points"]
    assert point["command"] is None and point["vllm"]["completed"] == 2
    assert point["vllm"]["mean_ttft_ms"] is None  # neither streamed nor timed by the server
    assert summary["meta"]["targets"][0]["description"] == f"the server at {url}"
    assert "| Code | 2 | — |" in (out / "report.md").read_text()
