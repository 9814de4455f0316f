"""The candidate CUDA-core decode GEMV (`ops.quant_gemv`) against dequantize-then-matmul.

Random stored parts (every code, fp8 scales over their whole range) from test_linear; every M
up to 8, K off the tile, several K splits, fp32 and half activations. Under the interpreter
(CPU) each case takes a fraction of a second.
"""

from __future__ import annotations

import pytest
import torch
from test_linear import DEVICE, SCHEMES, check, packed, rand

from ninfer_runtime.ops import quant_gemv
from ninfer_runtime.ops.quant_linear import _operands
from ninfer_runtime.quant import PackedWeight

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # interpreter: bf16 truncates
CONFIG = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 1}


def run(x: torch.Tensor, w: PackedWeight, **config: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return quant_gemv.gemv(x, _operands(w), out, **(CONFIG | config))


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gemv_matches_reference(scheme: str, m: int, split_k: int) -> None:
    """Odd N (row mask), K off the tile (nvfp4 1.75 tiles, groupwise-int 2.5), one split or
    several."""
    w = packed(scheme, 80, 448 if scheme == "nvfp4" else 640, seed=m)
    x = rand(m, w.shape[1], dtype=HALF, seed=m + 1)
    check(run(x, w, split_k=split_k, block_k=256), x, w)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gemv_fp32_activations(scheme: str, m: int) -> None:
    """fp32 in, fp32 out: only the accumulation order differs from the reference."""
    w = packed(scheme, 48, 512, seed=2)
    x = rand(m, 512, dtype=torch.float32)
    check(run(x, w, split_k=2, block_k=256), x, w)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gemv_one_hot_reads_exact_weights(scheme: str) -> None:
    """x = rows of the identity: each output is one dequantized weight, exact in fp32."""
    n, k = 48, 256
    w = packed(scheme, n, k, seed=3)
    eye = torch.eye(k, device=DEVICE)
    expected = w.dequantize().T
    for first in (0, 5, 11):
        cols = [(first + c * 37) % k for c in range(8)]  # every code position, several blocks
        assert torch.equal(run(eye[cols], w, split_k=2), expected[cols])


def test_bf16_activations_keep_their_range() -> None:
    """Large and tiny activations (nvfp4 scales x by 2^96 inside) stay finite and accurate."""
    w = packed("nvfp4", 48, 256, seed=8)
    x = rand(2, 256, dtype=torch.float32)
    x[0] *= 3e5
    x[1] *= 1e-4
    out = run(x, w, split_k=1)
    assert torch.isfinite(out).all()
    for row in range(2):
        check(out[row:row + 1], x[row:row + 1], w)


@pytest.mark.parametrize(("n", "k", "m"), [(16384, 5120, 1), (5120, 6144, 1), (5120, 17408, 4),
                                           (248320, 5120, 1), (48, 128, 8)])
def test_default_config_is_valid(n: int, k: int, m: int) -> None:
    cfg = quant_gemv.default_config(n, k, m, sm_count=132)
    split_len, splits = quant_gemv.split_len_splits(k, cfg.block_k, cfg.split_k)
    assert splits == cfg.split_k and split_len % cfg.block_k == 0
    assert (splits - 1) * split_len < k <= splits * split_len



@pytest.mark.parametrize("scheme", SCHEMES)
def test_linear_routes_few_rows_to_the_gemv(scheme: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """With GEMV_MAX_M set, packed_linear's decode rows take the GEMV with its default config
    (the split chosen for the shape) and still match the reference."""
    from ninfer_runtime.ops import quant_linear

    monkeypatch.setattr(quant_linear, "GEMV_MAX_M", 8)
    calls = []
    monkeypatch.setattr(quant_gemv, "gemv", lambda *a, **kw: calls.append(kw) or run_gemv(*a, **kw))
    w = packed(scheme, 96, 1024, seed=4)
    for m in (1, 3, 8):
        x = rand(m, 1024, dtype=HALF, seed=m)
        check(quant_linear.packed_linear(x, w), x, w)
    assert len(calls) == 3


run_gemv = quant_gemv.gemv
