"""Candidate decode kernel for packed 4-bit linears: a CUDA-core GEMV, no tensor cores.

Same weights and operands as `quant_linear` (`_operands`: codes as int32 words [N, K/8], word w
of a row holding inputs 8w..8w+7, input 8w + j in bits 4j..4j+3), for M <= 8 activation rows.
`quant_linear`'s decode kernel pads M to 16 and multiplies on tensor cores; this one streams the
weight through CUDA-core FMAs instead, which is the layout a GEMV wants: nothing about M = 1
gets padded, every thread owns whole 16-byte words of a row, and the cross-thread reduction
happens once per program, not once per K tile.

A program owns BN output rows and one slice of K (split-K over the grid's second axis). Per K
tile it loads the words [BN, BK/8] (16-byte loads, K contiguous, a thread owning 4 adjacent
words of a row), with the next tile's loads already issued (a register prefetch: Triton's
pipeliner does not touch these loads, so num_stages changes nothing), decodes code position j
of every word at once with the fp32 decoders of `quant_linear` (`_e2m1`: AND, IMAD, AND per
code; `_uint4`: shift, LOP3), and accumulates elementwise into one [BN, BK/8] fp32
accumulator per activation row, reduced across threads once, after the K loop. The decoded
codes are reused by the BM <= 8 rows in registers, so the weight is read once for every M.
Every tensor stays in the layout of the word load (a [BN, BM, BK/8] accumulator made Triton
move each decoded code through shared memory). The scale is applied once per word, loaded
once per scale block:

- nvfp4: the decoder yields e2m1 * 2^-126, x enters as x * 2^96, the per-word sum is scaled by
  s * 2^-120 * 2^120 with s * 2^-120 the e4m3 byte shifted into fp32 bits (block scales are
  non-negative; subnormal ones stay exact): acc holds sum(e2m1 * s * x) * 2^-30 (no subnormal
  products for |x| >= 2^-96, no overflow for |x| < 2^32); the epilogue multiplies by 2^30
  and the global scale.
- groupwise-int: the decoder yields u = 1 + q/16; per word, sum((q - z) s x) =
  16s * sum(u x) - (16 + z) s * sum(x), sum(x) over the word's 8 inputs shared by every row.

sm_90 SASS (scripts/sass_report.py's method, Triton 3.9): M = 1, BN = 64, BK = 512, 4 warps:
~5.8 instructions per weight for nvfp4 (2.1 LOP3, 1.3 IMAD, 1 FFMA), ~5.1 for groupwise-int,
~245 registers, no spills, no shared memory. M = 4 costs ~13 per weight (the activations are
scalar loads per thread, M FMAs per weight): expect it to lose to the tensor-core kernel there.

Splits > 1 write fp32 partials [splits, M, N] that `quant_linear._splitk_reduce_kernel` sums
(deterministic, no zeroing, CUDA-graph safe); splits == 1 stores the output directly. The
split count is a runtime argument (one compiled kernel serves every split), M too (one kernel
per BM = next power of two of M).

This module is a candidate: `scripts/gemv_sweep.py` times it against `linear()` on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_runtime.ops.quant_linear import _NVFP4_ID, _Operands

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here runs
    triton = None

MAX_M = 8  # rows handled in one pass over the weight (accumulators grow with M)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output rows per program
    block_k: int  # inputs per K tile (a power of two, >= 64)
    split_k: int  # programs along K (the grid's second axis)
    num_warps: int
    num_stages: int

    def label(self) -> str:
        return (f"BN={self.block_n} BK={self.block_k} split={self.split_k} "
                f"w={self.num_warps} s={self.num_stages}")

    def kwargs(self) -> dict[str, int]:
        return {"block_n": self.block_n, "block_k": self.block_k, "split_k": self.split_k,
                "num_warps": self.num_warps, "num_stages": self.num_stages}


def _block_m(m: int) -> int:
    return 1 << (m - 1).bit_length()


def default_config(n: int, k: int, m: int, sm_count: int) -> GemvConfig:
    """A config for an [m, k] x [n, k]^T GEMV on a GPU with sm_count SMs.

    BK = 512 inputs: a row's tile is 256 contiguous bytes, 16 threads of 4 words each. BN keeps
    the accumulator (BN * BM * BK/8 fp32 over the program's threads) near 32 registers per
    thread. K is split until the grid has about 4 programs per SM, keeping at least two tiles
    per split so that the prefetch has something to overlap.
    """
    bm = _block_m(m)
    block_k, num_warps = 512, 4
    block_n = max(16, 64 // bm)
    tiles_n = -(-n // block_n)
    tiles_k = -(-k // block_k)
    want = -(-4 * sm_count // tiles_n)
    split_k = max(1, min(want, tiles_k // 2, 16))
    return GemvConfig(block_n, block_k, split_len_splits(k, block_k, split_k)[1], num_warps, 1)


def split_len_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(split_len, splits): K cut into at most split_k chunks of whole BK tiles."""
    tiles = -(-k // block_k)
    per_split = -(-tiles // max(1, min(split_k, tiles)))
    split_len = per_split * block_k
    return split_len, -(-k // split_len)


def gemv(x: torch.Tensor, ops: _Operands, out: torch.Tensor, *, block_n: int, block_k: int,
         split_k: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """out [M, N] = x [M, K] @ dequantize(W)^T for M <= MAX_M, fp32 accumulation, explicit
    config; ops from `quant_linear._operands`. Returns out."""
    from ninfer_runtime.ops.quant_linear import _splitk_reduce_kernel

    m, k = x.shape
    n = out.shape[1]
    assert 1 <= m <= MAX_M and x.stride(1) == 1 and out.is_contiguous(), \
        f"gemv: x {tuple(x.shape)} stride {x.stride()}, out {tuple(out.shape)}"
    assert block_k >= 64 and block_k & (block_k - 1) == 0, f"gemv: block_k={block_k}"
    split_len, splits = split_len_splits(k, block_k, split_k)
    # fp32 partials; a stand-in when there is one split (the kernel then stores out itself)
    part = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32,
                       device=x.device)
    grid = (triton.cdiv(n, block_n), splits)
    _gemv_kernel[grid](x, ops.words, ops.scale, ops.zero, ops.gscale, out, part, m, n, k,
                       x.stride(0), ops.words.stride(0), ops.scale.stride(0), split_len,
                       splits, SCHEME=ops.layout.scheme, WPS=ops.layout.words_per_scale,
                       BM=_block_m(m), BN=block_n, BK=block_k, EVEN_K=k % block_k == 0,
                       num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, ops.gscale, out, m * n, n, splits, SCHEME=ops.layout.scheme, BLOCK=block)
    return out


if triton is not None:
    from ninfer_runtime.ops.quant_linear import _e2m1, _per_word, _uint4

    _NVFP4 = tl.constexpr(_NVFP4_ID)
    # nvfp4 offsets (module docstring): decoded e2m1 * 2^-126, x * 2^96, e4m3 bits s * 2^-120;
    # acc = sum(e2m1 * s * x) * 2^-30
    _NV_X = tl.constexpr(2.0**96)
    _NV_S = tl.constexpr(2.0**120)
    _NV_OUT = tl.constexpr(2.0**30)

    @triton.jit
    def _code(words, J: tl.constexpr, SCHEME: tl.constexpr):
        """fp32 code J of every word: nvfp4 e2m1 * 2^-126, groupwise-int 1 + q/16."""
        return _e2m1(words, J) if SCHEME == _NVFP4 else _uint4(words, J)

    @triton.jit
    def _load_words(w_rows, s_rows, z_rows, row_ok, k0, k_hi, SCHEME: tl.constexpr,
                    WPS: tl.constexpr, BKW: tl.constexpr, EVEN_K: tl.constexpr):
        """Words [BN, BKW] of inputs [k0, k0 + 8 BKW) and the scale / zero byte of each word,
        all zero past k_hi (the prefetch beyond the split's last tile loads nothing)."""
        kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BKW), BKW), BKW)
        if EVEN_K:  # whole tiles: the mask is per row, so the loads stay 16 bytes wide
            mask = (row_ok & (k0 + tl.zeros_like(row_ok.to(tl.int32)) < k_hi))[:, None]
        else:
            mask = row_ok[:, None] & (kw < k_hi // 8)[None, :]
        words = tl.load(w_rows + kw[None, :], mask=mask, other=0)
        # one scale (and zero) per block of WPS words, loaded once and repeated per word
        kb = k0 // (8 * WPS) + tl.arange(0, BKW // WPS)
        s_mask = mask if EVEN_K else row_ok[:, None] & (kb < tl.cdiv(k_hi, 8 * WPS))[None, :]
        scale = _per_word(tl.load(s_rows + kb[None, :], mask=s_mask, other=0.0), WPS)
        zero = scale  # nvfp4: no zero point
        if SCHEME != _NVFP4:
            zero = _per_word(tl.load(z_rows + kb[None, :], mask=s_mask, other=0), WPS)
        return words.to(tl.uint32, bitcast=True), scale, zero

    @triton.jit
    def _row(acc, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x, m: tl.constexpr,
             M, k0, k_hi, SCHEME: tl.constexpr, BKW: tl.constexpr):
        """acc [BN, BKW] + the tile's products for one activation row, per word:
        nvfp4 mul * sum_j c_j x_j; groupwise-int mul * sum_j c_j x_j + add * sum_j x_j.
        Activation row m >= M reads zeros (its output is never stored)."""
        kw = k0 + 8 * tl.arange(0, BKW)  # input 8w + j of word w
        mask = kw < tl.where(m < M, k_hi, 0)
        x_row = x_ptr + m * stride_x
        x0 = tl.load(x_row + kw, mask=mask, other=0.0).to(tl.float32)[None, :]
        x1 = tl.load(x_row + kw + 1, mask=mask, other=0.0).to(tl.float32)[None, :]
        x2 = tl.load(x_row + kw + 2, mask=mask, other=0.0).to(tl.float32)[None, :]
        x3 = tl.load(x_row + kw + 3, mask=mask, other=0.0).to(tl.float32)[None, :]
        x4 = tl.load(x_row + kw + 4, mask=mask, other=0.0).to(tl.float32)[None, :]
        x5 = tl.load(x_row + kw + 5, mask=mask, other=0.0).to(tl.float32)[None, :]
        x6 = tl.load(x_row + kw + 6, mask=mask, other=0.0).to(tl.float32)[None, :]
        x7 = tl.load(x_row + kw + 7, mask=mask, other=0.0).to(tl.float32)[None, :]
        if SCHEME == _NVFP4:
            x0, x1, x2, x3 = x0 * _NV_X, x1 * _NV_X, x2 * _NV_X, x3 * _NV_X
            x4, x5, x6, x7 = x4 * _NV_X, x5 * _NV_X, x6 * _NV_X, x7 * _NV_X
        d = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3 + c4 * x4 + c5 * x5 + c6 * x6 + c7 * x7
        acc += d * mul
        if SCHEME != _NVFP4:
            acc += add * (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))
        return acc

    @triton.jit
    def _store_row(acc, m: tl.constexpr, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N,
                   splits, SCHEME: tl.constexpr):
        res = tl.sum(acc, axis=1)
        if SCHEME == _NVFP4:
            res = res * _NV_OUT
        mask = rows < tl.where(m < M, N, 0)
        if splits == 1:
            if SCHEME == _NVFP4:
                res = res * g
            tl.store(out_ptr + m * N + rows, res.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + (pid_k * M + m).to(tl.int64) * N + rows, res, mask=mask)

    @triton.jit(do_not_specialize=["M", "stride_s", "splits"])
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, part_ptr, M, N, K, stride_x,
                     stride_w, stride_s, split_len, splits, SCHEME: tl.constexpr,
                     WPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     EVEN_K: tl.constexpr):
        """out[:, rows] (splits == 1: final, in out's dtype) or part[pid_k, :, rows], the fp32
        partial of K slice pid_k (nvfp4: without its global scale, which the reduce applies).

        One [BN, BK/8] accumulator per activation row (BM <= 8, written out: Triton keeps
        every 2-D tensor here in the layout of the word load, so decoded codes are never
        moved between threads; a [BN, BM, BK/8] accumulator made it shuffle them through
        shared memory)."""
        BKW: tl.constexpr = BK // 8
        tl.static_assert(BM <= 8, "gemv: at most 8 activation rows")
        pid_k = tl.program_id(1)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < N
        row_off = rows.to(tl.int64)
        k_lo = pid_k * split_len
        k_hi = tl.minimum(K, k_lo + split_len)
        w_rows = w_ptr + row_off[:, None] * stride_w
        s_rows = s_ptr + row_off[:, None] * stride_s
        z_rows = z_ptr + row_off[:, None] * stride_s
        acc0 = tl.zeros((BN, BKW), tl.float32)
        acc1 = tl.zeros((BN, BKW), tl.float32)
        acc2 = tl.zeros((BN, BKW), tl.float32)
        acc3 = tl.zeros((BN, BKW), tl.float32)
        acc4 = tl.zeros((BN, BKW), tl.float32)
        acc5 = tl.zeros((BN, BKW), tl.float32)
        acc6 = tl.zeros((BN, BKW), tl.float32)
        acc7 = tl.zeros((BN, BKW), tl.float32)
        words, scale, zero = _load_words(w_rows, s_rows, z_rows, row_ok, k_lo, k_hi, SCHEME, WPS,
                                         BKW, EVEN_K)
        for k0 in range(k_lo, k_hi, BK):
            # the next tile's loads go out before this tile's arithmetic
            nxt = _load_words(w_rows, s_rows, z_rows, row_ok, k0 + BK, k_hi, SCHEME, WPS, BKW,
                              EVEN_K)
            c0, c1 = _code(words, 0, SCHEME), _code(words, 1, SCHEME)
            c2, c3 = _code(words, 2, SCHEME), _code(words, 3, SCHEME)
            c4, c5 = _code(words, 4, SCHEME), _code(words, 5, SCHEME)
            c6, c7 = _code(words, 6, SCHEME), _code(words, 7, SCHEME)
            if SCHEME == _NVFP4:
                # e4m3 byte b -> fp32 bits (b & 0x7F) << 20 = |s| * 2^-120, subnormals included
                # (block scales are non-negative: the sign bit is dropped)
                sb = (scale.to(tl.uint8, bitcast=True).to(tl.int32) & 0x7F) << 20
                mul = sb.to(tl.float32, bitcast=True) * _NV_S
                add = mul
            else:
                s = scale.to(tl.float32)
                mul = 16.0 * s
                add = -(16.0 + zero.to(tl.float32)) * s
            acc0 = _row(acc0, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        0, M, k0, k_hi, SCHEME, BKW)
            if BM > 1:
                acc1 = _row(acc1, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        1, M, k0, k_hi, SCHEME, BKW)
            if BM > 2:
                acc2 = _row(acc2, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        2, M, k0, k_hi, SCHEME, BKW)
                acc3 = _row(acc3, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        3, M, k0, k_hi, SCHEME, BKW)
            if BM > 4:
                acc4 = _row(acc4, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        4, M, k0, k_hi, SCHEME, BKW)
                acc5 = _row(acc5, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        5, M, k0, k_hi, SCHEME, BKW)
                acc6 = _row(acc6, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        6, M, k0, k_hi, SCHEME, BKW)
                acc7 = _row(acc7, c0, c1, c2, c3, c4, c5, c6, c7, mul, add, x_ptr, stride_x,
                        7, M, k0, k_hi, SCHEME, BKW)
            words, scale, zero = nxt
        g = tl.load(g_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        _store_row(acc0, 0, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
        if BM > 1:
            _store_row(acc1, 1, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
        if BM > 2:
            _store_row(acc2, 2, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
            _store_row(acc3, 3, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
        if BM > 4:
            _store_row(acc4, 4, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
            _store_row(acc5, 5, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
            _store_row(acc6, 6, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
            _store_row(acc7, 7, g, out_ptr, part_ptr, rows, row_ok, pid_k, M, N, splits, SCHEME)
