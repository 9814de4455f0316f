"""ninfer-serve with speculative decoding: `--spec mtp --draft-tokens 3` serves the default
model (which carries its MTP layer) with the plain server's greedy text, reports the
speculative counters in each response's `ninfer.spec` and in /metrics under vLLM's names, and
the CLI flags reach the engine config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from serve_helpers import ENGINE_CONFIG, MODEL, Server, pool_state, real_engine, start_server
from test_serve_observability import metric, scrape

from ninfer_runtime.engine.config import EngineConfig
from ninfer_serve import ServeConfig, cli

SPEC = replace(ENGINE_CONFIG, spec="mtp", draft_tokens=3)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "count for me"}],
        "max_tokens": 9, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_server(artifact: Path) -> Iterator[Server]:
    with start_server(real_engine(artifact, SPEC), ServeConfig(MODEL, SPEC)) as s:
        yield s


def test_spec_serves_the_plain_text_with_counters(spec_server: Server, server: Server) -> None:
    before = scrape(spec_server)
    spec = httpx.post(f"{spec_server.api}/chat/completions", json=CHAT).json()
    plain = httpx.post(f"{server.api}/chat/completions", json=CHAT).json()
    after = scrape(spec_server)
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    assert spec["usage"]["completion_tokens"] == 9
    counters = spec["ninfer"]["spec"]
    assert counters["rounds"] >= 1 and counters["drafted_tokens"] == 3 * counters["rounds"]
    assert len(counters["accepted_per_position"]) == 3
    assert sum(counters["accepted_per_position"]) == counters["accepted_tokens"]
    assert plain["ninfer"]["spec"]["rounds"] == 0

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("ninfer:spec_decode_num_drafts_total") == counters["rounds"]
    assert delta("ninfer:spec_decode_num_draft_tokens_total") == counters["drafted_tokens"]
    assert delta("ninfer:spec_decode_num_accepted_tokens_total") == counters["accepted_tokens"]
    for position, accepted in enumerate(counters["accepted_per_position"]):
        name = "ninfer:spec_decode_num_accepted_tokens_per_pos_total"
        assert (name, (("position", str(position)),)) in after
        assert delta(name, position=str(position)) == accepted
    assert delta("ninfer:generation_tokens_total") == 9


def test_spec_streams_and_releases_its_slots(spec_server: Server) -> None:
    idle = spec_server.on_engine(pool_state)
    with httpx.stream("POST", f"{spec_server.api}/completions",
                      json={**CHAT, "messages": None, "prompt": "one two three",
                            "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert spec_server.on_engine(pool_state) == idle


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """Make model loads fail at once; returns the engine config each load was asked for."""
    seen: list[EngineConfig] = []

    def factory(path: Path | None, config: EngineConfig) -> Callable[[], object]:
        seen.append(config)

        def build() -> object:
            raise ValueError("not loading in this test")

        return build

    monkeypatch.setattr(cli, "engine_factory", factory)
    return seen


def test_cli_spec_flags_reach_the_engine_config(loads: list[EngineConfig]) -> None:
    result = CliRunner().invoke(cli.main, ["--port", "0", "--device", "cpu", "--spec", "mtp",
                                           "--draft-tokens", "2", "--lm-head-draft"])
    assert result.exit_code == 1
    [config] = loads
    assert (config.spec, config.draft_tokens, config.lm_head_draft) == ("mtp", 2, True)
    runner = CliRunner()
    assert runner.invoke(cli.main, ["--spec", "eagle"]).exit_code == 2
    assert runner.invoke(cli.main, ["--draft-tokens", "0"]).exit_code == 2
    no_spec = runner.invoke(cli.main, ["--lm-head-draft", "--device", "cpu"])
    assert no_spec.exit_code == 2 and "needs a spec method" in no_spec.output


def test_lm_head_draft_without_a_draft_head_fails_at_startup(artifact: Path) -> None:
    result = CliRunner().invoke(cli.main, [str(artifact), "--port", "0", "--device", "cpu",
                                           "--spec", "mtp", "--lm-head-draft"])
    assert result.exit_code == 1
    assert "--lm-head-draft needs a draft head" in result.output
    assert artifact.name in result.output
