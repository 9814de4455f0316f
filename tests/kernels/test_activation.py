"""The silu_and_mul kernel against its torch reference (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, check, kernels  # noqa: F401

from ninfer_runtime.ops.activation import silu_and_mul, silu_and_mul_ref

pytestmark = pytest.mark.usefixtures("kernels")


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
