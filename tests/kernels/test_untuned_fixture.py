"""The tests' `untuned_kernels` fixture (tests/conftest.py), which the engine tests' GPU runs
rely on: every autotuner keeps one config, the first that its own pruning lets through. On a
CPU every kernel has one config already, so this is the only place its patch of Triton's
autotuner runs in CI (a change in Triton's API would fail here, not on the GPU machine)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = triton.language


def _tuner(prune=None):
    """An autotuned no-op kernel over three block sizes, with an optional pruning hook."""
    @triton.autotune(configs=[triton.Config({"B": b}) for b in (16, 32, 64)], key=["n"],
                     prune_configs_by={"early_config_prune": prune} if prune else None)
    @triton.jit
    def kernel(x, n, B: tl.constexpr):
        pass

    kernel.nargs = {}
    return kernel


def _without_16(configs, nargs, **kwargs):
    return [c for c in configs if c.kwargs["B"] != 16]


def test_every_config_is_a_candidate_without_the_fixture() -> None:
    assert [c.kwargs["B"] for c in _tuner().prune_configs({})] == [16, 32, 64]


@pytest.mark.usefixtures("untuned_kernels")
@pytest.mark.parametrize(("prune", "first"), [(None, 16), (_without_16, 32)])
def test_untuned_kernels_keeps_the_first_config_that_fits(prune, first: int) -> None:
    assert [c.kwargs["B"] for c in _tuner(prune).prune_configs({})] == [first]
