"""Fixtures of the server tests (helpers in serve_helpers.py): the default artifact built once
per session, one server on the real engine and one on the scripted FakeEngine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fake_engine import FakeEngine
from serve_helpers import ENGINE_CONFIG, MODEL, Server, real_engine, start_server

from ninfer_serve import ServeConfig

# One thread per xdist worker: the tiny model gains nothing from more, and two workers (each
# with a server's engine thread) share two cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model (what `ninfer-serve` without ARTIFACT serves)."""
    from ninfer_convert.demo import default_artifact

    return default_artifact(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def server(artifact: Path) -> Iterator[Server]:
    with start_server(real_engine(artifact), ServeConfig(MODEL, ENGINE_CONFIG)) as s:
        yield s


@pytest.fixture(scope="session")
def scripted() -> Iterator[Server]:
    """A server on the scripted FakeEngine, for tests that need known output."""
    with start_server(lambda: FakeEngine(ENGINE_CONFIG), ServeConfig(MODEL, ENGINE_CONFIG)) as s:
        yield s
