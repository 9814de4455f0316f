"""Fetching a checkpoint from the Hugging Face hub (or its local cache).

huggingface_hub does the work: it downloads only the files we ask for, resumes interrupted
downloads, reuses the shared cache, and in offline mode (HF_HUB_OFFLINE=1) answers from the
cache alone. The snapshot folder it returns is named after the resolved commit, which is what
the artifact records as the revision: a branch name like "main" would not say which weights
were converted.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download

from ninfer_convert.checkpoint import ConvertError

ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "hf_quant_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
]


class HubError(ConvertError):
    """A repo that cannot be fetched (unknown, gated, offline and not cached, ...)."""


def download(repo_id: str, revision: str | None = None) -> tuple[Path, str]:
    """The local snapshot directory of `repo_id` at `revision` (default: main) and its resolved
    commit hash. The cache location and offline mode follow huggingface_hub's environment
    (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE)."""
    try:
        path = Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=ALLOW_PATTERNS))
    except (OSError, ValueError) as e:  # every hub error is an OSError; bad repo ids ValueError
        at = f" at revision {revision!r}" if revision else ""
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"cannot fetch {repo_id}{at} from the Hugging Face hub: {first_line}") \
            from None
    return path, path.name
