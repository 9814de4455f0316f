"""The decode plans the first-call tuner chose, kept on disk across processes.

Timing every (config, K split) candidate of each weight shape costs a 27B server about a
minute at start-up, and the benchmark suites start a fresh server per point. Triton keeps its
own autotune results (`cache_results`); this does the same for `tuner.tuned_plan`: one
JSON file per GPU model and Triton version under $NINFER_HOME/tuning (default
~/.cache/ninfer/tuning), mapping a plan key to the index of the chosen candidate. The key
carries a digest of the candidate list, so changed candidates are timed again rather than
misread. A missing, unreadable or corrupt file is an empty cache; writes go to a temporary
file renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch


def cache_file(device: torch.device) -> Path:
    """The JSON file of `device`'s GPU model and the installed Triton."""
    import triton

    gpu = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-")
    home = Path(os.environ.get("NINFER_HOME", Path.home() / ".cache" / "ninfer"))
    return home / "tuning" / f"{gpu}-triton{triton.__version__}.json"


# how candidates are timed: a change (2: from a cold L2; 3: streaming over weight copies, in rounds)
# makes every stored choice stale
TIMING = 3


def entry_key(key: tuple, candidates: list) -> str:
    """The plan key without its device (the file is per GPU model), and a digest of the
    candidates and of how they were timed."""
    plain = tuple(v for v in key if not isinstance(v, torch.device))
    digest = hashlib.sha1(repr((TIMING, candidates)).encode()).hexdigest()[:12]
    return f"{plain!r}#{digest}"


def _read(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(path: Path, key: str, count: int) -> int | None:
    """The stored index for `key` if it is one of `count` candidates."""
    index = _read(path).get(key)
    return index if isinstance(index, int) and 0 <= index < count else None


def store(path: Path, key: str, index: int) -> None:
    """Adds key -> index to the file (best effort: a read-only home only loses the cache)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path) | {key: index}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
