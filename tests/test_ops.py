"""Reference ops against transformers' Qwen3.5 modules or direct formulas (fp32, tiny shapes)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ninfer_runtime.ops.activation import silu_and_mul
from ninfer_runtime.ops.attention import causal_attention
from ninfer_runtime.ops.conv import causal_conv1d, causal_conv1d_update
from ninfer_runtime.ops.linear import linear, select
from ninfer_runtime.ops.moe import moe_experts, route
from ninfer_runtime.ops.norm import gated_rms_norm, rms_norm
from ninfer_runtime.ops.rope import apply_rope, rope_cos_sin
from ninfer_runtime.ops.sampling import sample
from ninfer_runtime.quant import PackedWeight, Scheme


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_is_zero_centred() -> None:
    x, w = rand(5, 32), rand(32, seed=1)
    module = hf.Qwen3_5RMSNorm(32, eps=1e-6)
    module.weight.data.copy_(w)
    close(rms_norm(x, w, 1e-6), module(x))
    close(rms_norm(x, torch.zeros(32), 1e-6), x / x.pow(2).mean(-1, keepdim=True).sqrt())


def test_gated_rms_norm_uses_plain_weight_and_silu_gate() -> None:
    x, z, w = rand(3, 4, 16), rand(3, 4, 16, seed=1), rand(16, seed=2)
    module = hf.Qwen3_5RMSNormGated(16, eps=1e-6)
    module.weight.data.copy_(w)
    close(gated_rms_norm(x, z, w, 1e-6), module(x, z))


def test_rope_rotates_only_the_rotary_dims() -> None:
    t, heads, head_dim, rotary_dim, theta = 6, 2, 16, 4, 1e7
    q, k = rand(t, heads, head_dim), rand(t, heads, head_dim, seed=1)
    positions = torch.arange(10, 10 + t)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = positions.float()[:, None] * inv_freq
    close(cos, torch.cat([angles, angles], -1).cos())
    hf_q, hf_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         cos[None], sin[None])
    close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))
    close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1))
    assert torch.equal(apply_rope(q, cos, sin)[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64}])
def test_rope_tables_are_the_formula_with_frequencies_made_once(
        monkeypatch: pytest.MonkeyPatch, scaling: dict | None) -> None:
    """The angles come from frequencies made once per arguments (a decode step makes its
    tables in three launches), and are the bits of the plain formula."""
    from ninfer_runtime.ops import rope

    monkeypatch.setattr(rope, "_INV_FREQS", {})
    made = []
    inv_freq = rope.rope_inv_freq
    monkeypatch.setattr(rope, "rope_inv_freq", lambda *a: made.append(a) or inv_freq(*a))
    positions = torch.tensor([0, 7, 100_000, 262_143])
    for _ in range(2):
        cos, sin = rope_cos_sin(positions, 16, 1e7, scaling)
    assert len(made) == 1
    freqs, factor = inv_freq(16, 1e7, scaling)
    angles = positions.float()[:, None] * torch.cat([freqs, freqs])
    assert torch.equal(cos, angles.cos() * factor) and torch.equal(sin, angles.sin() * factor)
    assert (factor == 1.0) == (scaling is None)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t, nq, d = q.shape
    s, nkv = k.shape[:2]
    out = torch.empty_like(q)
    for i in range(t):
        for h in range(nq):
            kv_head = h // (nq // nkv)
            visible = s - t + i + 1
            p = torch.softmax(k[:visible, kv_head] @ q[i, h] / math.sqrt(d), dim=0)
            out[i, h] = p @ v[:visible, kv_head]
    return out


@pytest.mark.parametrize("t,s", [(5, 5), (3, 8), (1, 7)])
def test_causal_gqa_attention_over_cached_keys(t: int, s: int) -> None:
    q, k, v = rand(t, 4, 8), rand(s, 2, 8, seed=1), rand(s, 2, 8, seed=2)
    close(causal_attention(q, k, v, 8**-0.5), naive_attention(q, k, v))


def test_conv_prefill_matches_transformers_and_decode_steps() -> None:
    t, c, kernel = 9, 6, 4
    x, w = rand(t, c), rand(c, kernel, seed=1)
    zero = torch.zeros(c, kernel - 1)
    out, state = causal_conv1d(x, w, zero)
    ref = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    close(out, ref)
    close(state, x[-(kernel - 1):].T)
    # one token at a time from the same zero state
    s, steps = zero, []
    for i in range(t):
        y, s = causal_conv1d_update(x[i], w, s)
        steps.append(y)
    close(torch.stack(steps), out)
    close(s, state)


def test_conv_prefill_continues_from_state() -> None:
    x, w = rand(10, 6), rand(6, 4, seed=1)
    whole, whole_state = causal_conv1d(x, w, torch.zeros(6, 3))
    a, s = causal_conv1d(x[:2], w, torch.zeros(6, 3))  # shorter than the state
    b, s = causal_conv1d(x[2:], w, s)
    close(torch.cat([a, b]), whole)
    close(s, whole_state)


def test_silu_and_mul() -> None:
    x = rand(3, 8)
    close(silu_and_mul(x), F.silu(x[:, :4]) * x[:, 4:])


def test_route_renormalises_top_k() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = route(logits, 2)
    assert ids.tolist() == [[3, 2]]
    close(weights, torch.tensor([[math.e / (math.e + 1), 1 / (math.e + 1)]]))


def test_moe_experts_match_per_token_loop() -> None:
    tokens, hidden, inter, experts, k = 7, 8, 6, 5, 2
    x = rand(tokens, hidden)
    gate_up, down = rand(experts, 2 * inter, hidden, seed=1), rand(experts, hidden, inter, seed=2)
    weights, ids = route(rand(tokens, experts, seed=3), k)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            e = ids[t, j]
            h = gate_up[e] @ x[t]
            expected[t] += weights[t, j] * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    close(moe_experts(x, gate_up, down, weights, ids), expected)


# A toy packed scheme (int8 codes, one fp32 scale per row): exercises the PackedWeight path of
# linear/select without depending on a real quantizer.
TOY = Scheme("toy-int8", ("weight", "weight_scale"),
             lambda shape: {"weight": (torch.int8, shape), "weight_scale": (torch.float32,
                                                                            shape[:-1])},
             lambda p: p["weight"].float() * p["weight_scale"][..., None])


def test_linear_and_select_dequantize_packed_weights() -> None:
    codes = torch.randint(-8, 8, (3, 4, 6), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int8)
    scale = rand(3, 4).abs()
    packed = PackedWeight(TOY, {"weight": codes, "weight_scale": scale}, (3, 4, 6))
    dense = codes.float() * scale[..., None]
    x = rand(2, 6)
    expert = select(packed, 1)
    assert isinstance(expert, PackedWeight) and expert.shape == (4, 6)
    close(linear(x, expert), x @ dense[1].T)
    close(linear(x, select(dense, 2)), x @ dense[2].T)


def test_sample_greedy_and_filters() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, -1.0, 4.0, 3.9]])
    assert sample(logits, temperature=0).tolist() == [1, 2]
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, temperature=5.0, top_k=1, generator=gen).tolist() == [1, 2]
    assert sample(logits, temperature=5.0, top_p=1e-3, generator=gen).tolist() == [1, 2]


def test_sample_top_k_and_top_p_restrict_support() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, 4)
    gen = torch.Generator().manual_seed(0)
    assert set(sample(logits, top_k=3, generator=gen).tolist()) == {0, 1, 2}
    assert set(sample(logits, top_p=0.75, generator=gen).tolist()) == {0, 1}
    counts = torch.bincount(sample(logits, generator=gen), minlength=4).float() / 2000
    torch.testing.assert_close(counts, probs, atol=0.04, rtol=0)


def test_sample_is_reproducible_with_a_seed() -> None:
    logits = rand(4, 50)
    draws = [sample(logits, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*draws)


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}])
def test_sample_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="invalid sampling parameters"):
        sample(torch.zeros(3), **kwargs)
