"""Weight quantizers (ninfer_convert.quantize) against ModelOpt and the runtime's reference dequant.

NVFP4 must equal ModelOpt's NVFP4QTensor byte for byte; groupwise-int is checked for exactness on
representable values, for its clipping search beating plain round-to-nearest, and for layout.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ninfer_convert.quantize import quantize, quantize_groupwise_int, quantize_nvfp4
from ninfer_runtime.quant import SCHEMES, UnknownSchemeError, get_scheme
from ninfer_runtime.quant.nvfp4 import e2m1_table
from ninfer_runtime.quant.packing import pack_nibbles, unpack_nibbles

NVFP4_DEQ = get_scheme("nvfp4").dequantize_parts
INT_DEQ = get_scheme("groupwise-int").dequantize_parts
FP32_ULP = 2.0**-23


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel_err(w: torch.Tensor, deq: torch.Tensor) -> float:
    return ((w.float() - deq).norm() / w.float().norm()).item()


@pytest.fixture(scope="module")
def modelopt_nvfp4() -> type:
    with warnings.catch_warnings():  # modelopt warns about the installed transformers version
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


def _modelopt_parts(nvfp4_qtensor: type, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt's parts (and dequant) for w [..., out, in], one call per source matrix."""
    per_matrix: dict[str, list[torch.Tensor]] = {}
    for m in w.reshape(-1, *w.shape[-2:]):
        qt, scale, scale_2 = nvfp4_qtensor.quantize(m, 16)
        deq = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2,
                            block_sizes={-1: 16})
        parts = {"weight": qt._quantized_data, "weight_scale": scale,
                 "weight_scale_2": scale_2.expand(m.shape[0]), "deq": deq}
        for role, t in parts.items():
            per_matrix.setdefault(role, []).append(t)
    return {role: torch.stack(ts).reshape(*w.shape[:-2], *ts[0].shape)
            for role, ts in per_matrix.items()}


def _ties_matrix() -> torch.Tensor:
    """Global amax 2688 (g = 1) and blocks of max 6 (s = 1): values land on E2M1 midpoints."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
            -5.0, -0.1]  # -0.1 rounds to -0 (code 8)
    w = torch.tensor(ties).repeat(8, 4)
    w[0, :16] = 0.0
    w[0, 0] = 2688.0
    return w


def _nvfp4_cases() -> dict[str, torch.Tensor]:
    g = _gen(1)
    outliers = torch.randn(64, 256, generator=g)
    outliers[torch.rand(outliers.shape, generator=g) < 0.005] *= 50.0
    huge = torch.randn(32, 128, generator=g, dtype=torch.float32)
    huge[3, 5] = 1e5  # most block scales hit the 2**-9 clamp
    zero_rows = torch.randn(48, 128, generator=g).to(torch.bfloat16)
    zero_rows[[0, 7, 30]] = 0.0
    zero_rows[5, 32:64] = 0.0  # two zero blocks inside a row
    experts = torch.randn(3, 32, 128, generator=g) * torch.tensor([1e-3, 1.0, 30.0])[:, None, None]
    return {
        "bf16": torch.randn(96, 256, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(64, 128, generator=g),
        "fp16": torch.randn(16, 512, generator=g).to(torch.float16),
        "outliers_bf16": outliers.to(torch.bfloat16),
        "huge_outlier_fp32": huge,
        "zero_rows_bf16": zero_rows,
        "ties_fp32": _ties_matrix(),
        "experts_3d_bf16": experts.to(torch.bfloat16),
    }


NVFP4_CASES = _nvfp4_cases()


@pytest.mark.parametrize("case", NVFP4_CASES)
def test_nvfp4_bytes_equal_modelopt(modelopt_nvfp4: type, case: str) -> None:
    w = NVFP4_CASES[case]
    ours = quantize("nvfp4", w)
    ref = _modelopt_parts(modelopt_nvfp4, w)
    assert torch.equal(ours["weight"], ref["weight"])
    assert torch.equal(ours["weight_scale"].view(torch.uint8),
                       ref["weight_scale"].view(torch.uint8))
    assert torch.equal(ours["weight_scale_2"], ref["weight_scale_2"])


@pytest.mark.parametrize("case", ["bf16", "outliers_bf16", "ties_fp32", "experts_3d_bf16"])
def test_nvfp4_dequant_matches_modelopt_and_is_exact(modelopt_nvfp4: type, case: str) -> None:
    w = NVFP4_CASES[case]
    parts = quantize("nvfp4", w)
    deq = NVFP4_DEQ(parts)
    # ModelOpt rounds s * g before multiplying by the code's value: at most one ulp apart.
    torch.testing.assert_close(deq, _modelopt_parts(modelopt_nvfp4, w)["deq"],
                               rtol=FP32_ULP, atol=0.0)
    # Ours is the exact product e2m1 * s * g rounded once.
    codes = unpack_nibbles(parts["weight"]).long()
    exact = (e2m1_table(torch.device("cpu")).double()[codes].unflatten(-1, (-1, 16))
             * parts["weight_scale"].double().unsqueeze(-1)
             * parts["weight_scale_2"].double()[..., None, None]).flatten(-2)
    assert torch.equal(deq, exact.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_grid_values_round_trip(dtype: torch.dtype) -> None:
    """w = e2m1 * s * g with s any positive e4m3 value, g a power of two, every block holding a
    +-6 and one block s = 448 (so amax / 2688 = g): codes, scales and values come back exactly."""
    g = _gen(2)
    rows, blocks = 24, 8
    codes = torch.randint(0, 16, (rows, blocks, 16), generator=g, dtype=torch.uint8)
    codes[..., 0] = 7 + 8 * torch.randint(0, 2, (rows, blocks), generator=g, dtype=torch.uint8)
    scale_bytes = torch.randint(1, 127, (rows, blocks), generator=g, dtype=torch.uint8)
    scale_bytes[4, 2] = 0x7E  # 448, the largest e4m3
    scales = scale_bytes.view(torch.float8_e4m3fn)
    global_scale = 2.0**-7
    w = e2m1_table(torch.device("cpu"))[codes.long()] * scales.float().unsqueeze(-1) * global_scale
    w = w.flatten(-2).to(dtype)
    parts = quantize("nvfp4", w)
    nonzero = e2m1_table(torch.device("cpu"))[codes.long()] != 0  # -0 and +0 are both fine
    got_codes = unpack_nibbles(parts["weight"]).view(rows, blocks, 16)
    assert torch.equal(got_codes[nonzero], codes[nonzero])
    assert torch.equal(parts["weight_scale"].view(torch.uint8), scale_bytes)
    assert torch.all(parts["weight_scale_2"] == global_scale)
    assert torch.equal(NVFP4_DEQ(parts), w.float())


def test_nvfp4_all_zero_matrix_gets_finite_scales() -> None:
    w = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    w[1, 3, 5] = 10.5  # the second expert is not all zero; 10.5 / 2688 = 2**-8 is exact
    parts = quantize("nvfp4", w)
    assert torch.isfinite(parts["weight_scale"].float()).all()
    assert torch.isfinite(parts["weight_scale_2"]).all()
    assert torch.equal(NVFP4_DEQ(parts), w.float())


def test_nvfp4_rejects_non_finite_weights() -> None:
    w = torch.randn(4, 32)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"\(4, 32\)"):
        quantize("nvfp4", w)


def _int_grid_matrix(gen: torch.Generator) -> torch.Tensor:
    """(q - z) * s with each group using codes 0 and 15, z in [1, 14], s a bf16 value."""
    rows, groups = 16, 3
    q = torch.randint(0, 16, (rows, groups, 128), generator=gen).float()
    q[..., 0], q[..., 1] = 0.0, 15.0
    z = torch.randint(1, 15, (rows, groups, 1), generator=gen).float()
    s = (torch.rand(rows, groups, 1, generator=gen) * 0.1 + 1e-3).to(torch.bfloat16).float()
    return ((q - z) * s).flatten(-2)


def test_groupwise_int_grid_values_round_trip() -> None:
    w = _int_grid_matrix(_gen(3))
    parts = quantize("groupwise-int", w)
    assert torch.equal(INT_DEQ(parts), w)
    zero_group = torch.zeros(2, 256)
    zero_group[1, 128:] = torch.linspace(-1.0, 2.0, 128)
    assert INT_DEQ(quantize("groupwise-int", zero_group))[:, :128].eq(0).all()


def test_groupwise_int_clipping_search_beats_plain_rtn() -> None:
    g = _gen(4)
    w = torch.randn(64, 512, generator=g)
    w = torch.where(torch.rand(w.shape, generator=g) < 0.01, w * 8.0, w)
    searched = _rel_err(w, INT_DEQ(quantize_groupwise_int(w)))
    plain = _rel_err(w, INT_DEQ(quantize_groupwise_int(w, clip_factors=(1.0,))))
    assert searched < 0.98 * plain
    assert searched < 0.2
    normal = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    assert _rel_err(normal, INT_DEQ(quantize("groupwise-int", normal))) < 0.1


def test_groupwise_int_params_in_range() -> None:
    w = torch.randn(32, 256, generator=_gen(5)) * 3.0 + 1.0  # shifted: zero points vary
    parts = quantize("groupwise-int", w)
    assert int(parts["weight_zero"].max()) <= 15
    assert parts["weight_zero"].unique().numel() > 1
    assert (parts["weight_scale"].float() > 0).all()


def test_groupwise_int_3d_equals_per_expert() -> None:
    g = _gen(6)
    w = (torch.randn(3, 16, 256, generator=g)
         * torch.tensor([1e-2, 1.0, 50.0])[:, None, None]).to(torch.bfloat16)
    parts = quantize("groupwise-int", w)
    for e in range(3):
        alone = quantize("groupwise-int", w[e])
        for role, t in alone.items():
            assert torch.equal(parts[role][e], t)
        assert _rel_err(w[e], INT_DEQ(alone)) < 0.1


def test_nibble_packing_order_and_lossless() -> None:
    assert pack_nibbles(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    codes = torch.randint(0, 16, (3, 5, 64), generator=_gen(7), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@pytest.mark.parametrize("scheme", ["nvfp4", "groupwise-int"])
@pytest.mark.parametrize("shape", [(8, 256), (2, 8, 384)])
def test_parts_follow_stored_specs(scheme: str, shape: tuple[int, ...]) -> None:
    parts = quantize(scheme, torch.randn(shape, generator=_gen(8)).to(torch.bfloat16))
    scheme_obj = SCHEMES[scheme]
    assert tuple(parts) == scheme_obj.roles
    for role, (dtype, stored_shape) in scheme_obj.stored_specs(shape).items():
        assert parts[role].dtype == dtype
        assert tuple(parts[role].shape) == stored_shape
    assert tuple(scheme_obj.dequantize_parts(parts).shape) == shape


@pytest.mark.parametrize("quantizer", [quantize_nvfp4, quantize_groupwise_int])
def test_row_chunking_does_not_change_the_result(quantizer) -> None:
    w = torch.randn(2, 13, 256, generator=_gen(9)).to(torch.bfloat16)
    whole = quantizer(w)
    chunked = quantizer(w, chunk_elems=5 * 256)  # 5 rows per chunk, crossing the expert edge
    for role, t in whole.items():
        assert torch.equal(chunked[role].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize(("scheme", "shape"), [
    ("nvfp4", (4, 24)), ("groupwise-int", (4, 136)), ("groupwise-int", (2, 4, 64)),
])
def test_input_dim_not_a_multiple_raises(scheme: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=str(shape).replace("(", r"\(").replace(")", r"\)")):
        quantize(scheme, torch.randn(shape))


def test_quantize_boundary_errors_and_plain_schemes() -> None:
    with pytest.raises(UnknownSchemeError, match="int3"):
        quantize("int3", torch.randn(4, 128))
    with pytest.raises(ValueError, match="1024"):
        quantize("nvfp4", torch.randn(1024))
    with pytest.raises(ValueError, match="int32"):
        quantize("groupwise-int", torch.ones(4, 128, dtype=torch.int32))
    w = torch.randn(4, 8)
    assert quantize("bf16", w)["weight"].dtype == torch.bfloat16
    assert torch.equal(quantize("fp32", w)["weight"], w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_nvfp4_bytes_equal_modelopt_on_cuda(modelopt_nvfp4: type) -> None:
    """On CUDA too, the bytes equal ModelOpt's run on CUDA (same device arithmetic)."""
    for case in ("outliers_bf16", "experts_3d_bf16", "huge_outlier_fp32"):
        w = NVFP4_CASES[case].cuda()
        ours = quantize("nvfp4", w)
        ref = _modelopt_parts(modelopt_nvfp4, w)
        assert ours["weight"].is_cuda
        assert torch.equal(ours["weight"], ref["weight"])
        assert torch.equal(ours["weight_scale"].view(torch.uint8),
                           ref["weight_scale"].view(torch.uint8))
        assert torch.equal(ours["weight_scale_2"], ref["weight_scale_2"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_groupwise_int_matches_cpu_error() -> None:
    w = torch.randn(64, 1024, generator=_gen(10))
    on_gpu = {k: v.cpu() for k, v in quantize("groupwise-int", w.cuda()).items()}
    on_cpu = quantize("groupwise-int", w)
    assert abs(_rel_err(w, INT_DEQ(on_gpu)) - _rel_err(w, INT_DEQ(on_cpu))) < 1e-3
