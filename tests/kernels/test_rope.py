"""The fused q/k norm + partial RoPE kernel against its torch reference (rms_norm_ref then
apply_rope), on q and k cut from a fused qkv projection output as gated attention does."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, DTYPES, check, empty_caches, kernels, rand  # noqa: F401

from ninfer_runtime.config import rope_scaling
from ninfer_runtime.ops.attention import KVStore, store_kv
from ninfer_runtime.ops.norm import rms_norm_ref
from ninfer_runtime.ops.rope import (
    norm_rope,
    norm_rope_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    qk_norm_rope_store,
    rope_cos_sin,
)

pytestmark = pytest.mark.usefixtures("kernels")


def check_rope(actual: torch.Tensor, expected: torch.Tensor) -> None:
    check(actual, expected, atol_steps=2)


def projected_qk(t: int, nq: int, nkv: int, hd: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, nq, hd] and k [t, nkv, hd] as views into one [t, nq*2*hd + 2*nkv*hd] output."""
    qkv = rand(t, 2 * nq * hd + 2 * nkv * hd, dtype=dtype) * 2
    q_gate, k, _ = qkv.split([2 * nq * hd, nkv * hd, nkv * hd], dim=-1)
    return q_gate.reshape(t, nq, 2 * hd)[..., :hd], k.reshape(t, nkv, hd)


# (tokens, nq, nkv, head_dim, rotary_dim): decode at the real head shape, a prompt chunk with
# many rows per program, a head_dim that is not a power of two
CASES = [(1, 24, 4, 256, 64), (37, 4, 2, 64, 16), (5, 3, 1, 48, 12)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_qk_norm_rope(case: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    t, nq, nkv, hd, rot = case
    q, k = projected_qk(t, nq, nkv, hd, dtype)
    qw, kw = rand(hd, seed=1, dtype=dtype) * 0.1, rand(hd, seed=2, dtype=dtype) * 0.1
    positions = torch.randint(0, 300_000, (t,), generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(positions.to(DEVICE), rot, 1e7)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    q_ref, k_ref = qk_norm_rope_ref(q, k, qw, kw, cos, sin, 1e-6)
    check_rope(q_out, q_ref)
    check_rope(k_out, k_ref)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    # past rotary_dim the kernel stores the norm output itself
    check_rope(q_out[..., rot:], rms_norm_ref(q, qw, 1e-6)[..., rot:])


# (tokens, nq, nkv, head_dim, rotary_dim, int8 cache): decode at the 27B's head shape, a prompt
# chunk of 2-head tokens (several tokens a program), a bf16 cache; 3 kv heads (not a power of
# two) take qk_norm_rope then store_kv
STORE_CASES = [(1, 24, 4, 256, 64, True), (37, 4, 2, 64, 16, True), (9, 4, 2, 32, 32, False),
               (5, 6, 3, 64, 16, True)]


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("case", STORE_CASES)
def test_qk_norm_rope_store_is_qk_norm_rope_then_store_kv(
        case: tuple[int, int, int, int, int, bool], with_q: bool) -> None:
    """The same q rows and caches, bit for bit, in one launch (keys alone without q, as the
    DFlash draft's context); a negative slot (a captured graph's padding row) is skipped."""
    t, nq, nkv, hd, rot, int8 = case
    dtype = DTYPES[0]
    q, k = projected_qk(t, nq, nkv, hd, dtype)
    v = rand(t, 2 * nkv * hd, seed=4, dtype=dtype)[:, nkv * hd:].unflatten(1, (nkv, hd))
    qw, kw = rand(hd, seed=1, dtype=dtype) * 0.1, rand(hd, seed=2, dtype=dtype) * 0.1
    positions = torch.randint(0, 300_000, (t,), generator=torch.Generator().manual_seed(3))
    cos, sin = rope_cos_sin(positions.to(DEVICE), rot, 1e7)
    pages, page = 4, 16
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(0))[:t]
    if t > 1:
        slots[t // 2] = -1
    slots = slots.to(DEVICE)
    got = empty_caches(pages, page, nkv, hd, int8, dtype)
    q_got = qk_norm_rope_store(q if with_q else None, k, v, qw if with_q else None, kw, cos,
                               sin, 1e-6, KVStore(*got, slots))
    expected = empty_caches(pages, page, nkv, hd, int8, dtype)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    store_kv(k_out, v, *expected, slots)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True) if a is not None)
    assert torch.equal(q_got, q_out) if with_q else q_got is None
    assert got[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_weight_full_rotation_and_keys_alone(dtype: torch.dtype) -> None:
    """The DFlash draft's form: plain-w norms, RoPE over the whole head, and norm_rope on the
    context's keys (no queries)."""
    q, k = projected_qk(6, 4, 2, 32, dtype)
    qw, kw = 1.0 + rand(32, seed=1, dtype=dtype) * 0.1, 1.0 + rand(32, seed=2, dtype=dtype) * 0.1
    positions = torch.arange(100, 106, device=DEVICE)
    cos, sin = rope_cos_sin(positions, 32, 1e7,
                            {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64})
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, unit_offset=False)
    q_ref, k_ref = qk_norm_rope_ref(q, k, qw, kw, cos, sin, 1e-6, unit_offset=False)
    check_rope(q_out, q_ref)
    check_rope(k_out, k_ref)
    keys = norm_rope(k, kw, cos, sin, 1e-6, unit_offset=False)
    check_rope(keys, norm_rope_ref(k, kw, cos, sin, 1e-6, unit_offset=False))
    check_rope(keys, k_out)
    assert keys.is_contiguous()


def test_position_zero_is_the_plain_norm() -> None:
    q, k = projected_qk(3, 2, 1, 32, torch.float32)
    cos, sin = rope_cos_sin(torch.zeros(3, dtype=torch.int64, device=DEVICE), 8, 1e7)
    w = rand(32, seed=1)
    q_out, k_out = qk_norm_rope(q, k, w, w, cos, sin, 1e-6)
    check_rope(q_out, rms_norm_ref(q, w, 1e-6))
    check_rope(k_out, rms_norm_ref(k, w, 1e-6))


@pytest.mark.parametrize(("params", "expected"), [
    ({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
      "mrope_section": [11, 11, 10], "mrope_interleaved": True}, None),  # the releases'
    ({"type": "mrope", "mrope_section": [2, 1, 1]}, None),  # transformers 4's plain mRoPE
    ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7},  # the model card's extension
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}),
    ({"type": "linear", "factor": 2.0, "original_max_position_embeddings": 1024},
     {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 1024}),
])
def test_rope_scaling_reads_hugging_face_parameters(params: dict, expected: dict | None) -> None:
    assert rope_scaling(params, 262144) == expected


@pytest.mark.parametrize(("params", "max_positions", "message"), [
    ({"rope_type": "longrope", "factor": 4.0}, 262144, "'longrope' is not supported"),
    ({"rope_type": "dynamic", "factor": 4.0}, 262144, "'dynamic' is not supported"),
    ({"rope_type": "yarn"}, 262144, "yarn rope scaling lacks its 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0}, None, "lacks original_max_position_embeddings"),
])
def test_rope_scaling_refuses_what_it_does_not_compute(params: dict, max_positions: int | None,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rope_scaling(params, max_positions)
