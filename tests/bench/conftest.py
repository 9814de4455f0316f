"""Fixtures of the bench tests: the embedded default artifact, the command that serves it on
the CPU, and `bench(...)`, which runs `ninfer-bench` in-process and returns its result."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ninfer_bench.cli import main


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ninfer_convert.demo import default_artifact

    return default_artifact(tmp_path_factory.mktemp("bench"))


@pytest.fixture
def serve() -> str:
    """ninfer-serve on the CPU, quiet; one torch thread per server (two xdist workers share
    two cores)."""
    return shlex.join([sys.executable, "-m", "ninfer_serve.cli", "--device", "cpu",
                       "--log-level", "warning"])


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def run(*args: str | Path) -> Result:
        return CliRunner().invoke(main, [str(a) for a in args])

    return run


@pytest.fixture
def fake_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[str], Path]:
    """fake_serve(mode) -> the file fake_server.py (run by the test) writes its and its
    child's pids to (see fake_server.py for the modes)."""

    def setup(mode: str) -> Path:
        pids = tmp_path / "pids"
        monkeypatch.setenv("FAKE_SERVE_MODE", mode)
        monkeypatch.setenv("FAKE_SERVE_PIDS", str(pids))
        return pids

    return setup
