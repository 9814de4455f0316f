"""How fast can a decode GEMV's weight stream be, before any decoding? (GPU, one call, ~2 min)

The decode kernel (`quant_linear._decode_kernel`) moves 27B weights at ~51% of the H200's
bandwidth. This separates the access pattern from the work done on it: a load-only kernel
walks the packed codes and scales exactly as the decode kernel does (a program owns BN rows
and one K split, K tiles of BK inputs: BN runs of BK/2 bytes, rows K/2 bytes apart) and only
adds the words up, so that nothing it loads can be dropped. Each 27B decode shape, nvfp4, M = 1:

- `decode`: quant_linear with its tuned plan (the real thing);
- `stream BNxBK w s t`: the load-only kernel, BN rows x BK inputs a tile, w warps,
  s pipeline stages, a K split for about t programs per SM, on the artifact's row-major codes;
- `tiled ...`: the same over codes repacked so that each [BN, BK/8] word tile is contiguous;
- `torch sum`: torch's reduction over the same bytes (the copy-bandwidth reference).

Weights rotate over copies beyond the L2; times are CUDA-graph replays. Ratios are to the
4.24 TB/s copy bandwidth, as `ninfer-bench kernels`.

    python3 scripts/stream_probe.py [--shapes gate_up,down]
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ninfer_bench.ceilings import ceilings
from ninfer_bench.kernels.linear import (
    MODELS,
    _rotating,
    _timed,
    projections,
    save_table,
    weight_bytes,
    weight_copies,
)
from ninfer_runtime.ops import quant_linear as ql
from ninfer_runtime.profiles import get_profile

# (BN, BK, warps, stages): the decode configs' tiles, then longer runs of fewer rows
TILES = ((128, 256, 4, 3), (128, 256, 4, 1), (64, 256, 4, 4), (32, 512, 4, 4),
         (16, 1024, 4, 4), (8, 1024, 2, 4), (64, 512, 8, 4), (32, 1024, 8, 4))
TARGETS = (4, 16)


@triton.jit
def _stream_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, split_len,
                   TILED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[split, row] = sum of the words and scale bytes of K split pid 1 of rows in tile
    pid 0. TILED: w is [N/BN, K/BK, BN, BK/8], each tile contiguous."""
    BKW: tl.constexpr = BK // 8
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BN + tl.arange(0, BN)
    k_lo = split * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    acc = tl.zeros((BN,), tl.int32)
    for k0 in range(k_lo, k_hi, BK):
        kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
        if TILED:
            base = (tile.to(tl.int64) * (K // BK) + k0 // BK) * (BN * BKW)
            ptrs = w_ptr + base + tl.arange(0, BN)[:, None] * BKW + tl.arange(0, BKW)[None, :]
        else:
            ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + kw[None, :]
        acc += tl.sum(tl.load(ptrs), axis=1)
        ks = tl.max_contiguous(tl.multiple_of(k0 // 16 + tl.arange(0, BK // 16), BK // 16),
                               BK // 16)
        scales = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + ks[None, :])
        acc += tl.sum(scales.to(tl.int32), axis=1)
    tl.store(out_ptr + split * N + rows, acc)


def _tiled(words: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, kw = words.shape
    return words.view(n // bn, bn, kw // (bk // 8), bk // 8).transpose(1, 2).contiguous()


def stream(words: torch.Tensor, scales: torch.Tensor, bn: int, bk: int, warps: int,
           stages: int, target: int, tiled: bool) -> torch.Tensor:
    """The load-only kernel over int32 words [N, K/8] (or their tiled copy) and uint8 scales
    [N, K/16]; returns [splits, N] sums."""
    n, k = scales.shape[0], scales.shape[1] * 16
    split_len, splits = ql.k_split(n, k, words.device, target, tile_rows=bn, granule=bk)
    out = torch.empty((splits, n), dtype=torch.int32, device=words.device)
    _stream_kernel[(n // bn, splits)](words, scales, out, n, k, k // 8, k // 16, split_len,
                                      TILED=tiled, BN=bn, BK=bk, num_warps=warps,
                                      num_stages=stages)
    return out


def _cycled(fn: Callable, args: list[tuple]) -> Callable[[], object]:
    """A call of fn on the next of `args` each time (rotating copies past the L2)."""
    cycle = itertools.cycle(args)
    return lambda: fn(*next(cycle))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="", help="substrings of the projection names")
    args = p.parse_args()
    wanted = [s for s in args.shapes.split(",") if s]
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| shape | kernel | us | % of BW |", "|---|---|---|---|"]

    def report(name: str, kernel: str, us: float, moved: int) -> None:
        lines.append(f"| {name} | {kernel} | {us:.1f} | "
                     f"{100 * moved / ceilings().bandwidth / (us * 1e-6):.1f}% |")
        print(lines[-1], flush=True)

    for name, (n, k) in projections(get_profile(MODELS["27B"]).config).items():
        if wanted and not any(s in name for s in wanted):
            continue
        ws = weight_copies("nvfp4", n, k, "cuda", gen)
        first, size = ws[0], weight_bytes(ws[0])
        shape = f"{name} {n}x{k}"
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        us = _timed(_rotating(ws, x))
        plan = ql.chosen_decode_plan(first, x)
        c = plan.config
        report(shape, f"decode BN={c.bn} BK={c.bk} w={c.warps} s={c.stages} d={c.dots} "
               f"split {plan.splits}", us, size + 2 * (n + k))
        parts = [(w.parts["weight"].view(torch.int32),
                  w.parts["weight_scale"].view(torch.uint8)) for w in ws]
        streamed = parts[0][0].numel() * 4 + parts[0][1].numel()  # one copy's codes and scales
        flat = [a.view(-1).view(torch.float32) for a, _ in parts]
        report(shape, "torch sum (codes only)", _timed(_cycled(torch.sum, [(f,) for f in flat])),
               flat[0].numel() * 4)
        for (bn, bk, warps, stages), target in itertools.product(TILES, TARGETS):
            if n % bn or k % bk:
                continue
            for tiled in (False, True):
                views = [(_tiled(a, bn, bk) if tiled else a, b) for a, b in parts]
                us = _timed(_cycled(functools.partial(stream, bn=bn, bk=bk, warps=warps,
                                                      stages=stages, target=target,
                                                      tiled=tiled), views))
                report(shape, f"{'tiled' if tiled else 'stream'} {bn}x{bk} w={warps} "
                       f"s={stages} t={target}", us, streamed)
                del views
        del ws, first, parts, flat
        torch.cuda.empty_cache()
    save_table(lines, "stream_probe.md")


if __name__ == "__main__":
    main()
