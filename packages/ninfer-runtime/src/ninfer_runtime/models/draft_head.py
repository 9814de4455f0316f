"""The compact draft head of `--lm-head-draft`: the lm_head rows of a vocabulary subset.

Drafting (MTP or DFlash) takes an argmax over the drafter's logits; computing them over a
subset of the vocabulary (FR-Spec, arXiv 2502.14856) cuts the lm_head GEMM by vocab / N.
Verification always uses the full head, so outputs never change, only acceptance. The
converter chooses the subset (ninfer_convert.draft_vocab) and stores `draft_head.token_ids`
(int64 [N], sorted full-vocabulary ids) and `draft_head.weight` (those rows, [N, H], in the
artifact's weight scheme).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ninfer_runtime.models.weights import WeightError
from ninfer_runtime.ops.linear import Weight, linear
from ninfer_runtime.quant import PackedWeight

TOKEN_IDS = "draft_head.token_ids"
WEIGHT = "draft_head.weight"


@dataclass(frozen=True)
class DraftHead:
    token_ids: torch.Tensor  # [N] int64, sorted full-vocabulary ids
    weight: Weight  # [N, H]: lm_head rows of token_ids

    @classmethod
    def load(cls, weights: Mapping[str, Weight], dtype: torch.dtype,
             device: torch.device | str) -> DraftHead | None:
        """The artifact's draft head on `device` (plain weights in `dtype`), or None when it
        has none."""
        if TOKEN_IDS not in weights:
            return None
        ids, w = weights[TOKEN_IDS], weights.get(WEIGHT)
        if w is None:
            raise WeightError(f"weights have {TOKEN_IDS!r} but lack {WEIGHT!r}")
        if isinstance(ids, PackedWeight) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise WeightError(f"tensor {TOKEN_IDS!r} is not a 1-D int64 tensor")
        if len(w.shape) != 2 or w.shape[0] != ids.shape[0]:
            raise WeightError(f"tensor {WEIGHT!r} has shape {tuple(w.shape)}, not "
                              f"[{ids.shape[0]}, hidden] for its {ids.shape[0]} token ids")
        if ids.numel() and not bool((ids[1:] > ids[:-1]).all() and ids[0] >= 0):
            raise WeightError(f"tensor {TOKEN_IDS!r} is not sorted, distinct and non-negative")
        w = w.to(device) if isinstance(w, PackedWeight) else w.to(device, dtype)
        return cls(ids.to(device), w)

    @property
    def size(self) -> int:
        return self.token_ids.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, N] over the subset for hidden [R, H]."""
        return linear(hidden, self.weight).float()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The subset's most likely token for each row of hidden [R, H], as full-vocabulary
        ids [R] int64 (ties go to the lowest id, as torch.argmax over the full head does)."""
        return self.token_ids[linear(hidden, self.weight).argmax(dim=-1)]
