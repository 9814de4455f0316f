"""The MoE kernels against their torch references (Triton's interpreter on CPU): routing,
the align step that sorts (token, slot) pairs into per-expert blocks, and the expert paths
(the decode GEMVs over the routed pairs; the grouped gate|up + SiLU + down GEMMs over the
aligned blocks; for long bf16 prompts the experts dequantized once and torch's grouped GEMM)
over bf16/fp16/fp32, nvfp4 and groupwise-int stacked experts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ninfer_runtime.ops import moe, quant_linear, skinny_linear, tuner
from ninfer_runtime.ops.linear import linear
from ninfer_runtime.ops.moe import (
    DECODE_MAX_TOKENS,
    _launch_align,
    _launch_moe_decode,
    _launch_moe_experts,
    align_ref,
    moe_experts,
    moe_experts_ref,
    route,
    route_ref,
)
from ninfer_runtime.ops.norm import DeferredNorm, add_rms_norm, defer_add_rms_norm
from ninfer_runtime.quant import PackedWeight, get_scheme

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "triton")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """[tokens, top_k] distinct experts per token, as top-k routing gives."""
    g = gen(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])


# no tl.dot in routing, so the interpreter takes bf16 too (its 256-expert case has ties)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 8, 2), (3, 256, 8)])
def test_route(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    logits = (torch.randn(tokens, experts, generator=gen(0)) * 2).to(DEVICE, dtype)
    weights, ids = route(logits, top_k)
    ref_weights, ref_ids = route_ref(logits, top_k)
    # Equal half logits tie exactly (the bf16 256-expert case has such pairs in its top 8),
    # and torch.topk orders ties arbitrarily (CUDA differs from CPU). So: the kernel picks
    # distinct experts whose probabilities are exactly the reference's top k, in order, and
    # breaks ties by the lowest id, as its docstring says.
    assert ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    assert all(len(set(row)) == top_k for row in ids.tolist())
    probs = torch.softmax(logits.float(), dim=-1)
    picked = probs.gather(-1, ids)
    assert torch.equal(picked, probs.gather(-1, ref_ids))
    tied = picked[:, 1:] == picked[:, :-1]
    assert (ids[:, 1:] > ids[:, :-1])[tied].all()
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


# (tokens, top_k, experts, block_m): decode, several chunks of pairs, the real 256 experts,
# a prompt chunk's shape (256 routed experts and the shared one, 9 slots), one expert (fewer
# blocks than spans of 16)
ALIGN_CASES = [(1, 8, 256, 16), (8, 8, 256, 16), (7, 2, 8, 16), (45, 2, 8, 16),
               (45, 2, 8, 32), (3, 2, 5, 16), (300, 9, 257, 64), (64, 1, 1, 64)]


@pytest.mark.parametrize("spans", [0, 64, 16])
@pytest.mark.parametrize("case", ALIGN_CASES)
def test_align_sorts_pairs_into_expert_blocks(case: tuple[int, int, int, int], spans: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """spans 0: one program; 64 or 16: the prompt path, one program per span of pairs (the
    last span partial), as if every case were above ALIGN_ONE_PROGRAM_MAX; each program
    writes its share of the block table."""
    if spans:
        monkeypatch.setattr(moe, "ALIGN_ONE_PROGRAM_MAX", 0)
        monkeypatch.setattr(moe, "ALIGN_SPAN", spans)
    tokens, top_k, experts, block_m = case
    ids = random_ids(tokens, top_k, experts, seed=tokens).to(DEVICE)
    ref = align_ref(ids, experts, block_m)
    out = _launch_align(ids, experts, block_m)
    assert torch.equal(out.sorted_slots, ref.sorted_slots)
    assert torch.equal(out.block_expert, ref.block_expert)
    # what the GEMMs rely on: every pair once, each in a block of its own expert
    pairs = tokens * top_k
    slots, owners = ref.sorted_slots.cpu(), ref.block_expert.cpu()
    real = slots < pairs
    assert sorted(slots[real].tolist()) == list(range(pairs))
    block_of = torch.arange(slots.numel()) // block_m
    assert torch.equal(owners[block_of[real]], ids.cpu().flatten()[slots[real]])
    used = owners[owners >= 0]
    if pairs <= block_m:  # decode: one block per active expert, its weights read once
        assert used.unique().numel() == used.numel() == ids.unique().numel()


def stacked(scheme: str, experts: int, rows: int, cols: int, seed: int,
            dtype: torch.dtype) -> torch.Tensor | PackedWeight:
    """Random [E, rows, cols] experts: plain in dtype, or packed parts drawn directly (every
    code and every non-NaN E4M3 scale byte can occur), each row of size ~ 1 / sqrt(cols)."""
    g = gen(seed)
    if scheme == "plain":
        return (torch.randn(experts, rows, cols, generator=g) * cols**-0.5).to(DEVICE, dtype)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=g)
    if scheme == "nvfp4":
        shape = (experts, rows, cols // 16)
        magnitude = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=g)  # no NaN
        sign = torch.randint(0, 2, shape, dtype=torch.uint8, generator=g) << 7
        scale = (magnitude | sign).view(torch.float8_e4m3fn)
        scale_2 = torch.rand(experts, rows, generator=g) * 0.2 * cols**-0.5 / 64
        parts = {"weight": codes, "weight_scale": scale, "weight_scale_2": scale_2}
    else:
        groups = cols // 128
        step = (torch.rand(experts, rows, groups, generator=g) * 0.3 * cols**-0.5)
        zero = torch.randint(0, 16, (experts, rows, groups), dtype=torch.uint8, generator=g)
        parts = {"weight": codes, "weight_scale": step.bfloat16(), "weight_zero": zero}
    name = {"nvfp4": "nvfp4", "int4": "groupwise-int"}[scheme]
    return PackedWeight(get_scheme(name), {k: v.to(DEVICE) for k, v in parts.items()},
                        (experts, rows, cols))


def as_fp32(w: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
    return w.float() if isinstance(w, torch.Tensor) else w


# (scheme, tokens, hidden, inter): odd sizes for plain weights; packed K must be a multiple of
# 16 (nvfp4: 48 is not one of the kernels' K tiles) or 128 (groupwise-int); hidden 256 streams
# gate|up in two K tiles of the decode kernel (one tile of 128 under the interpreter); 40
# tokens x 2 slots on 8 experts give the grouped GEMMs several blocks an expert
MOE_CASES = [("plain", 1, 40, 24), ("plain", 3, 256, 64), ("plain", 33, 40, 24),
             ("nvfp4", 1, 64, 48), ("nvfp4", 3, 256, 48), ("nvfp4", 40, 256, 128),
             ("int4", 2, 256, 128)]
PATHS = {"decode": _launch_moe_decode, "grouped": _launch_moe_experts}
# the decode GEMVs at the sizes moe_experts gives them; the grouped GEMMs at every size
PATH_CASES = [(path, case) for case in MOE_CASES for path in PATHS
              if path == "grouped" or case[1] <= DECODE_MAX_TOKENS]


def experts_case(scheme: str, tokens: int, hidden: int, inter: int, dtype: torch.dtype,
                 top_k: int = 2) -> tuple:
    """(x, gate_up, down, weights, ids) on 8 experts."""
    experts = 8
    gate_up = stacked(scheme, experts, 2 * inter, hidden, seed=1, dtype=dtype)
    down = stacked(scheme, experts, hidden, inter, seed=2, dtype=dtype)
    x = torch.randn(tokens, hidden, generator=gen(3)).to(DEVICE, dtype)
    weights, ids = route_ref(torch.randn(tokens, experts, generator=gen(4)).to(DEVICE), top_k)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("path,case", PATH_CASES)
def test_moe_experts(path: str, case: tuple[str, int, int, int], dtype: torch.dtype) -> None:
    x, gate_up, down, weights, ids = experts_case(*case, dtype)
    out = PATHS[path](x, gate_up, down, weights, ids)
    expected = moe_experts_ref(x.float(), as_fp32(gate_up), as_fp32(down), weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    scale = expected.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 4e-3)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("scheme", ["plain", "int4"])
def test_decode_with_top_k_not_a_power_of_two(scheme: str) -> None:
    """The down GEMV loads a power-of-two number of expert slots; the spare ones are masked."""
    x, gate_up, down, weights, ids = experts_case(scheme, 3, 128, 128, torch.float32, top_k=3)
    out = _launch_moe_decode(x, gate_up, down, weights, ids)
    expected = moe_experts_ref(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


def test_decode_sizes_take_the_gemv_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to DECODE_MAX_TOKENS tokens moe_experts runs the GEMVs (no align, no grouped GEMM)."""
    def grouped(*args: object) -> None:
        raise AssertionError("the grouped path ran at a decode size")

    monkeypatch.setattr(moe, "_launch_moe_experts", grouped)
    x, gate_up, down, weights, ids = experts_case("nvfp4", DECODE_MAX_TOKENS, 32, 16,
                                                  torch.float32)
    out = moe_experts(x, gate_up, down, weights, ids)
    expected = moe_experts_ref(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dots", [2, 8])
@pytest.mark.parametrize(("scheme", "bk"), [("nvfp4", 256), ("int4", 128), ("int4", 256)])
def test_tensor_core_decode(scheme: str, bk: int, dots: int, splits: int,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed experts with half activations take the tensor-core stages (ops.quant_linear's
    decode tile per pair); every config, K tile (int4: one or two groups, the last tile of
    K 384 and of K 128 part-filled) and K split gives the reference, and the arrival counters
    that add the K parts and a token's pairs are left at zero."""
    ran = []
    stage = moe._tensor_core_stage
    monkeypatch.setattr(moe, "_tensor_core_stage",
                        lambda *a, **kw: ran.append(1) or stage(*a, **kw))
    hidden, inter = (768, 64) if scheme == "nvfp4" else (384, 128)
    for tokens, top_k in ((1, 2), (2, 3)):
        moe._stage_plans.clear()
        candidate = moe._stage_candidates(inter, hidden, moe.NVFP4 if scheme == "nvfp4"
                                          else moe.INT4, True)[0]
        plan = moe._StagePlan(dataclasses.replace(candidate.config, dots=dots, bk=bk), splits)
        monkeypatch.setattr(moe, "_stage_candidates", lambda *a, plan=plan: [plan])
        x, gate_up, down, weights, ids = experts_case(scheme, tokens, hidden, inter, HALF,
                                                      top_k=top_k)
        out = _launch_moe_decode(x, gate_up, down, weights, ids)
        expected = moe_experts_ref(x.float(), gate_up, down, weights, ids)
        torch.testing.assert_close(out.float(), expected, rtol=4e-3,
                                   atol=4e-3 * expected.abs().max().item())
        assert not quant_linear.TILE_COUNTERS.on(x.device).any()
    assert len(ran) == 4  # two stages, two cases


@pytest.mark.parametrize("tokens", [1, 5])
def test_route_with_the_shared_expert(tokens: int) -> None:
    """With shared=True the last logit is the shared expert's gate: the routed slots are those
    of the other logits, and slot k is expert E weighted by sigmoid(gate)."""
    experts, top_k = 8, 2
    logits = (torch.randn(tokens, experts + 1, generator=gen(5)) * 2).to(DEVICE, HALF)
    weights, ids = route(logits, top_k, shared=True)
    ref_weights, ref_ids = route_ref(logits, top_k, shared=True)
    routed_weights, routed_ids = route_ref(logits[:, :-1], top_k)
    assert torch.equal(ref_ids[:, :top_k], routed_ids)
    assert torch.equal(ids, ref_ids) and (ids[:, top_k] == experts).all()
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights[:, top_k], torch.sigmoid(logits[:, -1].float()))


@pytest.mark.parametrize(("tokens", "shared"), [(1, True), (5, False), (16, True)])
def test_the_router_routes_in_its_last_row_tile(tokens: int, shared: bool) -> None:
    """`router`: the router's product and routing in one launch give what linear then route
    give, bit for bit, the same for a token alone as in a batch, and leave its counters at
    zero; a prompt's rows (and fp32) take linear and route."""
    experts, hidden = 40, 384  # three row tiles of the skinny kernel, K split in parts
    x = (torch.randn(tokens, hidden, generator=gen(7)) * 4).to(DEVICE, HALF)
    w = (torch.randn(experts + shared, hidden, generator=gen(8)) * hidden**-0.5).to(DEVICE, HALF)
    weights, ids, operand = moe.router(x, w, 4, shared, None)
    expect = route(linear(x, w), 4, shared)
    assert operand is None and torch.equal(ids, expect[1]) and torch.equal(weights, expect[0])
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()
    alone = moe.router(x[-1:], w, 4, shared, None)  # a token's bits whatever its batch
    assert torch.equal(alone[0], weights[-1:]) and torch.equal(alone[1], ids[-1:])
    for rows in (x.float(), x.new_zeros(DECODE_MAX_TOKENS + 1, hidden)):
        weights, ids, operand = moe.router(rows, w.to(rows.dtype), 4, shared, (128, False))
        expect = route(linear(rows, w.to(rows.dtype)), 4, shared)
        assert operand is None and torch.equal(ids, expect[1])


@pytest.mark.parametrize("tokens", [1, 3, DECODE_MAX_TOKENS + 5])
def test_the_router_routes_only_its_columns(tokens: int) -> None:
    """A weight padded with zero rows (models.weights.ROUTER_ROWS) routes over its first
    `columns` rows only: the ids and weights of the unpadded weight, at decode sizes (one
    launch) and for a prompt's rows (its GEMM over every row)."""
    experts, hidden = 40, 384
    x = (torch.randn(tokens, hidden, generator=gen(7)) * 4).to(DEVICE, HALF)
    w = (torch.randn(experts + 1, hidden, generator=gen(8)) * hidden**-0.5).to(DEVICE, HALF)
    padded = torch.cat([w, w.new_zeros(7, hidden)])
    weights, ids, _ = moe.router(x, padded, 4, True, None, experts + 1)
    expect = moe.router(x, w, 4, True, None)
    assert ids.shape == (tokens, 5) and int(ids.max()) <= experts
    assert torch.equal(ids, expect[1])
    torch.testing.assert_close(weights, expect[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme", ["nvfp4", "int4"])
def test_the_router_hands_the_gate_up_stage_its_operand(scheme: str) -> None:
    """The router's kernel writes x's operand for the tensor-core gate|up stage
    (`gate_up_operand_spec`): the experts' output is the same bit for bit as with the
    stage's own activation pass; no spec where the stages do not run on tensor cores or the
    tokens are a prompt's."""
    hidden, inter = (768, 64) if scheme == "nvfp4" else (384, 128)
    x, gate_up, down, _, _ = experts_case(scheme, 3, hidden, inter, HALF)
    w = (torch.randn(8, hidden, generator=gen(6)) * hidden**-0.5).to(DEVICE, HALF)
    spec = moe.gate_up_operand_spec(x, gate_up, down)
    assert spec == (quant_linear.operand_group(gate_up), scheme == "int4")
    weights, ids, operand = moe.router(x, w, 2, False, spec)
    expect = quant_linear.activation_operands(x, *spec)
    assert operand is not None and torch.equal(operand.xo, expect.xo)
    assert torch.equal(operand.inv, expect.inv) and torch.equal(operand.xsum, expect.xsum)
    assert torch.equal(moe_experts(x, gate_up, down, weights, ids, operand),
                       moe_experts(x, gate_up, down, weights, ids))
    plain = stacked("plain", 8, 2 * inter, hidden, seed=1, dtype=HALF)
    many = x.new_zeros(DECODE_MAX_TOKENS + 1, hidden)
    for args in ((x, plain, down), (x.float(), gate_up, down), (many, gate_up, down)):
        assert moe.gate_up_operand_spec(*args) is None


@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_the_router_runs_the_norm_before_it(tokens: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the post-attention norm deferred (ops.norm.DeferredNorm), the router's launch
    runs it (up to 4 rows of this hidden size; 9 get the norm kernel first): the residual,
    the normed rows, the routing and the gate|up operand are the bits of the norm kernel
    followed by the router."""
    hidden, experts = 1024, 40
    x = (torch.randn(tokens, hidden, generator=gen(1)) * 4).to(DEVICE, HALF)
    h = torch.randn(tokens, hidden, generator=gen(2)).to(DEVICE, HALF)
    weight = (torch.randn(hidden, generator=gen(3)) * 0.1).to(DEVICE, HALF)
    w = (torch.randn(experts + 1, hidden, generator=gen(4)) * hidden**-0.5).to(DEVICE, HALF)
    residual, normed = add_rms_norm(x, h, weight, 1e-6)
    expect = moe.router(normed, w, 4, True, (128, True))
    norm = defer_add_rms_norm(x, h, weight, 1e-6)
    run = DeferredNorm.run
    ran = []
    monkeypatch.setattr(DeferredNorm, "run", lambda norm: ran.append(norm) or run(norm))
    assert skinny_linear.takes_norm(norm) == (tokens <= 4)
    weights, ids, operand = moe.router(norm.out, w, 4, True, (128, True), norm=norm)
    assert len(ran) == (tokens > 4)  # the norm kernel only where the prologue cannot
    assert torch.equal(norm.residual, residual) and torch.equal(norm.out, normed)
    assert torch.equal(ids, expect[1]) and torch.equal(weights, expect[0])
    assert torch.equal(operand.xo, expect[2].xo) and torch.equal(operand.inv, expect[2].inv)
    assert torch.equal(operand.xsum, expect[2].xsum)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()


@pytest.mark.parametrize(("scheme", "inter"), [("nvfp4", 320), ("int4", 384)])
def test_the_gate_up_stage_hands_the_down_stage_its_operand(scheme: str, inter: int) -> None:
    """The tensor-core gate|up stage writes its output's decode operand for the down stage
    (the last column tile of each operand group to be stored writes the group), the bits the
    down stage's own activation pass makes of that output; its group counters end at zero.
    nvfp4: two groups of 256, the second of 2 column tiles; int4: three groups of 128."""
    x, gate_up, down, weights, ids = experts_case(scheme, 3, 256, inter, HALF, top_k=3)
    pairs = ids.numel()
    hidden = torch.empty(pairs, inter, dtype=HALF, device=DEVICE)
    handed = quant_linear.DecodeOperand.empty(pairs, inter, quant_linear.operand_group(down),
                                              quant_linear.needs_group_sums(down), x.device)
    moe._tensor_core_stage(x, moe._Experts.of(gate_up, "gate_up"), hidden, ids.contiguous(),
                           weights.float().contiguous(), swiglu=True, hand_on=handed)
    expect = quant_linear.activation_operands(hidden, handed.group, handed.sums)
    assert torch.equal(handed.xo, expect.xo) and torch.equal(handed.inv, expect.inv)
    assert not handed.sums or torch.equal(handed.xsum, expect.xsum)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()


# the interpreter casts fp32 to bf16 by truncation: bf16's bits on the GPU only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + [torch.bfloat16] * (DEVICE == "cuda"))
@pytest.mark.parametrize("scheme", ["nvfp4", "int4"])
def test_stacked_experts_dequantize_to_the_reference_bits(scheme: str,
                                                          dtype: torch.dtype) -> None:
    """The dequantized path's weights (quant_linear.dequantize of a stacked [E, N, K] weight,
    the nvfp4 global scale folded in) are PackedWeight.dequantize's bits."""
    w = stacked(scheme, 3, 40, 256, seed=6, dtype=dtype)
    got = quant_linear.dequantize(w, dtype)
    assert got.shape == (3, 40, 256) and got.dtype == dtype
    assert torch.equal(got, w.dequantize(dtype))


def dequantized_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the dequantized path's launches into the returned list."""
    ran: list[int] = []
    path = moe._launch_moe_dequantized
    monkeypatch.setattr(moe, "_launch_moe_dequantized", lambda *a: ran.append(1) or path(*a))
    return ran


# (scheme, tokens, hidden, inter): packed K off the dequant kernel's 256-wide nvfp4 tile;
# experts left unused (routing over 3 of the 8: empty groups in the grouped GEMM)
DEQUANTIZED_CASES = [("plain", 33, 40, 24), ("nvfp4", 40, 384, 48), ("int4", 24, 256, 128)]


@pytest.mark.parametrize("used", [8, 3])
@pytest.mark.parametrize("case", DEQUANTIZED_CASES)
def test_the_dequantized_prompt_path(case: tuple[str, int, int, int], used: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 prompts with enough pairs per expert: each stacked weight dequantized once and
    torch's grouped GEMM over the pairs sorted by expert, then the weighted sum per token."""
    monkeypatch.setattr(moe, "DEQUANT_MIN_ROWS", 0)
    ran = dequantized_runs(monkeypatch)
    x, gate_up, down, weights, ids = experts_case(*case, torch.bfloat16)
    ids = ids % used
    ids[:, 1] = (ids[:, 0] + 1) % used  # distinct slots, as routing gives
    out = moe_experts(x, gate_up, down, weights, ids)
    expected = moe_experts_ref(x.float(), as_fp32(gate_up), as_fp32(down), weights, ids)
    assert ran == [1] and out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected, rtol=2e-2,
                               atol=2e-2 * expected.abs().max().item())


def test_prompts_take_the_dequantized_path_from_enough_rows_per_expert(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed experts: from DEQUANT_MIN_ROWS pairs per stacked expert, and bf16 activations
    only (torch's grouped GEMM); below it, or in fp16, the in-register path."""
    ran = dequantized_runs(monkeypatch)
    x, gate_up, down, weights, ids = experts_case("nvfp4", 17, 64, 48, torch.bfloat16)
    monkeypatch.setattr(moe, "DEQUANT_MIN_ROWS", 5)  # 8 experts x 5 > 34 pairs
    moe_experts(x, gate_up, down, weights, ids)
    assert ran == []
    monkeypatch.setattr(moe, "DEQUANT_MIN_ROWS", 4)
    moe_experts(x.half(), gate_up, down, weights, ids)
    assert ran == []
    moe_experts(x, gate_up, down, weights, ids)
    assert ran == [1]


def test_tuned_tensor_core_decode_gives_the_reference(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With the stages' tuner on (on the GPU it times every candidate with the routing rotated
    over other experts, `moe._rotated_ids`), the plans it picks give the reference."""
    monkeypatch.setattr(tuner, "DECODE_TUNING", True)
    monkeypatch.setattr(moe, "_stage_plans", {})
    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    x, gate_up, down, weights, ids = experts_case("nvfp4", 1, 768, 64, HALF, top_k=2)
    out = _launch_moe_decode(x, gate_up, down, weights, ids)
    expected = moe_experts_ref(x.float(), gate_up, down, weights, ids)
    torch.testing.assert_close(out.float(), expected, rtol=4e-3,
                               atol=4e-3 * expected.abs().max().item())


def test_int_stages_tune_tiles_of_one_and_two_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU the groupwise-int stages' tuner also times K tiles of two 128-input groups
    (nvfp4's tile is its operand group, 256); every K split holds whole tiles."""
    monkeypatch.setattr(moe, "INTERPRET", False)
    for scheme, tiles in ((moe.INT4, {128, 256}), (moe.NVFP4, {256})):
        plans = moe._stage_candidates(512, 2048, scheme, True)
        assert {p.config.bk for p in plans} == tiles
        assert all(p.splits <= 2048 // p.config.bk for p in plans)
