"""The silu_and_mul kernel against its torch reference (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from ninfer_runtime.ops.activation import silu_and_mul, silu_and_mul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "triton")


def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 to 1e-5; half types within one rounding step, at most 1% of elements off."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    step = 2.0 ** -(8 if expected.dtype == torch.bfloat16 else 11)
    torch.testing.assert_close(actual, expected, rtol=2 * step, atol=step)
    assert (actual != expected).float().mean() <= 0.01


# [rows, 2I]: one row with an odd I, I over one 1024-column block, a 3-D input
SHAPES = [(1, 34), (5, 2 * 1100), (2, 3, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 4).to(DEVICE, dtype)
    out = silu_and_mul(x)
    check(out, silu_and_mul_ref(x))
    assert out.shape == (*shape[:-1], shape[-1] // 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reads_strided_rows(dtype: torch.dtype) -> None:
    wide = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    x = wide[:, 3:3 + 24]
    check(silu_and_mul(x), silu_and_mul_ref(x))


def test_no_rows() -> None:
    assert silu_and_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)
