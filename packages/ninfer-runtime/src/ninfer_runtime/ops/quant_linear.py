"""Triton kernels for `linear` over packed 4-bit weights (nvfp4, groupwise-int).

The kernels read the artifact layout as it is (quant/__init__.py), so no load-time `prepare`
is needed: codes uint8 [N, K/2] viewed as int32 words [N, K/8], word w of a row holding inputs
8w..8w+7 with input 8w + j in bits 4j..4j+3 (low nibble = even input). A K tile is a 16-byte
load per thread of whole words; the decode works on the words in place.

Two decoders:
- fp32 (the CUDA-core FMA paths of ops.moe, fp32 activations, the prefill GEMM's operands):
  code j (sign bit 3, magnitude bits 0-2) moves to the fp32 sign bit (31) and the exponent /
  top mantissa bits (22-24): that float is exactly e2m1 * 2^-126 (±0.5 land on a subnormal,
  which fp32 FMA handles at full rate). For j < 6 one integer multiply by 2^a + 2^b places
  magnitude and sign at once (the two shifted copies do not overlap): a code costs AND, IMAD,
  AND. groupwise-int: code q goes into the mantissa of 1.0, giving 1 + q/16 (shift, LOP3).
  Power-of-two offsets keep every intermediate exact and are undone in the epilogue.
- fp16 (`quant_decode`, the decode GEMV with half activations): two codes per 32-bit
  instruction with inline PTX byte tricks (prmt / lop3), the nvfp4 block scale applied with
  one fp16x2 multiply per word pair; a pure-Triton twin produces the same bits under the
  interpreter.

Kernels:
- `_decode_kernel`, decode (M <= SKINNY_MAX_M, one token included) of half activations (fp32
  ones, the CPU reference dtype, take the GEMM, exact with "ieee" dots). The activations are
  first scaled to fp16 and laid out by code position, once per call
  (`quant_decode.activation_kernel`: xo[j, m, w] = x[m, 8w + j] times a power of two per K
  tile, undone after the tile's dot; for a down projection it applies the MLP's SiLU too,
  `linear.silu_mul_linear`; where the kernel before the GEMV can write it, that kernel does,
  `DecodeOperand`: the GDN norm, skinny_linear, the attention merge, and this kernel itself
  for the down projection after a gate|up GEMV, `swiglu_decode`), so the K loop only
  streams weights, decodes them and multiplies. A
  program owns BN output rows and one split of K; every M runs on tensor cores, rows padded
  to 8 or 16 (`decode_rows`; a GEMV is bound by decoding, not by the MMA). Per
  code position j, W_j [BN, BK/8] @ xo[j]^T, the weight the MMA's A operand held in
  registers, so that the operand registers pair two adjacent words of one row, which is what
  the PTX decodes; the eight products of a tile run as 1-8 dots (`DecodeConfig.dots`: positions
  side by side along K). nvfp4 folds its fp8 block scale into the fp16 operand (exact);
  groupwise-int iterates one 128-code group at a time and applies scale and zero point to the
  group's dot result: s * (sum((1024 + q) x) - (1024 + z) * sum(x)). K is split over a second
  grid axis when row tiles alone would leave SMs idle (stream-K grids, timed on the H200, lost
  to K splits on every 27B shape by 25-100%, docs/perf.md): each part goes to a fp32 buffer,
  and the last part of a row tile to arrive (an atomic counter per tile) adds them all in a
  fixed order and writes the output: deterministic, no second kernel, counters left at zero
  for graph replays. With NINFER_L2_PREFETCH=1, before it waits for its inputs (PDL), a
  program asks L2 for up to 48 KB of its codes at once (`launch.prefetch_to_l2`, Hopper):
  Nsight Compute found the kernel latency-bound, but on the H200 the prefetch lost (9%).
- `_mlp_block_kernel`, a decode MLP's gate|up and down GEMVs in one launch (`mlp_decode`):
  `_decode_kernel`'s work items taken from a ticket, a down item waiting only for the
  operand groups of its own K split, so down's programs start where gate|up's last wave
  leaves SMs idle (a kernel boundary itself costs ~1 us under PDL; the overlap won the 27B
  3.8% at one token, docs/perf.md, thirtieth run).
- `_gemm_kernel`, prefill (M > SKINNY_MAX_M; fp32 activations at every M): tiled tensor-core
  GEMM; the [BN, BK] weight tile
  is dequantized in registers to x.dtype (exact for nvfp4 in bf16 and fp16), interleaved back
  to input order and fed to tl.dot (wgmma) with the activation tile, fp32 accumulation.
  nvfp4 weights with half activations take the fp16 decoder instead (`operand_tile`, the
  tile's codes concatenated by code position) against a row operand of x made once per call
  (`gemm_operand`: each row times the power of two that puts its largest |x| in [2^14,
  2^15), rounded once to fp16 (exact for every bf16 value within 2^-28 of the row's largest),
  each K tile of OPERAND_BLOCK_K inputs laid out by code position), the row scale undone in
  the epilogue: sm_90 SASS 3.2-4.5 instructions a weight in the K loop against 6.1-8.0 for the
  fp32 decoder's bf16 tile (LOP3, IMAD, FMUL and an F2FP per two weights). ops.moe's grouped
  GEMM does the same.
- `_dequant_kernel`, prefill of at least DEQUANT_MIN_M rows: the same tile decode,
  stored as a whole x.dtype weight for cuBLAS. On the H200 the fused GEMM reaches ~43% of bf16
  FLOPs (the decode in its inner loop) where cuBLAS bf16 reaches 85-90% on the same shapes;
  writing the weight out costs ~2.6 bytes per weight once per call, which a chunk of hundreds
  of rows repays (nvfp4 gate_up, 1,024 rows: ~1.05 ms fused against ~0.13 + ~0.5 ms).

NOTE: `scripts/sass_report.py` compiles these kernels for sm_90 without a GPU and prints the
SASS instructions per weight of each inner loop (the budget for 4.24 TB/s of nvfp4 on an H200
is ~4.4 at full issue rate).

bf16 weights never come here: cuBLAS (F.linear) is the ceiling for them (BENCHMARKS.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ninfer_runtime.ops import tuner
from ninfer_runtime.ops.ablation import ablated, zeros
from ninfer_runtime.ops.compile_ahead import launch
from ninfer_runtime.ops.counters import CounterPool
from ninfer_runtime.ops.dispatch import INTERPRET
from ninfer_runtime.ops.launch import dot_precision, l2_prefetch, options
from ninfer_runtime.ops.quant_decode import INT_F16_BIAS, NV_F16_EXP
from ninfer_runtime.ops.rms_math import prologue_args
from ninfer_runtime.quant import PackedWeight

if TYPE_CHECKING:
    from ninfer_runtime.ops.norm import DeferredNorm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: linear() runs the reference
    triton = None

SKINNY_MAX_M = 16  # up to here the decode kernel, above it the tiled GEMM
DEQUANT_MIN_M = 512  # from here dequantize once and call cuBLAS (_dequant_kernel)
# this module's nvfp4 prompt GEMM on fp16 operands in K tiles of OPERAND_BLOCK_K inputs (module
# docstring); off: the fp32 decoder's bf16 tile, as other weights take (ninfer-bench kernels
# times both; ops.moe's grouped GEMM keeps the tile, docs/perf.md, sixteenth run)
OPERAND_BLOCK_K = 128
PROMPT_FP16_OPERANDS = True
# nvfp4 global-scale runs given one cuBLAS GEMM each (a fused weight has up to 4 sources);
# scales that change more often are applied to an fp32 product instead (dequant_matmul)
_MAX_ALPHA_RUNS = 8
# the decode kernel's fp16 operands come from inline PTX on the GPU (False: the pure-Triton
# twin, bit-identical and slower; the interpreter always runs the twin)
DECODE_ASM = True
# whole row tiles load without row masks (decode_range's EVEN_N); NINFER_DECODE_EVEN_N=0 keeps
# the masks, the A/B of that change on the GPU
DECODE_EVEN_N = os.environ.get("NINFER_DECODE_EVEN_N", "1") != "0"
# the tuner's candidates include each config's `wave_split`; NINFER_DECODE_WAVE_SPLIT=0 leaves
# it out, the A/B of that change on the GPU
DECODE_WAVE_SPLIT = os.environ.get("NINFER_DECODE_WAVE_SPLIT", "1") != "0"
# a decode MLP's two GEMVs in one launch (`mlp_decode`, `_mlp_block_kernel`): the 27B decoded
# 3.8% faster at C = 1 and 5.4% at C = 8 on an H100 (docs/perf.md, thirtieth run);
# NINFER_MLP_BLOCK=0 runs them as two launches, the A/B of that change
MLP_BLOCK = os.environ.get("NINFER_MLP_BLOCK", "1") != "0"
_REGISTERS = 65536  # an SM's 32-bit registers (sm_80 to sm_90): the block's register cap
_INTERPRETER_SMS = 4  # small, so that CPU tests exercise the K split
# programs per SM the K split may aim at (counted with BN = 64); the decode tuner times each
# with each config, the first being the default (the H200 sweep, scripts/split_sweep.py,
# found the grid matters little: a shape's best target is within ~10% of the other)
SPLIT_TARGETS = (4, 16)
_MAX_SPLITS = 16
_SPLIT_GRANULE = 256  # K chunks are whole multiples of this and of their config's BK (`granule`)
GROUP_BK = 128  # one groupwise-int quantization group: the K tile of its decode and GEMMs


def decode_rows(m: int) -> int:
    """The decode kernel's row tile (the MMA's N) for m activation rows: 8 up to 8 rows (a
    decode step at C <= 8, an MTP verify at C <= 2), else 16.

    The activation tile is padded to it in shared memory and the accumulator in registers.
    With the H200 image's Triton 3.6 (sm_90 SASS, scripts/sass_report.py run on 3.6) 8 rows
    compile to mma.sync and 16 to wgmma; the nvfp4 config BN 128, 8 dots takes 168 registers
    (3 programs per SM) and 3.26 instructions per weight at 8 rows against 184 (2) and 3.45
    at 16. The 8-row tiles made the 27B decode step 11% shorter on the H200 (docs/perf.md).
    Triton 3.9 (the CPU venv's) compiles both to wgmma."""
    return 8 if m <= 8 else 16


def decode_plan_rows(m: int) -> tuple[int, bool]:
    """What a decode plan is tuned for, at m activation rows: the row tile (`decode_rows`)
    and whether m is one row, a lone request's decode step, which gets a plan of its own.

    A row tile's plan was tuned on its first call and then served every M of the tile; in the
    engine's warm-up that call is a short prompt step (5 rows on the 27B), whose larger K-split
    parts favour fewer splits: the plans it picked (gate|up unsplit, 52.8 us a one-row call
    against 46.2 for 4 splits) decoded the 27B at C = 1 2.7% slower than the one-row-fastest
    ones (docs/perf.md, twenty-fifth run). The warm-up's decode steps meet the one-row plan."""
    return decode_rows(m), m == 1


@dataclass(frozen=True)
class _Layout:
    scheme: int  # the kernels' SCHEME constexpr
    words_per_scale: int  # int32 words (8 codes each) that share one scale

    @property
    def operand_group(self) -> int:
        """The inputs the decode kernels' activation operand is scaled in groups of."""
        return _OPERAND_GROUPS[self.scheme]


_NVFP4_ID, _INT_ID = 0, 1
LAYOUTS = {"nvfp4": _Layout(_NVFP4_ID, 2), "groupwise-int": _Layout(_INT_ID, 16)}


class PackedWeightError(ValueError):
    """A packed weight whose stored parts do not have the layout the kernels read."""


def supports(w: PackedWeight) -> bool:
    """True when the kernels here can run this weight (a 2-D nvfp4 or groupwise-int weight)."""
    return w.scheme.name in LAYOUTS and len(w.shape) == 2


@dataclass(frozen=True)
class _Operands:
    words: torch.Tensor  # int32 [N, K/8]
    scale: torch.Tensor  # [N, K / (8 * words_per_scale)], row- or group-major (`group_major`)
    zero: torch.Tensor  # groupwise-int zero points (scale's strides); nvfp4: the scale again
    gscale: torch.Tensor  # nvfp4 per-row global scale; groupwise-int: the scale (unused)
    layout: _Layout


def group_major(w: PackedWeight) -> PackedWeight:
    """w with its groupwise-int scales and zero points stored a group after another ([N, G]
    views of [G, N] memory); other weights as they are. A decode tile loads one group's terms
    for its BN rows at a time: stored row by row (the artifact's layout), each row's sits in
    a 32-byte sector of its own, 32 sectors a warp for 64 useful bytes; group-major, the BN
    terms are adjacent. The kernels take either layout (a scale row stride and group stride)."""
    if w.scheme.name != "groupwise-int" or len(w.shape) != 2:
        return w
    parts = dict(w.parts)
    for role in ("weight_scale", "weight_zero"):
        parts[role] = parts[role].t().contiguous().t()
    return PackedWeight(w.scheme, parts, w.shape)


def _dense(part: torch.Tensor, role: str) -> bool:
    """Whether a part is stored densely as the kernels read it: row-major, or a scale or zero
    point part group-major (`group_major`)."""
    return part.is_contiguous() or (role != "weight" and part.t().is_contiguous())


def _operands(w: PackedWeight) -> _Operands:
    """The kernels' view of w's parts, checked (shapes, dtypes, layout)."""
    layout = LAYOUTS[w.scheme.name]
    n, k = w.shape
    per_scale = 8 * layout.words_per_scale
    blocks = k // per_scale
    expect = {"weight": (torch.uint8, (n, k // 2))}
    if layout.scheme == _NVFP4_ID:
        expect |= {"weight_scale": (torch.float8_e4m3fn, (n, blocks)),
                   "weight_scale_2": (torch.float32, (n,))}
    else:
        expect |= {"weight_scale": (torch.bfloat16, (n, blocks)),
                   "weight_zero": (torch.uint8, (n, blocks))}
    for role, (dtype, shape) in expect.items():
        part = w.parts.get(role)
        if part is None:
            raise PackedWeightError(f"{w.scheme.name} weight {tuple(w.shape)} lacks part {role!r}")
        if part.dtype != dtype or tuple(part.shape) != shape or not _dense(part, role):
            raise PackedWeightError(
                f"{w.scheme.name} weight {tuple(w.shape)}: part {role!r} is {part.dtype} "
                f"{tuple(part.shape)} (strides {part.stride()}), the kernels need {dtype} "
                f"{shape}, row-major (scales: or group-major)")
    codes, scale = w.parts["weight"], w.parts["weight_scale"]
    if layout.scheme == _INT_ID and w.parts["weight_zero"].stride() != scale.stride():
        raise PackedWeightError(f"groupwise-int weight {tuple(w.shape)}: its scales and zero "
                                "points are laid out differently")
    if k % per_scale or codes.storage_offset() % 4:
        raise PackedWeightError(f"{w.scheme.name} weight {tuple(w.shape)}: K must be a multiple "
                                f"of {per_scale} and the codes 4-byte aligned")
    words = codes.view(torch.int32)
    if layout.scheme == _NVFP4_ID:
        return _Operands(words, scale, scale, w.parts["weight_scale_2"], layout)
    return _Operands(words, scale, w.parts["weight_zero"], scale, layout)


def decodes(x: torch.Tensor) -> bool:
    """Whether x [M, K] takes the decode kernel (a few rows of half activations)."""
    return x.shape[0] <= SKINNY_MAX_M and x.dtype != torch.float32


@dataclass(frozen=True)
class DecodeOperand:
    """x's operand for the decode kernels: xo, inv, xsum of `activation_operands`, or written
    by the kernel that produced x (ops.norm) instead of a pass of its own, one launch fewer
    before the GEMV. `group` is the K tile it was scaled for (`operand_group`)."""

    xo: torch.Tensor
    inv: torch.Tensor
    xsum: torch.Tensor
    group: int

    @classmethod
    def empty(cls, m: int, k: int, group: int, sums: bool, device: torch.device,
              alloc: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor] | None = None
              ) -> DecodeOperand:
        """Unwritten buffers for the operand of an [m, k] activation: xo [8, m, k/8] fp16,
        inv and (with `sums`; else inv again) xsum [groups, m] fp32. `alloc(role, shape,
        dtype)` makes them instead of torch.empty (`ablated`)."""
        make = alloc or (lambda role, shape, dtype: torch.empty(shape, dtype=dtype,
                                                               device=device))
        inv = make("inv", (-(-k // group), m), torch.float32)
        xo = make("xo", (8, m, k // 8), torch.float16)
        return cls(xo, inv, make("xsum", inv.shape, torch.float32) if sums else inv, group)

    @classmethod
    def ablated(cls, m: int, k: int, group: int, sums: bool, device: torch.device
                ) -> DecodeOperand:
        """Zeros standing for the operand an ablated op would write (`ops.ablation.zeros`)."""
        return cls.empty(m, k, group, sums, device,
                         lambda role, shape, dtype: zeros(role, shape, dtype, device))

    @property
    def sums(self) -> bool:
        """Whether it holds the groups' sums (`empty` aliases xsum to inv where not)."""
        return self.xsum is not self.inv


def operand_buffers(operand: DecodeOperand | None, unused: torch.Tensor) -> tuple:
    """(xo, inv, xsum) of `operand` as a kernel's pointer arguments, or `unused` in their place
    where there is none (the kernel's constexpr then keeps it from touching them)."""
    return (unused,) * 3 if operand is None else (operand.xo, operand.inv, operand.xsum)


def operand_group(w: PackedWeight) -> int:
    """The inputs the activation operand of w's scheme is scaled in groups of
    (`_OPERAND_GROUPS`)."""
    return LAYOUTS[w.scheme.name].operand_group


def needs_group_sums(w: PackedWeight) -> bool:
    """Whether w's decode operand needs its groups' sums (groupwise-int's zero points)."""
    return LAYOUTS[w.scheme.name].scheme == _INT_ID


def packed_linear(x: torch.Tensor, w: PackedWeight, swiglu: bool = False,
                  operand: DecodeOperand | None = None, norm: DeferredNorm | None = None
                  ) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T -> [M, N] in x.dtype, fp32 accumulation, by the kernels.
    swiglu (decode only): x is [gate | up] [M, 2K] and silu_and_mul(x) is multiplied, the SiLU
    applied in the decode kernel's activation pass. operand (decode only): x's decode operand,
    already made (`DecodeOperand`). norm: the norm whose output x is, not yet run: at decode
    the activation pass runs it (`activation_operands`), else it runs first."""
    ops = _operands(w)
    n, k = w.shape
    assert x.dim() == 2 and x.shape[1] == k * (1 + swiglu) and x.stride(1) == 1, \
        f"packed_linear: x {tuple(x.shape)} stride {x.stride()} vs weight {tuple(w.shape)}"
    assert not swiglu or decodes(x), "packed_linear: swiglu is for the decode kernel"
    assert norm is None or (operand is None and not swiglu), "packed_linear: a norm and operand"
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if norm is not None:  # at decode the activation pass runs it, else the norm kernel
        if m and decodes(x):
            operand = _normed_operand(x, w, norm)
        else:
            norm.run()
    if m == 0:
        return out
    if decodes(x):
        _launch_decode(x, ops, out, swiglu, operand)
    elif m >= DEQUANT_MIN_M:
        dequant_matmul(x, ops, out)
    else:
        _launch_gemm(x, ops, out)
    return out


def dequantize_operand(ops: _Operands, dtype: torch.dtype, global_scale: bool = False
                       ) -> torch.Tensor:
    """The weight [N, K] in `dtype` as the GEMM's operand: nvfp4 e2m1 * s * 2^-8 (exact; the
    global scale and 2^8 are applied to the product), groupwise-int (q - z) * s (rounded once,
    as the reference does). With `global_scale`, nvfp4 rows are times their global scale
    instead, the exact product rounded once: PackedWeight.dequantize(dtype)'s bits."""
    n, k = ops.words.shape[0], ops.words.shape[1] * 8
    w = torch.empty((n, k), dtype=dtype, device=ops.words.device)
    bn, bk = (64, 256) if ops.layout.scheme == _NVFP4_ID else (64, GROUP_BK)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        ops.words, ops.scale, ops.zero, ops.gscale, w, n, k, ops.words.stride(0),
        *ops.scale.stride(), SCHEME=ops.layout.scheme, WPS=ops.layout.words_per_scale,
        GLOBAL=global_scale and ops.layout.scheme == _NVFP4_ID, BN=bn, BK=bk,
        EVEN_K=k % bk == 0)
    return w


def dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """w [..., N, K] (a weight, or experts stacked [E, N, K]) dequantized by the kernels to
    `dtype`, bit for bit PackedWeight.dequantize(dtype): a stacked weight's experts are decoded
    as the rows of one [E * N, K] weight."""
    *lead, n, k = w.shape
    rows = n * math.prod(lead)
    flat = PackedWeight(w.scheme, {role: part.reshape(rows, *part.shape[len(lead) + 1:])
                                   for role, part in w.parts.items()}, (rows, k))
    return dequantize_operand(_operands(flat), dtype, global_scale=True).view(*lead, n, k)


def dequant_matmul(x: torch.Tensor, ops: _Operands, out: torch.Tensor) -> None:
    """out = x @ W^T by dequantizing W to x.dtype and cuBLAS GEMMs (fp32 accumulation)."""
    w = dequantize_operand(ops, x.dtype)
    if ops.layout.scheme != _NVFP4_ID:
        torch.mm(x, w.t(), out=out)
        return
    # nvfp4: the global scale is the GEMM's alpha, applied to the fp32 product in cuBLAS's
    # epilogue and rounded once, one GEMM per run of rows sharing a scale. (An fp32 product
    # scaled afterwards writes and reads 10 bytes per output instead of 2: 13% of a 27B
    # prompt.) Scales that change from row to row take that path all the same.
    runs = _gscale_runs(ops.gscale)
    if len(runs) <= _MAX_ALPHA_RUNS:
        for start, end, alpha in runs:
            part = out[:, start:end]
            torch.addmm(part, x, w[start:end].t(), beta=0, alpha=alpha, out=part)
        return
    half = x.dtype in (torch.float16, torch.bfloat16)
    acc = torch.mm(x, w.t(), out_dtype=torch.float32) if x.is_cuda and half \
        else x.float() @ w.float().t()
    torch.mul(acc, ops.gscale * 2.0**8, out=out)


_GSCALE_RUNS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _gscale_runs(gscale: torch.Tensor) -> list[tuple[int, int, float]]:
    """(first row, end row, global scale x 2^8) of each run of rows sharing an nvfp4 global
    scale: one run for a plain weight, one per source tensor for a fused one (q|k|v, gate|up).
    Read from the device once per weight, on its first prompt step (the warm-up's, eager)."""
    runs = _GSCALE_RUNS.get(gscale)
    if runs is None:
        values = gscale.tolist()
        starts = [0] + [r for r in range(1, len(values)) if values[r] != values[r - 1]]
        ends = [*starts[1:], len(values)]
        runs = [(a, b, values[a] * 2.0**8) for a, b in zip(starts, ends, strict=True)]
        _GSCALE_RUNS[gscale] = runs
    return runs


@cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_split(n: int, k: int, device: torch.device, target: int = SPLIT_TARGETS[0], *,
            tile_rows: int = 64, granule: int = _SPLIT_GRANULE, max_splits: int = _MAX_SPLITS
            ) -> tuple[int, int]:
    """(split_len, splits) of a skinny product's K axis, for the decode kernel by default.

    Row tiles (of `tile_rows`, a typical BN) alone fill the GPU on wide matrices (gate|up,
    lm_head); a narrow one (down_proj, N = 5120, K = 17408) gets its K cut into chunks so that
    the grid reaches about `target` programs per SM. Chunks are whole multiples of `granule`
    (every decode config's BK).
    """
    tiles = triton.cdiv(n, tile_rows)
    want = triton.cdiv(target * _sm_count(device), tiles)
    splits = max(1, min(want, k // granule, max_splits))
    split_len = triton.cdiv(triton.cdiv(k, splits), granule) * granule
    return split_len, triton.cdiv(k, split_len)


def wave_split(n: int, k: int, device: torch.device, tile_rows: int, per_sm: int,
               granule: int = _SPLIT_GRANULE) -> tuple[int, int]:
    """(split_len, splits) of the decode kernel's K for a grid in whole waves: of every split
    (K chunks of whole granules, at most _MAX_SPLITS), the one whose busiest program slot
    (`per_sm` programs an SM) takes the fewest chunk-walks, waves x (granules a program + 1),
    fewer programs among equals (the + 1: a program's own cost, filling its pipeline and
    adding the parts). A candidate, not a rule: on the H100 (docs/perf.md, twenty-seventh
    run) it gives the targets' fastest split on gate|up, in_proj_qkvz and lm_head, and the
    one-wave splits they miss: down's 9 splits beat 14 and 7 by 0.6 us a call or more (the
    tuner's pick), out_proj's 8 lost to 6 by 1-2 us (a whole wave is not the loss there)."""
    tiles = triton.cdiv(n, tile_rows)
    granules = triton.cdiv(k, granule)
    slots = per_sm * _sm_count(device)

    def walks(chunk: int) -> tuple[int, int]:
        splits = triton.cdiv(granules, chunk)
        return triton.cdiv(tiles * splits, slots) * (chunk + 1), splits

    chunk = min(range(triton.cdiv(granules, _MAX_SPLITS), granules + 1), key=walks)
    split_len = chunk * granule
    return split_len, triton.cdiv(k, split_len)


@dataclass(frozen=True)
class DecodeConfig:
    bn: int  # output rows per program
    bk: int  # inputs per K tile
    warps: int
    stages: int
    dots: int = 8  # tensor-core dots per K tile (each over 8 / dots code positions)
    # programs an SM holds (registers, shared memory) at one activation row: sm_90, Triton
    # 3.6, `scripts/sass_report.py`; sizes `wave_split`'s candidate
    per_sm: int = 3
    # launched with the register cap that holds per_sm programs an SM (`register_cap`), not at
    # the registers the compiler picks (which hold fewer); out of the repr, so the tuning
    # cache's digests of the lists without a capped config stay what they were
    capped: bool = field(default=False, repr=False)

    @property
    def maxnreg(self) -> int | None:
        """The register cap it launches with (None: the compiler's choice)."""
        return register_cap(self.per_sm, self.warps) if self.capped else None

    def describe(self) -> str:
        """The config in a report's words, its register cap named (the repr leaves it out)."""
        capped = f", capped at {self.per_sm} an SM" if self.capped else ""
        return (f"BN {self.bn} BK {self.bk}, {self.warps} warps, {self.stages} stages, "
                f"{self.dots} dots{capped}")


def register_cap(per_sm: int, warps: int) -> int:
    """The most registers a thread may take for `per_sm` programs of `warps` warps to fit an
    SM (a multiple of 8, as ptxas allocates them)."""
    return _REGISTERS // (per_sm * 32 * warps) // 8 * 8


@dataclass(frozen=True)
class DecodePlan:
    """A config and a K split: programs on a (row tile, split) grid."""

    config: DecodeConfig
    split_len: int
    splits: int


# The weight tile is the MMA's A operand in registers (mma.sync at 8 activation rows with the
# H200's Triton 3.6, see `decode_rows`), the activation tile (laid out once per call) the B
# operand from shared memory; fewer, wider dots keep more decoded operands live. Nsight
# Compute on the H200 (docs/perf.md, nvfp4 gate_up at M = 1, 16-row tiles) found the kernel
# latency-bound, not issue- or bandwidth-bound: 2 programs per SM (the register limit) leave
# 2 warps per scheduler, which issue 0.52 instructions a cycle and move 1.76 TB/s; the BN 64
# config, 3 programs per SM, moved 1.97. So the configs trade instructions per weight for
# resident programs (Triton 3.6 sm_90 SASS at 8 rows, `scripts/sass_report.py`, no spills;
# per weight / programs per SM): nvfp4 BN 128 8 dots 3.26 / 3 (2 stages 3.14 / 2), 2 dots
# 3.18 / 2, BN 64 4 dots 3.63 / 4, 8 dots 3.70 / 5. groupwise-int (2 dots; its tuner never
# picked 6 stages or 8 dots for the 27B), its terms loaded a trip ahead from group-major
# scales: BK 128 BN 128 2.67 / 6, BN 64 3.62 / 7; BK 256 (two groups a trip; the tuner's
# pick for most 27B shapes on the H100, thirty-fourth run) BN 128 2.61 / 4, BN 64 3.25 / 5;
# BK 512 (four; K splits in chunks of 512) BN 128 2.25 / 3, BN 64 2.76 / 4 (sm_90, one row,
# 2026-12-07). Under ncu (tenth run) the default config's warps wait mostly on their own ALU
# results ("wait", 0.95 cycles an issued instruction) and on global loads (0.49), and find
# the ALU pipe busy (0.33): the decode's integer work is the bound.
# On the H200 (`scripts/decode_probe.py`, docs/perf.md, ninth run) the nvfp4 K loop is bound
# by the decode's issue, not by the tile stream or the dots: without its dots it is no
# faster, without its decode it streams at 85% of bandwidth; BN 128 with 8 dots at 2-3
# stages was the fastest on every 27B shape, 4 stages 1.5-3 us slower a call, BK 128 twice
# as slow. BK is a multiple of 128 (one groupwise-int group) and >= 128 (tl.dot needs
# BK/8 >= 16). The tuner times them all on the GPU; the interpreter runs one. Tried and not
# kept (twenty-third run, H100): a one-row GEMV applying the fp8 block scales per MMA column
# (the operand in 8 rows, one per scale block, zeros elsewhere), 2.61-2.71 instructions a
# weight and 96-102 registers, ran the 27B step 23% slower: its B operand is 8x the bytes,
# and its scale loads (which feed no dot, so Triton does not copy them ahead) waited on DRAM
# in every K tile. Its second form (twenty-fourth run: the B operand loaded from the one row
# with masks, the scales a tile ahead; 2.71-2.80 and 96-125) ran the 27B 1.1% faster and the
# 35B 7.3% slower.
DECODE_CONFIGS = {
    _NVFP4_ID: [DecodeConfig(bn, bk, w, s, d, p) for bn, bk, w, s, d, p in (
        (128, 256, 4, 3, 8, 3), (128, 256, 4, 2, 8, 3), (128, 256, 4, 3, 2, 3),
        (64, 256, 4, 4, 4, 5), (64, 256, 4, 4, 8, 5))]
    # the 8-dot tile at 4 programs an SM instead of 3 (128 registers, not 153-154: 6 and 7
    # spill instructions in the loop, 3.07 and 3.17 instructions a weight against 3.03, 3.10)
    + [DecodeConfig(128, 256, 4, s, 8, 4, capped=True) for s in (2, 3)],
    _INT_ID: [DecodeConfig(bn, bk, w, s, d, p) for bn, bk, w, s, d, p in (
        (128, 128, 4, 4, 2, 6), (128, 128, 4, 3, 2, 6), (64, 128, 4, 4, 2, 7),
        (64, 128, 4, 3, 2, 7), (128, 256, 4, 3, 2, 4), (128, 256, 4, 2, 2, 4),
        (64, 256, 4, 3, 2, 5), (128, 512, 4, 2, 2, 3), (64, 512, 4, 2, 2, 4))]
    # the two-group tile at 5 programs an SM instead of 4 (96 registers, not 127: one spill in
    # its loop, 2.64 instructions a weight against 2.61; the tuner's pick for gate|up and
    # down on the H200, +1.7%, thirty-fifth run), the one-group tile at 7 instead of 6 (72,
    # not 80: 3 spills, 2.79 against 2.68)
    + [DecodeConfig(128, 256, 4, 2, 2, 5, capped=True),
       DecodeConfig(128, 128, 4, 3, 2, 7, capped=True)],
}
# the interpreter's cost grows with programs and ops a program: wide tiles and 2 dots (the
# engine tests' tiny models in half the time; their weights still span several tiles)
_INTERPRETER_CONFIGS = {_NVFP4_ID: DecodeConfig(64, 256, 4, 1, 2),
                        _INT_ID: DecodeConfig(64, GROUP_BK, 4, 1, 2)}
# The activation operand's group (one scale, and groupwise-int's sum, per group of a row): the
# nvfp4 K tile, one groupwise-int quantization group (an int tile holds one or two). Every
# config of a scheme fits its group, so an operand made before the tuner picks a config
# (ops.norm) fits whichever it picks.
_OPERAND_GROUPS = {_NVFP4_ID: 256, _INT_ID: GROUP_BK}
assert all(c.bk == _OPERAND_GROUPS[_NVFP4_ID] for c in (*DECODE_CONFIGS[_NVFP4_ID],
                                                       _INTERPRETER_CONFIGS[_NVFP4_ID]))
assert all(c.bk % GROUP_BK == 0 for c in (*DECODE_CONFIGS[_INT_ID], _INTERPRETER_CONFIGS[_INT_ID]))
_decode_plans: dict[tuple, DecodePlan] = {}


def decode_candidates(n: int, k: int, scheme: int, device: torch.device) -> list[DecodePlan]:
    """Every (config, K split) the decode tuner may pick for an [n, k] weight: each config
    with the K split of each of SPLIT_TARGETS and its `wave_split` (distinct splits only);
    the first is the default."""
    configs = [_INTERPRETER_CONFIGS[scheme]] if INTERPRET else DECODE_CONFIGS[scheme]
    plans = []
    for c in configs:
        targets = [k_split(n, k, device, t, granule=granule(c)) for t in SPLIT_TARGETS]
        waves = ([wave_split(n, k, device, c.bn, c.per_sm, granule(c))] if DECODE_WAVE_SPLIT
                 else [])
        plans += [DecodePlan(c, *split) for split in dict.fromkeys([*targets, *waves])]
    return plans


def launch_candidates(n: int, k: int, scheme: int, device: torch.device,
                      launched_as: tuple[int, int] | None) -> list[DecodePlan]:
    """`decode_candidates`, with `launched_as` (warps, pipeline stages) only those that
    launch so (`_decode_plan`'s list for a plan sharing a launch)."""
    return [p for p in decode_candidates(n, k, scheme, device)
            if launched_as in (None, (p.config.warps, p.config.stages))]


def granule(config: DecodeConfig) -> int:
    """The K chunks a config's splits are whole multiples of: its K tiles must not straddle
    two splits."""
    return max(_SPLIT_GRANULE, config.bk)


def swiglu_decode(x: torch.Tensor, w: PackedWeight, spec: tuple[int, bool],
                  norm: DeferredNorm | None = None
                  ) -> tuple[torch.Tensor, DecodeOperand] | None:
    """silu_and_mul(x @ dequantize(w)^T) for a decode step's x [M, K] and a fused [gate | up]
    weight w [2I, K], and its decode operand of `spec` (group, sums: the down projection's)
    from the same launch: a program pairs BN/2 gate rows with their BN/2 up rows, stores
    their SiLU product, and the last column tile of each operand group to be stored writes
    that group (`_hand_on_swiglu`). The down GEMV then runs no activation pass. None where
    the tuned tile cannot pair whole groups (the caller takes linear, then silu_mul_linear,
    and runs `norm`, the norm whose output x is, which the activation pass runs here)."""
    ops = _operands(w)
    n, k = w.shape
    assert decodes(x) and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1 and n % 2 == 0
    m, inter = x.shape[0], n // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    plan = _decode_plan(x, ops, out)
    if not _hands_on(plan, spec[0]):
        return None
    hidden = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    operand = DecodeOperand.empty(m, inter, *spec, x.device)
    _run_decode(x, ops, out, plan, operand=_normed_operand(x, w, norm),
                hand_on=(hidden, operand))
    return hidden, operand


def _normed_operand(x: torch.Tensor, w: PackedWeight, norm: DeferredNorm | None
                    ) -> DecodeOperand | None:
    """x's decode operand for w, made by the activation pass that runs `norm` (x its output);
    None without a norm (the decode launch makes its own)."""
    if norm is None:
        return None
    return activation_operands(x, operand_group(w), needs_group_sums(w), norm=norm)


def _hands_on(plan: DecodePlan, group: int) -> bool:
    """Whether a [gate | up] GEMV of `plan` can hand on its SiLU product's operand in groups
    of `group` columns: each group is whole tiles' halves (BN/2 gate columns a tile)."""
    return group % (plan.config.bn // 2) == 0


def mlp_decode(x: torch.Tensor, gate_up: PackedWeight, down: PackedWeight,
               norm: DeferredNorm | None = None) -> torch.Tensor | None:
    """down(silu_and_mul(x @ gate_up^T)) for a decode step's x [M, H], a fused [gate | up]
    weight [2I, H] and down [H, I]: both GEMVs in one launch (`_mlp_block_kernel`). The
    gate|up items hand the SiLU product's operand on as `swiglu_decode` does, and a down
    item waits only until the operand groups of its own K split are written, where a second
    launch would wait for the whole first kernel to end and then fill the GPU again. The bits
    of `swiglu_decode` then the down GEMV. gate|up takes its own tuned plan, down the fastest
    of its candidates that launch as that one does (warps, pipeline stages: a launch has one
    of each), tuned under a key of its own. None where the hand-on does not fit the gate|up
    tile or no down candidate launches so: the caller runs the two launches (and `norm`,
    the norm whose output x is, not yet run, which the gate|up activation pass runs here)."""
    gops, dops = _operands(gate_up), _operands(down)
    n, k = gate_up.shape
    h, inter = down.shape
    assert decodes(x) and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1 \
        and n == 2 * inter, f"mlp_decode: x {tuple(x.shape)}, weights {n} x {k}, {h} x {inter}"
    m = x.shape[0]
    gate_up_out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gplan = _decode_plan(x, gops, gate_up_out)
    group = operand_group(down)
    if not _hands_on(gplan, group):
        return None
    hidden = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    # tuned (on the first call) over a hidden not yet written: timing only
    dplan = _decode_plan(hidden, dops, out, launched_as=(gplan.config.warps,
                                                         gplan.config.stages))
    if dplan is None:
        return None
    operand = DecodeOperand.empty(m, inter, group, needs_group_sums(down), x.device)
    pool = TILE_COUNTERS.on(x.device)
    g_grid, g_args, g_kw, used = _decode_args(x, gops, gate_up_out, gplan, False,
                                              _normed_operand(x, gate_up, norm),
                                              (hidden, operand), pool)
    d_grid, d_args, d_kw, d_used = _decode_args(hidden, dops, out, dplan, False, operand,
                                                None, pool[used:])
    sync = pool[used + d_used:]  # the work ticket, then each down split's ready and done counts
    assert used + d_used + 1 + 2 * dplan.splits <= pool.numel(), "mlp_decode: too many counters"
    launch_kw = {key: g_kw.pop(key) for key in ("num_warps", "num_stages")}
    for kw in (g_kw, d_kw):
        kw.pop("maxnreg", None)
    del d_kw["num_warps"], d_kw["num_stages"]
    if not INTERPRET:  # the occupancy the plans were tuned at (`DecodeConfig.per_sm`)
        per_sm = min(gplan.config.per_sm, dplan.config.per_sm)
        launch_kw["maxnreg"] = register_cap(per_sm, launch_kw["num_warps"])
    launch(_mlp_block_kernel, (math.prod(g_grid) + math.prod(d_grid),), *g_args, g_grid[0],
           *d_args, d_grid[0], sync, **{f"G_{key}": v for key, v in g_kw.items()},
           **{f"D_{key}": v for key, v in d_kw.items()}, **launch_kw, **options(x.device))
    return out


def _launch_decode(x: torch.Tensor, ops: _Operands, out: torch.Tensor, swiglu: bool,
                   operand: DecodeOperand | None = None) -> None:
    """The decode kernel with the plan tuned for this weight shape and row tile."""
    _run_decode(x, ops, out, _decode_plan(x, ops, out, swiglu), swiglu, operand)


def _decode_plan(x: torch.Tensor, ops: _Operands, out: torch.Tensor, swiglu: bool = False,
                 launched_as: tuple[int, int] | None = None) -> DecodePlan | None:
    """The plan for this weight shape and x's rows (`decode_plan_rows`): every candidate
    timed as CUDA-graph replays streaming over copies of the weight on the first call (before
    any graph captures the step, as the engine's warm-up guarantees), then reused for every M
    of the same tile (one row apart). With `launched_as` (warps, pipeline stages: a plan to
    share a launch with, `mlp_decode`), the fastest of the candidates that launch so, under a
    key of its own; None if no candidate does."""
    n, k = out.shape[1], ops.words.shape[1] * 8
    key = _decode_key(n, k, ops.layout, x)

    def candidates() -> list[DecodePlan]:  # only on a key's first call
        return launch_candidates(n, k, ops.layout.scheme, x.device, launched_as)

    if launched_as is not None:
        key = (*key, launched_as)
        if key not in _decode_plans and not candidates():
            return None
    return tuner.tuned_plan(_decode_plans, key, candidates,
                            lambda: decode_runs(x, ops, out, swiglu), x.device)


def decode_runs(x: torch.Tensor, ops: _Operands, out: torch.Tensor, swiglu: bool = False,
                operand: DecodeOperand | None = None) -> list[Callable[[DecodePlan], None]]:
    """What the decode tuner times: a call of a candidate plan on the weight, then on each of
    its stand-ins (`_weight_copies`); with `operand` (x's, made before), without the
    activation pass."""
    return [lambda c, o=o: _run_decode(x, o, out, c, swiglu, operand)
            for o in _weight_copies(ops, x.device)]


def _decode_key(n: int, k: int, layout: _Layout, x: torch.Tensor) -> tuple:
    """The decode tuner's key: the weight's shape and scheme, what x's rows are tuned for
    (`decode_plan_rows`), x's dtype and device, and whether the kernel prefetches (plans are
    timed with it)."""
    return (n, k, *decode_plan_rows(x.shape[0]), layout.scheme, x.dtype, l2_prefetch(x.device),
            x.device)


def chosen_decode_plan(w: PackedWeight, x: torch.Tensor) -> DecodePlan | None:
    """The plan the decode tuner chose for x @ w^T, if it has run on that key."""
    return _decode_plans.get(_decode_key(*w.shape, _operands(w).layout, x))


def _weight_copies(ops: _Operands, device: torch.device) -> list[_Operands]:
    """ops, then zero-filled stand-ins for its codes and scales (a decode call's time does
    not depend on their values), `weight_copy_count` in all."""
    parts = {id(t): t for t in (ops.words, ops.scale, ops.zero)}
    count = tuner.weight_copy_count(sum(t.nbytes for t in parts.values()), device)
    copies = [ops]
    for _ in range(count - 1):
        zeros = {i: torch.zeros_like(t) for i, t in parts.items()}
        copies.append(replace(ops, words=zeros[id(ops.words)], scale=zeros[id(ops.scale)],
                              zero=zeros[id(ops.zero)]))
    return copies


def activation_operands(x: torch.Tensor, group: int, group_sums: bool, swiglu: bool = False,
                        norm: DeferredNorm | None = None) -> DecodeOperand:
    """xo, inv, xsum of `quant_decode.activation_kernel` for x [M, K] (swiglu: [gate | up]
    [M, 2K], silu_and_mul's input) in groups of `group` inputs (the decode K tile): the decode
    kernels' fp16 operand by code position, 1 / each group's scale [K / group, M] and, with
    `group_sums` (groupwise-int weights), each group's operand sum [K / group, M]. `norm`:
    the norm whose output x is, not yet run: the same launch runs it (writes x)."""
    m, k = x.shape[0], x.shape[1] // (1 + swiglu)
    assert norm is None or not swiglu, "activation_operands: a norm's output is no SwiGLU input"
    if ablated("act", x):
        if norm is not None:
            norm.run()
        return DecodeOperand.ablated(m, k, group, group_sums, x.device)
    op = DecodeOperand.empty(m, k, group, group_sums, x.device)
    source, norm_args, norm_constexprs = prologue_args(x, norm)
    # a norm's program loads its row whole: up to 4 warps, a thread holding 64 inputs of
    # the 27B's (sm_90: 50 registers; 8 warps took groupwise-int's to 210)
    warps = max(1, group // 128, min(4, norm_constexprs["NORM_BD"] // 2048))
    activation_kernel[(m, op.inv.shape[0])](
        source, op.xo, op.inv, op.xsum, *norm_args, m, k, source.stride(0), GROUP=group,
        HAS_SUM=group_sums, SWIGLU=swiglu, **norm_constexprs, num_warps=warps,
        **options(x.device))
    return op


def _run_decode(x: torch.Tensor, ops: _Operands, out: torch.Tensor, plan: DecodePlan,
                swiglu: bool = False, operand: DecodeOperand | None = None,
                hand_on: tuple[torch.Tensor, DecodeOperand] | None = None) -> None:
    """hand_on (`swiglu_decode`): the SiLU product's buffer [M, N/2] and its operand's."""
    grid, args, kw, _ = _decode_args(x, ops, out, plan, swiglu, operand, hand_on,
                                     TILE_COUNTERS.on(x.device))
    launch(_decode_kernel, grid, *args, **kw, **options(x.device))


def _decode_args(x: torch.Tensor, ops: _Operands, out: torch.Tensor, plan: DecodePlan,
                 swiglu: bool, operand: DecodeOperand | None,
                 hand_on: tuple[torch.Tensor, DecodeOperand] | None, counters: torch.Tensor
                 ) -> tuple[tuple[int, int], list, dict, int]:
    """(grid, arguments, compile-time arguments and launch options, counters used) of
    `_decode_kernel`, its arrival counters (row tiles', then hand-on operand groups') from
    the start of `counters` (zeroed, left zeroed). The activation pass runs here where no
    `operand` is given."""
    m, n, k = x.shape[0], out.shape[1], ops.words.shape[1] * 8
    c = plan.config
    group = ops.layout.operand_group
    if operand is None:
        operand = activation_operands(x, group, ops.layout.scheme == _INT_ID, swiglu)
    else:
        assert not swiglu, "a norm's operand is of x, not of silu_and_mul(x)"
    assert operand.group == group, "a decode operand of another group"
    tiles = triton.cdiv(n, c.bn)
    hidden, handed = hand_on or (out, None)
    groups = 0 if handed is None else triton.cdiv(n // 2, handed.group)
    used = tiles + groups
    assert used <= counters.numel(), f"{used} counters: more than the buffer holds"
    parts = out if plan.splits == 1 else torch.empty((plan.splits, m, n), dtype=torch.float32,
                                                     device=x.device)
    args = [operand.xo, operand.inv, operand.xsum, ops.words, ops.scale, ops.zero, ops.gscale,
            parts, counters, out, hidden, *operand_buffers(handed, out), counters[tiles:], m,
            n, k, ops.words.stride(0), *ops.scale.stride(), plan.split_len, plan.splits]
    kw = dict(HAND_ON=handed is not None, OUT_GROUP=c.bn if handed is None else handed.group,
              OUT_SUMS=handed is not None and handed.sums,
              PREFETCH=prefetches(ops.words, k, plan.split_len),
              **decode_tile_args(ops.layout, c, n, k, m))
    return (tiles, plan.splits), args, kw, used


def prefetches(words: torch.Tensor, k: int, split_len: int) -> bool:
    """Whether a decode kernel may bulk-prefetch its programs' codes (int32 words [..., N,
    K/8], a weight or stacked experts): every row's range (codes [k_lo, k_hi) of a K split)
    must start and end on 16 bytes."""
    return (l2_prefetch(words.device) and words.data_ptr() % 16 == 0
            and all(stride * 4 % 16 == 0 for stride in words.stride()[:-1])
            and split_len // 2 % 16 == 0 and k // 2 % 16 == 0)


def decode_tile_args(layout: _Layout, config: DecodeConfig, n: int, k: int, m: int) -> dict:
    """The compile-time arguments and launch options of `decode_range` for a weight of
    `layout` with k inputs and m activation rows, as the dense decode kernel and ops.moe's
    expert decode pass them; n is the N their row tiles split BN at a time (EVEN_N: whole
    tiles), the kernel's own N argument."""
    cap = {} if config.maxnreg is None else {"maxnreg": config.maxnreg}
    return dict(SCHEME=layout.scheme, WPS=layout.words_per_scale, BM=decode_rows(m),
                ASM=DECODE_ASM and not INTERPRET, EVEN_K=k % config.bk == 0,
                EVEN_N=DECODE_EVEN_N and n % config.bn == 0, BN=config.bn,
                BK=config.bk, DOTS=config.dots, num_warps=config.warps,
                num_stages=config.stages, **cap)


# the decode kernels' arrival counters: one per row tile, where the tile's K parts count
# themselves (N <= 4M at BN = 64), then any the kernel hands on with
TILE_COUNTERS = CounterPool("decode tile counters", 1 << 16)


def _launch_gemm(x: torch.Tensor, ops: _Operands, out: torch.Tensor) -> None:
    m, k = x.shape
    n = out.shape[1]
    f16 = fp16_operands(x, ops.layout.scheme == _NVFP4_ID, k)
    xo, inv = gemm_operand(x) if f16 else (x, x)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    # NOTE: the autotune key uses M rounded up to a power of two, so chunked prefill's varying
    # token counts reuse a handful of tuned configs instead of re-tuning every step.
    launch(
        _gemm, grid,
        x, ops.words, ops.scale, ops.zero, ops.gscale, out, m, n, k, x.stride(0),
        ops.words.stride(0), *ops.scale.stride(), triton.next_power_of_2(m), xo, inv,
        SCHEME=ops.layout.scheme, WPS=ops.layout.words_per_scale,
        PRECISION=dot_precision(x.dtype), OPERAND=f16, ASM=DECODE_ASM and not INTERPRET)


def fp16_operands(x: torch.Tensor, nvfp4: bool, *ks: int) -> bool:
    """Whether a prompt GEMM of x's rows by nvfp4 weights of K in `ks` runs on fp16 operands
    (module docstring): half activations, whole K tiles."""
    return (PROMPT_FP16_OPERANDS and nvfp4 and x.dtype in (torch.float16, torch.bfloat16)
            and all(k % OPERAND_BLOCK_K == 0 for k in ks))


def gemm_operand(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xo [M, K] fp16, inv [M] fp32) of a [M, K] for the fp16 prompt GEMMs: each row times
    the power of two m that puts its largest |a| in [2^14, 2^15), rounded once, each K tile
    of OPERAND_BLOCK_K inputs in code position order (input k0 + 8w + j at k0 + j *
    OPERAND_BLOCK_K / 8 + w, as `operand_tile` concatenates a weight tile's codes); inv = 1 /
    m."""
    m, k = a.shape
    xo = torch.empty((m, k), dtype=torch.float16, device=a.device)
    inv = torch.empty(m, dtype=torch.float32, device=a.device)
    kp = triton.next_power_of_2(k)
    _gemm_operand_kernel[(m,)](a, a.stride(0), xo, inv, k, BLOCK_K=OPERAND_BLOCK_K, KP=kp,
                               num_warps=max(1, min(8, kp // 512)))
    return xo, inv


def _graph_bench(kernel_call: Callable[[], object], quantiles: tuple[float, ...]) -> object:
    """Autotune timing as CUDA-graph replays: a decode GEMV is shorter than its Python launch,
    which plain event timing would measure instead of the kernel."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


def _configs(space: list[tuple[dict, int, int]], interpret: tuple[dict, int, int]) -> list:
    """Autotune configs; a single one under the interpreter (which autotunes nothing)."""
    chosen = [interpret] if INTERPRET else space
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw, w, s in chosen]


if triton is not None:
    from ninfer_runtime.ops.activation import silu_mul
    from ninfer_runtime.ops.launch import prefetch_to_l2, wait_for_inputs
    from ninfer_runtime.ops.quant_decode import (
        activation_kernel,
        int_operands,
        nv_operands,
        operand_scale,
        store_operand_group,
    )

    _NVFP4 = tl.constexpr(_NVFP4_ID)
    # nvfp4 power-of-two offsets of the fp32 decoder (see the module docstring): decoded
    # codes are e2m1 * 2^-126; the tensor-core operand is e2m1 * s * 2^-8, a CUDA-core FMA
    # path (ops.moe) multiplies x by 2^96 (no subnormal products for |x| >= 2^-96, no overflow
    # below 2^32) and its per-word sums by s * 2^22: both accumulate sum(e2m1 * s * x) * 2^-8.
    _NV_DOT_SCALE = tl.constexpr(2.0**118)
    _NV_FMA_SCALE = tl.constexpr(2.0**22)
    _NV_FMA_X = tl.constexpr(2.0**96)
    _NV_OUT = tl.constexpr(2.0**8)
    # the fp16 decode operands' offsets (quant_decode)
    _NV_F16_OUT = tl.constexpr(2.0**NV_F16_EXP)
    _INT_F16_BIAS = tl.constexpr(INT_F16_BIAS)
    _GROUP_BK_C = tl.constexpr(GROUP_BK)
    # K parts the last program of a row tile loads at once by default: each round is an L2
    # round trip at the end of the kernel, where nothing hides it (a 14-way split took 4
    # rounds at 4); a decode tile's part is 8-16 registers a thread, which bounds it
    _PARTS_IN_FLIGHT = 8

    @triton.jit
    def _e2m1(words, J: tl.constexpr):
        """fp32 e2m1(code J) * 2^-126 of every uint32 word (sign to bit 31, magnitude to 22-24)."""
        if J < 6:
            # (t << (22 - 4J)) + (t << (28 - 4J)): magnitude lands on 22-24, sign on 31
            bits = (words & (0xF << (4 * J))) * ((1 << (22 - 4 * J)) + (1 << (28 - 4 * J)))
        elif J == 6:
            t = words & 0x0F000000
            bits = (t >> 2) | (t << 4)
        else:
            bits = ((words >> 6) & 0x01C00000) | (words & 0x80000000)
        return (bits & 0x81C00000).to(tl.float32, bitcast=True)

    @triton.jit
    def _uint4(words, J: tl.constexpr):
        """fp32 1 + q/16 for code J of every uint32 word (q placed at mantissa bits 19-22)."""
        t = words << (19 - 4 * J) if 4 * J <= 19 else words >> (4 * J - 19)
        return ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, k_hi, stride_w, stride_sn,
                   stride_sg, SCHEME: tl.constexpr, WPS: tl.constexpr, BK: tl.constexpr,
                   EVEN_K: tl.constexpr, NV_SCALE: tl.constexpr):
        """The uint32 words [BN, BK/8] of inputs [k0, k0 + BK) and, per scale block
        [BN, BK/8/WPS], the (mul, add) that turn a decoded code into a weight:
        nvfp4 e2m1 * 2^-126 * (s * NV_SCALE); groupwise-int (1 + q/16) * 16s - (16 + z)s."""
        BKW: tl.constexpr = BK // 8
        BKS: tl.constexpr = BKW // WPS
        # k0 is a multiple of BK: tell the compiler, so that the word loads are 16-byte wide
        kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
        ks = k0 // (8 * WPS) + tl.arange(0, BKS)
        row_off = rows.to(tl.int64)
        if EVEN_K:  # whole tiles; k0 >= k_hi only for the CUDA-core kernel's last prefetch
            live = row_ok & (k0 + tl.zeros_like(rows) < k_hi)  # per row: loads stay 16 B wide
            w_mask = live[:, None]
            s_mask = live[:, None]
        else:
            w_mask = row_ok[:, None] & (kw < k_hi // 8)[None, :]
            s_mask = row_ok[:, None] & (ks < k_hi // (8 * WPS))[None, :]
        words = tl.load(w_ptr + row_off[:, None] * stride_w + kw[None, :], mask=w_mask, other=0)
        s_off = row_off[:, None] * stride_sn + ks[None, :] * stride_sg
        scale = tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        if SCHEME == _NVFP4:
            mul = scale * NV_SCALE
            add = tl.zeros_like(mul)
        else:
            zero = tl.load(z_ptr + s_off, mask=s_mask, other=0).to(tl.float32)
            mul = 16.0 * scale
            add = -(16.0 + zero) * scale
        return words.to(tl.uint32, bitcast=True), mul, add

    @triton.jit
    def _per_word(t, WPS: tl.constexpr):
        """[BN, S] per scale block -> [BN, S * WPS] per word."""
        return tl.reshape(tl.broadcast_to(t[:, :, None], (t.shape[0], t.shape[1], WPS)),
                          (t.shape[0], t.shape[1] * WPS))

    @triton.jit
    def _operand(words, J: tl.constexpr, mul, add, SCHEME: tl.constexpr, DTYPE: tl.constexpr):
        """Code J of each word [BN, BKW] dequantized for tl.dot: nvfp4 e2m1 * s * 2^-8 (exact
        in bf16 and fp16), groupwise-int (q - z) * s (rounded once, as the reference does);
        mul and add per word."""
        w = _e2m1(words, J) * mul if SCHEME == _NVFP4 else _uint4(words, J) * mul + add
        return w.to(DTYPE)

    @triton.jit
    def _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, stride_w, stride_sn,
                     stride_sg, SCHEME: tl.constexpr, WPS: tl.constexpr, BK: tl.constexpr,
                     EVEN_K: tl.constexpr, DTYPE: tl.constexpr):
        """The weight tile [BN, BK] of inputs [k0, k0 + BK) in input order, as `_operand`
        dequantizes it (the prefill GEMM's operand, the dequantized weight's tile)."""
        words, mul, add = _load_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, stride_w,
                                     stride_sn, stride_sg, SCHEME, WPS, BK, EVEN_K,
                                     _NV_DOT_SCALE)
        mul = _per_word(mul, WPS)
        add = _per_word(add, WPS)
        return _interleave8(_operand(words, 0, mul, add, SCHEME, DTYPE),
                            _operand(words, 1, mul, add, SCHEME, DTYPE),
                            _operand(words, 2, mul, add, SCHEME, DTYPE),
                            _operand(words, 3, mul, add, SCHEME, DTYPE),
                            _operand(words, 4, mul, add, SCHEME, DTYPE),
                            _operand(words, 5, mul, add, SCHEME, DTYPE),
                            _operand(words, 6, mul, add, SCHEME, DTYPE),
                            _operand(words, 7, mul, add, SCHEME, DTYPE))

    @triton.jit
    def _interleave8(o0, o1, o2, o3, o4, o5, o6, o7):
        """Eight [R, C] tensors -> [R, 8C] with column 8c + j = oj[:, c] (input order).

        join() adds a trailing axis; the innermost joins end up most significant, so they pair
        codes 4 apart, then 2 apart, then 1 apart.
        """
        t = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)),
                    tl.join(tl.join(o1, o5), tl.join(o3, o7)))
        return tl.reshape(t, (o0.shape[0], 8 * o0.shape[1]))

    @triton.jit
    def _concat2(a, b):
        """[R, C] and [R, C] -> [R, 2C], a's columns first."""
        return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))

    @triton.jit
    def _operand_group(o, G: tl.constexpr, P: tl.constexpr):
        """Code positions G*P .. G*P + P - 1 of the eight decoded operands side by side."""
        if P == 1:
            return o[G]
        elif P == 2:
            return _concat2(o[2 * G], o[2 * G + 1])
        elif P == 4:
            return _concat2(_concat2(o[4 * G], o[4 * G + 1]),
                            _concat2(o[4 * G + 2], o[4 * G + 3]))
        else:
            return _concat2(_concat2(_concat2(o[0], o[1]), _concat2(o[2], o[3])),
                            _concat2(_concat2(o[4], o[5]), _concat2(o[6], o[7])))

    @triton.jit
    def _dots(o, acc, xo_ptr, ms, m_ok, M, K, k0, k_hi, EVEN_K: tl.constexpr,
              BKW: tl.constexpr, DOTS: tl.constexpr):
        """acc + the K tile's product in DOTS tensor-core dots, each over 8 / DOTS code
        positions (K of a dot runs over (code position, word), position-major, for the
        decoded weights and the activation operands alike): fewer dots wait less on the
        tensor cores, more keep fewer operand registers live."""
        P: tl.constexpr = 8 // DOTS
        r = tl.arange(0, P * BKW)
        w = k0 // 8 + r % BKW
        mask = m_ok[None, :] if EVEN_K else m_ok[None, :] & (w < k_hi // 8)[:, None]
        x_cols = ms[None, :] * (K // 8)
        for g in tl.static_range(DOTS):
            rows = (g * P + r // BKW) * (M * (K // 8)) + w
            xs = tl.load(xo_ptr + rows[:, None] + x_cols, mask=mask, other=0.0)
            acc = tl.dot(_operand_group(o, g, P), xs, acc)
        return acc

    @triton.jit
    def decode_range(acc, xo_ptr, inv_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, row_off, row_ok, ms,
                     m_ok, M, K, k_lo, k_hi, stride_w, stride_sn, stride_sg,
                     SCHEME: tl.constexpr, WPS: tl.constexpr, ASM: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BK: tl.constexpr,
                     DOTS: tl.constexpr):
        """acc [BN, BM] + inputs [k_lo, k_hi) of W[rows] @ xo^T, a K tile a trip, with each
        operand group's activation scale undone (the weights' operand offset is undone by
        `decode_result`). EVEN_N: every row of the tile exists (N a multiple of the tile), so
        its loads take no row mask, which the compiler would otherwise keep live across the
        K loop (sm_90, the 27B's nvfp4 config: 186 registers a thread, two programs an SM,
        against 168 and three; 2% fewer instructions a weight).

        An nvfp4 tile is one operand group, its block scales part of the dots' operands.
        A groupwise-int tile holds BK / 128 groups, each its own dots; its scales, zero points
        and activation terms scale the dots' results, so Triton's pipeline, which copies
        ahead only what feeds a dot, left them as loads in the trip that uses them, an L2 or
        DRAM round trip every 128 inputs (sm_90 SASS, Triton 3.6): they are loaded a trip
        ahead here (`_int_terms`). Two groups a tile halve the trips, each with its pipeline
        wait and bookkeeping (nvfp4 tiles of 128 inputs decoded at half the speed of 256,
        ninth run)."""
        if EVEN_N:
            row_ok = tl.full(row_ok.shape, 1, tl.int1)
        if SCHEME == _NVFP4:
            for k0 in range(k_lo, k_hi, BK):
                acc = _nv_tile(acc, xo_ptr, inv_ptr, w_ptr, s_ptr, row_off, row_ok, ms, m_ok, M,
                               K, k0, k_hi, stride_w, stride_sn, stride_sg, WPS, ASM, EVEN_K,
                               BK, DOTS)
        else:
            G: tl.constexpr = BK // _GROUP_BK_C
            terms = _int_terms(s_ptr, z_ptr, inv_ptr, xsum_ptr, row_off, row_ok, ms, m_ok, M,
                               k_lo, k_hi, stride_sn, stride_sg, G)
            for k0 in range(k_lo, k_hi, BK):
                ahead = _int_terms(s_ptr, z_ptr, inv_ptr, xsum_ptr, row_off, row_ok, ms, m_ok,
                                   M, k0 + BK, k_hi, stride_sn, stride_sg, G)
                for g in tl.static_range(G):
                    acc = _int_group(acc, xo_ptr, w_ptr, row_off, row_ok, ms, m_ok, M, K,
                                     k0 + g * _GROUP_BK_C, k_hi, stride_w, terms, g, ASM,
                                     EVEN_K, DOTS)
                terms = ahead
        return acc

    @triton.jit
    def _k_words(k0, k_hi, row_ok, G: tl.constexpr, EVEN_K: tl.constexpr):
        """The word columns of inputs [k0, k0 + G) (k0 a multiple of G) and their mask."""
        BKW: tl.constexpr = G // 8
        # k0 is a multiple of G: tell the compiler, so that the loads are 16-byte wide
        kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
        mask = row_ok[:, None]
        if not EVEN_K:
            mask = mask & (kw < k_hi // 8)[None, :]
        return kw, mask

    @triton.jit
    def _nv_tile(acc, xo_ptr, inv_ptr, w_ptr, s_ptr, row_off, row_ok, ms, m_ok, M, K, k0,
                 k_hi, stride_w, stride_sn, stride_sg, WPS: tl.constexpr, ASM: tl.constexpr,
                 EVEN_K: tl.constexpr, BK: tl.constexpr, DOTS: tl.constexpr):
        """`decode_range`'s nvfp4 tile [k0, k0 + BK)."""
        BKW: tl.constexpr = BK // 8
        BKS: tl.constexpr = BKW // WPS
        kw, w_mask = _k_words(k0, k_hi, row_ok, BK, EVEN_K)
        ks = tl.max_contiguous(tl.multiple_of(k0 // (8 * WPS) + tl.arange(0, BKS), BKS), BKS)
        s_mask = row_ok[:, None]
        if not EVEN_K:
            s_mask = s_mask & (ks < k_hi // (8 * WPS))[None, :]
        words = tl.load(w_ptr + row_off[:, None] * stride_w + kw[None, :], mask=w_mask,
                        other=0).to(tl.uint32, bitcast=True)
        sbytes = tl.load(s_ptr + row_off[:, None] * stride_sn + ks[None, :] * stride_sg,
                         mask=s_mask, other=0.0).to(tl.uint8, bitcast=True)
        inv = tl.load(inv_ptr + (k0 // BK) * M + ms, mask=m_ok, other=0.0)[None, :]
        d = _dots(nv_operands(words, _per_word(sbytes, WPS), ASM), tl.zeros(acc.shape,
                  tl.float32), xo_ptr, ms, m_ok, M, K, k0, k_hi, EVEN_K, BKW, DOTS)
        return acc + d * inv

    @triton.jit
    def _int_terms(s_ptr, z_ptr, inv_ptr, xsum_ptr, row_off, row_ok, ms, m_ok, M, k0, k_hi,
                   stride_sn, stride_sg, G: tl.constexpr):
        """The groups of the groupwise-int tile at k0 (G of them; nothing past k_hi): each
        row's scale and BIAS + zero point [BN, G], each activation row's inverse scale and
        operand sum [BM, G]."""
        group = k0 // _GROUP_BK_C + tl.arange(0, G)
        live = group < tl.cdiv(k_hi, _GROUP_BK_C)
        w_mask = row_ok[:, None] & live[None, :]
        x_mask = m_ok[:, None] & live[None, :]
        s_off = row_off[:, None] * stride_sn + group[None, :] * stride_sg
        scale = tl.load(s_ptr + s_off, mask=w_mask, other=0.0).to(tl.float32)
        offset = _INT_F16_BIAS + tl.load(z_ptr + s_off, mask=w_mask, other=0).to(tl.float32)
        x_off = group[None, :] * M + ms[:, None]
        inv = tl.load(inv_ptr + x_off, mask=x_mask, other=0.0)
        xsum = tl.load(xsum_ptr + x_off, mask=x_mask, other=0.0)
        return scale, offset, inv, xsum

    @triton.jit
    def _column(t, g: tl.constexpr, G: tl.constexpr):
        """Column g of t [R, G] (G 1, 2 or 4), as [R]."""
        if G == 1:
            column = tl.reshape(t, (t.shape[0],))
        elif G == 2:
            first, second = tl.split(t)
            column = first if g == 0 else second
        else:  # [R, 2 (g // 2), 2 (g's low bit)]
            even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
            first, second = tl.split(even if g // 2 * 2 == g else odd)
            column = first if g < 2 else second
        return column

    @triton.jit
    def _int_group(acc, xo_ptr, w_ptr, row_off, row_ok, ms, m_ok, M, K, k0, k_hi, stride_w,
                   terms, g: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                   DOTS: tl.constexpr):
        """`decode_range`'s groupwise-int group [k0, k0 + 128), group g of its tile's terms:
        d = sum(o * x) with o = q + BIAS, exact in fp16, less the zero point (and BIAS)
        times the group's sum of the same operand values, times the scale."""
        scale, offset, inv, xsum = terms
        kw, w_mask = _k_words(k0, k_hi, row_ok, _GROUP_BK_C, EVEN_K)
        words = tl.load(w_ptr + row_off[:, None] * stride_w + kw[None, :], mask=w_mask,
                        other=0).to(tl.uint32, bitcast=True)
        d = _dots(int_operands(words, ASM), tl.zeros(acc.shape, tl.float32), xo_ptr, ms, m_ok,
                  M, K, k0, k_hi, EVEN_K, _GROUP_BK_C // 8, DOTS)
        G: tl.constexpr = scale.shape[1]
        d = _column(scale, g, G)[:, None] * (d - _column(offset, g, G)[:, None]
                                             * _column(xsum, g, G)[None, :])
        return acc + d * _column(inv, g, G)[None, :]

    @triton.jit
    def decode_result(acc, SCHEME: tl.constexpr):
        """acc [BN, BM] -> [BM, BN] with the nvfp4 operand offset (e2m1 * s * 2^-14)
        undone."""
        if SCHEME == _NVFP4:
            acc = acc * _NV_F16_OUT
        return tl.trans(acc)

    @triton.jit
    def split_program(M, N, K, split_len, BM: tl.constexpr, BN: tl.constexpr):
        """A (row tile, K split) program of a skinny product out [M, N] = x [M, K] @ w^T:
        (tile, split, its BN weight rows and which exist, its BM activation rows and which
        exist, its inputs [k_lo, k_hi))."""
        return split_item(tl.program_id(0), tl.program_id(1), M, N, K, split_len, BM, BN)

    @triton.jit
    def split_item(tile, split, M, N, K, split_len, BM: tl.constexpr, BN: tl.constexpr):
        """`split_program` of the work item (row tile, K split)."""
        rows = tile * BN + tl.arange(0, BN)
        ms = tl.arange(0, BM)
        k_lo = split * split_len
        return tile, split, rows, rows < N, ms, ms < M, k_lo, tl.minimum(K, k_lo + split_len)

    @triton.jit
    def sum_parts(acc, part, parts, part_ptr, offs, part_stride, mask, counter_ptr,
                  IN_FLIGHT: tl.constexpr = _PARTS_IN_FLIGHT):
        """(whether this program holds the whole sum, that sum) of a tile computed in `parts`
        parts, this program's being acc (part `part`): each part is stored at part_ptr + part *
        part_stride + offs, and the last to arrive (the tile's arrival counter) adds them all in
        part order (the same bits whichever arrives last; IN_FLIGHT loads at a time) and sets
        the counter back to 0."""
        last = parts == 1
        total = acc
        if parts > 1:
            tl.store(part_ptr + part * part_stride + offs, acc, mask=mask)
            tl.debug_barrier()  # every thread's part is stored before the tile counts it
            last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == parts - 1
            if last:
                # a plain store: the next launch reads the counter only after this grid has
                # ended (an atomic, acq_rel by default, would add a fence to the kernel's tail)
                tl.store(counter_ptr, 0)
                total = tl.zeros(acc.shape, tl.float32)
                for j0 in range(0, parts, IN_FLIGHT):
                    for u in tl.static_range(IN_FLIGHT):
                        live = (tl.zeros(offs.shape, tl.int32) + j0 + u) < parts
                        total += tl.load(part_ptr + (j0 + u) * part_stride + offs,
                                         mask=mask & live, other=0.0, cache_modifier=".cg")
        return last, total

    @triton.jit
    def _finish_tile(acc, part, parts, part_ptr, counter_ptr, g_ptr, out_ptr, rows, row_ok, ms,
                     m_ok, M, N, SCHEME: tl.constexpr):
        """A row tile's part `part` of `parts` (acc [BM, BN], operand offsets undone) into
        out [M, N] (`sum_parts`), with the nvfp4 global scale, in out's dtype; whether this
        program stored the tile (the last part to arrive)."""
        mask = m_ok[:, None] & row_ok[None, :]
        offs = ms.to(tl.int64)[:, None] * N + rows[None, :]
        last, total = sum_parts(acc, part, parts, part_ptr, offs, M * N, mask, counter_ptr)
        if last:
            _store_output(total, g_ptr, out_ptr + offs, rows, row_ok, mask, SCHEME)
        return last

    @triton.jit
    def _store_output(acc, g_ptr, out, rows, row_ok, mask, SCHEME: tl.constexpr):
        """out = acc [BM, BN] times the nvfp4 global scale of each row, in out's dtype."""
        if SCHEME == _NVFP4:
            acc = acc * tl.load(g_ptr + rows, mask=row_ok, other=0.0)[None, :]
        tl.store(out, acc.to(out.dtype.element_ty), mask=mask)

    # not inlined, as ops.norm.gated_norm_rows (so it takes no tensors: it reads the tile back):
    # inlined, it took the default nvfp4 config from 168 to 182 registers, 3 programs an SM to 2
    @triton.jit(noinline=True)
    def _hand_on_swiglu(out_ptr, hidden_ptr, xo_ptr, inv_ptr, xsum_ptr, ticket_ptr, tile, M, N,
                        BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr,
                        HAS_SUM: tl.constexpr):
        """Once the program stored row tile `tile` of out [M, N] = [gate | up] (BN/2 gate rows
        of columns tile * BN/2 on, then their up rows N/2 later): stores silu(gate) * up into
        hidden [M, N/2] (as silu_and_mul rounds it); the last of the tiles of its operand
        group to get here writes that group of hidden's decode operand (`store_operand`, the
        bits the down GEMV's own activation pass makes) and zeroes the group's counter.
        Whether this program wrote the group."""
        HALF: tl.constexpr = BN // 2
        inter = N // 2
        ms = tl.arange(0, BM)
        m_ok = ms < M
        cols = tile * HALF + tl.arange(0, HALF)
        mask = m_ok[:, None] & (cols < inter)[None, :]
        gate_ptrs = out_ptr + ms.to(tl.int64)[:, None] * N + cols[None, :]
        tl.debug_barrier()  # the tile's stores are in before its threads read them back
        gate = tl.load(gate_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(gate_ptrs + inter, mask=mask, other=0.0,
                     cache_modifier=".cg").to(tl.float32)
        tl.store(hidden_ptr + ms.to(tl.int64)[:, None] * inter + cols[None, :],
                 silu_mul(gate, up, hidden_ptr.dtype.element_ty), mask=mask)
        return store_operand_group(hidden_ptr, ms, m_ok, M, inter, tile, tl.cdiv(inter, HALF),
                                   ticket_ptr, xo_ptr, inv_ptr, xsum_ptr, HALF, GROUP, HAS_SUM)

    @triton.jit
    def _decode_kernel(xo_ptr, inv_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, g_ptr, part_ptr,
                       counter_ptr, out_ptr, hidden_ptr, hxo_ptr, hinv_ptr, hxsum_ptr,
                       ticket_ptr, M, N, K, stride_w, stride_sn, stride_sg, split_len, splits,
                       SCHEME: tl.constexpr, WPS: tl.constexpr, BM: tl.constexpr,
                       ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, DOTS: tl.constexpr,
                       HAND_ON: tl.constexpr,
                       OUT_GROUP: tl.constexpr, OUT_SUMS: tl.constexpr,
                       PREFETCH: tl.constexpr, GDC: tl.constexpr):
        """`_decode_item` (row tile pid 0, K split pid 1 of `splits`), a program each. The
        splits are an argument, not num_programs(1): read before the K loop, that kept a
        register through it (groupwise-int's down 72 -> 80 registers, sm_90, Triton 3.6)."""
        _decode_item(tl.program_id(0), tl.program_id(1), splits, xo_ptr, inv_ptr,
                     xsum_ptr, w_ptr, s_ptr, z_ptr, g_ptr, part_ptr, counter_ptr, out_ptr,
                     hidden_ptr, hxo_ptr, hinv_ptr, hxsum_ptr, ticket_ptr, M, N, K, stride_w,
                     stride_sn, stride_sg, split_len, SCHEME, WPS, BM, ASM, EVEN_K, EVEN_N, BN,
                     BK, DOTS, HAND_ON, OUT_GROUP, OUT_SUMS, PREFETCH, GDC)

    @triton.jit
    def _decode_item(tile, pid_k, splits, xo_ptr, inv_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, g_ptr,
                     part_ptr, counter_ptr, out_ptr, hidden_ptr, hxo_ptr, hinv_ptr, hxsum_ptr,
                     ticket_ptr, M, N, K, stride_w, stride_sn, stride_sg, split_len,
                     SCHEME: tl.constexpr, WPS: tl.constexpr, BM: tl.constexpr,
                     ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, DOTS: tl.constexpr,
                     HAND_ON: tl.constexpr, OUT_GROUP: tl.constexpr, OUT_SUMS: tl.constexpr,
                     PREFETCH: tl.constexpr, GDC: tl.constexpr):
        """out[:, rows of tile `tile`] from the activation operands of `activation_kernel`,
        over K split pid_k of `splits` (`_finish_tile` adds the splits). PREFETCH: the
        program's first codes are requested into L2 before anything else. HAND_ON
        (`swiglu_decode`): a tile's rows are BN/2 gate rows and their up rows N/2 later, and
        the program that stores it hands the SiLU product on (`_hand_on_swiglu`). Whether
        this program wrote a group of that product's operand."""
        tl.static_assert(SCHEME == _NVFP4 or BK // _GROUP_BK_C * _GROUP_BK_C == BK,
                         "whole int groups a K tile")
        tile, pid_k, rows, row_ok, ms, m_ok, k_lo, k_hi = split_item(tile, pid_k, M, N, K,
                                                                     split_len, BM, BN)
        if HAND_ON:
            i = tl.arange(0, BN)
            cols = tile * (BN // 2) + i % (BN // 2)
            rows = cols + (i // (BN // 2)) * (N // 2)
            row_ok = cols < N // 2
        if PREFETCH:
            row = tl.minimum(rows, N - 1).to(tl.int64)
            prefetch_to_l2(w_ptr + row * stride_w + k_lo // 8, (k_hi - k_lo) // 2)
        # nothing is loaded before the wait: peeling the first K tile out of the loop to load
        # it there won 0.7-1.5 us a call alone but cost the 27B step 1.4-1.8 ms in the engine
        # (docs/perf.md, eleventh run)
        wait_for_inputs(GDC)
        acc = decode_range(tl.zeros((BN, BM), tl.float32), xo_ptr, inv_ptr, xsum_ptr, w_ptr,
                           s_ptr, z_ptr, rows.to(tl.int64), row_ok, ms, m_ok, M, K, k_lo, k_hi,
                           stride_w, stride_sn, stride_sg, SCHEME, WPS, ASM, EVEN_K, EVEN_N, BK,
                           DOTS)
        last = _finish_tile(decode_result(acc, SCHEME), pid_k, splits, part_ptr,
                            counter_ptr + tile, g_ptr, out_ptr, rows, row_ok, ms, m_ok, M, N,
                            SCHEME)
        wrote = last & (tile < 0)  # False
        if HAND_ON:  # noqa: SIM102 (a constexpr: no code for it when off)
            if last:
                wrote = _hand_on_swiglu(out_ptr, hidden_ptr, hxo_ptr, hinv_ptr, hxsum_ptr,
                                        ticket_ptr, tile, M, N, BM, BN, OUT_GROUP, OUT_SUMS)
        return wrote

    @triton.jit
    def _mlp_block_kernel(
        g_xo_ptr, g_inv_ptr, g_xsum_ptr, g_w_ptr, g_s_ptr, g_z_ptr, g_g_ptr, g_part_ptr,
        g_counter_ptr, g_out_ptr, g_hidden_ptr, g_hxo_ptr, g_hinv_ptr, g_hxsum_ptr,
        g_ticket_ptr, g_M, g_N, g_K, g_stride_w, g_stride_sn, g_stride_sg, g_split_len,
        g_splits, g_tiles,
        d_xo_ptr, d_inv_ptr, d_xsum_ptr, d_w_ptr, d_s_ptr, d_z_ptr, d_g_ptr, d_part_ptr,
        d_counter_ptr, d_out_ptr, d_hidden_ptr, d_hxo_ptr, d_hinv_ptr, d_hxsum_ptr,
        d_ticket_ptr, d_M, d_N, d_K, d_stride_w, d_stride_sn, d_stride_sg, d_split_len,
        d_splits, d_tiles,
        sync_ptr, G_SCHEME: tl.constexpr, G_WPS: tl.constexpr, G_BM: tl.constexpr,
        G_ASM: tl.constexpr, G_EVEN_K: tl.constexpr, G_EVEN_N: tl.constexpr,
        G_BN: tl.constexpr, G_BK: tl.constexpr, G_DOTS: tl.constexpr, G_HAND_ON: tl.constexpr,
        G_OUT_GROUP: tl.constexpr, G_OUT_SUMS: tl.constexpr, G_PREFETCH: tl.constexpr,
        D_SCHEME: tl.constexpr, D_WPS: tl.constexpr, D_BM: tl.constexpr, D_ASM: tl.constexpr,
        D_EVEN_K: tl.constexpr, D_EVEN_N: tl.constexpr, D_BN: tl.constexpr,
        D_BK: tl.constexpr, D_DOTS: tl.constexpr, D_HAND_ON: tl.constexpr,
        D_OUT_GROUP: tl.constexpr, D_OUT_SUMS: tl.constexpr, D_PREFETCH: tl.constexpr,
        GDC: tl.constexpr
    ):
        """The two GEMVs of `mlp_decode` in one launch, a work item a program (`_decode_item`):
        gate|up's items (g_*, G_*; row tile by row tile) then down's (d_*, D_*; K split by K
        split), each program taking the next from a ticket (sync_ptr[0]). A down item waits
        only until the gate|up items have written the operand groups of its K split (counted
        in sync_ptr[1 + split]); every item it waits on was taken before its own by a program
        already running, so none can wait forever, whatever the GPU keeps resident. The last
        program to take a ticket zeroes it, the last down item of a split the split's counts
        (sync_ptr[1 + d_splits + split]): all zero again for the next launch."""
        wait_for_inputs(GDC)
        g_items = g_tiles * g_splits
        items = g_items + d_tiles * d_splits
        ready_ptr = sync_ptr + 1
        done_ptr = ready_ptr + d_splits
        item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        if item == items - 1:
            tl.store(sync_ptr, 0)
        if item < g_items:
            tile = item // g_splits
            wrote = _decode_item(
                tile, item % g_splits, g_splits, g_xo_ptr, g_inv_ptr, g_xsum_ptr, g_w_ptr,
                g_s_ptr, g_z_ptr, g_g_ptr, g_part_ptr, g_counter_ptr, g_out_ptr, g_hidden_ptr,
                g_hxo_ptr, g_hinv_ptr, g_hxsum_ptr, g_ticket_ptr, g_M, g_N, g_K, g_stride_w,
                g_stride_sn, g_stride_sg, g_split_len, G_SCHEME, G_WPS, G_BM, G_ASM, G_EVEN_K,
                G_EVEN_N, G_BN, G_BK, G_DOTS, G_HAND_ON, G_OUT_GROUP, G_OUT_SUMS, G_PREFETCH,
                False)
            if wrote:
                group = tile * (G_BN // 2) // G_OUT_GROUP
                tl.debug_barrier()  # the group's operand is stored before its split counts it
                tl.atomic_add(ready_ptr + group * G_OUT_GROUP // d_split_len, 1, sem="release")
        else:
            split = (item - g_items) // d_tiles
            groups = tl.cdiv(tl.minimum(d_split_len, d_K - split * d_split_len), G_OUT_GROUP)
            while tl.atomic_add(ready_ptr + split, 0, sem="acquire") < groups:
                pass
            tl.debug_barrier()  # no thread reads the operand before the wait has ended
            _decode_item(
                (item - g_items) % d_tiles, split, d_splits, d_xo_ptr, d_inv_ptr, d_xsum_ptr,
                d_w_ptr, d_s_ptr, d_z_ptr, d_g_ptr, d_part_ptr, d_counter_ptr, d_out_ptr,
                d_hidden_ptr, d_hxo_ptr, d_hinv_ptr, d_hxsum_ptr, d_ticket_ptr, d_M, d_N, d_K,
                d_stride_w, d_stride_sn, d_stride_sg, d_split_len, D_SCHEME, D_WPS, D_BM, D_ASM,
                D_EVEN_K, D_EVEN_N, D_BN, D_BK, D_DOTS, D_HAND_ON, D_OUT_GROUP, D_OUT_SUMS,
                D_PREFETCH, False)
            if tl.atomic_add(done_ptr + split, 1, sem="relaxed") == d_tiles - 1:
                tl.store(ready_ptr + split, 0)
                tl.store(done_ptr + split, 0)

    @triton.jit
    def operand_tile(w_ptr, s_ptr, rows, row_ok, k0, stride_w, stride_sn, stride_sg,
                     BK: tl.constexpr, ASM: tl.constexpr):
        """nvfp4 weight rows `rows`, inputs [k0, k0 + BK), as tl.dot's [BN, BK] fp16 operand
        by code position, `gemm_operand`'s layout (the decode GEMV's e2m1 * s * 2^-14,
        exact)."""
        BKW: tl.constexpr = BK // 8
        kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
        ks = k0 // 16 + tl.arange(0, BKW // 2)  # a block scale per two words
        row_off = rows.to(tl.int64)
        words = tl.load(w_ptr + row_off[:, None] * stride_w + kw[None, :],
                        mask=row_ok[:, None], other=0).to(tl.uint32, bitcast=True)
        sbytes = tl.load(s_ptr + row_off[:, None] * stride_sn + ks[None, :] * stride_sg,
                         mask=row_ok[:, None], other=0.0).to(tl.uint8, bitcast=True)
        return _operand_group(nv_operands(words, _per_word(sbytes, 2), ASM), 0, 8)

    @triton.jit
    def _gemm_operand_kernel(a, stride_a, xo_ptr, inv_ptr, K, BLOCK_K: tl.constexpr,
                             KP: tl.constexpr):
        """Row program_id(0) of a [M, K] as `gemm_operand` lays it out."""
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, KP)
        x = tl.load(a + row * stride_a + k, mask=k < K, other=0.0).to(tl.float32)
        m, r = operand_scale(tl.max(tl.abs(x), axis=0))
        x = tl.reshape(tl.permute(tl.reshape(x * m, (KP // BLOCK_K, BLOCK_K // 8, 8)),
                                  (0, 2, 1)), (KP,))
        tl.store(xo_ptr + row * K + k, x.to(tl.float16), mask=k < K)
        tl.store(inv_ptr + row, r)

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_x, stride_w,
                     stride_sn, stride_sg, m_bucket, xo_ptr, inv_ptr, SCHEME: tl.constexpr,
                     WPS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                     OPERAND: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        """out [BM, BN] tile = x [BM, K] @ dequantize(W [BN, K])^T, grouped tile order so that
        GROUP_M row tiles share each weight tile while it is in L2. OPERAND (nvfp4, BK =
        OPERAND_BLOCK_K): x's rows read from its fp16 operand xo_ptr, inv_ptr
        (`gemm_operand`), the weight tiles decoded into fp16 (`operand_tile`)."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BM)
        grid_n = tl.cdiv(N, BN)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        ms = pid_m * BM + tl.arange(0, BM)
        rows = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < N
        m_ok = ms < M
        m_off = ms.to(tl.int64)[:, None]
        x_row = xo_ptr + m_off * K if OPERAND else x_ptr + m_off * stride_x
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x_mask = m_ok[:, None] if EVEN_K else m_ok[:, None] & (ks < K)[None, :]
            x = tl.load(x_row + ks[None, :], mask=x_mask, other=0.0)
            if OPERAND:
                w = operand_tile(w_ptr, s_ptr, rows, row_ok, k0, stride_w, stride_sn, stride_sg,
                                 BK, ASM)
            else:
                w = _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, stride_w, stride_sn,
                                 stride_sg, SCHEME, WPS, BK, EVEN_K, x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if OPERAND:  # the rows' operand scales
            acc = acc * tl.load(inv_ptr + ms, mask=m_ok, other=0.0)[:, None]
        if SCHEME == _NVFP4:
            g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
            acc = acc * (g * (_NV_F16_OUT if OPERAND else _NV_OUT))[None, :]
        dst = out_ptr + ms.to(tl.int64)[:, None] * N + rows[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, stride_w, stride_sn,
                        stride_sg, SCHEME: tl.constexpr, WPS: tl.constexpr,
                        GLOBAL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        EVEN_K: tl.constexpr):
        """out [BN, BK] tile of the weight, decoded as `_gemm_kernel` feeds it to tl.dot; with
        GLOBAL (nvfp4) times the rows' global scales g, rounded once from fp32 (the tile is
        exact, so (e2m1 s 2^-8)(g 2^8) is the reference's product)."""
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < N
        k0 = tl.program_id(1) * BK
        dtype = out_ptr.dtype.element_ty
        w = _weight_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, K, stride_w, stride_sn,
                         stride_sg, SCHEME, WPS, BK, EVEN_K, dtype)
        if GLOBAL:
            g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
            w = (w.to(tl.float32) * (g * _NV_OUT)[:, None]).to(dtype)
        ks = k0 + tl.arange(0, BK)
        mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (ks < K)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], w, mask=mask)

    def _even_k(args: dict) -> bool:
        return args["K"] % args["BK"] == 0

    # Autotune spaces are small on purpose: every config is compiled per kernel variant, and
    # each first holds the default (the tests' `untuned_kernels` fixture pins it). BK is a
    # multiple of 128 (one groupwise-int group). The decode kernel has its own tuner
    # (_launch_decode), which also picks the K split.
    # NOTE: tuning runs on a key's first call; warm every shape up before capturing the
    # engine's CUDA graphs.
    # prefill: dequantizing costs ~6-8 instructions per weight (~3.5-4.5 on fp16 operands),
    # shared by BM rows of MMA work, so tall tiles pay it least
    # every config fits an sm_90 SM's 227 KB of shared memory (BM 256 takes 2 stages: 169 KB;
    # at 3, 242 KB, it failed to launch after its compilation, scripts/sass_report.py --gemm)
    _GEMM_SPACE = [({"BM": bm, "BN": bn, "BK": OPERAND_BLOCK_K, "GROUP_M": 8}, w, s)
                   for bm, bn, w, s in ((128, 128, 8, 3), (256, 128, 8, 2), (128, 256, 8, 3),
                                        (64, 128, 4, 4))]
    # one tuner for both paths: the fp16-operand path's operand is laid out in K tiles of
    # OPERAND_BLOCK_K, so every config (the interpreter's too) takes that BK
    _gemm = triton.autotune(
        _configs(_GEMM_SPACE, ({"BM": 32, "BN": 64, "BK": OPERAND_BLOCK_K, "GROUP_M": 2}, 4, 1)),
        key=["m_bucket", "N", "K", "SCHEME", "OPERAND"], do_bench=_graph_bench,
        cache_results=True)(triton.heuristics({"EVEN_K": _even_k})(_gemm_kernel))
    assert all(granule(c) % c.bk == 0 and granule(c) % _SPLIT_GRANULE == 0
               for cs in DECODE_CONFIGS.values() for c in cs)
