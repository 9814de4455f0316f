"""The `ninfer-serve` command: option checking, and exiting when the model cannot load."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ninfer_runtime.engine.config import EngineConfig
from ninfer_serve import cli


def test_bad_options_are_usage_errors() -> None:
    runner = CliRunner()
    assert runner.invoke(cli.main, ["--kv-capacity", "lots"]).exit_code == 2
    assert runner.invoke(cli.main, ["--kv-dtype", "fp4"]).exit_code == 2
    assert runner.invoke(cli.main, ["--kv-capacity", "8", "--device", "cpu"]).exit_code == 2
    assert runner.invoke(cli.main, ["missing.ninfer"]).exit_code == 2


def test_a_model_that_fails_to_load_ends_the_process(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    artifact = tmp_path / "broken.ninfer"
    artifact.write_bytes(b"not an artifact")
    seen: list[tuple[Path | None, EngineConfig]] = []

    def factory(path: Path | None, config: EngineConfig):
        seen.append((path, config))

        def build():
            raise ValueError(f"{path.name}: bad header")

        return build

    monkeypatch.setattr(cli, "engine_factory", factory)
    result = CliRunner().invoke(cli.main, [str(artifact), "--port", "0", "--device", "cpu",
                                           "--max-context", "4096", "--kv-dtype", "bf16"])
    assert result.exit_code == 1
    assert "broken.ninfer: bad header" in result.output
    [(path, config)] = seen
    assert path == artifact
    assert (config.max_context, config.kv_dtype, config.device) == (4096, "bf16", "cpu")
