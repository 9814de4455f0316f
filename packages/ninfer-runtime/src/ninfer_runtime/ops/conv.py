"""Causal depthwise conv1d (+ SiLU) of the GDN layer, with a rolling conv state.

The conv state of one sequence holds the last K-1 *pre-activation* inputs, [C, K-1], oldest
first; a fresh sequence starts from zeros, which equals the zero left-padding of a plain causal
conv. Both forms apply SiLU to the conv output, as the fused kernels do.

The Triton kernel runs the varlen op: one program per (time tile of a sequence, channel
block), tiles aligned to each sequence's start (ops.varlen), so a prompt chunk's rows spread
over the whole GPU (one program walking a sequence's rows, as before, kept ~160 programs of a
27B step busy, spilled registers, and ran the 8K prefill's convs at ~10% of bandwidth:
docs/perf.md). Only a sequence's first tile reads rows before the segment start, from the
slot's conv state (a tile holds at least the K-1 rows the taps reach back): its first K-1
rows are a small tile of their own, the rest of every tile reads x alone. That program also
rewrites the state: the new state is the segment's last K-1 inputs, read from x (or, for a
segment shorter than K-1, one tile, from x and the old state), and the read-then-overwrite
needs no ordering between programs, only a barrier inside one. Every row adds its taps in
the same order, so its bits do not depend on where the chunks cut the prompt. `conv_input`,
`conv_silu_at` and the first token's split of the latter (`conv_first_taps`, `conv_own_row`,
`conv_silu_taps`: loads apart from the math) serve the fused GDN decode kernel (ops.gdn).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.varlen import num_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references still run
    triton = None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill form: x [T, C], weight [C, K], state [C, K-1] -> (silu(conv) [T, C], new state).

    out[t, c] = sum_j weight[c, j] * xs[t + j, c] over xs = [state^T ; x] (K-1+T rows).
    """
    kernel = weight.shape[-1]
    xs = torch.cat([state.transpose(0, 1).to(x.dtype), x], dim=0)  # [K-1+T, C]
    # conv1d wants [batch, C, len]; groups=C makes it depthwise, no padding as xs carries it.
    out = F.conv1d(xs.transpose(0, 1)[None].float(), weight.float()[:, None, :],
                   groups=weight.shape[0])[0].transpose(0, 1)
    new_state = xs[-(kernel - 1):].transpose(0, 1).to(state.dtype)
    return F.silu(out).to(x.dtype), new_state


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode form for one new token per sequence: x [..., C], state [..., C, K-1].

    Returns (silu(conv) [..., C], new state [..., C, K-1]); leading dims batch sequences.
    """
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [..., C, K]
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out).to(x.dtype), window[..., 1:].to(state.dtype)


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                             cu_seqlens: torch.Tensor, slots: torch.Tensor,
                             split: Sequence[int] | None = None,
                             ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Reference of `causal_conv1d_varlen`: a host loop over the sequences."""
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if hi - lo == 1:
            out[lo], states[slot] = causal_conv1d_update(x[lo], weight, states[slot])
        else:
            out[lo:hi], states[slot] = causal_conv1d(x[lo:hi], weight, states[slot])
    if split is None:
        return out
    return tuple(part.contiguous() for part in out.split(list(split), dim=-1))


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                         cu_seqlens: torch.Tensor, slots: torch.Tensor,
                         split: Sequence[int] | None = None,
                         ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Several sequences back to back, each continuing from its slot of a state pool.

    x [N, C] (rows may be strided, channels contiguous) holds sequence b at rows
    cu_seqlens[b] .. cu_seqlens[b+1] ([B+1]); its conv state is states[slots[b]] (states
    [num_slots, C, K-1], slots [B]), which this replaces. A one-token sequence takes the decode
    form, a longer one the prefill form (the kernel does both in one launch). Returns [N, C],
    or with `split` (channel counts summing to C, at most three: the GDN layer's q | k | v)
    one contiguous [N, c] tensor per part, written there directly: fla-core's kernels copy
    strided views to contiguous ones first (three copies a layer, 11 ms of the 27B's 8K
    prompt step, docs/perf.md, twentieth run).
    """
    if split is not None and (sum(split) != x.shape[1] or not 1 <= len(split) <= 3):
        raise ValueError(f"split {tuple(split)} must be one to three parts of {x.shape[1]} "
                         "channels")
    if not use_triton(x, weight, states, cu_seqlens, slots):
        return causal_conv1d_varlen_ref(x, weight, states, cu_seqlens, slots, split)
    return _launch_conv_varlen(x, weight, states, cu_seqlens, slots, split)


def check_conv_args(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                    cu_seqlens: torch.Tensor, slots: torch.Tensor) -> None:
    """Launcher preconditions shared with the fused GDN decode kernel."""
    channels, kernel = weight.shape
    assert x.dim() == 2 and x.shape[1] == channels and x.stride(1) == 1, \
        f"conv input must be [N, {channels}] with contiguous channels, got {tuple(x.shape)}"
    assert weight.stride(1) == 1, "conv weight [C, K] needs contiguous taps"
    assert states.shape[1:] == (channels, kernel - 1), \
        f"conv states {tuple(states.shape)} do not match weight {tuple(weight.shape)}"
    assert states.dtype == x.dtype, f"conv states are {states.dtype}, input {x.dtype}"
    assert cu_seqlens.dtype == slots.dtype == torch.int64, "cu_seqlens and slots are int64"
    assert cu_seqlens.is_contiguous() and slots.is_contiguous()
    assert cu_seqlens.shape[0] == slots.shape[0] + 1, "cu_seqlens is [B+1] for slots [B]"


def _launch_conv_varlen(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                        cu_seqlens: torch.Tensor, slots: torch.Tensor,
                        split: Sequence[int] | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    check_conv_args(x, weight, states, cu_seqlens, slots)
    channels, kernel = weight.shape
    rows = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # out holds each part as a flat [rows, width] block from (its first channel) * rows on;
    # the kernel takes the second and third parts' first channels (C for parts that are not),
    # and a channel block never straddles two parts (so its stores stay vectorized)
    ends = list(accumulate(split or [channels]))
    second, third = ends[:-1] + [channels] * (3 - len(ends))
    block_c = _CONV_CHANNELS
    while any(first % block_c for first in ends[:-1]):
        block_c //= 2
    assert kernel - 1 <= _CONV_ROWS, "a time tile must hold the rows the taps reach back"
    seqs = slots.shape[0]
    grid = (num_blocks(rows, seqs, _CONV_ROWS), triton.cdiv(channels, block_c))
    _conv_varlen_kernel[grid](
        x, weight, states, out, cu_seqlens, slots, seqs, channels, rows, second, third,
        x.stride(0), weight.stride(0), *states.stride(), K=kernel,
        KP=triton.next_power_of_2(kernel), BLOCK_T=_CONV_ROWS, BLOCK_C=block_c, num_warps=4)
    if split is None:
        return out
    flat = out.view(-1)
    return tuple(flat[first * rows:end * rows].view(rows, end - first)
                 for first, end in zip([0, *ends[:-1]], ends, strict=True))


# a program's tile: 32 rows of one sequence by 64 channels, 4 warps (Triton 3.6, sm_90: 122
# registers, 4 programs an SM; 64 x 64 over 8 warps: 121, 2)
_CONV_ROWS = 32
_CONV_CHANNELS = 64


if triton is not None:
    from ninfer_runtime.ops.varlen import block_of

    @triton.jit
    def conv_input(x_ptr, stride_x, state_ptr, stride_sc, stride_sk, src, lo, ch, mask,
                   K: tl.constexpr):
        """xs[src] of channels ch (broadcast together), fp32: the pre-conv input at absolute
        row src, rows before the segment start lo read from the conv state at state_ptr (the
        slot's base), whose column K-1 - (lo - src) holds row src."""
        in_state = src < lo
        s = tl.load(state_ptr + ch * stride_sc + (src - lo + K - 1) * stride_sk,
                    mask=mask & in_state, other=0.0)
        x = tl.load(x_ptr + src.to(tl.int64) * stride_x + ch, mask=mask & (src >= lo),
                    other=0.0)
        return s.to(x_ptr.dtype.element_ty).to(tl.float32) + x.to(tl.float32)

    @triton.jit
    def silu_rounded(y, dtype: tl.constexpr):
        """silu(y) rounded to dtype (as the reference stores the conv output) and back."""
        return (y * tl.sigmoid(y)).to(dtype).to(tl.float32)

    @triton.jit
    def conv_silu_at(x_ptr, stride_x, w_ptr, stride_w, state_ptr, stride_sc, stride_sk, t, lo,
                     ch, cmask, K: tl.constexpr, KP: tl.constexpr):
        """silu(conv) of row t for channels ch [CH] -> [CH] fp32 (the decode step)."""
        j = tl.arange(0, KP)[:, None]
        valid = (j < K) & cmask[None, :]
        xs = conv_input(x_ptr, stride_x, state_ptr, stride_sc, stride_sk, t - (K - 1) + j, lo,
                        ch[None, :], valid, K)
        w = tl.load(w_ptr + ch[None, :] * stride_w + j, mask=valid, other=0.0)
        return _silu_of_taps(xs, w, x_ptr.dtype.element_ty)

    @triton.jit
    def _silu_of_taps(xs, w, dtype: tl.constexpr):
        """silu(sum over taps of xs * w) [KP, CH] -> [CH], rounded to dtype (and back)."""
        return silu_rounded(tl.sum(xs * w.to(tl.float32), axis=0), dtype)

    @triton.jit
    def conv_first_taps(w_ptr, stride_w, state_ptr, stride_sc, stride_sk, ch, cmask,
                        K: tl.constexpr, KP: tl.constexpr):
        """(weights, state taps) [KP, CH] of a segment's first row for channels ch: the
        weights and the K-1 earlier rows from the conv state (the last tap, the row's own,
        zero): what no kernel of a decode step writes, so they may load before the PDL wait
        (`conv_silu_taps` then adds the row's own, `conv_own_row`)."""
        j = tl.arange(0, KP)[:, None]
        w = tl.load(w_ptr + ch[None, :] * stride_w + j, mask=(j < K) & cmask[None, :],
                    other=0.0)
        s = tl.load(state_ptr + ch[None, :] * stride_sc + j * stride_sk,
                    mask=(j < K - 1) & cmask[None, :], other=0.0)
        return w, s

    @triton.jit
    def conv_own_row(x_ptr, stride_x, t, ch, cmask, K: tl.constexpr, KP: tl.constexpr):
        """Row t's own inputs as the last tap [KP, CH] (zeros at the others)."""
        j = tl.arange(0, KP)[:, None]
        return tl.load(x_ptr + t.to(tl.int64) * stride_x + ch[None, :] + j * 0,
                       mask=(j == K - 1) & cmask[None, :], other=0.0)

    @triton.jit
    def conv_silu_taps(w, s, x, dtype: tl.constexpr):
        """`conv_silu_at` of a segment's first row from `conv_first_taps` and
        `conv_own_row`: the same taps, sums and rounding."""
        return _silu_of_taps(s.to(dtype).to(tl.float32) + x.to(tl.float32), w, dtype)

    @triton.jit
    def store_conv_window(x_ptr, stride_x, state_ptr, dst_ptr, stride_sc, stride_sk, t, lo,
                          ch, cmask, K: tl.constexpr, KP: tl.constexpr):
        """Write the conv state after row t (xs rows t-K+2 .. t) of channels ch to dst_ptr.

        dst may be the slot read from (state_ptr): everything is loaded before a barrier and
        stored after it, as other threads of the program may still read what is overwritten.
        """
        j = tl.arange(0, KP)[None, :]
        mask = (j < K - 1) & cmask[:, None]
        window = conv_input(x_ptr, stride_x, state_ptr, stride_sc, stride_sk, t - (K - 2) + j,
                            lo, ch[:, None], mask, K)
        tl.debug_barrier()
        tl.store(dst_ptr + ch[:, None] * stride_sc + j * stride_sk,
                 window.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv_rows(x_ptr, stride_x, w_ptr, stride_w, state_ptr, stride_sc, stride_sk, rows,
                   lo, ch, cmask, mask, K: tl.constexpr, STATE: tl.constexpr):
        """conv of rows [R] for channels ch [CH] -> [R, CH] fp32 (mask: [R, CH]), the taps
        added in order.

        STATE: some rows reach back before the segment start lo, into the conv state;
        otherwise every tap of the masked rows lies in the segment and only x is read (no
        state addresses: they took the tile from 119 to 208 registers a thread, Triton 3.6,
        sm_90, 8 warps)."""
        acc = tl.zeros(mask.shape, dtype=tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + ch * stride_w + j, mask=cmask, other=0.0).to(tl.float32)
            src = rows[:, None] + j - (K - 1)
            if STATE:
                xs = conv_input(x_ptr, stride_x, state_ptr, stride_sc, stride_sk, src, lo,
                                ch[None, :], mask, K)
            else:
                xs = tl.load(x_ptr + src.to(tl.int64) * stride_x + ch[None, :], mask=mask,
                             other=0.0).to(tl.float32)
            acc += xs * w[None, :]
        return acc

    @triton.jit
    def _part_offsets(rows, c0, ch, N, C, SECOND, THIRD):
        """[R, CH] offsets of rows x channels (ch: the channel block from c0, within one part)
        in the flat output of N rows whose channels split into parts at SECOND and THIRD (C: no
        such part), each a row-major [N, width] block starting at its first channel times N
        (one part: [N, C] itself). The part is found from c0, a scalar, so that the offsets
        stay contiguous along ch for the compiler."""
        first = tl.where(c0 >= THIRD, THIRD, tl.where(c0 >= SECOND, SECOND, 0))
        end = tl.where(c0 >= THIRD, C, tl.where(c0 >= SECOND, THIRD, SECOND))
        return first.to(tl.int64) * N + rows.to(tl.int64)[:, None] * (end - first) + \
            (ch - first)[None, :]

    @triton.jit
    def _conv_varlen_kernel(x_ptr, w_ptr, states_ptr, out_ptr, cu_ptr, slot_ptr, num_seqs, C,
                            N, SECOND, THIRD, stride_x, stride_w, stride_ss, stride_sc, stride_sk,
                            K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        """Program (time tile, channel block): see the module docstring. The first tile's
        first K-1 rows, whose taps reach into the conv state, are a small tile of their own.
        Channels SECOND .. and THIRD .. go to parts of their own (`_part_offsets`)."""
        seq, t0 = block_of(cu_ptr, tl.program_id(0), num_seqs, BLOCK_T)
        lo, hi = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
        if t0 >= hi:  # a spare program (or an empty segment, whose state stays)
            return
        state_ptr = states_ptr + tl.load(slot_ptr + seq) * stride_ss
        c0 = tl.program_id(1) * BLOCK_C
        ch = c0 + tl.arange(0, BLOCK_C)
        cmask = ch < C
        rows = t0 + tl.arange(0, BLOCK_T)
        body = (rows < hi) & (rows >= lo + K - 1)
        acc = _conv_rows(x_ptr, stride_x, w_ptr, stride_w, state_ptr, stride_sc, stride_sk,
                         rows, lo, ch, cmask, body[:, None] & cmask[None, :], K, False)
        tl.store(out_ptr + _part_offsets(rows, c0, ch, N, C, SECOND, THIRD),
                 (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty),
                 mask=body[:, None] & cmask[None, :])
        if t0 == lo:  # the first tile, the only reader of the old state
            head = lo + tl.arange(0, KP)
            live = (head < hi) & (head < lo + K - 1)
            mask = live[:, None] & cmask[None, :]
            head_acc = _conv_rows(x_ptr, stride_x, w_ptr, stride_w, state_ptr, stride_sc,
                                  stride_sk, head, lo, ch, cmask, mask, K, True)
            tl.store(out_ptr + _part_offsets(head, c0, ch, N, C, SECOND, THIRD),
                     (head_acc * tl.sigmoid(head_acc)).to(out_ptr.dtype.element_ty), mask=mask)
            store_conv_window(x_ptr, stride_x, state_ptr, state_ptr, stride_sc, stride_sk,
                              hi - 1, lo, ch, cmask, K, KP)
