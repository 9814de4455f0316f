"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of logits [..., V] -> [...] (int64).

    temperature 0 is greedy (argmax); top_k 0 and top_p 1 switch those filters off. top-k is
    applied before top-p; top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches top_p (always at least the most likely token).
    """
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"invalid sampling parameters: temperature={temperature} "
                         f"(>= 0), top_k={top_k} (>= 0), top_p={top_p} (in (0, 1])")
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_scores = sorted_scores.masked_fill(mass_before >= top_p, float("-inf"))
        scores = scores.scatter(-1, order, sorted_scores)
    probs = scores.softmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
