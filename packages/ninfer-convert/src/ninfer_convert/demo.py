"""The embedded default model: what `ninfer-serve` serves without ARTIFACT (and `make demo`).

It is the built-in `tiny_dense` profile with random weights (seed 0), converted to NVFP4 once and
cached, so a bare `ninfer-serve` runs the real path (convert -> .ninfer -> runtime) on any machine
without a download. Its text is noise. The demo itself is `python -m ninfer_serve.demo`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ninfer_convert.build import BuildOptions, build
from ninfer_convert.sources import open_source

DEFAULT_PROFILE = "tiny_dense"
DEFAULT_WEIGHTS = "nvfp4"


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_HOME", Path.home() / ".cache" / "ninfer"))


def default_artifact(directory: Path | None = None) -> Path:
    """Path of the default artifact, built on first use (atomically, so concurrent first uses
    never see a partial file)."""
    path = (directory or cache_dir()) / f"{DEFAULT_PROFILE}_{DEFAULT_WEIGHTS}_random.ninfer"
    if not path.exists():
        source = open_source(DEFAULT_PROFILE, random_init=True, seed=0)
        build(source, path, BuildOptions(weights=DEFAULT_WEIGHTS))
    return path
