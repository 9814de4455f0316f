"""Fixtures of the server tests (helpers in serve_helpers.py): one server on `make_engine`,
one on the scripted FakeEngine, each started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from serve_helpers import ENGINE_CONFIG, MODEL, Server, make_engine, start_server

from ninfer_serve import ServeConfig


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with start_server(make_engine, ServeConfig(MODEL, ENGINE_CONFIG)) as s:
        yield s


@pytest.fixture(scope="session")
def scripted() -> Iterator[Server]:
    """A server on the scripted FakeEngine, for tests that need known output."""
    with start_server(lambda: FakeEngine(ENGINE_CONFIG), ServeConfig(MODEL, ENGINE_CONFIG)) as s:
        yield s
