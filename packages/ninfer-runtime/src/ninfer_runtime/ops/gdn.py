"""Gated DeltaNet (GDN) core: gating, and the gated delta rule in chunked and recurrent form.

Per value head, with state S in R^{dk x dv} (fp32, layout [nv, dk, dv]) and for each token:

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T        # the delta rule
    o = S^T q

q and k arrive raw (after the conv); both forms l2-normalise them and scale q by dk^-0.5, as
the Qwen3.5 kernels do ("use_qk_l2norm_in_kernel"). Grouped value attention: value head h
reads q/k head h // (nv // nk). The chunked form is the prompt path, the recurrent form the
decode path; they compute the same function (tests/test_gdn.py).

Two ops run Triton kernels on the GPU (the references stay the oracle and the CPU path):

* `gdn_decode`: the whole mixer from the in_proj outputs to o for sequences of a few tokens,
  recurrently, in one launch: conv shift + depthwise conv + SiLU, q/k l2norm, gating, the state
  update in place in the slot and o = S^T q. It streams the fp32 state (27B: 3 MiB per
  sequence and layer, each way), so it is spread as wide as the state splits: one program
  per (value head, tile of BV state columns, sequence), each column of the state being
  independent. A program keeps its tile in registers across the segment's tokens and
  recomputes its k-head's q and k (cheap); the conv window of those shared q/k channels is
  rewritten by whichever of the k-head's programs finishes last (an atomic ticket), so no
  program overwrites it while another still reads it. Optionally the state after every token
  goes to its own slot (speculative verification). `gdn_decode_norm` applies the layer's
  output norm in the same launch, and writes out_proj's decode operand: the last program of
  each head group to finish takes the group's heads (a second ticket).
* `gated_delta_rule_varlen`: the chunked (WY/UT) form in three launches. First, in parallel
  over every (chunk, value head), what does not depend on the state: the chunk's unit
  lower-triangular system inverted by recursive doubling (blocks of 2, 4, .. 64, two dots a
  level) and applied, w = inv (beta exp(G) K) and u = inv (beta V), plus the normalised q
  and k, into an fp32 workspace. Then one program per (sequence, value head, dv block)
  carries its [dk, BV] state tile across the sequence's chunks with two tensor-core dots a
  chunk (delta = u - w S, the state update), storing each chunk's delta and starting state;
  no chunk's inverse, and none of the output's three dots, sits on that sequential path.
  Last, in parallel over every (chunk, value head, dv block) again, the outputs from those.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from ninfer_runtime.ops.compile_ahead import launch
from ninfer_runtime.ops.conv import causal_conv1d_update, check_conv_args
from ninfer_runtime.ops.counters import CounterPool
from ninfer_runtime.ops.dispatch import INTERPRET, graphing, use_triton
from ninfer_runtime.ops.launch import dot_precision, options
from ninfer_runtime.ops.norm import gated_rms_norm, operand_heads, rounds_product
from ninfer_runtime.ops.quant_linear import DecodeOperand, operand_buffers
from ninfer_runtime.ops.varlen import num_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references still run
    triton = None

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (log-decay <= 0) and beta = sigmoid(b), fp32.

    a, b [..., nv]; A_log, dt_bias [nv].
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_gating_ref` for a prompt chunk's a, b [N, nv] (row views of a projection): one
    launch where the torch ops take eight, for a chunk whose short kernels leave the GPU
    waiting on the host (docs/perf.md, sixth run). The decode kernel gates in place."""
    if not use_triton(a, b, A_log, dt_bias) or a.dim() != 2:
        return gdn_gating_ref(a, b, A_log, dt_bias)
    return _launch_gating(a, b, A_log, dt_bias)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32, [heads, T, ...], q/k expanded to the value heads, normalised and scaled."""
    group = v.shape[1] // k.shape[1]
    q, k = (l2norm(x.float().repeat_interleave(group, dim=1)) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return (q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1),
            g.float().transpose(0, 1), beta.float().transpose(0, 1))


def _initial_state(state: torch.Tensor | None, v: torch.Tensor, dk: int) -> torch.Tensor:
    if state is None:
        return v.new_zeros(v.shape[1], dk, v.shape[2], dtype=torch.float32)
    return state.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form (decode: T = 1).

    q, k [T, nk, dk]; v [T, nv, dv]; g, beta [T, nv]; state [nv, dk, dv] or None (zeros).
    Returns (o [T, nv, dv] in v.dtype, final state fp32 [nv, dk, dv]).
    """
    s = _initial_state(state, v, k.shape[-1])
    q, k, vf, g, beta = _heads_first(q, k, v, g, beta)
    out = []
    for t in range(vf.shape[1]):
        k_t = k[:, t]  # [h, dk]
        s = s * g[:, t].exp()[:, None, None]
        delta = beta[:, t, None] * (vf[:, t] - torch.einsum("hkv,hk->hv", s, k_t))
        s = s + k_t[:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[:, t]))
    return torch.stack(out, dim=0).to(v.dtype), s


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT transform) form for prompts; same arguments and results as the
    recurrent form.

    Inside a chunk, with G the cumulative log-decay from the chunk start and S0 the state
    entering it, the corrections delta_i = beta_i (v_i - (decayed S_{i-1})^T k_i) solve the unit
    lower-triangular system (I + A) delta = beta V - (beta exp(G) K) S0, where
    A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i. Then
        o_i   = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) delta_j
        S_end = exp(G_end) S0 + sum_j exp(G_end - G_j) k_j delta_j^T.
    The sequence is zero-padded to whole chunks: a padded step has g = 0 and beta = 0, so it
    leaves the state unchanged.
    """
    t_len, dk = k.shape[0], k.shape[-1]
    s = _initial_state(state, v, dk)
    q, k, vf, g, beta = _heads_first(q, k, v, g, beta)
    pad = -t_len % chunk_size
    q, k, vf = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, vf))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, n = q.shape[0], (t_len + pad) // chunk_size
    q, k, vf = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, vf))
    g, beta = g.reshape(heads, n, chunk_size), beta.reshape(heads, n, chunk_size)

    cum = g.cumsum(-1)  # G, [h, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i, else 0 (masked before exp: no overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # strictly-lower part is A; diag ignored
    u = torch.linalg.solve_triangular(system, vf * beta[..., None], upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [h, n]

    out = torch.empty_like(vf)
    for i in range(n):
        delta = u[:, i] - w[:, i] @ s  # [h, C, dv]
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ delta
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ delta
    out = out.reshape(heads, n * chunk_size, -1)[:, :t_len]
    return out.transpose(0, 1).to(v.dtype), s



def gated_delta_rule_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """Reference of `gated_delta_rule_varlen`: a host loop over the sequences."""
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        rule = recurrent_gated_delta_rule if hi - lo == 1 else chunk_gated_delta_rule
        out[lo:hi], states[slot] = rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                        states[slot])
    return out


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """Several sequences back to back, each continuing from its slot of a state pool.

    q, k [N, nk, dk]; v [N, nv, dv]; g, beta [N, nv]; sequence b owns rows cu_seqlens[b] ..
    cu_seqlens[b+1] ([B+1]) and the state states[slots[b]] (states fp32 [num_slots, nv, dk,
    dv], slots [B]), which this replaces. The reference takes the recurrent form for one token
    and the chunked form for several; the kernel is chunked throughout. Returns o [N, nv, dv]
    in v.dtype. q/k/v may be strided views (last dim contiguous) of a fused projection.
    """
    if not use_triton(q, k, v, g, beta, states, cu_seqlens, slots):
        return gated_delta_rule_varlen_ref(q, k, v, g, beta, states, cu_seqlens, slots)
    if _takes_fla(v):
        return _launch_fla(q, k, v, g, beta, states, cu_seqlens, slots)
    return _launch_chunked(q, k, v, g, beta, states, cu_seqlens, slots)


PROMPT_KERNELS = ("fla", "ninfer")


def prompt_kernels() -> str:
    """Whose chunked kernels run the GDN prompt path on the GPU: NINFER_GDN_PROMPT (`fla` or
    `ninfer`), by default fla-core's where it is installed (the `gpu` extra), else ours.

    fla's took 790 us of a 27B layer's 8K prompt against our 1,924 (`scripts/gdn_probe.py`,
    nineteenth run, H100) and the 27B's one-step 8K prefill from 10,830 to 11,323 tok/s
    (twentieth run, H200). They keep bf16 intermediates where ours keep fp32 (within 9e-3 of
    ours relative to the output's largest). Graph capture always takes ours: fla reads the
    segment bounds on the host."""
    choice = os.environ.get("NINFER_GDN_PROMPT", "").strip().lower()
    if choice and choice not in PROMPT_KERNELS:
        raise ValueError(f"NINFER_GDN_PROMPT={choice!r}: expected one of {PROMPT_KERNELS}")
    if choice == "fla" and not fla_installed():
        raise RuntimeError("NINFER_GDN_PROMPT=fla needs fla-core: pip install "
                           "'ninfer-runtime[gpu]'")
    return choice or ("fla" if fla_installed() else "ninfer")


@cache
def fla_installed() -> bool:
    """Whether fla-core's gated delta rule kernels import (asked once a process)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _takes_fla(v: torch.Tensor) -> bool:
    """Whether this prompt step runs fla-core's kernels: on a GPU, where `prompt_kernels`
    says so, outside a graph's capture and its warm-up (`graph_kernels`)."""
    return v.is_cuda and prompt_kernels() == "fla" and not graphing()


def _launch_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """`gated_delta_rule_varlen` through fla-core's `chunk_gated_delta_rule` (bf16
    intermediates where ours keep fp32): the slots' states in, the final states back."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_rule

    o, final = fla_chunk_rule(q[None], k[None], v[None], g[None], beta[None],
                              scale=q.shape[-1] ** -0.5, initial_state=states[slots],
                              output_final_state=True, use_qk_l2norm_in_kernel=True,
                              cu_seqlens=cu_seqlens)
    states[slots] = final
    return o[0]


def _num_key_heads(conv_dim: int, states: torch.Tensor) -> int:
    """nk from conv_dim = 2 nk dk + nv dv and the state pool [slots, nv, dk, dv]."""
    nv, dk, dv = states.shape[1:]
    nk, rest = divmod(conv_dim - nv * dv, 2 * dk)
    if rest or nk <= 0 or nv % nk:
        raise ValueError(f"conv_dim {conv_dim} does not split into q|k|v heads for a state "
                         f"pool of {nv} value heads, dk {dk}, dv {dv}")
    return nk


def gdn_decode_ref(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
    snapshot_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of `gdn_decode`: conv update, gating and the recurrent rule, token by token."""
    nv, dk, dv = states.shape[1:]
    nk = _num_key_heads(mixed_qkv.shape[-1], states)
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    out = mixed_qkv.new_empty(mixed_qkv.shape[0], nv, dv)
    bounds = cu_seqlens.tolist()
    snaps = None if snapshot_slots is None else snapshot_slots.tolist()
    for seq, slot in enumerate(slots.tolist()):
        conv, state = conv_states[slot], states[slot]
        for i in range(bounds[seq], bounds[seq + 1]):
            y, conv = causal_conv1d_update(mixed_qkv[i], conv_weight, conv)
            q, k, v = y.split([nk * dk, nk * dk, nv * dv])
            o, state = recurrent_gated_delta_rule(
                q.view(1, nk, dk), k.view(1, nk, dk), v.view(1, nv, dv), g[i:i + 1],
                beta[i:i + 1], state)
            out[i] = o[0]
            if snaps is not None:
                conv_states[snaps[i]], states[snaps[i]] = conv, state
        if snaps is None:
            conv_states[slot], states[slot] = conv, state
    return out


def gdn_decode(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
    snapshot_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GDN mixer core for short segments (decode, speculative verification), fused.

    From the in_proj outputs to o: mixed_qkv [N, conv_dim] (pre-conv, q|k|v channels), a, b
    [N, nv] (raw, as in_proj_ba gives them), conv_weight [conv_dim, K], A_log and dt_bias
    [nv]; sequence s owns rows cu_seqlens[s] .. cu_seqlens[s+1] and continues from conv_states
    [num_slots, conv_dim, K-1] and states fp32 [num_slots, nv, dk, dv] at slot slots[s]. Every
    token takes the recurrent form, so this is `causal_conv1d_varlen`, `gdn_gating` and
    `gated_delta_rule_varlen` in one pass for segments short enough that chunking does not
    pay. Inputs may be strided row views of fused projections (last dim contiguous).

    Without snapshot_slots each sequence's final conv and recurrent state replace its slot.
    With snapshot_slots [N], the state after token i goes to slot snapshot_slots[i] instead
    and the sequences' own slots are only read, so a speculative verifier can resume from any
    accepted position. Snapshot slots must be distinct and must not be any sequence's own
    slot, with one exception: a sequence's last token may snapshot into that sequence's own
    slot (which then ends as without snapshots). Returns o [N, nv, dv] in mixed_qkv.dtype.
    """
    tensors = [mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_states, states, cu_seqlens,
               slots] + ([] if snapshot_slots is None else [snapshot_slots])
    if not use_triton(*tensors):
        return gdn_decode_ref(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_states,
                              states, cu_seqlens, slots, snapshot_slots)
    return _launch_decode(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_states, states,
                          cu_seqlens, slots, snapshot_slots)[0]


@dataclass(frozen=True)
class OutputNorm:
    """The GDN output norm, for `gdn_decode_norm` to apply in the decode kernel:
    gated_rms_norm(o, z, weight, eps) with z [N, nv, dv] (a view of in_proj_qkvz's output),
    and with `spec` (group, sums: ops.linear.decode_operand_spec of out_proj) its decode
    operand for out_proj."""

    z: torch.Tensor
    weight: torch.Tensor
    eps: float
    spec: tuple[int, bool] | None


def gdn_decode_norm(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
    snapshot_slots: torch.Tensor | None, norm: OutputNorm,
) -> tuple[torch.Tensor, DecodeOperand | None]:
    """gated_rms_norm(gdn_decode(...), norm.z, norm.weight, norm.eps) -> [N, nv, dv], the norm
    applied by the decode kernel itself (the last program of each head group to finish a
    token: one launch fewer a GDN layer), and with norm.spec the decode operand of the result
    read as [N, nv * dv] where the heads make whole groups (else None, as elsewhere: the
    references, or the Triton norm's bits, which the fused one gives)."""
    args = (mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_states, states, cu_seqlens,
            slots, snapshot_slots)
    tensors = [t for t in args if t is not None]
    if not use_triton(*tensors, norm.z, norm.weight):
        return gated_rms_norm(gdn_decode(*args), norm.z, norm.weight, norm.eps), None
    return _launch_decode(*args, norm=norm)


def _launch_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, nv = a.shape
    assert b.shape == (n, nv) and A_log.shape == dt_bias.shape == (nv,), \
        f"gdn_gating: a {tuple(a.shape)}, b {tuple(b.shape)}, A_log and dt_bias [{nv}]"
    assert a.stride(1) == b.stride(1) == 1 and A_log.is_contiguous() and dt_bias.is_contiguous()
    g = torch.empty((n, nv), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    rows = _GATING_ROWS
    _gating_kernel[(triton.cdiv(n, rows),)](a, b, A_log, dt_bias, g, beta, n, a.stride(0),
                                            b.stride(0), NV=nv, NVP=triton.next_power_of_2(nv),
                                            ROWS=rows)
    return g, beta


def _check_state_pool(states: torch.Tensor) -> tuple[int, int, int]:
    assert states.dtype == torch.float32 and states.dim() == 4, \
        f"GDN states must be fp32 [slots, nv, dk, dv], got {states.dtype} {tuple(states.shape)}"
    nv, dk, dv = states.shape[1:]
    assert states.stride(3) == 1 and states.stride(2) == dv, "each [dk, dv] state contiguous"
    assert dk >= 16 and dv >= 16 and dk & (dk - 1) == 0 and dv & (dv - 1) == 0, \
        f"the kernels need dk, dv powers of two >= 16, got {dk}, {dv}"
    return nv, dk, dv


def _launch_decode(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   conv_states: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor,
                   slots: torch.Tensor, snapshot_slots: torch.Tensor | None,
                   block_v: int | None = None, norm: OutputNorm | None = None
                   ) -> tuple[torch.Tensor, DecodeOperand | None]:
    """(o, None), or with `norm` (the normed o, its operand or None): see `gdn_decode_norm`.
    block_v overrides the column tile (the benchmark compares them); None: `_decode_tile`."""
    check_conv_args(mixed_qkv, conv_weight, conv_states, cu_seqlens, slots)
    nv, dk, dv = _check_state_pool(states)
    nk = _num_key_heads(mixed_qkv.shape[1], states)
    n, seqs = mixed_qkv.shape[0], slots.shape[0]
    assert a.shape == b.shape == (n, nv) and a.stride(1) == b.stride(1) == 1, \
        f"a, b must be [{n}, {nv}] with contiguous heads"
    assert A_log.shape == dt_bias.shape == (nv,) and A_log.is_contiguous() \
        and dt_bias.is_contiguous()
    if snapshot_slots is not None:
        assert snapshot_slots.shape == (n,) and snapshot_slots.dtype == torch.int64 \
            and snapshot_slots.is_contiguous(), "snapshot_slots is int64 [N]"
    out = torch.empty(n, nv, dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    normed, operand, heads = out, None, 1  # without the norm: unused
    z, weight, eps = out, A_log, 0.0
    if norm is not None:
        z, weight, eps = norm.z, norm.weight, norm.eps
        assert z.shape == out.shape and z.stride(2) == 1 and weight.shape == (dv,) \
            and weight.is_contiguous(), f"gdn_decode_norm: z {tuple(z.shape)}, weight " \
            f"{tuple(weight.shape)} for o {tuple(out.shape)}"
        normed = torch.empty_like(out)
        heads = None if norm.spec is None else operand_heads(nv, dv, norm.spec[0])
        if heads is not None:
            operand = DecodeOperand.empty(n, nv * dv, *norm.spec, out.device)
        heads = heads or 1
    tickets = DECODE_TICKETS.on(mixed_qkv.device, seqs * (nk + nv))
    bv = min(block_v or _decode_tile(seqs, nv, dv, mixed_qkv.device), dv)
    kernel = conv_weight.shape[1]
    _gdn_decode_kernel[(nv * (dv // bv), seqs)](
        mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_states, states, out, cu_seqlens,
        slots, slots if snapshot_slots is None else snapshot_slots, tickets,
        mixed_qkv.stride(0), a.stride(0), b.stride(0), conv_weight.stride(0),
        *conv_states.stride(), states.stride(0), states.stride(1), out.stride(0),
        out.stride(1), nk * dk, dk**-0.5, z, z.stride(0), z.stride(1), weight, normed,
        *operand_buffers(operand, out),
        tickets[seqs * nk:], n, eps, GROUP=nv // nk, DK=dk, DV=dv, BV=bv, K=kernel,
        KP=triton.next_power_of_2(kernel), HAS_SNAPSHOTS=snapshot_slots is not None,
        NORM=norm is not None, NORM_HEADS=heads,
        ROUND_PRODUCT=norm is not None and rounds_product(weight, out),
        OPERAND=0 if operand is None else operand.group,
        OPERAND_SUMS=operand is not None and operand.sums,
        num_warps=max(1, min(_DECODE_WARPS, dk * bv // 512)), **options(mixed_qkv.device))
    return (out, None) if norm is None else (normed, operand)


# gdn_decode's tiles: a program owns BV columns of one value head's [dk, dv] state and
# streams them once: 8 KiB (BV 16) or 16 KiB (BV 32) each way at dk 128, with 4 warps. Narrow
# tiles when wide ones would leave SMs with fewer than two programs (27B batch 1: 48 heads x 8
# = 384 programs, not 192). NOTE (sm_90 SASS, Triton 3.6, dk 128, 4 warps, with the output
# norm and its operand, 2026-12-07): 166 registers a thread at BV 16, 196 at BV 32, no spills
# (128 and 204 before the first token's conv taps were loaded ahead of the wait); 3 (BV 16) or
# 2 (BV 32) programs fit an SM: 24-32 KiB of state loads in flight per SM. A persistent grid
# (2 programs an SM, each taking every 264th work item with the next item's state tile loaded
# ahead, 252 registers at BV 32) lost to this grid at 8 sequences: the 27B at C = 8 decoded
# 616 tok/s against 641 (docs/perf.md, thirty-first run).
_DECODE_WARPS = 4
_DECODE_MIN_PROGRAMS_PER_SM = 2
# the decode kernel's ticket (see the kernel): sequence x k-head, then sequence x v-head
DECODE_TICKETS = CounterPool("gdn_decode tickets", 1 << 16)


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_tile(seqs: int, nv: int, dv: int, device: torch.device) -> int:
    """BV for `seqs` sequences: 32 when that still gives every SM two programs, else 16. The
    interpreter takes 16 (so that the tests' dv 32 splits into two column tiles)."""
    if device.type != "cuda":
        return 16
    wide = seqs * nv * max(1, dv // 32)
    return 32 if wide >= _DECODE_MIN_PROGRAMS_PER_SM * _sm_count(device) else 16


def _launch_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    nv, dk, dv = _check_state_pool(states)
    n, nk = q.shape[:2]
    assert q.shape == k.shape == (n, nk, dk) and v.shape == (n, nv, dv) and nv % nk == 0, \
        f"q, k [N, nk, {dk}] and v [N, {nv}, {dv}] expected, got {tuple(q.shape)}, " \
        f"{tuple(k.shape)}, {tuple(v.shape)}"
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "q, k, v need a contiguous last dim"
    assert g.shape == beta.shape == (n, nv) and g.stride(1) == beta.stride(1) == 1
    assert cu_seqlens.dtype == slots.dtype == torch.int64
    assert cu_seqlens.is_contiguous() and slots.is_contiguous()
    seqs = slots.shape[0]
    # fp32 operands in every dot; TF32 products (finer than the bf16 operands fla-style
    # kernels use) unless the model itself is fp32
    precision = dot_precision(v.dtype)
    out = torch.empty(n, nv, dv, dtype=v.dtype, device=v.device)
    # Workspace, fp32: the chunks' state-independent terms (27B: 64 KiB a token), made for
    # every chunk at once, then read by the sequential scan straight into its dots.
    qn, kn = (torch.empty(n, nk, dk, dtype=torch.float32, device=v.device) for _ in range(2))
    w = torch.empty(n, nv, dk, dtype=torch.float32, device=v.device)
    u = torch.empty(n, nv, dv, dtype=torch.float32, device=v.device)
    _gdn_chunk_prepare_kernel[(num_blocks(n, seqs, CHUNK_SIZE), nv)](
        q, k, v, g, beta, qn, kn, w, u, cu_seqlens, seqs, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        dk**-0.5, GROUP=nv // nk, DK=dk, DV=dv, C=CHUNK_SIZE,
        LEVELS=CHUNK_SIZE.bit_length() - 1, BV=min(dv, 64),
        PRECISION=precision, num_warps=_PREPARE_WARPS)

    # the scan's products for the output kernel: each chunk's delta and starting state
    # (27B: 24 KiB a token and 3 MiB a chunk of 64, fp32)
    blocks = num_blocks(n, seqs, CHUNK_SIZE)
    delta = torch.empty(n, nv, dv, dtype=torch.float32, device=v.device)
    hs = torch.empty(blocks, nv, dk, dv, dtype=torch.float32, device=v.device)
    launch(
        scan_kernel(dv), lambda meta: (seqs, nv, dv // meta["BV"]),
        kn, g, w, u, delta, hs, states, cu_seqlens, slots, g.stride(0), states.stride(0),
        states.stride(1), GROUP=nv // nk, DK=dk, DV=dv, C=CHUNK_SIZE,
        PRECISION=precision)
    (bv, warps, stages), = _fitted(_OUTPUT_TILES, dv)
    _gdn_chunk_output_kernel[(blocks, nv, dv // bv)](
        qn, kn, g, delta, hs, out, cu_seqlens, seqs, g.stride(0), out.stride(0),
        out.stride(1), GROUP=nv // nk, DK=dk, DV=dv, BV=bv, C=CHUNK_SIZE, PRECISION=precision,
        num_warps=warps, num_stages=stages)
    return out


# tokens per program of the gating kernel
_GATING_ROWS = 16
# The prepare kernel holds a few [64, 128] fp32 tiles, which 8 warps keep in registers (255
# a thread, 1 program an SM) and 4 spill a little: yet 4 run the 27B's 8K prompt in 624 us a
# layer against 978 (docs/perf.md, fourteenth run).
_PREPARE_WARPS = 4


# (BV, num_warps, num_stages) of the prompt path's scan (tuned) and output kernel: the ones the
# H200 timed fastest over a lone 8K prompt at dk = dv = 128 (docs/perf.md, fourteenth run). Of
# 7 scan candidates (BV 16-64, 4 or 8 warps, 1 or 2 stages) and 5 output ones only these won:
# the scan at BV 64 for the 27B (48 heads x 2 programs, one round of the 132 SMs: 752 us; BV
# 32 makes two rounds, 1,219) and BV 32 for the 35B (32 heads: 698 us against 759); the output
# at BV 64, 4 warps for both (467 and 329 us; a tuner timing 5 configs took 643-666 and 412).
# Every load feeds a dot, so stages multiply the shared memory (the scan: 168 KiB at BV 32, 192
# at BV 64, 2 stages each; the output: 113 KiB).
_SCAN_TILES = ((64, 4, 2), (32, 4, 2))
_OUTPUT_TILES = ((64, 4, 2),)


def _fitted(tiles: tuple[tuple[int, int, int], ...], dv: int) -> list[tuple[int, int, int]]:
    """The tiles clamped to dv (equal ones merged); the interpreter's one is BV 16, so that
    tests at small dv still split a head's columns.

    A tile must never be wider than dv: the state tiles are loaded and stored unmasked, so a
    wider one overruns into the next rows, and the grid, dv // BV programs a head, would be
    empty. Fitted here, per dv, not by the autotuner's pruning hook, which Triton skips for a
    list of one config: the output kernel's single config (9de23db) launched no program at
    the tests' dv 32 on the GPU and left its output unwritten (docs/perf.md, sixteenth run).
    """
    if INTERPRET:
        tiles = ((16, 4, 1),)
    return list(dict.fromkeys((min(bv, dv), warps, stages) for bv, warps, stages in tiles))


@cache
def scan_kernel(dv: int):
    """The prompt path's scan autotuned over `_SCAN_TILES` fitted to dv."""
    configs = [triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
               for bv, warps, stages in _fitted(_SCAN_TILES, dv)]
    return triton.autotune(configs, key=["DK", "DV", "GROUP"], restore_value=["states_ptr"],
                           cache_results=True)(_gdn_chunked_kernel)


if triton is not None:
    from ninfer_runtime.ops.conv import (
        conv_first_taps,
        conv_own_row,
        conv_silu_at,
        conv_silu_taps,
        store_conv_window,
    )
    from ninfer_runtime.ops.launch import wait_for_inputs
    from ninfer_runtime.ops.norm import gated_norm_rows
    from ninfer_runtime.ops.varlen import block_of

    @triton.jit
    def _l2norm_rows(x, eps: tl.constexpr):
        """x * rsqrt(sum(x^2) + eps) along the last axis of a fp32 tile (`l2norm`; the
        kernels pass its eps, 1e-6)."""
        return x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + eps)

    @triton.jit
    def _gating(a_ptr, b_ptr, alog_ptr, dtb_ptr, t, h, stride_a, stride_b, mask=None):
        """(g, beta) of token t, value head h (or tiles of them, within `mask`):
        -exp(A_log) softplus(a + dt_bias), sigmoid(b).

        softplus as torch computes it: linear above 20, where exp would lose nothing.
        """
        return _gates(tl.load(a_ptr + t * stride_a + h, mask=mask),
                      tl.load(b_ptr + t * stride_b + h, mask=mask),
                      tl.load(alog_ptr + h, mask=mask), tl.load(dtb_ptr + h, mask=mask))

    @triton.jit
    def _gates(a, b, a_log, dt_bias):
        """`_gating` of loaded values."""
        x = a.to(tl.float32) + dt_bias.to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        return -tl.exp(a_log.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))

    @triton.jit
    def _delta_step(s, q, k, v, g, beta, scale):
        """One token through the gated delta rule: (the state after it, its output o [BV])
        from the state columns s [DK, BV] and the token's conv outputs q, k [DK], v [BV]."""
        q = _l2norm_rows(q, 1e-6) * scale
        k = _l2norm_rows(k, 1e-6)
        decay = tl.exp(g)
        # both reductions read the incoming state, so they run side by side:
        # (decay S)^T k and (decay S + k delta^T)^T q = decay S^T q + (q.k) delta
        sk = tl.sum(s * k[:, None], axis=0)
        sq = tl.sum(s * q[:, None], axis=0)
        delta = beta * (v - decay * sk)
        o = decay * sq + tl.sum(q * k, axis=0) * delta
        return s * decay + k[:, None] * delta[None, :], o

    @triton.jit(do_not_specialize=["n"])
    def _gating_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, n, stride_a, stride_b,
                       NV: tl.constexpr, NVP: tl.constexpr, ROWS: tl.constexpr):
        """Program p: g and beta [ROWS, NV] of tokens p * ROWS ..., stored contiguous."""
        t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        h = tl.arange(0, NVP)[None, :]
        mask = (t < n) & (h < NV)
        g, beta = _gating(a_ptr, b_ptr, alog_ptr, dtb_ptr, t, h, stride_a, stride_b, mask)
        tl.store(g_ptr + t * NV + h, g, mask=mask)
        tl.store(beta_ptr + t * NV + h, beta, mask=mask)

    @triton.jit
    def _gdn_decode_kernel(
        x_ptr, a_ptr, b_ptr, w_ptr, alog_ptr, dtb_ptr, conv_ptr, states_ptr, o_ptr, cu_ptr,
        slot_ptr, snap_ptr, ticket_ptr, stride_x, stride_a, stride_b, stride_w, stride_cs,
        stride_cc, stride_ck, stride_ss, stride_sh, stride_ot, stride_oh, key_dim, scale,
        z_ptr, stride_zt, stride_zh, nw_ptr, normed_ptr, xo_ptr, inv_ptr, xsum_ptr,
        norm_ticket_ptr, n_tokens, eps, GROUP: tl.constexpr, DK: tl.constexpr,
        DV: tl.constexpr, BV: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
        HAS_SNAPSHOTS: tl.constexpr, NORM: tl.constexpr, NORM_HEADS: tl.constexpr,
        ROUND_PRODUCT: tl.constexpr, OPERAND: tl.constexpr, OPERAND_SUMS: tl.constexpr,
        GDC: tl.constexpr
    ):
        """Program (value head h, column tile, sequence): the [DK, BV] state columns of h.

        With NORM, the output norm too (`gdn_decode_norm`): once a program's columns of o
        are stored, the last of the NORM_HEADS * DV / BV programs of h's head group to take a
        ticket normalises the group's heads of every token of the segment
        (ops.norm.gated_norm_rows, with OPERAND the decode operand of whole groups).

        The state tile is loaded first (the only large transfer), stays in registers across
        the segment's tokens and is stored once (or once per token to its snapshot slot).
        Each program recomputes its k-head's q and k (conv + l2norm, a few KiB from L2).

        With PDL what no kernel of the step writes is loaded before `wait_for_inputs`, while
        the predecessor still runs: the state tile, the first token's conv weights and conv
        state taps, A_log and dt_bias (and the step's segment bounds and slots, copied in
        before the step's first kernel). Nothing the predecessor writes is read until the
        wait, and the states were last written a step earlier, by a kernel that finished
        before this one launched (see ops.launch). After the wait the first token's own
        inputs (its rows of q, k, v, a and b) are loaded together, before any of its math:
        loaded where the math needs them, behind the reductions' barriers, they made five
        round trips to memory one after another (sm_90 SASS, 2026-12-07).
        """
        NVB: tl.constexpr = DV // BV
        tl.static_assert(DV % BV == 0, "the state tiles are unmasked: BV must divide DV")
        pid, seq = tl.program_id(0), tl.program_id(1)
        h = pid // NVB
        kh = h // GROUP
        lo, hi = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
        if hi <= lo:  # a padding entry: its slot may be shared, nothing is read or written
            wait_for_inputs(GDC)
            return
        slot = tl.load(slot_ptr + seq)
        dk = tl.arange(0, DK)
        dv = (pid % NVB) * BV + tl.arange(0, BV)
        tile = h * stride_sh + dk[:, None] * DV + dv[None, :]  # [DK, BV] of the head's state
        s = tl.load(states_ptr + slot * stride_ss + tile)
        conv_slot = conv_ptr + slot * stride_cs
        qch = kh * DK + dk
        kch = key_dim + qch
        vch = 2 * key_dim + h * DV + dv
        whole_k = dk < DK
        whole_v = dv < DV
        wq, cq = conv_first_taps(w_ptr, stride_w, conv_slot, stride_cc, stride_ck, qch,
                                 whole_k, K, KP)
        wk, ck = conv_first_taps(w_ptr, stride_w, conv_slot, stride_cc, stride_ck, kch,
                                 whole_k, K, KP)
        wv, cv = conv_first_taps(w_ptr, stride_w, conv_slot, stride_cc, stride_ck, vch,
                                 whole_v, K, KP)
        a_log, dt_bias = tl.load(alog_ptr + h), tl.load(dtb_ptr + h)
        wait_for_inputs(GDC)
        xq = conv_own_row(x_ptr, stride_x, lo, qch, whole_k, K, KP)
        xk = conv_own_row(x_ptr, stride_x, lo, kch, whole_k, K, KP)
        xv = conv_own_row(x_ptr, stride_x, lo, vch, whole_v, K, KP)
        a, b = tl.load(a_ptr + lo * stride_a + h), tl.load(b_ptr + lo * stride_b + h)
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        g, beta = _gates(a, b, a_log, dt_bias)
        s, o = _delta_step(s, conv_silu_taps(wq, cq, xq, dtype), conv_silu_taps(wk, ck, xk, dtype),
                           conv_silu_taps(wv, cv, xv, dtype), g, beta, scale)
        tl.store(o_ptr + lo * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty))
        if HAS_SNAPSHOTS:
            tl.store(states_ptr + tl.load(snap_ptr + lo) * stride_ss + tile, s)
        for t in range(lo + 1, hi):  # a verify segment's later tokens
            q = conv_silu_at(x_ptr, stride_x, w_ptr, stride_w, conv_slot, stride_cc, stride_ck,
                             t, lo, qch, whole_k, K, KP)
            k = conv_silu_at(x_ptr, stride_x, w_ptr, stride_w, conv_slot, stride_cc, stride_ck,
                             t, lo, kch, whole_k, K, KP)
            v = conv_silu_at(x_ptr, stride_x, w_ptr, stride_w, conv_slot, stride_cc, stride_ck,
                             t, lo, vch, whole_v, K, KP)
            g, beta = _gating(a_ptr, b_ptr, alog_ptr, dtb_ptr, t, h, stride_a, stride_b)
            s, o = _delta_step(s, q, k, v, g, beta, scale)
            tl.store(o_ptr + t * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty))
            if HAS_SNAPSHOTS:
                tl.store(states_ptr + tl.load(snap_ptr + t) * stride_ss + tile, s)
        if not HAS_SNAPSHOTS:
            tl.store(states_ptr + slot * stride_ss + tile, s)
        # Conv windows, after every read of them above. The v channels are this program's
        # own; q and k are shared by the k-head's GROUP * NVB programs, so the last of them
        # to take a ticket writes them (no program waits: nothing depends on the launch
        # order) and zeroes the counter for the next launch. The barrier and the release
        # order this program's window reads before its ticket.
        first = lo if HAS_SNAPSHOTS else hi - 1
        for t in range(first, hi):
            dst = conv_ptr + (tl.load(snap_ptr + t) if HAS_SNAPSHOTS else slot) * stride_cs
            store_conv_window(x_ptr, stride_x, conv_slot, dst, stride_cc, stride_ck, t, lo,
                              vch, whole_v, K, KP)
        # With NORM the norm's ticket (the o stores above before it) is taken in the same
        # atomic instruction, a lane each: one fence and one round trip to L2, where two
        # tickets one after the other waited out two of each.
        tl.debug_barrier()
        conv_counter = ticket_ptr + seq * (key_dim // DK) + kh
        nv = tl.num_programs(0) // NVB
        norm_counter = norm_ticket_ptr + seq * (nv // NORM_HEADS) + h // NORM_HEADS
        lane = tl.arange(0, 2 if NORM else 1)
        taken = tl.atomic_add(tl.where(lane == 0, conv_counter, norm_counter), 1,
                              sem="acq_rel", scope="gpu")
        last = taken == tl.where(lane == 0, GROUP * NVB, NORM_HEADS * NVB) - 1
        if tl.max(tl.where(lane == 0, last, False), 0):
            for t in range(first, hi):
                dst = conv_ptr + (tl.load(snap_ptr + t) if HAS_SNAPSHOTS else slot) * stride_cs
                store_conv_window(x_ptr, stride_x, conv_slot, dst, stride_cc, stride_ck, t, lo,
                                  qch, whole_k, K, KP)
                store_conv_window(x_ptr, stride_x, conv_slot, dst, stride_cc, stride_ck, t, lo,
                                  kch, whole_k, K, KP)
            tl.store(conv_counter, 0)
        if NORM and tl.max(tl.where(lane == 1, last, False), 0):
            tl.store(norm_counter, 0)
            for t in range(lo, hi):
                gated_norm_rows(o_ptr, z_ptr, nw_ptr, normed_ptr, xo_ptr, inv_ptr, xsum_ptr,
                                t * nv + h // NORM_HEADS * NORM_HEADS, n_tokens * nv, nv,
                                stride_ot, stride_oh, stride_zt, stride_zh, eps, DV,
                                ROUND_PRODUCT, OPERAND, OPERAND_SUMS, NORM_HEADS, DV, ".cg")

    @triton.jit
    def _unit_lower_inverse(a, C: tl.constexpr, LEVELS: tl.constexpr,
                            PRECISION: tl.constexpr):
        """(I + a)^-1 for a strictly lower-triangular [C, C] tile (C = 2^LEVELS), by
        recursive doubling: with x the inverse of the block diagonal of I + a in blocks of s
        (x = I - a's in-block part for s = 2) and e the part of a between the two s-halves of
        each 2s-block, the inverse in blocks of 2s is (I + x e)^-1 x = x - x e x, since
        (x e)^2 = 0. Two dots a level and no serial substitution (one barrier-bound step per
        row before: 127 barriers in the sm_90 code against 21; a 27B layer's 8K prompt took
        the H200 672 us of inverses at 8 warps, 513 now). Every product is of blocks of the
        true inverse and of a, as in blocked substitution: no powers of a, which grow where
        the inverse does not (at TF32, 9.4e-4 of the largest entry off on correlated keys,
        against 2.2e-3 for the substitution; docs/perf.md, fourteenth run)."""
        r = tl.arange(0, C)[:, None]
        c = tl.arange(0, C)[None, :]
        x = tl.where(r == c, 1.0, 0.0) - tl.where((r // 2 == c // 2) & (r != c), a, 0.0)
        for level in tl.static_range(1, LEVELS):  # blocks of s = 2^level -> 2s
            e = tl.where((r >> (level + 1) == c >> (level + 1)) & (r >> level != c >> level),
                         a, 0.0)
            x = x - tl.dot(tl.dot(x, e, input_precision=PRECISION), x,
                           input_precision=PRECISION)
        return x

    @triton.jit
    def _gdn_chunk_prepare_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, qn_ptr, kn_ptr, w_ptr, u_ptr, cu_ptr, num_seqs,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_g,
        stride_beta, scale,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
        LEVELS: tl.constexpr, BV: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Program (chunk, value head h): the chunk's state-independent terms, with inv the
        inverse of its unit lower-triangular system (I + A), all fp32 [rows, heads, dim]:
        u = inv (beta V) and w = inv (beta exp(G) K) for h; the normalised q (times the
        scale) and k of h's k-head, written by the first of its value heads. Rows of the
        chunk only (the padding rows of a partial chunk are zero in every input)."""
        seq, first = block_of(cu_ptr, tl.program_id(0), num_seqs, C)
        hi = tl.load(cu_ptr + seq + 1)
        if first >= hi:  # a spare program: this sequence has fewer chunks than the bound
            return
        h = tl.program_id(1)
        nv = tl.num_programs(1)
        kh = h // GROUP
        i = tl.arange(0, C)
        rows = first + i
        live = rows < hi
        row = rows.to(tl.int64)[:, None]
        dk = tl.arange(0, DK)[None, :]
        kn = _l2norm_rows(tl.load(k_ptr + row * stride_kt + kh * stride_kh + dk,
                                  mask=live[:, None], other=0.0).to(tl.float32), 1e-6)
        if h % GROUP == 0:
            qn = tl.load(q_ptr + row * stride_qt + kh * stride_qh + dk, mask=live[:, None],
                         other=0.0).to(tl.float32)
            qn = _l2norm_rows(qn, 1e-6) * scale
            dst = row * (nv // GROUP * DK) + kh * DK + dk
            tl.store(qn_ptr + dst, qn, mask=live[:, None])
            tl.store(kn_ptr + dst, kn, mask=live[:, None])
        g = tl.load(g_ptr + rows * stride_g + h, mask=live, other=0.0)
        beta = tl.load(beta_ptr + rows * stride_beta + h, mask=live, other=0.0)
        cum = tl.cumsum(g, axis=0)  # G: log-decay from the chunk start, non-increasing
        # exp(G_i - G_j) for j < i, masked before exp (the upper side would overflow)
        strict = i[:, None] > i[None, :]
        decay = tl.exp(tl.where(strict, cum[:, None] - cum[None, :], float("-inf")))
        k_beta = kn * beta[:, None]
        a = tl.where(strict, tl.dot(k_beta, tl.trans(kn), input_precision=PRECISION) * decay,
                     0.0)
        inv = _unit_lower_inverse(a, C, LEVELS, PRECISION)
        w = tl.dot(inv, k_beta * tl.exp(cum)[:, None], input_precision=PRECISION)
        tl.store(w_ptr + row * (nv * DK) + h * DK + dk, w, mask=live[:, None])
        for v0 in tl.static_range(0, DV, BV):  # u by column blocks: fewer live registers
            dv = v0 + tl.arange(0, BV)[None, :]
            v = tl.load(v_ptr + row * stride_vt + h * stride_vh + dv, mask=live[:, None],
                        other=0.0).to(tl.float32)
            u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
            tl.store(u_ptr + row * (nv * DV) + h * DV + dv, u, mask=live[:, None])

    @triton.jit
    def _gdn_chunked_kernel(
        kn_ptr, g_ptr, w_ptr, u_ptr, delta_ptr, hs_ptr, states_ptr, cu_ptr, slot_ptr,
        stride_g, stride_ss, stride_sh,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        C: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program (sequence, value head h, dv block): carries the [DK, BV] state tile across
        the sequence's chunks, from their prepared terms (`_gdn_chunk_prepare_kernel`):
            delta = u - w S
            S'    = exp(G_end) S + K^T (exp(G_end - G) delta)
        storing each chunk's delta and the state S it starts from (hs, indexed as
        ops.varlen numbers the chunk's block) for `_gdn_chunk_output_kernel`, which makes the
        outputs of all chunks side by side. Only these two products are sequential; the
        decays scale the small results, not the [C, DK] operands, so those go from memory
        straight into the dots."""
        tl.static_assert(DV % BV == 0, "the state tiles are unmasked: BV must divide DV")
        seq, h, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nv = tl.num_programs(1)
        lo, hi = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
        kh = h // GROUP
        dk = tl.arange(0, DK)
        dv = vblock * BV + tl.arange(0, BV)
        cell = dk[:, None] * DV + dv[None, :]  # the tile within a [DK, DV] state
        state = states_ptr + tl.load(slot_ptr + seq) * stride_ss + h * stride_sh + cell
        s = tl.load(state)  # [DK, BV] fp32, carried across the chunks
        i = tl.arange(0, C)
        first_block = (lo - seq) // C + seq  # ops.varlen: the sequence's first block
        for t0 in range(lo, hi, C):
            rows = t0 + i
            live = rows < hi  # padding rows: k = w = u = 0, g = 0 leave s unchanged
            row = rows.to(tl.int64)[:, None]
            block = (first_block + (t0 - lo) // C).to(tl.int64)
            tl.store(hs_ptr + (block * nv + h) * (DK * DV) + cell, s)
            k = tl.load(kn_ptr + row * (nv // GROUP * DK) + kh * DK + dk[None, :],
                        mask=live[:, None], other=0.0)
            w = tl.load(w_ptr + row * (nv * DK) + h * DK + dk[None, :], mask=live[:, None],
                        other=0.0)
            u = tl.load(u_ptr + row * (nv * DV) + h * DV + dv[None, :], mask=live[:, None],
                        other=0.0)
            g = tl.load(g_ptr + rows * stride_g + h, mask=live, other=0.0)
            cum = tl.cumsum(g, axis=0)
            total = tl.sum(g, axis=0)
            delta = u - tl.dot(w, s, input_precision=PRECISION)  # [C, BV]
            tl.store(delta_ptr + row * (nv * DV) + h * DV + dv[None, :], delta,
                     mask=live[:, None])
            s = s * tl.exp(total) + tl.dot(tl.trans(k), delta * tl.exp(total - cum)[:, None],
                                           input_precision=PRECISION)
        tl.store(state, s)

    @triton.jit
    def _gdn_chunk_output_kernel(
        qn_ptr, kn_ptr, g_ptr, delta_ptr, hs_ptr, o_ptr, cu_ptr, num_seqs, stride_g,
        stride_ot, stride_oh,
        GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        C: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Program (chunk block, value head h, dv block), all side by side: the chunk's
        output from the state it starts from (S, stored by the scan) and its delta:
            o = exp(G) (Q S) + (Q K^T o decay) delta"""
        tl.static_assert(DV % BV == 0, "the state tiles are unmasked: BV must divide DV")
        block, h, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        nv = tl.num_programs(1)
        seq, t0 = block_of(cu_ptr, block, num_seqs, C)
        hi = tl.load(cu_ptr + seq + 1)
        if t0 >= hi:
            return  # spare program (ops.varlen)
        kh = h // GROUP
        dk = tl.arange(0, DK)
        dv = vblock * BV + tl.arange(0, BV)
        i = tl.arange(0, C)
        rows = t0 + i
        live = rows < hi
        row = rows.to(tl.int64)[:, None]
        qk_off = row * (nv // GROUP * DK) + kh * DK + dk[None, :]
        q = tl.load(qn_ptr + qk_off, mask=live[:, None], other=0.0)
        k = tl.load(kn_ptr + qk_off, mask=live[:, None], other=0.0)
        s = tl.load(hs_ptr + (block.to(tl.int64) * nv + h) * (DK * DV) + dk[:, None] * DV
                    + dv[None, :])
        delta = tl.load(delta_ptr + row * (nv * DV) + h * DV + dv[None, :],
                        mask=live[:, None], other=0.0)
        g = tl.load(g_ptr + rows * stride_g + h, mask=live, other=0.0)
        cum = tl.cumsum(g, axis=0)
        # exp(G_i - G_j) for j <= i, masked before exp (the upper side would overflow)
        causal = i[:, None] >= i[None, :]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        intra = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = (tl.dot(q, s, input_precision=PRECISION) * tl.exp(cum)[:, None]
             + tl.dot(intra, delta, input_precision=PRECISION))
        tl.store(o_ptr + row * stride_ot + h * stride_oh + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=live[:, None])
