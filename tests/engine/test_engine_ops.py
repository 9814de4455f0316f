"""The engine's ops: INT8 group-64 KV quantization, paged KV store + attention, and the GDN ops
that continue several sequences from their state slots."""

from __future__ import annotations

import pytest
import torch

from ninfer_runtime.ops.attention import causal_attention, gather_kv, paged_attention, store_kv
from ninfer_runtime.ops.conv import causal_conv1d, causal_conv1d_update, causal_conv1d_varlen
from ninfer_runtime.ops.gdn import (
    chunk_gated_delta_rule,
    gated_delta_rule_varlen,
    gdn_gating,
    recurrent_gated_delta_rule,
)
from ninfer_runtime.ops.kv_quant import dequantize_int8, kv_group_size, quantize_int8


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int8_group_quantization_error_is_half_a_step() -> None:
    x = rand(5, 3, 256)
    x[0, 0, :64] *= 1000.0  # groups of very different magnitudes
    x[1, 2, 64:128] *= 1e-3
    x[2, 1, 128:192] = 0.0  # an all-zero group
    q, scale = quantize_int8(x, 64)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float16 and scale.shape == (5, 3, 4)
    peaks = q.abs().unflatten(-1, (4, 64)).amax(-1)  # each group's largest value hits 127
    assert q.min() >= -127 and (peaks == 127).sum() == peaks.numel() - 1 and peaks[2, 1, 2] == 0
    deq = dequantize_int8(q, scale, torch.float32)
    err = (deq - x).abs().unflatten(-1, (4, 64))
    step = scale.float()[..., None]
    assert (err <= step / 2 + 1e-7).all()
    absmax = x.abs().unflatten(-1, (4, 64)).amax(-1, keepdim=True)
    assert (err <= absmax / 254 * (1 + 2**-9) + 1e-7).all()  # relative to the group's range
    assert torch.equal(deq[2, 1, 128:192], torch.zeros(64)) and scale[2, 1, 2] == 0
    assert deq.dtype == torch.float32
    assert dequantize_int8(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_kv_group_size() -> None:
    assert kv_group_size(256) == 64 and kv_group_size(128) == 64
    assert kv_group_size(32) == 32  # small test heads: one group per head
    with pytest.raises(ValueError, match="not a multiple"):
        kv_group_size(96)


PAGE, NKV, NQ, D, PAGES = 4, 2, 4, 32, 16


def paged_caches(int8: bool) -> tuple[torch.Tensor, ...]:
    shape = (PAGES, PAGE, NKV, D)
    if not int8:
        return torch.zeros(shape), torch.zeros(shape), None, None
    scales = (PAGES, PAGE, NKV, D // kv_group_size(D))
    return (torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
            torch.zeros(scales, dtype=torch.float16), torch.zeros(scales, dtype=torch.float16))


def slots_of(pages: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(start, end)])


@pytest.mark.parametrize("int8", [False, True])
def test_paged_attention_equals_attention_over_the_whole_sequence(int8: bool) -> None:
    """Three sequences on scattered pages: a prompt chunk continuing 6 cached tokens, one
    decode token after 12, a whole 14-token prompt; their earlier K/V stored in a previous
    call, the new ones in this call, as the engine does."""
    caches = paged_caches(int8)
    tables = [[9, 2, 14], [0, 7, 3, 11], [5, 1, 12, 4]]
    context, query = [9, 13, 14], [3, 1, 14]
    ks = [rand(n, NKV, D, seed=10 + b) * 3 for b, n in enumerate(context)]
    vs = [rand(n, NKV, D, seed=20 + b) for b, n in enumerate(context)]
    qs = [rand(n, NQ, D, seed=30 + b) for b, n in enumerate(query)]
    for b in range(3):  # the tokens before this step
        old = context[b] - query[b]
        if old:
            store_kv(ks[b][:old], vs[b][:old], *caches, slots_of(tables[b], 0, old))
    new_slots = torch.cat([slots_of(tables[b], context[b] - query[b], context[b])
                           for b in range(3)])
    store_kv(torch.cat([k[-n:] for k, n in zip(ks, query, strict=True)]),
             torch.cat([v[-n:] for v, n in zip(vs, query, strict=True)]), *caches, new_slots)
    page_tables = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    cu = torch.tensor([0, 3, 4, 18])
    out = paged_attention(torch.cat(qs), *caches, page_tables, cu, torch.tensor(context),
                          D**-0.5)
    assert out.shape == (18, NQ, D)
    group = kv_group_size(D)
    for b in range(3):
        k, v = ks[b], vs[b]
        if int8:  # the reference sees what the cache holds
            k = dequantize_int8(*quantize_int8(k, group), torch.float32)
            v = dequantize_int8(*quantize_int8(v, group), torch.float32)
        stored = gather_kv(caches[0], caches[2], torch.tensor(tables[b]), context[b],
                           torch.float32)
        assert torch.equal(stored, k)
        expected = causal_attention(qs[b], k, v, D**-0.5)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], expected, rtol=1e-5, atol=1e-5)
        if int8:  # and that stays close to exact attention
            exact = causal_attention(qs[b], ks[b], vs[b], D**-0.5)
            assert (out[cu[b]:cu[b + 1]] - exact).abs().max() < 0.05


def test_gdn_varlen_ops_continue_each_sequence_from_its_slot() -> None:
    """One decode token and two prompt chunks, on slots 3, 0, 2 of a 4-slot pool: each equals
    the single-sequence op from the same state; slot 1 (not in the batch) is untouched."""
    nk, nv, dk, dv, c, kernel = 2, 4, 8, 6, 10, 4
    lens, slots = [1, 5, 70], [3, 0, 2]
    n = sum(lens)
    cu = torch.tensor([0, 1, 6, 76])
    x, weight = rand(n, c), rand(c, kernel, seed=1)
    conv_states = rand(4, c, kernel - 1, seed=2)
    q, k = rand(n, nk, dk, seed=3), rand(n, nk, dk, seed=4)
    v = rand(n, nv, dv, seed=5)
    g, beta = gdn_gating(rand(n, nv, seed=6), rand(n, nv, seed=7), torch.zeros(nv),
                         torch.zeros(nv))
    states = rand(4, nv, dk, dv, seed=8)
    conv_before, states_before = conv_states.clone(), states.clone()

    conv_out = causal_conv1d_varlen(x, weight, conv_states, cu, torch.tensor(slots))
    out = gated_delta_rule_varlen(q, k, v, g, beta, states, cu, torch.tensor(slots))
    for b, slot in enumerate(slots):
        lo, hi = cu[b].item(), cu[b + 1].item()
        if hi - lo == 1:
            y, s = causal_conv1d_update(x[lo], weight, conv_before[slot])
            o, r = recurrent_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                              beta[lo:hi], states_before[slot])
        else:
            y, s = causal_conv1d(x[lo:hi], weight, conv_before[slot])
            o, r = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                          beta[lo:hi], states_before[slot])
        assert torch.equal(conv_out[lo:hi], y.reshape(hi - lo, c))
        assert torch.equal(conv_states[slot], s)
        assert torch.equal(out[lo:hi], o) and torch.equal(states[slot], r)
    assert torch.equal(conv_states[1], conv_before[1]) and torch.equal(states[1], states_before[1])
