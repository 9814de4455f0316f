"""The embedded default model: what `ninfer-serve` serves without ARTIFACT (and `make demo`).

It is the built-in `tiny_dense` profile with random weights (seed 0), converted to NVFP4 once and
cached, so a bare `ninfer-serve` runs the real path (convert -> .ninfer -> runtime) on any machine
without a download. Its text is noise. The demo itself is `python -m ninfer_serve.demo`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ninfer_convert.build import BuildOptions, build
from ninfer_convert.sources import open_source
from ninfer_runtime.profiles import get_profile

DEFAULT_PROFILE = "tiny_dense"
DEFAULT_WEIGHTS = "nvfp4"


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_HOME", Path.home() / ".cache" / "ninfer"))


def artifact_name(hf_config: dict[str, Any]) -> str:
    """The default artifact's file name for its profile's Hugging Face config."""
    digest = hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:12]
    return f"{DEFAULT_PROFILE}_{DEFAULT_WEIGHTS}_random_{digest}.ninfer"


def default_artifact(directory: Path | None = None) -> Path:
    """Path of the default artifact, built on first use (atomically, so concurrent first uses
    never see a partial file). Its name carries a digest of the profile's config, so that a
    cache built from an older profile is never served for a newer one."""
    path = (directory or cache_dir()) / artifact_name(get_profile(DEFAULT_PROFILE).hf_config)
    if not path.exists():
        source = open_source(DEFAULT_PROFILE, random_init=True, seed=0)
        build(source, path, BuildOptions(weights=DEFAULT_WEIGHTS))
    return path
