"""Loading a `.ninfer` artifact into a model, with its tokenizer, generation config and, when
speculative decoding asks for them, its draft models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer_runtime.models.dflash import DFlashDraft, load_dflash
from ninfer_runtime.models.mtp import Qwen3_5MTP
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model

if TYPE_CHECKING:
    from ninfer_runtime.artifact import Artifact
    from ninfer_runtime.tokenizer import Tokenizer

DraftArgmax = Callable[[torch.Tensor], torch.Tensor]  # hidden [R, H] -> full-vocab ids [R]


@dataclass(frozen=True)
class DraftModels:
    """What speculative proposers draft with, loaded only when the engine config asks: the MTP
    head (sharing the target's embed_tokens and lm_head), the DFlash draft, and the compact
    draft head of --lm-head-draft (`argmax` of a vocabulary subset of lm_head; None: the full
    lm_head)."""

    mtp: Qwen3_5MTP | None = None
    dflash: DFlashDraft | None = None
    draft_argmax: DraftArgmax | None = None


@dataclass(frozen=True)
class LoadedModel:
    model: Qwen3_5Model
    tokenizer: Tokenizer | None  # None when the artifact carries no tokenizer.json
    generation_config: dict[str, Any]
    drafts: DraftModels = field(default_factory=DraftModels)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 keeps the CPU path exact; bf16 is the GPU compute type."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_artifact(source: Artifact | str | Path, device: str | torch.device,
                  dtype: torch.dtype | None = None, *, mtp: bool = False,
                  dflash: bool = False, lm_head_draft: bool = False) -> LoadedModel:
    """The artifact's model on `device` (`source`: a path, opened and verified here, or an
    `Artifact` already open); with `mtp` also its MTP head, with `dflash` its DFlash draft,
    with `lm_head_draft` its draft head. An artifact without the asked-for part raises
    ArtifactError."""
    from ninfer_runtime.artifact import Artifact
    from ninfer_runtime.tokenizer import Tokenizer

    artifact = source if isinstance(source, Artifact) else Artifact.open(source)
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    model = Qwen3_5Model(artifact.config, artifact.weights(), dtype=dtype, device=device)
    tokenizer = Tokenizer.from_artifact(artifact) if artifact.tokenizer_json else None
    drafts = DraftModels(mtp=_load_mtp(artifact, model) if mtp else None,
                         dflash=_load_dflash(artifact, model) if dflash else None,
                         draft_argmax=_load_draft_head(artifact, model) if lm_head_draft
                         else None)
    return LoadedModel(model, tokenizer, dict(artifact.generation_config), drafts)


def _load_mtp(artifact: Artifact, model: Qwen3_5Model) -> Qwen3_5MTP:
    from ninfer_runtime.artifact import ArtifactError

    names = [n for n in artifact.weight_names() if n.startswith("mtp.")]
    if not names:
        raise ArtifactError(artifact.path, "--spec mtp needs the MTP layer (mtp.* weights), "
                            "and this artifact has none (it was built with --no-mtp)")
    weights = {n: artifact.weight(n) for n in names}
    # the target's converted tensors: shared, not copied
    weights |= {"embed_tokens.weight": model.embed_tokens, "lm_head.weight": model.lm_head}
    return Qwen3_5MTP(artifact.config, weights, dtype=model.dtype, device=model.device)


def _load_dflash(artifact: Artifact, model: Qwen3_5Model) -> DFlashDraft:
    from ninfer_runtime.artifact import ArtifactError

    draft = load_dflash(artifact, dtype=model.dtype, device=model.device)
    if draft is None:
        raise ArtifactError(artifact.path, "--spec dflash needs a DFlash draft, and this "
                            "artifact has none (build it with ninfer-convert build ... "
                            "--dflash SOURCE)")
    return draft


def _load_draft_head(artifact: Artifact, model: Qwen3_5Model) -> DraftArgmax:
    from ninfer_runtime.artifact import ArtifactError
    from ninfer_runtime.models.draft_head import DraftHead

    head = DraftHead.load(artifact.weights(), model.dtype, model.device)
    if head is None:
        raise ArtifactError(artifact.path, "--lm-head-draft needs a draft head (draft_head.* "
                            "weights), and this artifact has none (build it with "
                            "ninfer-convert build ... --lm-head-draft)")
    return head.argmax
