"""The packed-weight linear kernels (nvfp4, groupwise-int) against dequantize-then-matmul.

Weights are random stored parts (every code, fp8 scales over their whole range), not quantizer
output, so every decode case is hit. One-hot activations read single weights back and must be
bit-exact (in fp32, and in half types up to the output's one rounding); random activations
check accumulation, masking and the K split to the rounding of the output dtype. On the GPU the
decode kernel runs both its inline-PTX decoders and their pure-Triton twin (the interpreter can
only run the twin; tests/kernels/test_quant_decode.py proves the PTX itself).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ninfer_runtime.models.layers import gated_norm, mlp
from ninfer_runtime.models.weights import MLPWeights, WeightReader
from ninfer_runtime.ops import quant_linear, tuner
from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.linear import (
    linear,
    mlp_decode,
    select,
    silu_mul_linear,
    swiglu_with_operand,
)
from ninfer_runtime.ops.norm import (
    DeferredNorm,
    add_rms_norm,
    defer_add_rms_norm,
    gated_rms_norm,
    gated_rms_norm_with_operand,
    rms_norm,
)
from ninfer_runtime.quant import PackedWeight, get_scheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # interpreter: no bf16 tl.dot
# the decode kernel converts activations to fp16 itself, so it takes bf16 under the interpreter
DECODE_HALVES = (torch.float16, torch.bfloat16)
# ... but the interpreter casts fp32 to bf16 by truncation: bit-exact bf16 outputs on the GPU only
EXACT_HALVES = DECODE_HALVES if DEVICE == "cuda" else (torch.float16,)
ASM = (True, False) if DEVICE == "cuda" else (False,)  # inline PTX needs the GPU
# max |error| allowed, relative to max |reference|: fp32 accumulation order; one rounding of
# the output (and of the groupwise-int operand, as the reference rounds it) in half types
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SCHEMES = ("nvfp4", "groupwise-int")


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch, untuned_kernels: None) -> None:
    """Kernels on, each autotuner pinned to its default config (no tuning runs on the GPU)."""
    monkeypatch.setenv("NINFER_OPS", "triton")


def packed(scheme: str, n: int, k: int, *lead: int, seed: int = 0) -> PackedWeight:
    """Random stored parts of a [*lead, n, k] weight, laid out as the runtime loads them
    (a linear layer's groupwise-int scales group-major: `quant_linear.group_major`)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, n)
    codes = torch.randint(0, 256, (*shape, k // 2), dtype=torch.uint8, generator=gen)
    if scheme == "nvfp4":
        # every finite positive e4m3 (bytes 0..0x7e: zero, subnormals, up to 448)
        scale = torch.randint(0, 0x7F, (*shape, k // 16), dtype=torch.uint8, generator=gen)
        parts = {"weight": codes, "weight_scale": scale.view(torch.float8_e4m3fn),
                 "weight_scale_2": torch.rand(shape, generator=gen) * 1e-3 + 1e-4}
    else:
        groups = (*shape, k // 128)
        parts = {"weight": codes,
                 "weight_scale": (torch.rand(groups, generator=gen) * 0.02 + 1e-3).bfloat16(),
                 "weight_zero": torch.randint(0, 16, groups, dtype=torch.uint8, generator=gen)}
    return quant_linear.group_major(PackedWeight(
        get_scheme(scheme), {r: p.to(DEVICE) for r, p in parts.items()}, (*lead, n, k)))


def rand(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def check(out: torch.Tensor, x: torch.Tensor, w: PackedWeight) -> None:
    """out == x @ dequantize(w)^T (in float64) within TOL[x.dtype] of its largest entry."""
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], w.shape[-2])
    ref = x.double() @ w.dequantize(torch.float64).transpose(-1, -2)
    tol = TOL[x.dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("k", [128, 256, 384])
@pytest.mark.parametrize("n", [48, 80])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_linear_matches_reference(scheme: str, m: int, n: int, k: int) -> None:
    """Decode (CUDA-core and tensor-core) and GEMM paths, odd N, K below / at / off the tile."""
    w = packed(scheme, n, k)
    x = rand(m, k, dtype=HALF)
    check(linear(x, w), x, w)


@pytest.mark.parametrize("k", [256, 384])
@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_of_whole_row_tiles(scheme: str, m: int, k: int) -> None:
    """N a multiple of every decode row tile (as every real projection's): the K loop loads
    without row masks (EVEN_N)."""
    n = 256
    assert all(n % c.bn == 0 for cs in quant_linear.DECODE_CONFIGS.values() for c in cs)
    w = packed(scheme, n, k, seed=3)
    x = rand(m, k, dtype=HALF, seed=2)
    check(linear(x, w), x, w)


def test_the_gemm_operand_is_each_row_scaled_by_code_position() -> None:
    """`gemm_operand`: every row times the power of two that puts its largest |x| in
    [2^14, 2^15), rounded once to fp16, input k0 + 8w + j of each 128-input tile at
    k0 + 16j + w; inv the inverse power of two (a zero row too)."""
    x = rand(5, 256, dtype=HALF, seed=8) * torch.tensor(
        [1.0, 1e-3, 300.0, 0.0, 1.0], device=DEVICE, dtype=HALF)[:, None]
    xo, inv = quant_linear.gemm_operand(x)
    assert xo.shape == (5, 256) and xo.dtype == torch.float16 and inv.shape == (5,)
    m = 1.0 / inv.double()
    # powers of two (exactly: CUDA's float64 log2 of 2^126 is not an integer)
    assert torch.equal(torch.frexp(m).mantissa, torch.full_like(m, 0.5))
    expected = (x.double() * m[:, None]).to(torch.float16)
    expected = expected.view(5, 2, 16, 8).transpose(2, 3).reshape(5, 256)
    assert torch.equal(xo, expected)
    big = xo.float().abs().amax(1)
    assert bool(((big >= 2**14) & (big < 2**15))[[0, 1, 2, 4]].all()) and big[3] == 0


@pytest.mark.parametrize("m", [17, 64])
def test_nvfp4_prompt_gemm_runs_on_fp16_operands(m: int, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """Half activations and nvfp4 weights of whole 128-input K tiles: x's row operand made
    once, the weight tiles decoded as the decode GEMV decodes them; against the reference."""
    made = []
    operand = quant_linear.gemm_operand
    monkeypatch.setattr(quant_linear, "gemm_operand",
                        lambda a: made.append(a.shape) or operand(a))
    w = packed("nvfp4", 80, 384, seed=4)
    x = rand(m, 384, dtype=HALF)
    check(linear(x, w), x, w)
    assert made == [(m, 384)]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp32_activations(scheme: str, m: int) -> None:
    """fp32 activations (the CPU reference dtype) take the GEMM at every M, exact products."""
    w = packed(scheme, 80, 384, seed=2)
    x = rand(m, 384, dtype=torch.float32)
    check(linear(x, w), x, w)


@pytest.mark.parametrize("rows", ["1", "16", "all"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_hot_rows_read_back_exact_weights(scheme: str, rows: str) -> None:
    """x = rows of the identity in fp32: each output is one dequantized weight, exact (one
    row, 16 or all K rows per call; fp32 takes the GEMM; the decode kernel's half-type twin
    is test_decode_one_hot_in_half_types)."""
    n, k = 48, 256
    w = packed(scheme, n, k, seed=3)
    eye = torch.eye(k, device=DEVICE)
    expected = w.dequantize().T
    # columns 37 apart hit every code position j and several scale blocks
    batches = {"1": [[c * 37 % k] for c in range(8)],
               "16": [[c * 37 % k for c in range(16)]], "all": [list(range(k))]}[rows]
    for cols in batches:
        assert torch.equal(linear(eye[cols], w), expected[cols])


@pytest.mark.parametrize("asm", ASM)
@pytest.mark.parametrize("dtype", EXACT_HALVES)
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_one_hot_in_half_types(scheme: str, m: int, dtype: torch.dtype, asm: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp16 operands are exact: one-hot half activations give each weight rounded once
    to the output dtype, as the reference does (fp32 product, then the cast)."""
    monkeypatch.setattr(quant_linear, "DECODE_ASM", asm)
    n, k = 48, 256
    w = packed(scheme, n, k, seed=7)
    eye = torch.eye(k, device=DEVICE, dtype=dtype)
    expected = w.dequantize().T.to(dtype)
    for first in (0, 5, 11):
        cols = [(first + c * 37) % k for c in range(m)]
        assert torch.equal(linear(eye[cols], w), expected[cols])


@pytest.mark.parametrize("asm", ASM)
@pytest.mark.parametrize("dtype", DECODE_HALVES)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_every_m(scheme: str, m: int, dtype: torch.dtype, asm: bool,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode M (rows padded to 8 or 16), both half activation types, K off the tile."""
    monkeypatch.setattr(quant_linear, "DECODE_ASM", asm)
    w = packed(scheme, 80, 384, seed=4)
    x = rand(m, 384, dtype=dtype)
    check(linear(x, w), x, w)


def test_bf16_activations_keep_their_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 activations far beyond fp16's range and tiny ones (each row of the decode's fp16
    operand is scaled by its own power of two) stay finite and accurate."""
    w = packed("nvfp4", 48, 256, seed=8)
    x = rand(4, 256, dtype=torch.float32)
    x[0] *= 3e5
    x[1] *= 1e-4
    x[2] *= 1e30
    x[3] *= 1e-30
    x = x.bfloat16()
    for asm in ASM:
        monkeypatch.setattr(quant_linear, "DECODE_ASM", asm)
        out = linear(x, w)
        assert torch.isfinite(out).all()
        for row in range(4):  # each against its own magnitude
            check(out[row:row + 1], x[row:row + 1], w)


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_k_split(scheme: str, m: int) -> None:
    """A narrow, deep matrix is cut along K; the partials reduce to the same output."""
    n, k = 48, 1024
    assert quant_linear.k_split(n, k, torch.device(DEVICE))[1] > 1
    w = packed(scheme, n, k, seed=5)
    x = rand(m, k, dtype=HALF)
    check(linear(x, w), x, w)


def test_k_split_into_more_parts_than_one_round_loads() -> None:
    """The last program of a row tile adds the parts in rounds of a few loads; 10 parts take
    two rounds (the second partly masked) and still give the reference result."""
    n, k = 40, 2560
    w = packed("nvfp4", n, k, seed=7)
    x = rand(1, k, dtype=HALF)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    plan = quant_linear.DecodePlan(quant_linear.decode_candidates(n, k, 0, x.device)[0].config,
                                   256, 10)
    quant_linear._run_decode(x, quant_linear._operands(w), out, plan)
    check(out, x, w)


@pytest.mark.parametrize(("n", "k"), [(48, 1024), (5120, 17408), (34816, 5120), (16, 128),
                                      (7, 640)])
def test_k_split_plan_covers_k(n: int, k: int) -> None:
    split_len, splits = quant_linear.k_split(n, k, torch.device(DEVICE))
    assert 1 <= splits <= 16 and split_len % 256 == 0
    assert (splits - 1) * split_len < k <= splits * split_len


@pytest.mark.parametrize("scheme", SCHEMES)
def test_stacked_experts_and_leading_dims(scheme: str) -> None:
    """select() keeps an expert packed; x may carry leading dims."""
    stacked = packed(scheme, 48, 256, 3, seed=6)
    x = rand(2, 3, 256, dtype=HALF)
    for e in range(3):
        w = select(stacked, e)
        check(linear(x, w), x, w)


def test_empty_batch() -> None:
    w = packed("nvfp4", 48, 128)
    assert linear(torch.empty(0, 128, device=DEVICE, dtype=HALF), w).shape == (0, 48)


def test_bf16_weights_use_the_matmul() -> None:
    w, x = rand(48, 128, dtype=HALF), rand(3, 128, dtype=HALF, seed=2)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("m", [1, 9, 64])
def test_row_major_int_scales_give_the_same_bits(m: int) -> None:
    """The artifact's row-major groupwise-int scales and zero points, which the runtime
    lays out group by group (`group_major`), give the same bits in either layout: the decode
    GEMV (1 and 9 rows), the prompt GEMM (64) and the dequantized weight."""
    n, k = 80, 384
    w = packed("groupwise-int", n, k, seed=6)
    assert w.parts["weight_scale"].stride() == w.parts["weight_zero"].stride() == (1, n)
    assert w.parts["weight"].is_contiguous()
    rows = PackedWeight(w.scheme, {r: p.contiguous() for r, p in w.parts.items()}, w.shape)
    assert rows.parts["weight_scale"].stride() == (k // 128, 1)
    x = rand(m, k, dtype=HALF, seed=m)
    assert torch.equal(linear(x, rows), linear(x, w))
    assert torch.equal(quant_linear.dequantize(rows, HALF), quant_linear.dequantize(w, HALF))


def test_the_model_loads_int_linear_weights_group_major() -> None:
    """A model's linear layers take their groupwise-int terms group-major whatever the
    artifact stored (row-major), the same values; nvfp4 weights as stored."""
    int_w, nv = packed("groupwise-int", 48, 256), packed("nvfp4", 48, 256)
    stored = PackedWeight(int_w.scheme, {r: p.contiguous() for r, p in int_w.parts.items()},
                          int_w.shape)
    reader = WeightReader({"int.weight": stored, "nv.weight": nv}, HALF, DEVICE)
    loaded = reader.linear("int.weight", 48, 256)
    for role, part in loaded.parts.items():
        assert torch.equal(part, stored.parts[role])
        assert part.stride() == ((1, 48) if role != "weight" else (128, 1))
    assert all(p.is_contiguous() for p in reader.linear("nv.weight", 48, 256).parts.values())


def test_group_major_leaves_other_weights_as_they_are() -> None:
    nv, experts = packed("nvfp4", 48, 256), packed("groupwise-int", 48, 256, 2)
    assert quant_linear.group_major(nv) is nv
    assert quant_linear.group_major(experts) is experts
    assert all(p.is_contiguous() for p in (*nv.parts.values(), *experts.parts.values()))


def test_bad_layout_is_rejected() -> None:
    w = packed("groupwise-int", 48, 256)
    wide = torch.zeros(48, 4, device=DEVICE, dtype=torch.bfloat16)
    parts = w.parts | {"weight_scale": wide[:, ::2]}  # right shape and dtype, strided
    with pytest.raises(quant_linear.PackedWeightError, match="weight_scale"):
        linear(rand(1, 256, dtype=HALF), PackedWeight(w.scheme, parts, w.shape))
    mixed = w.parts | {"weight_zero": w.parts["weight_zero"].contiguous()}
    with pytest.raises(quant_linear.PackedWeightError, match="laid out differently"):
        linear(rand(1, 256, dtype=HALF), PackedWeight(w.scheme, mixed, w.shape))
    missing = {r: p for r, p in w.parts.items() if r != "weight_zero"}
    with pytest.raises(quant_linear.PackedWeightError, match="weight_zero"):
        linear(rand(1, 256, dtype=HALF), PackedWeight(w.scheme, missing, w.shape))


@pytest.mark.parametrize("k", [256, 384])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_operand_is_the_weight(scheme: str, k: int) -> None:
    """The prefill's dequantized weight (fp32, so nothing rounds) times the nvfp4 global
    scale is the reference dequantization: odd N, K off the tile."""
    w = packed(scheme, 80, k)
    ops = quant_linear._operands(w)
    got = quant_linear.dequantize_operand(ops, torch.float32).double()
    if scheme == "nvfp4":
        got = got * (ops.gscale.double() * 2.0**8)[:, None]
    torch.testing.assert_close(got, w.dequantize(torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_long_prefill_takes_dequantize_then_matmul(scheme: str, dtype: torch.dtype,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From DEQUANT_MIN_M rows the weight is dequantized once and multiplied by cuBLAS (torch
    on the CPU): the same result as the fused GEMM, within the output's rounding."""
    calls = []
    monkeypatch.setattr(quant_linear, "dequantize_operand", lambda *a, _f=(
        quant_linear.dequantize_operand): calls.append(1) or _f(*a))
    monkeypatch.setattr(quant_linear, "DEQUANT_MIN_M", 24)
    w = packed(scheme, 80, 384, seed=5)
    x = rand(24, 384, dtype=dtype)
    check(linear(x, w), x, w)
    assert calls == [1]
    check(linear(x[:23], w), x[:23], w)  # below the threshold: the fused GEMM
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_long_prefill_of_a_fused_nvfp4_weight_scales_each_source_in_its_gemm(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused weight (q|k|v) holds one global scale per source: the prompt path runs one GEMM
    per source with the scale as its alpha, into that source's output columns."""
    monkeypatch.setattr(quant_linear, "DEQUANT_MIN_M", 24)
    w = packed("nvfp4", 96, 384, seed=6)
    rows = torch.tensor([40, 24, 32], device=DEVICE)
    scales = torch.tensor([3e-4, 7e-4, 1e-4], device=DEVICE)
    w.parts["weight_scale_2"] = scales.repeat_interleave(rows)
    gemms = []
    monkeypatch.setattr(torch, "addmm", lambda *a, _f=torch.addmm, **kw: gemms.append(
        kw["alpha"]) or _f(*a, **kw))
    x = rand(24, 384, dtype=dtype)
    check(linear(x, w), x, w)
    assert gemms == pytest.approx([s * 2.0**8 for s in scales.tolist()])


@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_silu_mul_linear_is_linear_of_silu_and_mul(scheme: str, m: int) -> None:
    """The down projection with its SiLU in the decode kernel's activation pass gives the
    bits of silu_and_mul followed by linear (at 20 rows: the two ops themselves)."""
    w = packed(scheme, 64, 256, seed=7)
    h = rand(m, 512, dtype=HALF, seed=8)
    torch.testing.assert_close(silu_mul_linear(h, w), linear(silu_and_mul(h), w), rtol=0,
                               atol=0)


def test_decode_prefetches_only_16_byte_aligned_row_ranges(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bulk L2 prefetch (sm_90) faults on an address or size off 16 bytes: the decode
    kernel asks for it only when every row's K-split range starts and ends on 16 bytes."""
    monkeypatch.setattr(quant_linear, "l2_prefetch", lambda device: True)
    words = torch.zeros(64, 5120 // 8 + 4, dtype=torch.int32)
    aligned = words[:, :640]  # rows 2,576 bytes apart (a multiple of 16)
    assert quant_linear.prefetches(aligned, 5120, 1024)
    assert not quant_linear.prefetches(words[:, 1:641], 5120, 1024)  # starts 4 bytes in
    assert not quant_linear.prefetches(aligned, 5120, 1040)  # a split of 520 bytes
    assert not quant_linear.prefetches(aligned, 5104, 1024)  # a last split of 488 bytes
    odd_rows = torch.zeros(64, 642, dtype=torch.int32)[:, :640]  # rows 2,568 bytes apart
    assert not quant_linear.prefetches(odd_rows, 5120, 1024)
    monkeypatch.setattr(quant_linear, "l2_prefetch", lambda device: False)
    assert not quant_linear.prefetches(aligned, 5120, 1024)


def test_decode_candidates_cover_every_config_and_split_target() -> None:
    """The decode tuner's choices: each config with the K split of each target and its wave
    split (distinct splits only), the default first."""
    device = torch.device(DEVICE)
    n, k = (256, 8192) if DEVICE == "cpu" else (5120, 17408)  # the interpreter has 4 "SMs"
    plans = quant_linear.decode_candidates(n, k, 0, device)
    targets = [quant_linear.k_split(n, k, device, t) for t in quant_linear.SPLIT_TARGETS]
    configs = list(dict.fromkeys(p.config for p in plans))
    want = [(c, split) for c in configs for split in dict.fromkeys(
        [*targets, quant_linear.wave_split(n, k, device, c.bn, c.per_sm)])]
    assert [(p.config, (p.split_len, p.splits)) for p in plans] == want
    assert (plans[0].split_len, plans[0].splits) == quant_linear.k_split(n, k, device)
    assert len(set(targets)) == 2 and targets[1][1] > targets[0][1]  # more programs at 16


def test_candidate_splits_hold_whole_k_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GPU candidate's K split is a whole number of its config's K tiles (groupwise-int
    tiles of 512 inputs split in chunks of 512) and covers K."""
    monkeypatch.setattr(quant_linear, "INTERPRET", False)
    monkeypatch.setattr(quant_linear, "_sm_count", lambda device: 132)
    n, k = 5120, 17408
    for scheme_id in (0, 1):
        plans = quant_linear.decode_candidates(n, k, scheme_id, torch.device("cpu"))
        assert {p.config for p in plans} == set(quant_linear.DECODE_CONFIGS[scheme_id])
        for p in plans:
            assert p.split_len % p.config.bk == 0 and p.split_len % 256 == 0
            assert (p.splits - 1) * p.split_len < k <= p.splits * p.split_len
    assert any(p.config.bk == 512 and p.splits > 1 for p in plans)


@pytest.mark.parametrize(("n", "k", "splits"), [
    (5120, 17408, 9),  # down: 360 programs, one wave (14 splits take 1.4, 7 fill 0.7)
    (5120, 6144, 8),  # out_proj / o_proj: 320 programs of 3 chunks, where 6 splits walk 4
    (34816, 5120, 4),  # gate|up: 3 waves of 5 chunks beat 1 split's 21 and 10 splits' 7 x 3
    (16384, 5120, 3),  # in_proj_qkvz: 384 programs, one wave
    (248320, 5120, 1),  # lm_head: 5 waves already; splitting only adds programs
])
def test_wave_split_fills_whole_waves(monkeypatch: pytest.MonkeyPatch, n: int, k: int,
                                      splits: int) -> None:
    """On an H100 (132 SMs, 3 programs of BN 128 each) the wave split of each 27B decode
    shape: the targets' fastest split where they reach it (twenty-sixth run), one full wave
    where they do not."""
    monkeypatch.setattr(quant_linear, "_sm_count", lambda device: 132)
    split_len, got = quant_linear.wave_split(n, k, torch.device("cpu"), 128, 3)
    assert got == splits
    assert split_len % 256 == 0 and (got - 1) * split_len < k <= got * split_len


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_tuned_decode_config(scheme: str) -> None:
    """Each config the decode tuner may pick on the GPU (whichever it times fastest is
    served) gives the reference result on 8-row and 16-row tiles, K split or not, K a whole
    number of tiles or not (640: a groupwise-int tile of two groups ends half past K, one of
    four a quarter past), split in chunks of the config's granule."""
    scheme_id = 0 if scheme == "nvfp4" else 1
    n = 80
    for k in (512, 640):
        w = packed(scheme, n, k, seed=5)
        ops = quant_linear._operands(w)
        for config in quant_linear.DECODE_CONFIGS[scheme_id]:
            for m in (1, 9):
                x = rand(m, k, dtype=HALF, seed=m)
                chunk = quant_linear.granule(config)
                for split in ((k, 1), (chunk, -(-k // chunk))):
                    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
                    plan = quant_linear.DecodePlan(config, *split)
                    quant_linear._run_decode(x, ops, out, plan)
                    check(out, x, w)


@pytest.mark.parametrize("dots", [1, 2, 4, 8])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_dots(scheme: str, dots: int) -> None:
    """A K tile multiplied in 1, 2, 4 or 8 tensor-core dots (code positions grouped side by
    side) gives the reference result, K split or not (the parts added in-kernel by the last
    to arrive), K off the tile or not."""
    scheme_id = 0 if scheme == "nvfp4" else 1
    for n, k in ((80, 384), (48, 1024)):
        w = packed(scheme, n, k, seed=dots)
        ops = quant_linear._operands(w)
        plan = quant_linear.decode_candidates(n, k, scheme_id, torch.device(DEVICE))[0]
        config = dataclasses.replace(plan.config, dots=dots)
        for m in (1, 3):
            x = rand(m, k, dtype=HALF, seed=m)
            for split in ((k, 1), (256, -(-k // 256))):
                out = torch.empty((m, n), dtype=x.dtype, device=x.device)
                quant_linear._run_decode(x, ops, out, quant_linear.DecodePlan(config, *split))
                check(out, x, w)
                # the last part of each tile reset its arrival counter for the next call
                assert not quant_linear.TILE_COUNTERS.on(x.device).any()


def test_chosen_decode_plan_is_the_one_the_call_tuned() -> None:
    """The plan a decode call settled on is found again by weight and activation rows (per
    row tile: 8 rows and 16 rows are tuned apart; one row, a lone request's decode step, is
    tuned apart from the rest of its tile, whose first call in the engine's warm-up is a
    short prompt step)."""
    w = packed("nvfp4", 48, 512)
    x = rand(3, 512, dtype=HALF)
    assert quant_linear.chosen_decode_plan(w, x) is None
    quant_linear.packed_linear(x, w)
    plan = quant_linear.chosen_decode_plan(w, x)
    assert plan is not None and plan in quant_linear.decode_candidates(
        48, 512, 0, torch.device(DEVICE))
    assert quant_linear.chosen_decode_plan(w, rand(8, 512, dtype=HALF)) is plan
    assert quant_linear.chosen_decode_plan(w, rand(9, 512, dtype=HALF)) is None
    one = rand(1, 512, dtype=HALF)
    assert quant_linear.chosen_decode_plan(w, one) is None
    quant_linear.packed_linear(one, w)
    assert quant_linear.chosen_decode_plan(w, one) is not None
    assert len(quant_linear._decode_plans) == 2


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_gdn_output_norm_writes_out_projs_operand(scheme: str, rows: int) -> None:
    """`gated_rms_norm_with_operand` over [rows, heads, D]: the norm `gated_rms_norm` gives,
    and the decode operand of it read as [rows, heads * D] that out_proj's own activation
    pass would make, bit for bit (D = 64: a program takes the 2 or 4 heads of a group); no
    operand where a program's heads cannot make whole groups."""
    heads, d = 8, 64
    w = packed(scheme, 96, heads * d)
    x = rand(rows, heads, d, dtype=torch.float16) * 4
    z = rand(rows, heads, d, dtype=torch.float16, seed=2)
    gamma = 1 + rand(d, dtype=torch.float16, seed=3) * 0.1
    group, sums = quant_linear.operand_group(w), quant_linear.needs_group_sums(w)
    out, operand = gated_rms_norm_with_operand(x, z, gamma, 1e-6, group, sums)
    assert torch.equal(out, gated_rms_norm(x, z, gamma, 1e-6))
    flat = out.reshape(rows, heads * d)
    expect = quant_linear.activation_operands(flat, group, sums)
    assert operand is not None and operand.group == group
    assert torch.equal(operand.xo, expect.xo) and torch.equal(operand.inv, expect.inv)
    assert not sums or torch.equal(operand.xsum, expect.xsum)
    assert torch.equal(linear(flat, w, operand), linear(flat, w))
    odd = group // d + 1  # heads that split a group between programs
    out, operand = gated_rms_norm_with_operand(x[:, :odd], z[:, :odd], gamma, 1e-6, group, sums)
    assert operand is None and torch.equal(out, gated_rms_norm(x[:, :odd], z[:, :odd], gamma,
                                                               1e-6))


def test_the_operand_group_sums_are_exact() -> None:
    """groupwise-int's operand group sums (the zero-point term) are the exact sums of the
    operand values, rounded once: a fp32 sum's bits depend on its order, which on a GPU
    follows the tile layout of the kernel that writes the operand (a norm's is not the
    activation pass's), so that with a norm-written operand the GEMV gave other bits."""
    k = 640
    group = quant_linear.operand_group(packed("groupwise-int", 96, k))
    x = rand(3, k, dtype=HALF) * 4
    x[:, ::3] *= 1e-3  # magnitudes wide apart: a running fp32 sum rounds
    op = quant_linear.activation_operands(x, group, True)
    values = op.xo.double().permute(1, 2, 0).reshape(3, k)  # xo[j, m, w] is input 8w + j
    exact = values.reshape(3, k // group, group).sum(-1).float().t()
    assert torch.equal(op.xsum, exact)


def test_the_gdn_norm_hands_out_proj_the_operand_of_a_decode_gemv_only() -> None:
    """`models.layers.gated_norm`: the operand where out_proj runs the decode GEMV, none for a
    plain weight, fp32 activations or a prompt's rows; the norm in every case."""
    heads, d = 8, 64
    w = packed("nvfp4", 96, heads * d)
    gamma = 1 + rand(d, dtype=torch.float16, seed=3) * 0.1
    x = rand(2, heads, d, dtype=torch.float16) * 4
    z = rand(2, heads, d, dtype=torch.float16, seed=2)
    out, operand = gated_norm(x, z, gamma, 1e-6, w)
    assert torch.equal(out, gated_rms_norm(x, z, gamma, 1e-6)) and operand is not None
    plain = rand(96, heads * d, dtype=torch.float16)
    many = rand(quant_linear.SKINNY_MAX_M + 1, heads, d, dtype=torch.float16)
    for args in ((x, z, gamma, plain), (x.float(), z.float(), gamma.float(), w),
                 (many, many, gamma, w)):
        out, operand = gated_norm(*args[:3], 1e-6, args[3])
        assert operand is None and torch.equal(out, gated_rms_norm(*args[:3], 1e-6))


def equal_on_the_gpu(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit on the GPU; to half rounding under the interpreter, whose fp32 dots are
    numpy's BLAS: there a sum can depend on its column's place in the tile (OpenBLAS on an AMD
    EPYC: a gate or up value an ulp off), and the fused gate|up GEMV places gate and up rows
    otherwise than the plain one."""
    if DEVICE == "cuda":
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=0,
                                   atol=4e-3 * expected.abs().max().item())


@pytest.mark.parametrize(("scheme", "inter", "m"), [("nvfp4", 320, 1), ("nvfp4", 512, 3),
                                                    ("groupwise-int", 384, 2)])
def test_the_gate_up_gemv_hands_the_down_gemv_its_operand(scheme: str, inter: int,
                                                           m: int) -> None:
    """`swiglu_with_operand`: the gate|up decode GEMV pairing each gate row tile with its up
    rows gives silu_and_mul of its plain product, bit for bit, and the down projection's
    operand of it, the bits that GEMV's own activation pass makes (nvfp4 320: a last group
    of fewer column tiles; its counters end at zero); nothing for prompts or plain weights."""
    gate_up = packed(scheme, 2 * inter, 256)
    down = packed(scheme, 96, inter, seed=1)
    x = rand(m, 256, dtype=HALF) * 4
    spec = (quant_linear.operand_group(down), quant_linear.needs_group_sums(down))
    fused = swiglu_with_operand(x, gate_up, spec)
    assert fused is not None
    hidden, operand = fused
    equal_on_the_gpu(hidden, silu_and_mul(linear(x, gate_up)))
    expect = quant_linear.activation_operands(hidden, *spec)
    assert torch.equal(operand.xo, expect.xo) and torch.equal(operand.inv, expect.inv)
    assert not spec[1] or torch.equal(operand.xsum, expect.xsum)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()
    assert torch.equal(linear(hidden, down, operand), linear(hidden, down))
    equal_on_the_gpu(linear(hidden, down), silu_mul_linear(linear(x, gate_up), down))
    plain = rand(2 * inter, 256, dtype=HALF)
    for args in ((x, plain, spec), (x, gate_up, None),
                 (rand(quant_linear.SKINNY_MAX_M + 1, 256, dtype=HALF), gate_up, spec)):
        assert swiglu_with_operand(*args) is None


@pytest.mark.parametrize(("scheme", "inter", "m"), [("nvfp4", 320, 1), ("nvfp4", 768, 3),
                                                    ("nvfp4", 256, 2), ("groupwise-int", 384, 2)])
def test_the_mlp_block_keeps_the_two_launches_bits(scheme: str, inter: int, m: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`mlp_decode`: the MLP's two decode GEMVs in one launch give the bits of the gate|up
    GEMV handing on its operand and the down GEMV after it, with down's K split in several
    parts (its items wait on their own split's groups: nvfp4 768 has 3) or in one (256), and
    leave every counter at zero; the model's `mlp` takes it. Off (NINFER_MLP_BLOCK=0), nothing."""
    gate_up = packed(scheme, 2 * inter, 256)
    down = packed(scheme, 96, inter, seed=1)
    x = rand(m, 256, dtype=HALF) * 4
    spec = (quant_linear.operand_group(down), quant_linear.needs_group_sums(down))
    hidden, operand = swiglu_with_operand(x, gate_up, spec)
    expect = linear(hidden, down, operand)
    assert torch.equal(mlp_decode(x, gate_up, down), expect)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()
    splits = {768: 3, 256: 1}
    if inter in splits:  # the block's down plan, under its own key (`launched_as`)
        assert [plan.splits for key, plan in quant_linear._decode_plans.items()
                if isinstance(key[-1], tuple)] == [splits[inter]]
    assert torch.equal(mlp(x, MLPWeights(gate_up, down)), expect)
    assert mlp_decode(rand(quant_linear.SKINNY_MAX_M + 1, 256, dtype=HALF), gate_up,
                      down) is None
    monkeypatch.setattr(quant_linear, "MLP_BLOCK", False)
    assert mlp_decode(x, gate_up, down) is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_capped_config_launches_at_its_register_cap(scheme: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A capped config (a tile at more programs an SM than its registers allow) launches with
    the most registers that fit its per_sm programs, the others at the compiler's; the MLP
    block sets its own cap, and with a capped gate|up plan still gives the two launches' bits."""
    layout = quant_linear.LAYOUTS[scheme]
    configs = quant_linear.DECODE_CONFIGS[layout.scheme]
    assert any(c.capped for c in configs) and not configs[0].capped  # the MoE stages' base
    for c in configs:
        args = quant_linear.decode_tile_args(layout, c, 5120, 5120, 1)
        if not c.capped:
            assert "maxnreg" not in args
            continue
        threads = c.per_sm * c.warps * 32
        assert args["maxnreg"] % 8 == 0 and threads * args["maxnreg"] <= 65536
        assert threads * (args["maxnreg"] + 8) > 65536
    # the default plan capped: the interpreter's one config, the GPU's first candidate
    def more(c: quant_linear.DecodeConfig) -> quant_linear.DecodeConfig:
        return dataclasses.replace(c, per_sm=c.per_sm + 1, capped=True)
    interpreted = quant_linear._INTERPRETER_CONFIGS[layout.scheme]
    monkeypatch.setitem(quant_linear._INTERPRETER_CONFIGS, layout.scheme, more(interpreted))
    monkeypatch.setitem(quant_linear.DECODE_CONFIGS, layout.scheme, [more(configs[0])])
    monkeypatch.setattr(quant_linear, "_decode_plans", {})
    gate_up, down = packed(scheme, 768, 256), packed(scheme, 96, 384, seed=1)
    x = rand(2, 256, dtype=HALF) * 4
    spec = (quant_linear.operand_group(down), quant_linear.needs_group_sums(down))
    hidden, operand = swiglu_with_operand(x, gate_up, spec)
    assert torch.equal(mlp_decode(x, gate_up, down), linear(hidden, down, operand))
    assert all(plan.config.capped for plan in quant_linear._decode_plans.values())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tuned_decode_gives_the_reference(scheme: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the decode tuner on (on the GPU it times every candidate streaming over zero-filled
    copies of the weight, `tuner.streaming_times`), the plan it picks gives the
    reference, and the weight itself is untouched."""
    monkeypatch.setattr(tuner, "DECODE_TUNING", True)
    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    w = packed(scheme, 384, 512)
    before = {r: p.clone() for r, p in w.parts.items()}
    x = rand(1, 512, dtype=HALF)
    check(linear(x, w), x, w)
    assert all(torch.equal(w.parts[r], p) for r, p in before.items())


@pytest.mark.parametrize(("m", "residual"), [(1, True), (3, True), (2, False)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_activation_pass_runs_the_norm_before_it(scheme: str, m: int, residual: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred norm (ops.norm.DeferredNorm) handed to a decode GEMV runs in its activation
    pass, never as a launch of its own: the residual, the normed rows and the product are the
    bits of the norm kernel, then the GEMV; through `linear`, `swiglu_with_operand` and
    `mlp_decode` (a norm each: the first launch that reads it runs it)."""
    run = DeferredNorm.run
    ran = []
    monkeypatch.setattr(DeferredNorm, "run", lambda norm: ran.append(norm) or run(norm))
    k, inter = 640, 256
    x, w = rand(m, k, dtype=HALF, seed=2) * 4, packed(scheme, 48, k, seed=3)
    h = rand(m, k, dtype=HALF, seed=4) if residual else None
    weight = rand(k, dtype=HALF, seed=5) * 0.1
    if residual:
        expect_x, normed = add_rms_norm(x, h, weight, 1e-6)
    else:
        expect_x, normed = x, rms_norm(x, weight, 1e-6)
    norm = defer_add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(linear(norm.out, w, norm=norm), linear(normed, w))
    assert torch.equal(norm.out, normed) and torch.equal(norm.residual, expect_x)
    gate_up, down = packed(scheme, 2 * inter, k, seed=6), packed(scheme, 96, inter, seed=7)
    spec = (quant_linear.operand_group(down), quant_linear.needs_group_sums(down))
    norm = defer_add_rms_norm(x, h, weight, 1e-6)
    hidden, operand = swiglu_with_operand(norm.out, gate_up, spec, norm)
    expect_hidden, expect_operand = swiglu_with_operand(normed, gate_up, spec)
    assert torch.equal(norm.out, normed) and torch.equal(hidden, expect_hidden)
    assert torch.equal(operand.xo, expect_operand.xo)
    norm = defer_add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(mlp_decode(norm.out, gate_up, down, norm), mlp_decode(normed, gate_up, down))
    assert torch.equal(norm.out, normed) and torch.equal(norm.residual, expect_x)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()
    assert not ran
