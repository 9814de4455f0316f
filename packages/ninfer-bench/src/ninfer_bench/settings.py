"""One run's settings (what the command line resolved to) and the seed's fixed serving profile.

Modes map to ninfer-serve's speculative flags, sampling profiles to request parameters; the
prefill chunk and the KV dtype are the seed's (1,024 tokens, INT8 group-64). Prefix reuse and
CUDA graphs need no flags: ninfer-serve has no prefix cache and captures graphs on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES: dict[str, tuple[str, ...]] = {
    "mtp0": (),
    "mtp3": ("--spec", "mtp", "--draft-tokens", "3", "--lm-head-draft"),
    "dflash7": ("--spec", "dflash", "--draft-tokens", "7", "--lm-head-draft"),
}
SAMPLING: dict[str, dict[str, Any]] = {
    "stochastic": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.0},
    "greedy": {"temperature": 0.0},
}
PREFILL_CHUNK = 1024
KV_DTYPE = "int8"


@dataclass(frozen=True)
class Target:
    """What is measured: an artifact served by a fresh ninfer-serve, or (artifact None) the
    server at Settings.url."""

    name: str
    artifact: Path | None


@dataclass(frozen=True)
class Settings:
    serve: tuple[str, ...]  # the ninfer-serve command, split like a shell line
    targets: tuple[Target, ...]
    url: str | None  # measure this running server instead of starting one
    mode: str  # a key of MODES
    sampling: str  # a key of SAMPLING
    max_context: int | None  # None: the suite's default
    kv_capacity: str  # "auto" or a number of tokens
    output: Path
    fixtures: tuple[str, ...]  # ids or categories; empty: the suite's default
    seeds: tuple[int, ...]
    max_tokens: int | None  # caps every output budget
    stream: bool
    startup_timeout_s: float
    request_timeout_s: float

    def budget(self, tokens: int) -> int:
        """An output budget under --max-tokens."""
        return tokens if self.max_tokens is None else min(tokens, self.max_tokens)
