"""Where the nvfp4 decode GEMV's time goes, and which tiles it could use (GPU, one call, ~2 min).

`scripts/stream_probe.py` found that the decode kernel's access pattern alone streams 27B
weights at 75-91% of bandwidth where the kernel reaches 30-51%: the loss is in the K loop's
work. This times the decode kernel's K loop (`quant_linear.decode_range`'s parts: tile loads,
the PTX decode, the tensor-core dots) on every 27B decode shape, M = 1, in four modes:

- `full`: `quant_linear.decode_range` (what `_decode_kernel` does, less its split reduction;
  parts stored unreduced, the activation pass run once outside the timing);
- `no-dot`: loads and decode; the operands are added up instead of dotted;
- `no-decode`: loads and dots; the raw words are the fp16 operands (no PTX, no scale);
- `kernel`: `quant_linear._run_decode`, the engine's call: activation pass, `_decode_kernel`
  and its split reduction;
- `decode-only`: `_decode_kernel` alone on activation operands prepared once;
- `decode-nopdl`: the same launched without programmatic dependent launch;
- `streamk`: `full`'s K tiles in stream-K order over one program a slot (the config's
  programs an SM x the SMs; the split ignored), in one loop pipelined across row tiles: a
  program fills its pipeline once, not once a (row tile, K split), and no slot idles at a
  last wave. Is the ~2 us a work unit that the twenty-sixth and twenty-seventh runs' call
  times fit (docs/perf.md) its pipeline fill?
for the tuner's configs and the ones it dropped after this probe's runs (4 stages, BK 128;
docs/perf.md, ninth run) or a longer K tile, each at the K split for 4 and 16 programs per
SM; and the activation pass alone. Times are CUDA-graph replays over weight copies beyond the
L2, against 4.24 TB/s. (A register cap, `maxnreg` 128, was tried too: no faster.)

    python3 scripts/decode_probe.py [--shapes gate_up,down] [--modes full,no-dot,no-decode,kernel]
        [--configs 64,128,1,3,8/128,256,4,3,8] [--targets 4,16 | --splits 1-16]
    python3 scripts/decode_probe.py --modes full,streamk    # stream-K against the grid

`--configs` replaces the config list (BN,BK,warps,stages,dots each), `--splits` the K split
targets by split counts (the tenth run timed 1-16: the tuner's two targets come within 2% of
the best count on every 27B shape).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ninfer_bench.ceilings import ceilings
from ninfer_bench.kernels.linear import (
    MODELS,
    _timed,
    projections,
    save_table,
    weight_bytes,
    weight_copies,
)
from ninfer_runtime.ops import quant_linear as ql
from ninfer_runtime.ops.quant_decode import nv_operands
from ninfer_runtime.profiles import get_profile

MODES = {"full": 0, "no-dot": 1, "no-decode": 2, "kernel": 3, "decode-only": 4,
         "decode-nopdl": 5, "streamk": 6}
_STREAMK_MAXNREG = 168  # 3 programs an SM (`_streamk_kernel`)
CONFIGS = [*ql.DECODE_CONFIGS[ql._NVFP4_ID]] + [
    ql.DecodeConfig(*args) for args in (
        (128, 256, 4, 4, 8), (128, 128, 4, 4, 2), (64, 512, 4, 3, 8))]
TARGETS = (4, 16)

_RAW_PTX = tl.constexpr("\n".join(f"mov.b32 ${j}, ${8 + j % 2};" for j in range(8)))


@triton.jit
def _probe_kernel(xo_ptr, inv_ptr, w_ptr, s_ptr, part_ptr, M, N, K, stride_w, stride_s,
                  split_len, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, DOTS: tl.constexpr):
    tile, split, rows, row_ok, ms, m_ok, k_lo, k_hi = ql.split_program(M, N, K, split_len,
                                                                       BM, BN)
    BKW: tl.constexpr = BK // 8
    row_off = rows.to(tl.int64)
    acc = tl.zeros((BN, BM), tl.float32)
    fold = tl.zeros((BN, BKW), tl.float16)
    if MODE == 0:
        acc = ql.decode_range(acc, xo_ptr, inv_ptr, inv_ptr, w_ptr, s_ptr, s_ptr, row_off,
                              row_ok, ms, m_ok, M, K, k_lo, k_hi, stride_w, stride_s, 1, 0, 2,
                              True, True, True, BK, DOTS)
    else:
        for k0 in range(k_lo, k_hi, BK):
            kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
            ks = tl.max_contiguous(tl.multiple_of(k0 // 16 + tl.arange(0, BKW // 2), BKW // 2),
                                   BKW // 2)
            words = tl.load(w_ptr + row_off[:, None] * stride_w + kw[None, :])
            scale = tl.load(s_ptr + row_off[:, None] * stride_s + ks[None, :])
            sbytes = ql._per_word(scale.to(tl.uint8, bitcast=True), 2)
            if MODE == 2:
                o = tl.inline_asm_elementwise(_RAW_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                              dtype=(tl.float16,) * 8, is_pure=True, pack=2)
            else:
                o = nv_operands(words.to(tl.uint32, bitcast=True), sbytes, True)
            if MODE == 1:
                fold = fold + o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7]
            else:
                d = ql._dots(o, tl.zeros(acc.shape, tl.float32), xo_ptr, ms, m_ok, M, K, k0,
                             k_hi, True, BKW, DOTS)
                inv = tl.load(inv_ptr + (k0 // BK) * M + ms, mask=m_ok, other=0.0)[None, :]
                acc += d * inv
    if MODE == 1:
        acc += tl.sum(fold.to(tl.float32), axis=1)[:, None]
    offs = ms[None, :] * N + rows[:, None]
    tl.store(part_ptr + split * M * N + offs, acc, mask=m_ok[None, :] & row_ok[:, None])


@triton.jit
def _streamk_kernel(xo_ptr, inv_ptr, w_ptr, s_ptr, part_ptr, M, N, K, stride_w, stride_s,
                    iters, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    DOTS: tl.constexpr, ASM: tl.constexpr):
    """`full`'s K tiles in stream-K order: each of the P programs walks a contiguous 1/P of
    the (row tile, K tile) sequence, row tile-major, in one loop that Triton pipelines across
    row tiles. The weight and scale pointers step a K tile, or at a row tile's end to the
    next one's start (a uniform step: nothing is recomputed a tile); a row tile's part is
    stored at its last K tile or the program's end (parts [P, M, N], unreduced as `full`'s).
    sm_90 SASS (Triton 3.6, BN 128, 8 dots, launched with maxnreg 168): 820-851 instructions
    a K tile against `full`'s 776-793, 165 registers, 3 programs an SM (175 and 2 without the
    cap)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    BKW: tl.constexpr = BK // 8
    BKS: tl.constexpr = BKW // 2
    k_tiles = K // BK
    it_lo = pid * iters // programs
    kt = it_lo % k_tiles
    rows = it_lo // k_tiles * BN + tl.arange(0, BN)
    kw = tl.max_contiguous(tl.multiple_of(tl.arange(0, BKW), BKW), BKW)
    ks = tl.max_contiguous(tl.multiple_of(tl.arange(0, BKS), BKS), BKS)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + kt * BKW + kw[None, :]
    s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * stride_s + kt * BKS + ks[None, :]
    w_jump = BN * stride_w - (k_tiles - 1) * BKW
    s_jump = BN * stride_s - (k_tiles - 1) * BKS
    ms = tl.arange(0, BM)
    m_ok = ms < M
    acc = tl.zeros((BN, BM), tl.float32)
    for _ in range(it_lo, (pid + 1) * iters // programs):
        words = tl.load(w_ptrs).to(tl.uint32, bitcast=True)
        scale = tl.load(s_ptrs)
        o = nv_operands(words, ql._per_word(scale.to(tl.uint8, bitcast=True), 2), ASM)
        d = ql._dots(o, tl.zeros(acc.shape, tl.float32), xo_ptr, ms, m_ok, M, K, kt * BK, K,
                     True, BKW, DOTS)
        acc += d * tl.load(inv_ptr + kt * M + ms, mask=m_ok, other=0.0)[None, :]
        wrap = kt == k_tiles - 1
        last = (tl.zeros_like(ms) + kt == k_tiles - 1)[None, :]  # [1, BM], all alike
        tl.store(part_ptr + pid * M * N + ms[None, :] * N + rows[:, None], acc,
                 mask=m_ok[None, :] & last)
        acc = tl.where(last, 0.0, acc)
        w_ptrs += tl.where(wrap, w_jump, BKW)
        s_ptrs += tl.where(wrap, s_jump, BKS)
        rows = tl.where(wrap, rows + BN, rows)
        kt = tl.where(wrap, 0, kt + 1)
    tl.store(part_ptr + pid * M * N + ms[None, :] * N + rows[:, None], acc,
             mask=m_ok[None, :] & (tl.zeros_like(ms) + kt != 0)[None, :])


def _probe_call(ws: list, x: torch.Tensor, xo: torch.Tensor, inv: torch.Tensor,
                parts: torch.Tensor, c: ql.DecodeConfig, mode: int, split_len: int
                ) -> Callable[[], None]:
    """A launch in `mode` (the probe kernel, its stream-K twin, the engine's decode call or
    `_decode_kernel` alone) on the next weight copy each time; x [1, K] and its activation
    operands xo, inv, parts [splits, 1, N] fp32."""
    cycle = itertools.cycle(ws)
    splits, _, n = parts.shape
    k = x.shape[1]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if mode == MODES["kernel"]:
        plan = ql.DecodePlan(c, split_len, splits)
        return lambda: ql._run_decode(x, ql._operands(next(cycle)), out, plan)
    if mode == MODES["streamk"]:
        programs = c.per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count
        own_parts = torch.empty((programs, 1, n), dtype=torch.float32, device=x.device)

        def streamk() -> None:
            w = next(cycle)
            _streamk_kernel[(programs,)](
                xo, inv, w.parts["weight"].view(torch.int32), w.parts["weight_scale"],
                own_parts, 1, n, k, k // 8, k // 16, n // c.bn * (k // c.bk),
                BM=ql.decode_rows(1), BN=c.bn, BK=c.bk, DOTS=c.dots, ASM=True,
                num_warps=c.warps, num_stages=c.stages, maxnreg=_STREAMK_MAXNREG)
        return streamk
    if mode in (MODES["decode-only"], MODES["decode-nopdl"]):
        launch = {"GDC": False, "launch_pdl": False} if mode == MODES["decode-nopdl"] \
            else ql.options(x.device)
        counters = ql.TILE_COUNTERS.on(x.device, n // c.bn)
        part = out if splits == 1 else parts

        def decode() -> None:
            ops = ql._operands(next(cycle))
            ql._decode_kernel[(n // c.bn, splits)](
                xo, inv, inv, ops.words, ops.scale, ops.zero, ops.gscale, part, counters, out,
                out, out, out, out, counters, 1, n, k, ops.words.stride(0), *ops.scale.stride(),
                split_len, splits, HAND_ON=False, OUT_GROUP=c.bn, OUT_SUMS=False, PREFETCH=False,
                **ql.decode_tile_args(ops.layout, c, n, k, 1), **launch)
        return decode

    def call() -> None:
        w = next(cycle)
        _probe_kernel[(n // c.bn, splits)](
            xo, inv, w.parts["weight"].view(torch.int32), w.parts["weight_scale"], parts, 1, n,
            k, k // 8, k // 16, split_len, MODE=mode, BM=ql.decode_rows(1), BN=c.bn, BK=c.bk,
            DOTS=c.dots, num_warps=c.warps, num_stages=c.stages)
    return call


def _split(k: int, bk: int, count: int) -> tuple[int, int] | None:
    """(split_len, splits) cutting K into `count` chunks of whole K tiles, None if it can't."""
    split_len = triton.cdiv(triton.cdiv(k, count), bk) * bk
    return (split_len, count) if triton.cdiv(k, split_len) == count else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="", help="substrings of the projection names")
    p.add_argument("--modes", default="full,kernel,decode-only,decode-nopdl")
    p.add_argument("--configs", default="", help="BN,BK,warps,stages,dots/... (default: ours)")
    p.add_argument("--targets", default=",".join(map(str, TARGETS)),
                   help="programs per SM the K split aims at")
    p.add_argument("--splits", default="", help="K split counts instead: 1-16 or 2,3,7")
    args = p.parse_args()
    configs = [ql.DecodeConfig(*map(int, c.split(","))) for c in args.configs.split("/") if c] \
        or CONFIGS
    lo, dash, hi = args.splits.partition("-")
    counts = list(range(int(lo), int(hi) + 1)) if dash else \
        [int(s) for s in args.splits.split(",") if s]
    targets = [int(t) for t in args.targets.split(",")]
    wanted = [s for s in args.shapes.split(",") if s]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| shape | mode | config | splits | us | % of BW |", "|---|---|---|---|---|---|"]
    for name, (n, k) in projections(get_profile(MODELS["27B"]).config).items():
        if wanted and not any(s in name for s in wanted):
            continue
        ws = weight_copies("nvfp4", n, k, "cuda", gen)
        size = weight_bytes(ws[0])
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        us = _timed(lambda: ql.activation_operands(x, 256, False))  # noqa: B023 (called here)
        lines.append(f"| {name} {n}x{k} | activation pass | BK=256 | | {us:.1f} | |")
        print(lines[-1], flush=True)
        grids = [(c, split) for c in configs for split in dict.fromkeys(
            _split(k, c.bk, s) for s in counts) if split] if counts else \
            [(c, ql.k_split(n, k, x.device, t, granule=c.bk)) for c in configs for t in targets]
        streamed = set()  # configs timed in stream-K order, which no split changes
        for (c, (split_len, splits)), mode in itertools.product(grids, args.modes.split(",")):
            if n % c.bn or k % c.bk or (mode == "streamk" and c in streamed):
                continue
            if mode == "streamk":
                streamed.add(c)
                splits = "stream"
            op = ql.activation_operands(x, c.bk, False)
            xo, inv = op.xo, op.inv
            parts = torch.empty((1 if mode == "streamk" else splits, 1, n), dtype=torch.float32,
                                device="cuda")
            call = _probe_call(ws, x, xo, inv, parts, c, MODES[mode], split_len)
            try:
                us = _timed(call)
            except Exception as e:  # a config that does not compile or fit: say so, go on
                lines.append(f"| {name} | {mode} | {c} | {splits} | {type(e).__name__} | |")
                print(lines[-1], flush=True)
                continue
            lines.append(f"| {name} {n}x{k} | {mode} | BN={c.bn} BK={c.bk} w={c.warps} "
                         f"s={c.stages} d={c.dots} | {splits} | {us:.1f} "
                         f"| {100 * size / ceilings().bandwidth / (us * 1e-6):.1f}% |")
            print(lines[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    save_table(lines, "decode_probe.md")


if __name__ == "__main__":
    main()
