"""What a published number must name besides itself: the commit and the GPU that produced it,
and which weights were measured."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def commit() -> str:
    """NINFER_COMMIT when set (a copied tree whose .git is not the source's), else git's HEAD."""
    if os.environ.get("NINFER_COMMIT"):
        return os.environ["NINFER_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi (no torch import), else the CPU's."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        if out.strip():
            return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return f"no GPU ({platform.processor() or platform.machine()})"


def describe_artifact(path: Path) -> str:
    """Profile, weights and whether they are random-init, from the artifact's manifest."""
    try:
        from ninfer_runtime.artifact import Artifact

        manifest = Artifact.open(path, verify=False).manifest
    except Exception as e:  # noqa: BLE001 - a description must never stop a run
        return f"{path} (manifest unreadable: {e})"
    kind = "random-init weights" if manifest.get("random_init") else "converted weights"
    return (f"{path} (profile {manifest.get('profile')}, {manifest.get('weights_id')}, "
            f"{kind})")
