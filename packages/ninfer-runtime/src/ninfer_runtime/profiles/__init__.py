"""Registered model profiles: a name, its Hugging Face repo and its exact config.

The real profiles carry the official configs; the tiny ones have the same structure at toy
sizes (dense and MoE, MTP layer, vision config) for tests and the demo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ninfer_runtime.config import ModelConfig

# Qwen3.5-family generation defaults (generation_config.json of the released checkpoints).
_QWEN_GENERATION = {"eos_token_id": [248046, 248044], "pad_token_id": 248044,
                    "temperature": 1.0, "top_k": 20, "top_p": 0.95}
_TINY_GENERATION = {"eos_token_id": [1002, 1000], "pad_token_id": 1000,
                    "temperature": 1.0, "top_k": 20, "top_p": 0.95}


@dataclass(frozen=True)
class Profile:
    name: str
    hf_repo: str | None  # None for the built-in tiny profiles
    config_file: str
    generation_config: dict[str, Any]
    description: str

    @property
    def hf_config(self) -> dict[str, Any]:
        return json.loads(resources.files(__package__).joinpath(self.config_file).read_text())

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def is_tiny(self) -> bool:
        return self.hf_repo is None


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("qwen3_6_27b", "Qwen/Qwen3.6-27B", "qwen3_6_27b.json", _QWEN_GENERATION,
                "Qwen3.6 27B dense"),
        Profile("qwen3_6_35b_a3b", "Qwen/Qwen3.6-35B-A3B", "qwen3_6_35b_a3b.json",
                _QWEN_GENERATION, "Qwen3.6 35B-A3B MoE"),
        Profile("qwen3_8_27b", "Qwen/Qwen3.8-27B", "qwen3_8_27b.json", _QWEN_GENERATION,
                "Qwen3.8 27B dense"),
        Profile("tiny_dense", None, "tiny_dense.json", _TINY_GENERATION,
                "tiny dense Qwen3.5-shaped model (tests, demo)"),
        Profile("tiny_moe", None, "tiny_moe.json", _TINY_GENERATION,
                "tiny MoE Qwen3.5-shaped model (tests, demo)"),
    )
}


class UnknownProfileError(KeyError):
    def __str__(self) -> str:
        return f"unknown profile {self.args[0]!r}; registered: {', '.join(PROFILES)}"


@cache
def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownProfileError(name) from None
