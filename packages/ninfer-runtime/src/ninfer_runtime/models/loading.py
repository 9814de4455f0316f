"""Loading a `.ninfer` artifact into a model, with its tokenizer and generation config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer_runtime.models.qwen3_5 import Qwen3_5Model

if TYPE_CHECKING:
    from ninfer_runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    model: Qwen3_5Model
    tokenizer: Tokenizer | None  # None when the artifact carries no tokenizer.json
    generation_config: dict[str, Any]


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 keeps the CPU path exact; bf16 is the GPU compute type."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_artifact(path: str | Path, device: str | torch.device,
                  dtype: torch.dtype | None = None) -> LoadedModel:
    from ninfer_runtime.artifact import Artifact
    from ninfer_runtime.tokenizer import Tokenizer

    artifact = Artifact.open(path)
    device = torch.device(device)
    model = Qwen3_5Model(artifact.config, artifact.weights(), dtype=dtype or default_dtype(device),
                         device=device)
    tokenizer = Tokenizer.from_artifact(artifact) if artifact.tokenizer_json else None
    return LoadedModel(model, tokenizer, dict(artifact.generation_config))
