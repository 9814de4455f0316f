"""Speculative decoding: proposers of draft tokens, and rollback of the GDN state.

The engine verifies K drafts per decode-ready request in every step (engine.engine); the
lossless acceptance rule is in engine.sampler (`sample_verify`).
"""

from __future__ import annotations

from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.spec.mtp import MTPProposer
from ninfer_runtime.engine.spec.proposer import Committed, Proposer
from ninfer_runtime.models.loading import DraftModels

__all__ = ["Committed", "MTPProposer", "Proposer", "make_proposer"]


def make_proposer(config: EngineConfig, drafts: DraftModels) -> Proposer | None:
    """The proposer config.spec names, built from the loaded draft models (None: no spec)."""
    if config.spec == "none":
        return None
    if config.lm_head_draft and drafts.draft_argmax is None:
        raise ValueError("lm_head_draft is set but no draft head was loaded")
    if config.spec == "mtp":
        if drafts.mtp is None:
            raise ValueError("spec 'mtp' needs the model's MTP head (load_artifact(..., "
                             "mtp=True))")
        return MTPProposer(drafts.mtp, config.draft_tokens,
                           drafts.draft_argmax if config.lm_head_draft else None)
    raise ValueError(f"spec {config.spec!r} has no proposer in this engine yet")
