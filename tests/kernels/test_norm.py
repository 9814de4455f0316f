"""The RMSNorm kernels against their torch references (Triton's interpreter on CPU).

Half-precision outputs must agree bit for bit almost everywhere: the kernels round where the
references round, so only fp32 reduction order may flip an occasional last bit.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, check, kernels, rand  # noqa: F401

from ninfer_runtime.ops.norm import (
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

pytestmark = pytest.mark.usefixtures("kernels")


# (tokens, heads, D): decode rows, an odd long row, many short rows (several rows per program)
SHAPES = [(1, 1, 128), (3, 1, 1000), (300, 1, 64), (5, 3, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    t, heads, d = shape
    wide = rand(t, heads, d + 16, dtype=dtype) * 3
    x = wide[..., 5:5 + d]  # a strided view, as q heads cut from a projection are
    w = rand(d, seed=1, dtype=dtype) * 0.1
    out = rms_norm(x, w, 1e-6)
    check(out, rms_norm_ref(x, w, 1e-6))
    assert out.is_contiguous()
    flat = x.reshape(t * heads, d) if heads == 1 else x[:, 0]
    check(rms_norm(flat, w, 1e-6), rms_norm_ref(flat, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 256), (7, 200), (130, 64)])
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(rows: int, d: int,
                                                         dtype: torch.dtype) -> None:
    x = rand(rows, d, dtype=dtype) * 4
    h = rand(rows, 2 * d, seed=1, dtype=dtype)[:, d:]  # different strides from x
    w = rand(d, seed=2) * 0.1  # fp32 weight: the scale is 1 + w in fp32 either way
    residual, out = add_rms_norm(x, h, w, 1e-6)
    ref_residual, ref_out = add_rms_norm_ref(x, h, w, 1e-6)
    assert torch.equal(residual, ref_residual)
    check(out, ref_out)
    check(out, rms_norm_ref(residual, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_fp32", [False, True])
@pytest.mark.parametrize("tokens", [1, 9])
def test_gated_rms_norm(tokens: int, weight_fp32: bool, dtype: torch.dtype) -> None:
    """x from the GDN kernel, z a head view of the fused projection output; the weight in the
    compute dtype (the product rounds to it) or in fp32 (it does not)."""
    heads, d = 6, 32
    x = rand(tokens, heads, d, dtype=dtype) * 2
    z = rand(tokens, 3 * heads * d, seed=1, dtype=dtype)[:, heads * d:2 * heads * d]
    z = z.reshape(tokens, heads, d)
    w = 1.0 + rand(d, seed=2, dtype=torch.float32 if weight_fp32 else dtype) * 0.1
    check(gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_weight_norms(dtype: torch.dtype) -> None:
    """unit_offset=False scales by w itself (the DFlash draft's Qwen3 RMSNorm)."""
    x, h = rand(7, 200, dtype=dtype) * 3, rand(7, 200, seed=1, dtype=dtype)
    w = 1.0 + rand(200, seed=2, dtype=dtype) * 0.1
    out = rms_norm(x, w, 1e-6, unit_offset=False)
    check(out, rms_norm_ref(x, w, 1e-6, unit_offset=False))
    check(out, rms_norm_ref(x, w - 1.0, 1e-6), atol_steps=2)
    residual, out = add_rms_norm(x, h, w, 1e-6, unit_offset=False)
    ref_residual, ref_out = add_rms_norm_ref(x, h, w, 1e-6, unit_offset=False)
    assert torch.equal(residual, ref_residual)
    check(out, ref_out)


def test_mismatched_shapes_are_refused() -> None:
    x = rand(2, 8)
    with pytest.raises(ValueError, match="add_rms_norm"):
        add_rms_norm(x, rand(1, 8), torch.zeros(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="gated_rms_norm"):
        gated_rms_norm(x, rand(2, 4), torch.zeros(8, device=DEVICE), 1e-6)


def test_no_rows() -> None:
    x, w = rand(0, 16), rand(16)
    residual, out = add_rms_norm(x, x, w, 1e-6)
    assert residual.shape == out.shape == (0, 16)
