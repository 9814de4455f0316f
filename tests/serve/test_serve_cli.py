"""The `ninfer-serve` command: option checking, the default device, and exiting when the model
cannot load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ninfer_runtime.engine.config import EngineConfig
from ninfer_serve import cli


def test_bad_options_are_usage_errors() -> None:
    runner = CliRunner()
    assert runner.invoke(cli.main, ["--kv-capacity", "lots"]).exit_code == 2
    assert runner.invoke(cli.main, ["--kv-dtype", "fp4"]).exit_code == 2
    assert runner.invoke(cli.main, ["--kv-capacity", "8", "--device", "cpu"]).exit_code == 2
    assert runner.invoke(cli.main, ["missing.ninfer"]).exit_code == 2
    too_few = runner.invoke(cli.main, ["--max-concurrency", "8", "--max-batched-tokens", "4"])
    assert too_few.exit_code == 2 and "below a decode step" in too_few.output


@pytest.fixture
def broken_load(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path | None, EngineConfig]]:
    """Make every model load fail; returns the (artifact, config) each load was asked for."""
    seen: list[tuple[Path | None, EngineConfig]] = []

    def factory(path: Path | None, config: EngineConfig) -> Callable[[], object]:
        seen.append((path, config))

        def build() -> object:
            raise ValueError(f"{path.name if path else 'default'}: bad header")

        return build

    monkeypatch.setattr(cli, "engine_factory", factory)
    return seen


def test_a_model_that_fails_to_load_ends_the_process(broken_load: list, tmp_path: Path) -> None:
    artifact = tmp_path / "broken.ninfer"
    artifact.write_bytes(b"not an artifact")
    result = CliRunner().invoke(cli.main, [str(artifact), "--port", "0", "--device", "cpu",
                                           "--max-context", "4096", "--kv-dtype", "bf16",
                                           "--max-num-batched-tokens", "2048"])
    assert result.exit_code == 1
    assert "broken.ninfer: bad header" in result.output
    [(path, config)] = broken_load
    assert path == artifact
    assert (config.max_context, config.kv_dtype, config.device) == (4096, "bf16", "cpu")
    assert config.max_batched_tokens == 2048


def test_defaults_bind_loopback_and_take_cuda_when_available(broken_load: list) -> None:
    assert {p.name: p.default for p in cli.main.params}["host"] == "127.0.0.1"
    result = CliRunner().invoke(cli.main, ["--port", "0"])
    assert result.exit_code == 1
    [(path, config)] = broken_load
    assert path is None  # no ARTIFACT: the embedded default model
    assert config.device == ("cuda" if torch.cuda.is_available() else "cpu")
