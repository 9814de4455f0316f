"""Next-token sampling ops: penalties, top-k / top-p / min-p filters, and draws.

The row-wise ops take logits [B, V] and one parameter per row ([B] tensors), so one request's
result never depends on the other rows of the batch. Semantics follow vLLM: penalties apply to
the raw logits, then temperature, then min-p, top-k and top-p (top-p over what the other two
kept, renormalised).
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalised fp32 logits [B, V].

    seen [B, V] bool: tokens of the prompt or the output so far; counts [B, V]: how often each
    token was generated. A seen token's logit is divided by repetition[b] when positive and
    multiplied by it otherwise (> 1 discourages repeats); then every logit loses
    frequency[b] * count + presence[b] * (count > 0). Neutral values (1, 0, 0) change nothing.
    """
    logits = logits.float()
    rep = repetition.float()[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = counts.float()
    return logits - frequency.float()[:, None] * counts - presence.float()[:, None] * (counts > 0)


def filter_logits(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """scores [B, V] (temperature applied) with the filtered-out tokens set to -inf.

    Per row: min_p keeps tokens at least min_p times as likely as the most likely one; top_k
    (0 = off) the k most likely (ties broken by token id); top_p the smallest prefix of the
    remaining distribution, renormalised, whose mass reaches top_p. The most likely token always
    survives.
    """
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)
    probs = sorted_scores.softmax(-1)
    ranks = torch.arange(scores.shape[-1], device=scores.device)
    keep = probs >= min_p[:, None] * probs[:, :1]
    keep &= (ranks[None, :] < top_k[:, None]) | (top_k[:, None] <= 0)
    kept = probs * keep
    kept = kept / kept.sum(-1, keepdim=True)
    keep &= (kept.cumsum(-1) - kept < top_p[:, None]) | (top_p[:, None] >= 1.0)
    return scores.scatter(-1, order, sorted_scores.masked_fill(~keep, float("-inf")))


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """Draw one token id per row of logits [..., V] -> [...] (int64), one setting for all rows.

    temperature 0 is greedy (argmax); top_k 0, top_p 1 and min_p 0 switch those filters off.
    """
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"invalid sampling parameters: temperature={temperature} "
                         f"(>= 0), top_k={top_k} (>= 0), top_p={top_p} (in (0, 1]), "
                         f"min_p={min_p} (in [0, 1])")
    if temperature == 0:
        return logits.argmax(-1)
    scores = (logits.float() / temperature).reshape(-1, logits.shape[-1])
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        rows = scores.shape[0]
        scores = filter_logits(scores, torch.full((rows,), top_k, device=scores.device),
                               torch.full((rows,), top_p, device=scores.device),
                               torch.full((rows,), min_p, device=scores.device))
    draws = torch.multinomial(scores.softmax(-1), 1, generator=generator)
    return draws.reshape(logits.shape[:-1])
