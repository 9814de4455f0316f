"""ops.dispatch: which implementation each mode picks."""

from __future__ import annotations

import pytest
import torch

from ninfer_runtime.ops import launch
from ninfer_runtime.ops.dispatch import use_triton

CPU = torch.zeros(1)


def test_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "ref")
    assert not use_triton(CPU)
    monkeypatch.setenv("NINFER_OPS", "triton")
    assert use_triton(CPU) and use_triton(CPU, validated=False)
    monkeypatch.setenv("NINFER_OPS", "auto")
    assert not use_triton(CPU)  # CPU tensors take the reference in auto mode
    monkeypatch.setenv("NINFER_OPS", "fast")
    with pytest.raises(ValueError, match="NINFER_OPS"):
        use_triton(CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_unvalidated_kernels_stay_off_in_auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "auto")
    x = torch.zeros(1, device="cuda")
    assert use_triton(x) and not use_triton(x, validated=False)


def test_dependent_launch_only_when_asked_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL launch arguments stay off unless NINFER_PDL=1, and even then on the CPU (and under
    the interpreter, which cannot run its wait)."""
    launch._pdl.cache_clear()
    monkeypatch.setenv("NINFER_PDL", "1")
    assert launch.options(torch.device("cpu")) == {"GDC": False, "launch_pdl": False}
    launch._pdl.cache_clear()
    monkeypatch.delenv("NINFER_PDL")
    if torch.cuda.is_available():
        assert launch.options(torch.device("cuda")) == {"GDC": False, "launch_pdl": False}
    launch._pdl.cache_clear()
