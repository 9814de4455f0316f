"""Gated DeltaNet (GDN) core: gating, and the gated delta rule in chunked and recurrent form.

Per value head, with state S in R^{dk x dv} (fp32, layout [nv, dk, dv]) and for each token:

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T        # the delta rule
    o = S^T q

q and k arrive raw (after the conv); both forms l2-normalise them and scale q by dk^-0.5, as
the Qwen3.5 kernels do ("use_qk_l2norm_in_kernel"). Grouped value attention: value head h
reads q/k head h // (nv // nk). The chunked form is the prompt path, the recurrent form the
decode path; they compute the same function (tests/test_gdn.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (log-decay <= 0) and beta = sigmoid(b), fp32.

    a, b [..., nv]; A_log, dt_bias [nv].
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


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


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """Several sequences back to back, each continuing from its slot of a state pool.

    q, k [N, nk, dk]; v [N, nv, dv]; g, beta [N, nv]; sequence b owns rows cu_seqlens[b] ..
    cu_seqlens[b+1] ([B+1]) and the state states[slots[b]] (states fp32 [num_slots, nv, dk,
    dv], slots [B]), which this replaces. One token takes the recurrent (decode) form, several
    the chunked (prompt) form. Returns o [N, nv, dv] in v.dtype.
    """
    out = torch.empty_like(v)
    # NOTE: the reference loops over sequences on the host; a kernel takes the tensors.
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        rule = recurrent_gated_delta_rule if hi - lo == 1 else chunk_gated_delta_rule
        out[lo:hi], states[slot] = rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                        states[slot])
    return out
