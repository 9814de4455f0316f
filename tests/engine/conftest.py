"""Engine test fixtures: tiny random-init artifacts (dense and MoE) built once per session with
the converter, and their models loaded once (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ninfer_runtime.models.loading import LoadedModel, load_artifact

# One thread per xdist worker: the tiny shapes gain nothing from more, and two workers share
# two cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_artifact("dense" | "moe")` -> a cached bf16 artifact of that tiny profile."""
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.sources import open_source

    cache: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in cache:
            path = tmp_path_factory.mktemp("engine") / f"tiny_{kind}.ninfer"
            cache[kind] = build(open_source(f"tiny_{kind}", random_init=True), path,
                                BuildOptions(include_vision=False, include_mtp=False))
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_artifact: Callable[[str], Path]) -> Callable[[str], LoadedModel]:
    """`tiny_model("dense" | "moe")` -> the artifact loaded on the CPU (fp32 compute)."""
    cache: dict[str, LoadedModel] = {}

    def load(kind: str) -> LoadedModel:
        if kind not in cache:
            cache[kind] = load_artifact(tiny_artifact(kind), "cpu")
        return cache[kind]

    return load
