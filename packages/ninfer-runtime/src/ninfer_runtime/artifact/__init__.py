"""The `.ninfer` artifact: one self-describing safetensors file (layout in format.py)."""

from __future__ import annotations

from ninfer_runtime.artifact.format import FORMAT_VERSION, ArtifactError, WeightSpec
from ninfer_runtime.artifact.reader import Artifact
from ninfer_runtime.artifact.writer import ArtifactWriter

__all__ = ["FORMAT_VERSION", "Artifact", "ArtifactError", "ArtifactWriter", "WeightSpec"]
