"""Mixture-of-experts routing and the routed SwiGLU experts.

The shared expert, an MLP gated by sigmoid(x . shared_expert_gate), is stacked after the E
routed experts (models.weights.MoEWeights): `route(..., shared=True)` gives every token a slot
k for expert E with that gate as its weight, so one pass runs routed and shared experts.

Each op has a torch reference (`*_ref`, the oracle and the CPU path) and a Triton path
(ops.dispatch picks):

- `route`: one program per token does top-k and the softmax renormalised over the k (fp32);
  at decode sizes the router's own kernel routes instead (`router`), once its logits are in.
- `moe_experts` at decode sizes (T <= DECODE_MAX_TOKENS): two GEMV launches straight over the
  routed (token, slot) pairs, no sorting. gate|up: a program per (pair, tile of BN
  intermediate columns) reads its expert's BN gate rows and BN up rows once and stores
  silu(gate) * up (-> hidden [T*k, I]); down: a program per (token, tile of BN output rows)
  walks the token's k experts, their routing weights folded into the per-row multipliers, and
  stores the finished sum (deterministic: a fixed order, no atomics, no third pass). Only the
  chosen experts' bytes are read; packed codes decode on CUDA cores as 32-bit words
  (ops.quant_linear's decoders), each block scale applied once per word. Packed experts with
  half activations (the GPU's case) run the same two stages on tensor cores instead
  (`_tensor_core_stage`): a program per (pair, column tile, K split) runs ops.quant_linear's
  decode tile (PTX decoders, ~2.7-4 SASS instructions per weight against ~6 on CUDA cores)
  on its pair's expert, and the K parts and a token's pairs are added in-kernel by the last
  program to arrive, in a fixed order. The gate|up stage also writes the down stage's
  activation operand (the last column tile of each operand group to be stored writes that
  group), and the router's kernel writes gate|up's (`router`): neither stage launches an
  activation pass. (The two stages in one launch, a down item waiting only for its own
  pair's hidden operand, ran the 35B-A3B 3.8% slower on an H100: docs/perf.md, thirtieth
  run.)
- `moe_experts` for prompts, two paths, each ending in `_combine` (a program per token adds
  its k rows times their routing weights in slot order, fp32, rounded once):
  - in registers: the T*k pairs are sorted by expert into blocks of BLOCK_M rows (`align`:
    every block belongs to one expert; an expert's last block is padded with a sentinel),
    then two grouped GEMMs (`_grouped_gemm_kernel`) run over the blocks: gate|up with
    SiLU-and-mul fused into the epilogue (-> hidden [padded rows, I]), then down (-> one row
    per (token, slot)). Both read the stacked expert weights [E, N, K] as stored (bf16,
    nvfp4 or groupwise-int), dequantizing packed tiles in registers once per block (the
    dense prompt GEMM's tile decode to the activations' type; its fp16-operand path lost
    here: 665 against 595 us for a 35B layer's 1,024-token chunk, even at 4,096-8,192,
    docs/perf.md, sixteenth run).
  - dequantized (`_launch_moe_dequantized`), bf16 prompts of at least DEQUANT_MIN_ROWS pairs
    per expert on a GPU where torch's grouped GEMM runs (CUTLASS, `_grouped_mm_runs`; a CUDA
    graph's verify step has far fewer): each stacked weight (bf16 experts as they are) is
    dequantized once to bf16 (`quant_linear.dequantize`: the reference's bits, the nvfp4
    global scale folded in) and torch's grouped GEMM multiplies the
    pairs sorted by expert, as the dense prefill hands cuBLAS a dequantized weight; the
    weight's bytes are written and read once more, against a tile decode per block of rows.

Dequantization is exact where it can be: an E2M1 code times its E4M3 block scale has at most 6
significant bits and lies in [2^-10, 2688], so it is formed exactly in fp16 or bf16; the fp32
per-row global scale multiplies the fp32 accumulator. groupwise-int weights are (q - zero) *
scale rounded once to the compute dtype, as the reference rounds them (the CUDA-core GEMV
applies the group scale to fp32 partial sums instead); the two agree to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from ninfer_runtime.ops import quant_linear, skinny_linear, tuner
from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.compile_ahead import launch
from ninfer_runtime.ops.dispatch import INTERPRET, use_triton
from ninfer_runtime.ops.launch import dot_precision, l2_prefetch, options
from ninfer_runtime.ops.linear import linear
from ninfer_runtime.ops.norm import DeferredNorm
from ninfer_runtime.quant import PackedWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references still run
    triton = None

ExpertWeight = torch.Tensor | PackedWeight

# How the kernels read a stacked expert weight (a constexpr of the GEMM kernel).
PLAIN, NVFP4, INT4 = 0, 1, 2
_SCHEMES = {"nvfp4": NVFP4, "groupwise-int": INT4}
INT4_GROUP = 128  # quant.groupwise_int.GROUP: a K tile must lie inside one group
# `align` sorts up to this many (token, slot) pairs in one program and launch; more (prompt
# chunks: 1,024 tokens x 9 slots in the 35B) in two launches of a program per ALIGN_SPAN
# pairs (count and sentinel rows; then block owners and place, each program taking its share
# of the block table):
# few launches matter, since a prompt chunk's many short kernels leave the GPU waiting on the
# host (docs/perf.md, sixth run), and no launch of one program, which took 44 us of each
# 35B chunk-layer (eleventh run: 14 of the 8K prefill's 372 ms)
ALIGN_ONE_PROGRAM_MAX = 4096
ALIGN_SPAN = 512
# spans' count rows a program of the place kernel loads at once
_ALIGN_SPAN_TILE = 8
# sentinel rows an align program stores at once
_ALIGN_FILL = 1024
# From this many pairs per expert (mean over the stacked experts) a bf16 prompt step takes the
# dequantized path. A first guess, untimed: from the H200's eleventh run, a 64-row block of
# the in-register path ~2 us and dequantizing the 35B's experts ~0.6 ms a layer, the two
# meet between ~150 and ~300 rows (an 8K prompt step gives ~287); `ninfer-bench kernels
# --only moe` times both paths at 1K-8K tokens to set it.
DEQUANT_MIN_ROWS = 192
# Up to this many tokens moe_experts takes the GEMV path: a pair's expert is read by its own
# programs (L2 absorbs repeats of an expert within the step); above it, sorting by expert pays.
DECODE_MAX_TOKENS = 16


# ---- references ----


def route_ref(router_logits: torch.Tensor, top_k: int, shared: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k -> renormalise: (weights fp32 [T, k], expert ids [T, k]).

    Qwen3.5 always renormalises the top-k probabilities (no norm_topk_prob switch). With
    `shared`, the logits' last column is the shared expert's gate and not routed: it becomes
    slot k, expert E (the shared expert stacked after the E routed ones), weight sigmoid(gate).
    """
    if shared:
        weights, ids = route_ref(router_logits[..., :-1], top_k)
        gate = torch.sigmoid(router_logits[..., -1:].float())
        return (torch.cat([weights, gate], -1),
                torch.cat([ids, torch.full_like(ids[..., :1], router_logits.shape[-1] - 1)], -1))
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _expert(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e of a stacked weight, dequantized to dtype."""
    if isinstance(w, PackedWeight):
        return w.scheme.dequantize_parts({r: p[e] for r, p in w.parts.items()}).to(dtype)
    return w[e]


def moe_experts_ref(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H].

    gate_up [E, 2I, H] holds each expert's gate rows then up rows; down [E, H, I].
    """
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():  # reference: one dense matmul per used expert
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], _expert(gate_up, e, x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, _expert(down, e, x.dtype))
        out.index_add_(0, tokens, y * weights[tokens, slots, None].to(x.dtype))
    return out


@dataclass(frozen=True)
class Alignment:
    """The (token, slot) pairs of a step sorted into per-expert blocks of `block_m` rows.

    sorted_slots [num_blocks * block_m] int64: flat pair index t * k + j, or the sentinel
    T * k on padding rows; block_expert [num_blocks] int64: the expert of each block, -1 for
    blocks past the last used one (num_blocks is a bound known without reading the ids).
    Within an expert, pairs keep their flat order.
    """

    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def _num_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m) over the used experts, from sizes
    alone: each used expert wastes less than one block."""
    used = min(num_experts, pairs)
    return -(-(pairs + used * (block_m - 1)) // block_m)


def align_ref(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the pairs by expert with torch ops (no host sync: sizes come from the bound)."""
    flat = ids.reshape(-1)
    n, device = flat.numel(), flat.device
    num_blocks = _num_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert]
    sorted_slots = torch.full((num_blocks * block_m,), n, dtype=torch.int64, device=device)
    sorted_slots[(block_end - blocks)[expert] * block_m + rank] = order
    block = torch.arange(num_blocks, device=device)
    owner = torch.searchsorted(block_end, block, right=True)
    return Alignment(sorted_slots, torch.where(owner < num_experts, owner, -1), block_m)


# ---- public ops ----


def route(router_logits: torch.Tensor, top_k: int, shared: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (fp32) -> top-k -> renormalise: (weights fp32 [T, k], expert ids [T, k]), and
    with `shared` the shared expert's slot after them (`route_ref`)."""
    if not use_triton(router_logits) or router_logits.shape[0] == 0:
        return route_ref(router_logits, top_k, shared)
    return _launch_route(router_logits, top_k, shared)


def router(x: torch.Tensor, w: torch.Tensor, top_k: int, shared: bool,
           spec: tuple[int, bool] | None, columns: int | None = None,
           norm: DeferredNorm | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, quant_linear.DecodeOperand | None]:
    """route(linear(x, w), top_k, shared) for x [T, H] and the router's weight w [E (+1), H],
    and x's decode operand of `spec` for the gate|up stage (`gate_up_operand_spec`, or None).
    At decode sizes one launch (`_router_kernel`: skinny_linear's product, whose last row
    tile routes) where linear, route and an activation pass were three; elsewhere those ops
    (the operand None). With `columns`, only w's first `columns` rows route: the rest are
    zero rows that align a prompt's logits for its GEMM (models.weights.ROUTER_ROWS). `norm`:
    the norm whose output x is, not yet run (the launch runs it where skinny_linear can)."""
    routed = w[:columns]
    if not (use_triton(x, w) and skinny_linear.applies(x, routed)):
        return (*route(linear(x, w, norm=norm)[:, :columns], top_k, shared), None)
    w = routed
    launch = skinny_linear.Launch.of(x, w.shape[0])
    weights, ids, constexprs = _routing(x.shape[0], w.shape[0], top_k, shared, x.device)
    operand = None if spec is None else quant_linear.DecodeOperand.empty(*x.shape, *spec,
                                                                         x.device)
    buffers, operand_options = skinny_linear.operand_args(x, operand)
    source, norm_buffers, norm_options = skinny_linear.norm_args(x, norm)
    _router_kernel[launch.grid](*launch.args(source, w, 1), *buffers, *norm_buffers,
                                *launch.sizes(source, w), weights, ids, **operand_options,
                                **norm_options, **constexprs,
                                ROUTE_ROWS=triton.next_power_of_2(x.shape[0]),
                                **skinny_linear.tile_options(x))
    return weights, ids, operand


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """`align_ref` in Triton: one launch at decode sizes, three for prompt chunks."""
    if not use_triton(ids):
        return align_ref(ids, num_experts, block_m)
    return _launch_align(ids, num_experts, block_m)


def moe_experts(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
                weights: torch.Tensor, ids: torch.Tensor,
                operand: quant_linear.DecodeOperand | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H] (see `moe_experts_ref`).
    operand: x's decode operand for the gate|up stage on tensor cores, made with x by the
    kernel beside it (`gate_up_operand_spec`), which spares the stage its activation pass."""
    if not _kernels(x, gate_up, down, weights, ids):
        return moe_experts_ref(x, gate_up, down, weights, ids)
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return _launch_moe_decode(x, gate_up, down, weights, ids, operand)
    if _dequantizes(x, gate_up, ids):
        return _launch_moe_dequantized(x, gate_up, down, weights, ids)
    return _launch_moe_experts(x, gate_up, down, weights, ids)


def dequantizes_experts(pairs: int, num_experts: int) -> bool:
    """Whether a prompt step of `pairs` (token, slot) pairs over `num_experts` stacked experts
    is long enough for the dequantized path (a key of engine.warmup's)."""
    return pairs >= DEQUANT_MIN_ROWS * num_experts


def gate_up_operand_spec(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight
                         ) -> tuple[int, bool] | None:
    """(group, sums) of the decode operand the gate|up stage on tensor cores makes of x [T,
    H] (quant_linear.DecodeOperand), for the kernel that reads x beside it (`router`) to
    write; None where `moe_experts` would not run that stage."""
    if (x.dim() != 2 or not 0 < x.shape[0] <= DECODE_MAX_TOKENS
            or not _tensor_cores(x, gate_up) or not _kernels(x, gate_up, down)):
        return None
    return quant_linear.operand_group(gate_up), quant_linear.needs_group_sums(gate_up)


def _kernels(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
             *routing: torch.Tensor) -> bool:
    """Whether moe_experts runs its Triton kernels (else the reference)."""
    return (use_triton(x, *routing, *_tensors(gate_up), *_tensors(down)) and x.shape[0] > 0
            and _supported(gate_up) and _supported(down))


def _dequantizes(x: torch.Tensor, gate_up: ExpertWeight, ids: torch.Tensor) -> bool:
    """Whether the prompt of x takes the dequantized path (module docstring)."""
    plain_bf16 = not isinstance(gate_up, PackedWeight) and gate_up.dtype == torch.bfloat16
    return (dequantized_path_runs(x.dtype, x.device)
            and (isinstance(gate_up, PackedWeight) or plain_bf16)
            and dequantizes_experts(ids.numel(), gate_up.shape[0]))


def dequantized_path_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prompts of `dtype` activations on `device` can take the dequantized path: bf16
    where torch._grouped_mm runs (a fact engine.warmup's keys need)."""
    return dtype == torch.bfloat16 and _grouped_mm_runs(device)


@cache
def _grouped_mm_runs(device: torch.device) -> bool:
    """Whether torch._grouped_mm has a kernel for bf16 on `device`: CUTLASS's on sm_90 and
    sm_100 (others take the in-register path), the CPU's loop (torch >= 2.9; the tests)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)


def _tensor_cores(x: torch.Tensor, gate_up: ExpertWeight) -> bool:
    """Whether the decode path runs its stages on tensor cores (`_tensor_core_stage`): packed
    experts and half activations."""
    return isinstance(gate_up, PackedWeight) and x.dtype in (torch.float16, torch.bfloat16)


def _tensors(w: ExpertWeight) -> list[torch.Tensor]:
    return list(w.parts.values()) if isinstance(w, PackedWeight) else [w]


def _supported(w: ExpertWeight) -> bool:
    return not isinstance(w, PackedWeight) or w.scheme.name in _SCHEMES


# ---- launchers ----


@dataclass(frozen=True)
class _Experts:
    """A stacked expert weight [E, N, K] as the GEMM kernel reads it.

    PLAIN: weight [E, N, K]. NVFP4: weight uint8 [E, N, K/2], scale the E4M3 bytes as uint8
    [E, N, K/16], aux the fp32 global scale [E, N]. INT4: weight uint8 [E, N, K/2], scale bf16
    [E, N, K/128], aux the uint8 zero [E, N, K/128]. Unused parts alias the weight.
    """

    scheme: int
    weight: torch.Tensor
    scale: torch.Tensor
    aux: torch.Tensor
    shape: tuple[int, int, int]

    @classmethod
    def of(cls, w: ExpertWeight, name: str) -> _Experts:
        if not isinstance(w, PackedWeight):
            scheme, parts = PLAIN, (w, w, w)
        elif w.scheme.name == "nvfp4":
            p = w.parts
            scheme = NVFP4
            parts = (p["weight"], p["weight_scale"].view(torch.uint8), p["weight_scale_2"])
        else:
            p = w.parts
            scheme, parts = INT4, (p["weight"], p["weight_scale"], p["weight_zero"])
        shape = tuple(w.shape)
        assert len(shape) == 3, f"moe_experts: {name} must be stacked [E, N, K], got {shape}"
        for t in parts:
            assert t.stride(-1) == 1, f"moe_experts: {name} needs a contiguous last dim"
        return cls(scheme, *parts, shape)


def grouped_block_m(pairs: int, num_experts: int) -> int:
    """Rows per block from the mean rows per used expert: 16 at decode (one block each),
    up to 64 for long prefills (fewer weight re-reads per row). Part of the grouped GEMM's
    autotune key: the engine's start-up warm-up (engine.warmup) enumerates it with this."""
    mean = pairs / min(num_experts, pairs)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def _routing(t: int, columns: int, top_k: int, shared: bool, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Unwritten (weights, ids) of `route` for t tokens' `columns` logits, and the routing
    constexprs of the kernels that write them."""
    e = columns - shared
    assert 0 < top_k <= e, f"route: top_k {top_k} of {e} experts"
    weights = torch.empty((t, top_k + shared), dtype=torch.float32, device=device)
    ids = torch.empty((t, top_k + shared), dtype=torch.int64, device=device)
    return weights, ids, {"TOP_K": top_k, "TOP_K_P2": triton.next_power_of_2(top_k),
                          "BLOCK_E": triton.next_power_of_2(e), "SHARED": shared}


def _launch_route(logits: torch.Tensor, top_k: int, shared: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    assert logits.dim() == 2 and logits.stride(1) == 1, \
        f"route: need [T, E] with contiguous columns, got {tuple(logits.shape)}"
    t, columns = logits.shape
    weights, ids, constexprs = _routing(t, columns, top_k, shared, logits.device)
    _route_kernel[(t,)](logits, logits.stride(0), weights, ids, columns - shared, **constexprs,
                        num_warps=max(1, min(8, constexprs["BLOCK_E"] // 128)),
                        **options(logits.device))
    return weights, ids


def _launch_align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    flat = ids.reshape(-1)
    assert flat.dtype == torch.int64 and flat.is_contiguous(), "align: need contiguous int64"
    n = flat.numel()
    num_blocks = _num_blocks(n, num_experts, block_m)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=flat.device)
    experts = triton.next_power_of_2(num_experts)
    sweeps = {"EXPERTS": experts, "CHUNK": 32, "num_warps": 4}  # every align kernel's
    one_program = n <= ALIGN_ONE_PROGRAM_MAX
    spans = 1 if one_program else triton.cdiv(n, ALIGN_SPAN)
    # each program's row cursors (`_place_pairs`)
    cursors = torch.empty((spans, experts), dtype=torch.int32, device=flat.device)
    if one_program:
        _align_kernel[(1,)](flat, sorted_slots, block_expert, cursors, n, num_blocks,
                            BLOCK_M=block_m, FILL=_ALIGN_FILL, **sweeps)
        return Alignment(sorted_slots, block_expert, block_m)
    counts = torch.empty((spans, experts), dtype=torch.int32, device=flat.device)  # per span
    _align_count_kernel[(spans,)](flat, counts, sorted_slots, n, sorted_slots.shape[0],
                                  SPAN=ALIGN_SPAN, FILL=_ALIGN_FILL, **sweeps)
    _align_place_kernel[(spans,)](flat, sorted_slots, block_expert, counts, cursors, n,
                                  num_blocks, spans, SPAN=ALIGN_SPAN, BLOCK_M=block_m,
                                  SPAN_TILE=_ALIGN_SPAN_TILE, **sweeps)
    return Alignment(sorted_slots, block_expert, block_m)


def _launch_grouped(a: torch.Tensor, w: _Experts, out: torch.Tensor, al: Alignment,
                    pairs: int, top_k: int, swiglu: bool) -> None:
    """One grouped GEMM over the aligned blocks.

    swiglu: a = x [T, K] gathered by token, out = hidden [padded rows, N] with N = I, the
    weight's rows [0, I) gate and [I, 2I) up. Otherwise: a = hidden [padded rows, K], out =
    [T * k, N] scattered by pair.
    """
    _, n_rows, k = w.shape
    n = n_rows // 2 if swiglu else n_rows
    assert a.stride(1) == 1 and out.stride(1) == 1 and a.shape[1] == k, \
        f"moe_experts: activations {tuple(a.shape)} vs weight {w.shape}"
    num_blocks = al.block_expert.shape[0]
    weight, scale, qscheme, wps = w.weight, w.scale, 0, 1
    if w.scheme != PLAIN:  # quant_linear's tile decode: int32 words, typed block scales
        layout = _DECODE_LAYOUTS[w.scheme]
        weight, qscheme, wps = w.weight.view(torch.int32), layout.scheme, layout.words_per_scale
        if w.scheme == NVFP4:
            scale = w.scale.view(torch.float8_e4m3fn)

    def grid(meta: dict) -> tuple[int, int]:
        return num_blocks, triton.cdiv(n, meta["BLOCK_N"])

    launch(
        _grouped_gemm_kernel, grid,
        a, a.stride(0), weight, scale, w.aux, weight.stride(0), weight.stride(1),
        scale.stride(0), scale.stride(1), w.aux.stride(0), w.aux.stride(1),
        out, out.stride(0), al.sorted_slots, al.block_expert, n, k, pairs, top_k,
        SCHEME=w.scheme, QSCHEME=qscheme, WPS=wps, SWIGLU=swiglu, BLOCK_M=al.block_m,
        DOT_PRECISION=dot_precision(a.dtype))


def _launch_moe_experts(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
                        weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    gu, dn = _Experts.of(gate_up, "gate_up"), _Experts.of(down, "down")
    t, h = x.shape
    num_experts, inter = gu.shape[0], _check_experts(x, gate_up, down)
    top_k = ids.shape[1]
    pairs = t * top_k
    al = align(ids.to(torch.int64).contiguous(), num_experts,
               grouped_block_m(pairs, num_experts))
    hidden = torch.empty((al.sorted_slots.shape[0], inter), dtype=x.dtype, device=x.device)
    _launch_grouped(x, gu, hidden, al, pairs, top_k, swiglu=True)
    y = torch.empty((pairs, h), dtype=x.dtype, device=x.device)
    _launch_grouped(hidden, dn, y, al, pairs, top_k, swiglu=False)
    return _combine(y, weights)


def _launch_moe_dequantized(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
                            weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The dequantized prompt path (module docstring). The pairs are sorted by expert, each
    expert's in flat order (a stable sort: no host sync, sizes are known); one weight is
    dequantized at a time, freed once its GEMM is queued, so the allocator hands down's
    the same memory."""
    _check_experts(x, gate_up, down)
    top_k = ids.shape[1]
    flat = ids.reshape(-1).to(torch.int64)
    order = flat.argsort(stable=True)
    ends = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                   device=x.device))
    hidden = silu_and_mul(torch._grouped_mm(x.index_select(0, order // top_k),
                                            _dequantized(gate_up).transpose(1, 2), offs=ends))
    y = torch._grouped_mm(hidden, _dequantized(down).transpose(1, 2), offs=ends)
    return _combine(y, weights, rows)


def _dequantized(w: ExpertWeight) -> torch.Tensor:
    return quant_linear.dequantize(w, torch.bfloat16) if isinstance(w, PackedWeight) else w


def _combine(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None
             ) -> torch.Tensor:
    """out [T, H]: token t's sum over its slots j of weights[t, j] * y[r], r = rows[t * k + j]
    (or t * k + j without rows), in slot order in fp32, rounded once."""
    t, top_k = weights.shape
    h = y.shape[1]
    assert y.stride(1) == 1, "moe_experts: the pairs' rows need contiguous features"
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(t, triton.cdiv(h, block))](
        y, y.stride(0), y if rows is None else rows, weights.float().contiguous(), out, h,
        TOP_K=top_k, GATHER=rows is not None, BLOCK=block,
        num_warps=max(1, min(4, block // 256)), **options(y.device))
    return out


def _check_experts(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight) -> int:
    """The intermediate size I, after checking gate_up [E, 2I, H] and down [E, H, I]."""
    gu, dn = tuple(gate_up.shape), tuple(down.shape)
    num_experts, h = gu[0], x.shape[1]
    inter = gu[1] // 2
    assert len(gu) == 3 and gu[2] == h and dn == (num_experts, h, inter), \
        f"moe_experts: gate_up {gu} and down {dn} do not fit x {tuple(x.shape)}"
    for w in (gate_up, down):
        if isinstance(w, PackedWeight) and _SCHEMES.get(w.scheme.name) == INT4:
            assert w.shape[2] % INT4_GROUP == 0, \
                f"moe_experts: groupwise-int K {w.shape[2]} not a multiple of {INT4_GROUP}"
    return inter


def _launch_moe_decode(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
                       weights: torch.Tensor, ids: torch.Tensor,
                       operand: quant_linear.DecodeOperand | None = None) -> torch.Tensor:
    """The GEMV path (module docstring): gate|up + SiLU per pair, then down summed per token;
    packed experts with half activations on tensor cores (`_tensor_core_stage`, the gate|up
    stage with x's `operand` where given)."""
    gu, dn = _Experts.of(gate_up, "gate_up"), _Experts.of(down, "down")
    assert x.stride(1) == 1, "moe_experts: x needs contiguous features"
    inter = _check_experts(x, gate_up, down)
    t, h = x.shape
    top_k = ids.shape[1]
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    hidden = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if _tensor_cores(x, gate_up):
        # the gate|up stage writes hidden's operand for the down stage as it goes
        hidden_operand = quant_linear.DecodeOperand.empty(
            t * top_k, inter, quant_linear.operand_group(down), quant_linear.needs_group_sums(down),
            x.device)
        _tensor_core_stage(x, gu, hidden, ids, weights, swiglu=True, operand=operand,
                           hand_on=hidden_operand)
        _tensor_core_stage(hidden, dn, out, ids, weights, swiglu=False, operand=hidden_operand)
        return out
    assert operand is None, "moe_experts: an operand for the CUDA-core stages"
    for a, w, dst, programs, swiglu in ((x, gu, hidden, t * top_k, True),
                                        (hidden, dn, out, t, False)):
        n = w.shape[1] // 2 if swiglu else w.shape[1]
        words = w.weight if w.scheme == PLAIN else w.weight.view(torch.int32)

        def grid(meta: dict, programs: int = programs, n: int = n) -> tuple[int, int]:
            return programs, triton.cdiv(n, meta["BN"])

        launch(
            _decode_gemv_kernel, grid,
            a, a.stride(0), words, w.scale, w.aux, words.stride(0), words.stride(1),
            w.scale.stride(0), w.scale.stride(1), w.aux.stride(0), w.aux.stride(1),
            dst, dst.stride(0), ids, weights, n, w.shape[2], top_k,
            SCHEME=w.scheme, SWIGLU=swiglu, SLOTS=1 if swiglu else triton.next_power_of_2(top_k))
    return out


@dataclass(frozen=True)
class _StagePlan:
    config: quant_linear.DecodeConfig
    splits: int  # K splits per (pair, row tile)


_stage_plans: dict[tuple, _StagePlan] = {}


# ops.quant_linear's weight layouts of the packed expert schemes
_DECODE_LAYOUTS = {NVFP4: quant_linear.LAYOUTS["nvfp4"],
                   INT4: quant_linear.LAYOUTS["groupwise-int"]}


def _stage_candidates(n: int, k: int, scheme: int, swiglu: bool) -> list[_StagePlan]:
    """Configs and K splits the stage's tuner times; the first is the default. A program
    covers BN output columns, so gate|up tiles hold 2 BN weight rows (>= 64, one warp group's
    MMA); pipeline depth as the dense decode's first config for the scheme, its K tile too,
    and for groupwise-int also tiles of two groups (fewer trips, each with its wait and
    bookkeeping: the dense decode's pick for most 27B shapes, docs/perf.md, thirty-fourth
    run)."""
    dense = quant_linear.DECODE_CONFIGS[_DECODE_LAYOUTS[scheme].scheme][0]
    if INTERPRET:
        return [_StagePlan(quant_linear.DecodeConfig(64 if swiglu else 128, dense.bk, 4, 1, 2),
                           2)]
    widths = (32, 64) if swiglu else (64, 128)
    tiles = (dense.bk, 2 * dense.bk) if scheme == INT4 else (dense.bk,)
    return [_StagePlan(quant_linear.DecodeConfig(bn, bk, 4, dense.stages, dots), splits)
            for bk in tiles for bn in widths for dots in (2, 8) for splits in (1, 2, 4)
            if splits <= triton.cdiv(k, bk)]


def _tensor_core_stage(a: torch.Tensor, w: _Experts, out: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor, swiglu: bool,
                       operand: quant_linear.DecodeOperand | None = None,
                       hand_on: quant_linear.DecodeOperand | None = None) -> None:
    """One decode stage on tensor cores, a program per (pair, BN output columns, K split),
    with ops.quant_linear's decode tile on the pair's expert: gate|up (swiglu: out [pairs,
    I] = silu(gate) * up) or down (out [T, H] = the token's pairs summed, routing weights
    applied). K splits and a token's pairs are added by the last to arrive (`sum_parts`). The
    plan (config, splits) is timed per shape on the first call, like the dense decode's; a's
    `operand`, where given, is used instead of the stage's own activation pass. `hand_on`
    (gate|up only): buffers the stage writes its output's operand into (for the down stage),
    a group by the last of its column tiles to be stored (`_hand_on_operand`)."""
    e, rows, k = w.shape
    n = rows // 2 if swiglu else rows
    # tuned per power of two of the token count (the warm-up meets each, engine.warmup)
    key = (triton.next_power_of_2(ids.shape[0]), ids.shape[1], n, k, w.scheme, swiglu, a.dtype,
           l2_prefetch(a.device), a.device)
    plan = tuner.tuned_plan(
        _stage_plans, key, lambda: _stage_candidates(n, k, w.scheme, swiglu),
        lambda: [lambda c, i=i: _run_stage(a, w, out, i, weights, swiglu, c)
                 for i in _rotated_ids(ids, w)], a.device)
    _run_stage(a, w, out, ids, weights, swiglu, plan, operand, hand_on)


def _rotated_ids(ids: torch.Tensor, w: _Experts) -> list[torch.Tensor]:
    """ids, then the same routing shifted to other experts (ids + j mod E), as many as
    `tuner.weight_copy_count` asks for the experts a call reads (at most E over
    their number): the stage's tuner cycles through them, so that its calls stream their
    experts from memory as a step's do (ops.tuner.streaming_times)."""
    e = w.shape[0]
    used = torch.unique(ids).numel()
    parts = {id(t): t for t in (w.weight, w.scale, w.aux)}
    per_expert = sum(t[0].nbytes for t in parts.values())
    count = min(tuner.weight_copy_count(used * per_expert, ids.device), max(1, e // used))
    step = e // count
    return [ids if i == 0 else (ids + i * step) % e for i in range(count)]


def _run_stage(a: torch.Tensor, w: _Experts, out: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor, swiglu: bool, plan: _StagePlan,
               operand: quant_linear.DecodeOperand | None = None,
               hand_on: quant_linear.DecodeOperand | None = None) -> None:
    c = plan.config
    assert hand_on is None or (swiglu and hand_on.group % c.bn == 0), \
        "moe_experts: an output operand for gate|up in groups of whole column tiles"
    group = _DECODE_LAYOUTS[w.scheme].operand_group
    if operand is None:
        operand = quant_linear.activation_operands(a, group, w.scheme == INT4)
    assert operand.group == group, "moe_experts: a decode operand of another group"
    e, rows, k = w.shape
    n = rows // 2 if swiglu else rows
    pairs, top_k = ids.numel(), ids.shape[-1]
    tiles = triton.cdiv(n, c.bn)
    split_len = triton.cdiv(triton.cdiv(k, plan.splits), c.bk) * c.bk
    splits = triton.cdiv(k, split_len)
    outputs = pairs if swiglu else pairs // top_k
    parts = splits * (1 if swiglu else top_k)
    part_buf = torch.empty((parts, outputs, rows), dtype=torch.float32, device=a.device) \
        if parts > 1 else out
    words = w.weight.view(torch.int32)
    # arrival counters: (output row, column tile) for the K parts, then (pair, operand group)
    groups = pairs * triton.cdiv(n, hand_on.group) if hand_on else 0
    counters = quant_linear.TILE_COUNTERS.on(a.device, outputs * tiles + groups)
    launch(
        _decode_experts_kernel, (pairs, tiles, splits),
        operand.xo, operand.inv, operand.xsum, words, w.scale, w.aux, part_buf, counters, out,
        *quant_linear.operand_buffers(hand_on, out), counters[outputs * tiles:], ids, weights,
        a.shape[0], n, k, top_k,
        words.stride(0), words.stride(1), w.scale.stride(0), w.scale.stride(1),
        w.aux.stride(0), split_len, SWIGLU=swiglu, HAND_ON=hand_on is not None,
        OUT_GROUP=hand_on.group if hand_on else c.bn, OUT_SUMS=hand_on is not None and hand_on.sums,
        PREFETCH=quant_linear.prefetches(words, k, split_len),
        **quant_linear.decode_tile_args(_DECODE_LAYOUTS[w.scheme], c, n, k, 1),
        **options(a.device))


def _gemm_configs() -> list[triton.Config]:
    """Autotuning candidates; the interpreter gets one (it is slow and has nothing to tune).

    BLOCK_K is one int4 group (128), as the dense prefill GEMM's. Few candidates (each is
    compiled per key): narrow N tiles spread a short prompt's experts over more programs,
    wide ones with 8 warps suit the 64-row blocks of long prompts.
    """
    bk = quant_linear.GROUP_BK
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": bk}, num_warps=4, num_stages=1)]
    shapes = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, w, s in shapes]


# ---- kernels ----

if triton is not None:
    from ninfer_runtime.ops.launch import prefetch_to_l2, wait_for_inputs
    from ninfer_runtime.ops.quant_decode import store_operand_group
    from ninfer_runtime.ops.quant_linear import (
        _NV_FMA_SCALE,
        _NV_FMA_X,
        _NV_OUT,
        _NVFP4,
        _e2m1,
        _graph_bench,
        _uint4,
        _weight_tile,
        decode_range,
        decode_result,
        sum_parts,
    )
    from ninfer_runtime.ops.skinny_linear import skinny_part, write_operand

    @triton.jit
    def _ordered_bits(x):
        """fp32 x <-> int32 whose signed order is x's (negative floats' magnitude bits
        flipped); its own inverse, on the int32 side."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _route_rows(logits, stride_t, weights_out, ids_out, t0, T, num_experts,
                    BT: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                    BLOCK_E: tl.constexpr, SHARED: tl.constexpr):
        """Tokens t0 .. t0 + BT (those below T): the top k of their experts' logits (the
        lowest expert id on ties), weighted by their softmax renormalised over the k,
        exp(z - max) / the k's sum, added in slot order: no sum over all experts (the full
        softmax's denominator cancels), so that a token's bits do not depend on BT or the
        tile layout. With SHARED, slot k is expert num_experts weighted by the sigmoid of the
        logit after the experts'. The logits are read from L2 (.cg): the router's other
        programs may have written them (`_router_kernel`).

        The top k are those of an int64 key, the logit's order-preserving bits above the
        complement of the expert id (the largest key is the largest logit and, among equal
        ones, the lowest id), by Triton's bitonic top-k (`tl.topk`): compare-and-swap rounds
        and halvings, where k rounds of a block-wide argmax were a serial chain in the
        router's last program (~7.8 us a launch on the H100 against ~4 for a GEMV of its
        size, 40 a 35B-A3B decode step)."""
        t = t0 + tl.arange(0, BT).to(tl.int64)
        t_ok = t < T
        e = tl.arange(0, BLOCK_E)
        rows = logits + t[:, None] * stride_t
        work = tl.load(rows + e[None, :], mask=t_ok[:, None] & (e < num_experts)[None, :],
                       other=float("-inf"), cache_modifier=".cg").to(tl.float32)
        work = tl.where(t_ok[:, None], work, 0.0)  # rows past T: finite, never stored
        # + 0.0 makes -0.0 +0.0, which ties with it as the float compare did
        keys = (_ordered_bits(work + 0.0).to(tl.int64) << 32) | (BLOCK_E - 1 - e)[None, :]
        slot = tl.arange(0, TOP_K_P2)
        key = tl.topk(keys, TOP_K_P2, dim=1)  # [BT, TOP_K_P2], the largest first
        best = _ordered_bits((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
        top_ids = BLOCK_E - 1 - (key & 0xFFFFFFFF)
        top = tl.where(slot[None, :] < TOP_K, tl.exp(best - tl.max(best, axis=1)[:, None]), 0.0)
        total = tl.zeros([BT], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # in slot order (a sum of one weight and zeros)
            total += tl.sum(tl.where(slot[None, :] == j, top, 0.0), axis=1)
        out = t[:, None] * (TOP_K + SHARED) + slot[None, :]
        kept = t_ok[:, None] & (slot < TOP_K)[None, :]
        tl.store(weights_out + out, top / total[:, None], mask=kept)
        tl.store(ids_out + out, top_ids, mask=kept)
        if SHARED:
            gate = tl.load(rows + num_experts, mask=t_ok[:, None], other=0.0,
                           cache_modifier=".cg").to(tl.float32)
            shared_slot = t[:, None] * (TOP_K + 1) + TOP_K
            tl.store(weights_out + shared_slot, 1.0 / (1.0 + tl.exp(-gate)), mask=t_ok[:, None])
            tl.store(ids_out + shared_slot, tl.zeros([BT, 1], tl.int64) + num_experts,
                     mask=t_ok[:, None])

    @triton.jit
    def _route_kernel(logits, stride_t, weights_out, ids_out, num_experts,
                      TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK_E: tl.constexpr,
                      SHARED: tl.constexpr, GDC: tl.constexpr):
        """Token program_id(0) of T (`_route_rows`)."""
        wait_for_inputs(GDC)
        _route_rows(logits, stride_t, weights_out, ids_out, tl.program_id(0),
                    tl.num_programs(0), num_experts, 1, TOP_K, TOP_K_P2, BLOCK_E, SHARED)

    @triton.jit
    def _router_kernel(x_ptr, w_ptr, part_ptr, counter_ptr, logits_ptr, xo_ptr, inv_ptr,
                       xsum_ptr, h_ptr, nw_ptr, res_ptr, normed_ptr, stride_h, eps, M, N, K,
                       stride_x, stride_w, split_len, weights_out, ids_out,
                       OPERAND: tl.constexpr, GROUP: tl.constexpr, HAS_SUM: tl.constexpr,
                       NORM: tl.constexpr, HAS_H: tl.constexpr, NORM_ROWS: tl.constexpr,
                       NORM_BD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                       BLOCK_E: tl.constexpr, SHARED: tl.constexpr, ROUTE_ROWS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GDC: tl.constexpr):
        """The router's logits by ops.skinny_linear's kernel (`skinny_part`, with NORM its
        prologue norm, and x's decode operand with OPERAND), then the last row tile to be
        finished routes every token (`_route_rows`, ROUTE_ROWS = next_pow2(M) at once: the
        top-k's work grows with its rows, BM of which may be padding) and zeroes its counter
        (the one after the row tiles')."""
        last, rstd = skinny_part(x_ptr, w_ptr, part_ptr, counter_ptr, logits_ptr, h_ptr,
                                 nw_ptr, res_ptr, normed_ptr, stride_h, eps, M, N, K, stride_x,
                                 stride_w, split_len, NORM, HAS_H, NORM_ROWS, NORM_BD, BM, BN,
                                 BK, GDC)
        if last:
            tl.debug_barrier()  # the tile's logits are stored before the tiles count it
            tiles = tl.num_programs(0)
            if tl.atomic_add(counter_ptr + tiles, 1, sem="acq_rel") == tiles - 1:
                tl.store(counter_ptr + tiles, 0)
                _route_rows(logits_ptr, N, weights_out, ids_out, 0, M, N - SHARED, ROUTE_ROWS,
                            TOP_K, TOP_K_P2, BLOCK_E, SHARED)
        if OPERAND:
            write_operand(x_ptr, stride_x, h_ptr, stride_h, nw_ptr, rstd, M, K, xo_ptr,
                          inv_ptr, xsum_ptr, BM, GROUP, HAS_SUM, NORM, HAS_H)

    @triton.jit
    def _count_pairs(flat_ids, lo, hi, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        """[EXPERTS] int32: how many of the pairs [lo, hi) go to each expert."""
        lane = tl.arange(0, CHUNK)
        counts = tl.zeros([EXPERTS], dtype=tl.int32)
        for c0 in range(lo, hi, CHUNK):
            valid = c0 + lane < hi
            e = tl.load(flat_ids + c0 + lane, mask=valid, other=0).to(tl.int32)
            counts += tl.histogram(e, EXPERTS, mask=valid)
        return counts

    @triton.jit
    def _fill_rows(sorted_slots, lo, hi, n, FILL: tl.constexpr):
        """The sentinel n into rows [lo, hi) of the sorted slots: every row that no pair
        takes keeps it (the pairs' rows are written after, in stream or barrier order)."""
        for r0 in range(lo, hi, FILL):
            r = r0 + tl.arange(0, FILL)
            tl.store(sorted_slots + r, tl.full([FILL], n, tl.int64), mask=r < hi)

    @triton.jit
    def _write_owners(counts, block_expert, b_lo, b_hi, BLOCK_M: tl.constexpr,
                      EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        """From every expert's pair count: the owner expert (or -1) of blocks [b_lo, b_hi),
        written from the experts' side (each its own blocks, then -1 on the blocks after all
        of theirs), where finding each block's owner took a [CHUNK, EXPERTS] compare a chunk
        of 32 blocks (~2,000-3,500 sm_90 instructions a thread; a 35B prompt of 200 tokens
        has ~350 blocks). Returns each expert's first row [EXPERTS]."""
        experts = tl.arange(0, EXPERTS)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_start = tl.cumsum(blocks, axis=0) - blocks
        for j in range(0, tl.max(blocks, axis=0)):
            b = block_start + j
            tl.store(block_expert + b, experts.to(tl.int64),
                     mask=(j < blocks) & (b >= b_lo) & (b < b_hi))
        lane = tl.arange(0, CHUNK)
        for b0 in range(tl.maximum(tl.sum(blocks, axis=0), b_lo), b_hi, CHUNK):
            b = b0 + lane
            tl.store(block_expert + b, tl.full([CHUNK], -1, tl.int64), mask=b < b_hi)
        return block_start * BLOCK_M

    @triton.jit
    def _place_pairs(flat_ids, sorted_slots, cursors, lo, hi, CHUNK: tl.constexpr):
        """Pairs [lo, hi) in order to their rows: pair i of expert e goes to row cursors[e]
        plus the pairs of e before it in its chunk of CHUNK, and the last of them moves
        cursors[e] past the chunk's, so each expert keeps the flat order. The cursors (the
        program's own [EXPERTS] row, each expert's next free row) live in global memory,
        gathered and scattered through L2 (.cg), a barrier between a chunk's reads and its
        writes and another before the next chunk's reads: a [CHUNK, EXPERTS] one-hot in
        registers took ~2,750 instructions a thread a chunk of 32 (sm_90 SASS), the [CHUNK,
        CHUNK] ranks here a tenth of that."""
        lane = tl.arange(0, CHUNK)
        for c0 in range(lo, hi, CHUNK):
            i = c0 + lane
            valid = i < hi
            e = tl.load(flat_ids + i, mask=valid, other=0)
            same = (e[:, None] == e[None, :]) & valid[None, :]
            rank = tl.sum((same & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
            later = tl.sum((same & (lane[None, :] > lane[:, None])).to(tl.int32), axis=1)
            row = tl.load(cursors + e, mask=valid, other=0, cache_modifier=".cg") + rank
            tl.store(sorted_slots + row, i.to(tl.int64), mask=valid)
            tl.debug_barrier()  # every lane has read its expert's cursor
            tl.store(cursors + e, row + 1, mask=valid & (later == 0), cache_modifier=".cg")
            tl.debug_barrier()  # the moved cursors are written before the next chunk reads

    @triton.jit
    def _align_kernel(flat_ids, sorted_slots, block_expert, cursors, n, num_blocks,
                      BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                      FILL: tl.constexpr):
        """One program: align_ref's sort (sentinel rows, count, block owners, place)."""
        _fill_rows(sorted_slots, 0, num_blocks * BLOCK_M, n, FILL)
        counts = _count_pairs(flat_ids, 0, n, EXPERTS, CHUNK)
        first_row = _write_owners(counts, block_expert, 0, num_blocks, BLOCK_M, EXPERTS, CHUNK)
        tl.store(cursors + tl.arange(0, EXPERTS), first_row, cache_modifier=".cg")
        tl.debug_barrier()  # the cursors, and the sentinel rows the pairs overwrite
        _place_pairs(flat_ids, sorted_slots, cursors, 0, n, CHUNK)

    @triton.jit(do_not_specialize=["n"])
    def _align_count_kernel(flat_ids, span_counts, sorted_slots, n, rows,
                            SPAN: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                            FILL: tl.constexpr):
        """Program p: the per-expert counts of pairs [p * SPAN, (p + 1) * SPAN) ->
        span_counts[p], and the sentinel into its share of the `rows` sorted slots (the
        place kernel, launched after, writes the pairs' rows)."""
        p = tl.program_id(0)
        share = tl.cdiv(rows, tl.num_programs(0))
        _fill_rows(sorted_slots, p * share, tl.minimum((p + 1) * share, rows), n, FILL)
        lo = p * SPAN
        counts = _count_pairs(flat_ids, lo, tl.minimum(lo + SPAN, n), EXPERTS, CHUNK)
        tl.store(span_counts + p * EXPERTS + tl.arange(0, EXPERTS), counts)

    @triton.jit(do_not_specialize=["n", "num_blocks", "spans"])
    def _align_place_kernel(flat_ids, sorted_slots, block_expert, span_counts, cursors, n,
                            num_blocks, spans, SPAN: tl.constexpr, BLOCK_M: tl.constexpr,
                            SPAN_TILE: tl.constexpr, EXPERTS: tl.constexpr,
                            CHUNK: tl.constexpr):
        """Program p: every expert's total and its pairs in the spans before p (from all the
        spans' counts, which every program reads), p's share of the block table, then the
        pairs of span p placed after those of the spans before it (from its own row of
        cursors), over the sentinel the count kernel left. The stores are disjoint (block
        owners to the program's share, pairs to their rows): no ordering between programs."""
        p = tl.program_id(0)
        experts = tl.arange(0, EXPERTS)
        tile = tl.arange(0, SPAN_TILE)
        totals = tl.zeros([EXPERTS], dtype=tl.int32)
        before = tl.zeros([EXPERTS], dtype=tl.int32)
        for q0 in range(0, spans, SPAN_TILE):
            q = q0 + tile
            counts = tl.load(span_counts + q[:, None] * EXPERTS + experts[None, :],
                             mask=(q < spans)[:, None], other=0)
            totals += tl.sum(counts, axis=0)
            before += tl.sum(tl.where((q < p)[:, None], counts, 0), axis=0)
        share = tl.cdiv(num_blocks, spans)
        first_row = _write_owners(totals, block_expert, p * share,
                                  tl.minimum((p + 1) * share, num_blocks), BLOCK_M, EXPERTS,
                                  CHUNK)
        own = cursors + p * EXPERTS
        tl.store(own + experts, first_row + before, cache_modifier=".cg")
        tl.debug_barrier()
        lo = p * SPAN
        _place_pairs(flat_ids, sorted_slots, own, lo, tl.minimum(lo + SPAN, n), CHUNK)

    @triton.jit
    def _e4m3_f16(raw):
        """float8_e4m3fn bytes (uint8, never NaN) -> exact fp16: sign to bit 15, exponent and
        mantissa to bits 7..14, then x 2^8 (the bias gap); subnormals map the same way."""
        r = raw.to(tl.uint16)
        bits = ((r & 0x80) << 8) | ((r & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True) * 256.0

    @triton.jit
    def _expert_tile(w, scale, aux, e, rows, row_ok, k0, K, stride_we, stride_wn, stride_se,
                     stride_sn, stride_ae, SCHEME: tl.constexpr, QSCHEME: tl.constexpr,
                     WPS: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     DTYPE: tl.constexpr):
        """Expert e's weight rows `rows`, inputs [k0, k0 + BK), as tl.dot's [BN, BK] operand
        in DTYPE: plain weights as stored (SCHEME 0); packed ones by ops.quant_linear's tile
        decode (16-byte word loads, input order; nvfp4 e2m1 * s * 2^-8, exact)."""
        # if/else, not an early return: Triton compiles the code after a constexpr branch's
        # return too, and a 16-bit plain weight cannot take the packed path's uint32 bitcast
        if SCHEME == 0:
            ks = k0 + tl.arange(0, BK)
            mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (ks < K)[None, :]
            tile = tl.load(w + e * stride_we + rows.to(tl.int64)[:, None] * stride_wn
                           + ks[None, :], mask=mask, other=0.0).to(DTYPE)
        else:  # the experts' scales are row-major (group stride 1)
            tile = _weight_tile(w + e * stride_we, scale + e * stride_se, aux + e * stride_ae,
                                rows, row_ok, k0, K, stride_wn, stride_sn, 1, QSCHEME, WPS, BK,
                                EVEN_K, DTYPE)
        return tile

    @triton.jit
    def _global_scale(acc, aux, e, rows, row_mask, stride_ae, stride_an,
                      SCHEME: tl.constexpr, FACTOR: tl.constexpr):
        """nvfp4: the per-row fp32 global scale times FACTOR (what the tile decode left out),
        applied to the fp32 accumulator."""
        if SCHEME == 1:
            g = tl.load(aux + e * stride_ae + rows * stride_an, mask=row_mask, other=0.0)
            acc = acc * (g * FACTOR)[None, :]
        return acc

    @triton.autotune(configs=_gemm_configs(),
                     key=["N", "K", "SCHEME", "SWIGLU", "BLOCK_M"], cache_results=True)
    @triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
    @triton.jit
    def _grouped_gemm_kernel(
        a, stride_am, w, scale, aux, stride_we, stride_wn, stride_se, stride_sn,
        stride_ae, stride_an, out, stride_om, sorted_slots, block_expert, N, K, num_pairs,
        top_k,
        SCHEME: tl.constexpr, QSCHEME: tl.constexpr, WPS: tl.constexpr, SWIGLU: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Program (block, N tile): the block's rows times its expert's weight rows.

        SWIGLU: rows of a are tokens (pair // top_k); the gate and up accumulators meet in
        silu(gate) * up, stored at the block's padded rows. Otherwise rows of a are the
        padded rows and each result row goes to its pair's row (`_combine` weights it).
        """
        pid_m = tl.program_id(0)
        e = tl.load(block_expert + pid_m)
        if e < 0:
            return
        padded = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_slots + padded)
        valid = pair < num_pairs
        a_rows = pair // top_k if SWIGLU else padded.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_base = a + a_rows[:, None] * stride_am
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x_mask = valid[:, None] if EVEN_K else valid[:, None] & (ks < K)[None, :]
            x = tl.load(x_base + ks[None, :], mask=x_mask, other=0.0)
            gate = _expert_tile(w, scale, aux, e, cols, col_mask, k0, K, stride_we, stride_wn,
                                stride_se, stride_sn, stride_ae, SCHEME, QSCHEME, WPS, BLOCK_K,
                                EVEN_K, a.dtype.element_ty)
            acc = tl.dot(x, tl.trans(gate), acc, input_precision=DOT_PRECISION)
            if SWIGLU:
                up = _expert_tile(w, scale, aux, e, cols + N, col_mask, k0, K, stride_we,
                                  stride_wn, stride_se, stride_sn, stride_ae, SCHEME, QSCHEME,
                                  WPS, BLOCK_K, EVEN_K, a.dtype.element_ty)
                acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision=DOT_PRECISION)
        acc = _global_scale(acc, aux, e, cols, col_mask, stride_ae, stride_an, SCHEME, _NV_OUT)
        store_mask = valid[:, None] & col_mask[None, :]
        if SWIGLU:
            up = _global_scale(acc_up, aux, e, cols + N, col_mask, stride_ae, stride_an,
                               SCHEME, _NV_OUT)
            h = acc / (1.0 + tl.exp(-acc)) * up
            tl.store(out + padded[:, None] * stride_om + cols[None, :],
                     h.to(out.dtype.element_ty), mask=store_mask)
        else:
            tl.store(out + pair[:, None] * stride_om + cols[None, :],
                     acc.to(out.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _combine_kernel(y, stride_y, rows, weights, out, H, TOP_K: tl.constexpr,
                        GATHER: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
        """Token program_id(0), columns program_id(1) * BLOCK.. (`_combine`)."""
        wait_for_inputs(GDC)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = t * TOP_K + j
            row = tl.load(rows + pair) if GATHER else pair
            part = tl.load(y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
            acc += tl.load(weights + pair) * part
        tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=mask)

    # ---- decode (GEMV) path ----

    @triton.jit
    def _gemv_tile(w, scale, aux, experts, rows, ok, factor, k0, K, stride_we, stride_wn,
                   stride_se, stride_sn, stride_ae, stride_an, SCHEME: tl.constexpr,
                   BK: tl.constexpr, EVEN_K: tl.constexpr):
        """Rows `rows` [R] of experts `experts` [S] at inputs [k0, k0 + BK), as `_gemv_acc`
        takes them (ok [S, R] masks whole rows off).

        PLAIN: the values [S, R, BK]. Packed: the uint32 code words [S, R, BK/8] (input 8w + j
        in bits 4j..4j+3) and, per scale block [S, R, BKS], the multiplier and addend that
        turn a decoded code (quant_linear's `_e2m1` / `_uint4`) into the weight, times the
        row factor [S, R] (routing weight, and the nvfp4 global scale): nvfp4 s * 2^22 *
        factor (the output then times 2^8: the decoder's power-of-two offsets); groupwise-int
        16 s and -(16 + z) s, times factor.
        """
        row_off = (experts.to(tl.int64)[:, None] * stride_we
                   + rows.to(tl.int64)[None, :] * stride_wn)[:, :, None]  # [S, R, 1]
        okk = ok[:, :, None]
        if SCHEME == 0:
            kk = k0 + tl.arange(0, BK)[None, None, :]
            vals = tl.load(w + row_off + kk, mask=okk if EVEN_K else okk & (kk < K), other=0.0)
            return vals, factor, factor
        else:
            BKW: tl.constexpr = BK // 8
            WPS: tl.constexpr = 2 if SCHEME == 1 else 16  # words per scale block
            BKS: tl.constexpr = BKW // WPS
            kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
            kw = kw[None, None, :]
            ks = (k0 // (8 * WPS) + tl.arange(0, BKS))[None, None, :]
            w_mask = okk if EVEN_K else okk & (kw < K // 8)
            s_mask = okk if EVEN_K else okk & (ks < K // (8 * WPS))
            words = tl.load(w + row_off + kw, mask=w_mask, other=0).to(tl.uint32, bitcast=True)
            s_off = (experts.to(tl.int64)[:, None] * stride_se
                     + rows.to(tl.int64)[None, :] * stride_sn)[:, :, None] + ks
            if SCHEME == 1:
                s = _e4m3_f16(tl.load(scale + s_off, mask=s_mask, other=0)).to(tl.float32)
                mul = s * (_NV_FMA_SCALE * factor[:, :, None])
                add = mul
            else:
                step = tl.load(scale + s_off, mask=s_mask, other=0.0).to(tl.float32)
                z_off = (experts.to(tl.int64)[:, None] * stride_ae
                         + rows.to(tl.int64)[None, :] * stride_an)[:, :, None] + ks
                zero = tl.load(aux + z_off, mask=s_mask, other=0).to(tl.float32)
                mul = 16.0 * step * factor[:, :, None]
                add = -(16.0 + zero) * step * factor[:, :, None]
            return words, mul, add

    @triton.jit
    def _gemv_acc(acc, tile, mul, add, a_rows, k0, K, SCHEME: tl.constexpr,
                  BK: tl.constexpr):
        """acc += the tile's weights times each slot's activations a_rows [S] (pointers to
        the rows) at inputs [k0, k0 + BK).

        Packed: acc is [S, R, BKS, WPS], the word tile's own shape (only the small activation
        slices [S, 1, ...] move between layouts), reduced over K once, after the loop. PLAIN
        (4x the bytes per weight, so issue is not its limit): acc [S, R], reduced per tile,
        times the row factor (the routing weight alone there).
        """
        if SCHEME == 0:
            kk = k0 + tl.arange(0, BK)[None, :]
            xk = tl.load(a_rows[:, None] + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += tl.sum(tile.to(tl.float32) * xk[:, None, :], axis=2) * mul
        else:
            BKW: tl.constexpr = BK // 8
            WPS: tl.constexpr = 2 if SCHEME == 1 else 16
            BKS: tl.constexpr = BKW // WPS
            S: tl.constexpr = tile.shape[0]
            R: tl.constexpr = tile.shape[1]
            words = tl.reshape(tile, (S, R, BKS, WPS))
            kw = (k0 // 8 + tl.arange(0, BKS)[:, None] * WPS + tl.arange(0, WPS)[None, :])
            x_ptrs = a_rows[:, None, None] + kw[None] * 8  # [S, BKS, WPS]
            x_mask = (kw < K // 8)[None]
            part = tl.zeros(acc.shape, tl.float32)
            xsum = tl.zeros((S, BKS, WPS), tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_ptrs + j, mask=x_mask, other=0.0).to(tl.float32)
                if SCHEME == 1:
                    part += _e2m1(words, j) * (xj * _NV_FMA_X)[:, None]
                else:
                    part += _uint4(words, j) * xj[:, None]
                    xsum += xj
            if SCHEME == 1:
                acc += part * mul[:, :, :, None]
            else:
                acc += part * mul[:, :, :, None] + xsum[:, None] * add[:, :, :, None]
        return acc

    @triton.jit
    def _decode_gemv_kernel(
        a, stride_am, w, scale, aux, stride_we, stride_wn, stride_se, stride_sn,
        stride_ae, stride_an, out, stride_om, ids, route_weights, N, K, top_k,
        SCHEME: tl.constexpr, SWIGLU: tl.constexpr, SLOTS: tl.constexpr,
        EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        """A tile is [S slots, R rows, BK inputs] of the experts' weights.

        SWIGLU (S = 1): program (pair, column tile) -> silu(gate) * up of the pair's expert at
        the tile's BN columns (R = 2 BN: the gate rows and the matching up rows N later).
        Otherwise (S = SLOTS >= top_k): program (token, row tile) -> sum over the token's k
        pairs of routing weight x down rows @ hidden[pair]: all k experts are loaded at once,
        so a program has all of them in flight. Along K, the next tile is loaded (into
        registers) before this one is decoded: the compiler pipelines only loads feeding dots.
        """
        R: tl.constexpr = 2 * BN if SWIGLU else BN
        pid = tl.program_id(0)
        i = tl.arange(0, R)
        cols = tl.program_id(1) * BN + i % BN
        rows = cols + (i // BN) * N  # SWIGLU: the second half are the up rows
        slot = tl.arange(0, SLOTS)
        slot_ok = slot < (1 if SWIGLU else top_k)
        # [S] flat pair indices; a spare slot (top_k < SLOTS) reads the token's first pair,
        # its weight rows masked off (never an activation row past the end: 0 * NaN)
        pair = pid + slot if SWIGLU else pid * top_k + tl.where(slot_ok, slot, 0)
        ok = slot_ok[:, None] & (cols < N)[None, :]
        experts = tl.load(ids + pair, mask=slot_ok, other=0)
        if SWIGLU:
            rw = tl.full((SLOTS,), 1.0, tl.float32)
            a_rows = a + (pair // top_k).to(tl.int64) * stride_am
        else:
            rw = tl.load(route_weights + pair, mask=slot_ok, other=0.0)
            a_rows = a + pair.to(tl.int64) * stride_am
        factor = tl.broadcast_to(rw[:, None], (SLOTS, R))
        if SCHEME == 1:  # the nvfp4 per-row global scale
            factor = factor * tl.load(aux + experts.to(tl.int64)[:, None] * stride_ae
                                      + rows[None, :] * stride_an, mask=ok, other=0.0)
        if SCHEME == 0:
            acc = tl.zeros((SLOTS, R), tl.float32)
        else:
            WPS: tl.constexpr = 2 if SCHEME == 1 else 16
            acc = tl.zeros((SLOTS, R, BK // 8 // WPS, WPS), tl.float32)
        nxt = _gemv_tile(w, scale, aux, experts, rows, ok, factor, 0, K, stride_we, stride_wn,
                         stride_se, stride_sn, stride_ae, stride_an, SCHEME, BK, EVEN_K)
        for k0 in range(0, K, BK):
            tile, mul, add = nxt
            # the next tile (past the last: every row masked off, nothing is read)
            more = (tl.zeros((SLOTS, R), tl.int32) + k0 + BK) < K
            nxt = _gemv_tile(w, scale, aux, experts, rows, ok & more, factor, k0 + BK, K,
                             stride_we, stride_wn, stride_se, stride_sn, stride_ae, stride_an,
                             SCHEME, BK, EVEN_K)
            acc = _gemv_acc(acc, tile, mul, add, a_rows, k0, K, SCHEME, BK)
        res = acc if SCHEME == 0 else tl.sum(tl.sum(acc, axis=3), axis=2)
        res = tl.sum(res, axis=0)  # [R]: the slots summed (down), or the one slot
        if SCHEME == 1:
            res = res * _NV_OUT
        if SWIGLU:
            gate, up = tl.split(tl.permute(tl.reshape(res, (2, BN)), (1, 0)))
            res = gate / (1.0 + tl.exp(-gate)) * up
        n_cols = tl.program_id(1) * BN + tl.arange(0, BN)
        tl.store(out + pid.to(tl.int64) * stride_om + n_cols, res.to(out.dtype.element_ty),
                 mask=n_cols < N)

    @triton.jit
    def _hand_on_operand(hidden_ptr, pair, tile, tiles, pairs, N, xo_ptr, inv_ptr, xsum_ptr,
                         ticket_ptr, BN: tl.constexpr, GROUP: tl.constexpr,
                         HAS_SUM: tl.constexpr):
        """Once column tile `tile` of the pair's hidden row is stored: the last of the tiles of
        its operand group to get here writes that group of the row's decode operand (the
        down stage's input; `store_operand`, the bits its activation pass would make of the
        stored row) and zeroes the group's counter for the next launch."""
        rows = pair + tl.arange(0, 1)
        store_operand_group(hidden_ptr, rows, rows < pairs, pairs, N, tile, tiles,
                            ticket_ptr + pair * tl.cdiv(tiles, GROUP // BN), xo_ptr, inv_ptr,
                            xsum_ptr, BN, GROUP, HAS_SUM)

    @triton.jit
    def _decode_experts_kernel(
        xo_ptr, inv_ptr, xsum_ptr, w_ptr, s_ptr, aux_ptr, part_ptr, counter_ptr, out_ptr,
        oxo_ptr, oinv_ptr, oxsum_ptr, ticket_ptr, ids, route_weights, M, N, K, top_k,
        stride_we, stride_wn, stride_se, stride_sn, stride_ae, split_len, SCHEME: tl.constexpr,
        WPS: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOTS: tl.constexpr,
        SWIGLU: tl.constexpr,
        HAND_ON: tl.constexpr, OUT_GROUP: tl.constexpr, OUT_SUMS: tl.constexpr,
        PREFETCH: tl.constexpr, GDC: tl.constexpr
    ):
        """Program (pair, column tile, K split) of `_tensor_core_stage`: the pair's activation
        row (gate|up: its token's x, down: its hidden row) times BN output columns of its
        expert (gate|up: the BN gate rows and the BN up rows N later), as a K part of the
        pair's output (gate|up) or of its token's (down, routing weight applied). HAND_ON
        (gate|up): the output's decode operand too, in groups of OUT_GROUP columns
        (`_hand_on_operand`)."""
        wait_for_inputs(GDC)
        pair = tl.program_id(0)
        tile = tl.program_id(1)
        expert = tl.load(ids + pair).to(tl.int64)
        x_row = pair // top_k if SWIGLU else pair
        R: tl.constexpr = 2 * BN if SWIGLU else BN
        i = tl.arange(0, R)
        cols = tile * BN + i % BN
        rows = cols + (i // BN) * N
        row_ok = cols < N
        ms = tl.arange(0, BM)
        m_ok = ms == 0  # the one activation row, at x_row
        k_lo = tl.program_id(2) * split_len
        k_hi = tl.minimum(K, k_lo + split_len)
        if PREFETCH:  # the expert is known only now: the program's first codes at once
            row = tl.where(row_ok, rows, 0).to(tl.int64)
            prefetch_to_l2(w_ptr + expert * stride_we + row * stride_wn + k_lo // 8,
                           (k_hi - k_lo) // 2)
        # the experts' scales are row-major (group stride 1)
        acc = decode_range(tl.zeros((R, BM), tl.float32), xo_ptr + x_row * (K // 8),
                           inv_ptr + x_row, xsum_ptr + x_row, w_ptr + expert * stride_we,
                           s_ptr + expert * stride_se, aux_ptr + expert * stride_ae,
                           rows.to(tl.int64), row_ok, ms, m_ok, M, K, k_lo, k_hi, stride_wn,
                           stride_sn, 1, SCHEME, WPS, ASM, EVEN_K, EVEN_N, BK, DOTS)
        res = decode_result(acc, SCHEME)  # [BM, R]
        if SCHEME == _NVFP4:  # the expert's per-row global scale (aux)
            res = res * tl.load(aux_ptr + expert * stride_ae + rows, mask=row_ok,
                                other=0.0)[None, :]
        splits = tl.num_programs(2)
        tiles = tl.num_programs(1)
        if SWIGLU:
            out_row = pair
            part = tl.program_id(2)
            parts = splits
            outputs = tl.num_programs(0)
        else:
            res = res * tl.load(route_weights + pair)
            out_row = pair // top_k
            part = (pair % top_k) * splits + tl.program_id(2)
            parts = top_k * splits
            outputs = tl.num_programs(0) // top_k
        width = 2 * N if SWIGLU else N
        offs = out_row * width + rows[None, :] + ms[:, None] * 0
        mask = m_ok[:, None] & row_ok[None, :]
        last, total = sum_parts(res, part, parts, part_ptr, offs, outputs * width, mask,
                                counter_ptr + out_row * tiles + tile)
        if last:
            if SWIGLU:
                gate, up = tl.split(tl.permute(tl.reshape(total, (BM, 2, BN)), (0, 2, 1)))
                c = tile * BN + tl.arange(0, BN)
                tl.store(out_ptr + pair * N + c[None, :] + ms[:, None] * 0,
                         (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
                         mask=m_ok[:, None] & (c < N)[None, :])
                if HAND_ON:
                    _hand_on_operand(out_ptr, pair, tile, tiles, tl.num_programs(0), N,
                                     oxo_ptr, oinv_ptr, oxsum_ptr, ticket_ptr, BN, OUT_GROUP,
                                     OUT_SUMS)
            else:
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)

    def _decode_configs() -> list:
        """(BN, BK, warps). BK is a multiple of the int4 group (128 codes = 16 words) so a
        scale block never straddles a tile.

        NOTE (sm_90 SASS at 35B-A3B, H 2048, I 512, k 8): nvfp4 gate|up (16, 512, 4) 120
        registers, 6.3 instructions per weight in the loop; down (16, 256, 4) 255 registers
        (8 B spilled), 5.9; groupwise-int 5.8 / 5.2; all weight loads 16 B wide. bf16 down
        spills at BK >= 256 with 8 slots a tile: (16, 128, 8) is there for it.
        """
        if INTERPRET:
            options = [(128, 128, 4)]
        else:
            options = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (16, 512, 8), (32, 512, 8),
                       (16, 128, 8)]
        return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=1)
                for bn, bk, w in options]

    _decode_gemv_kernel = triton.autotune(
        _decode_configs(), key=["N", "K", "SCHEME", "SWIGLU", "SLOTS"],
        do_bench=_graph_bench, cache_results=True)(triton.heuristics(
            {"EVEN_K": lambda args: args["K"] % args["BK"] == 0})(_decode_gemv_kernel))
