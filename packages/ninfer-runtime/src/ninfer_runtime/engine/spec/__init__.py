"""Speculative decoding: proposers of draft tokens, and rollback of the GDN state.

The engine verifies K drafts per decode-ready request in every step (engine.engine); the
lossless acceptance rule is in engine.sampler (`sample_verify`).
"""

from __future__ import annotations

from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.spec.dflash import DFlashProposer
from ninfer_runtime.engine.spec.mtp import MTPProposer
from ninfer_runtime.engine.spec.proposer import Committed, Proposer
from ninfer_runtime.models.loading import DraftModels
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model

__all__ = ["Committed", "DFlashProposer", "MTPProposer", "Proposer", "make_proposer"]


def make_proposer(config: EngineConfig, drafts: DraftModels,
                  model: Qwen3_5Model | None = None) -> Proposer | None:
    """The proposer config.spec names, built from the loaded draft models (None: no spec);
    DFlash borrows the target `model`'s embedding and lm_head."""
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
    assert config.spec == "dflash", config.spec
    if drafts.dflash is None or model is None:
        raise ValueError("spec 'dflash' needs the artifact's DFlash draft (load_artifact(..., "
                         "dflash=True)) and the target model")
    return DFlashProposer(drafts.dflash, model.embed_tokens,
                          lambda hidden: model.logits(hidden).argmax(-1), config.draft_tokens,
                          drafts.draft_argmax if config.lm_head_draft else None)
