"""The offline API: load a `.ninfer` artifact, score token sequences, generate text.

One sequence at a time over the reference model: the prompt goes through in one call (the
chunked GDN path), then one token per step over the KV and state caches (the recurrent path).
The batching engine replaces this loop; the API stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ninfer_runtime.models import Qwen3_5Model
from ninfer_runtime.ops.sampling import sample

if TYPE_CHECKING:
    from ninfer_runtime.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationResult:
    """token_ids: the generated ids, including the stop token when finish_reason is "stop";
    text: their decoding without the stop token (None when the model has no tokenizer)."""

    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: FinishReason


def _ids(value: int | Iterable[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLM:
    """`LLM(path)` loads an artifact; `LLM.from_model` wraps a model built in memory."""

    def __init__(self, path: str | Path, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None):
        from ninfer_runtime.artifact import Artifact
        from ninfer_runtime.tokenizer import Tokenizer

        artifact = Artifact.open(path)
        device = torch.device(device) if device is not None else default_device()
        if dtype is None:  # fp32 keeps the CPU path exact; bf16 is the GPU compute type
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = Qwen3_5Model(artifact.config, artifact.weights(), dtype=dtype, device=device)
        tokenizer = Tokenizer.from_artifact(artifact) if artifact.tokenizer_json else None
        self._setup(model, tokenizer, artifact.generation_config)

    @classmethod
    def from_model(cls, model: Qwen3_5Model, tokenizer: Tokenizer | None = None,
                   generation_config: Mapping[str, Any] | None = None) -> LLM:
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, generation_config or {})
        return llm

    def _setup(self, model: Qwen3_5Model, tokenizer: Tokenizer | None,
               generation_config: Mapping[str, Any]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # stop on the generation config's eos ids and the model config's
        self.eos_token_ids = frozenset(_ids(generation_config.get("eos_token_id"))
                                       | set(model.config.eos_token_ids))

    def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this model has none; "
                                 "pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def _tensor(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits at every position, fp32 [T, vocab] on the CPU: row t scores token t+1."""
        ids = self._token_ids(token_ids)
        hidden = self.model.forward(self._tensor(ids), 0, self.model.new_cache())
        return self.model.logits(hidden).cpu()

    @torch.inference_mode()
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop_token_ids: Iterable[int] | None = None,
                 ignore_eos: bool = False) -> GenerationResult:
        """Sample up to max_tokens tokens after `prompt` (text or token ids).

        temperature 0 is greedy; `seed` makes sampling reproducible. Generation stops at an
        eos id (unless ignore_eos) or one of stop_token_ids, else after max_tokens.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = self._token_ids(prompt)
        stops = _ids(stop_token_ids) | (set() if ignore_eos else set(self.eos_token_ids))
        generator = None
        if seed is not None:
            generator = torch.Generator(self.model.device).manual_seed(seed)
        cache = self.model.new_cache()
        hidden = self.model.forward(self._tensor(ids), 0, cache)
        out: list[int] = []
        finish: FinishReason = "length"
        while True:
            logits = self.model.logits(hidden[-1])
            token = int(sample(logits, temperature, top_k, top_p, generator))
            out.append(token)
            if token in stops:
                finish = "stop"
                break
            if len(out) == max_tokens:
                break
            hidden = self.model.forward(self._tensor([token]), cache.num_tokens, cache)
        text = None
        if self.tokenizer is not None:
            content = out[:-1] if finish == "stop" else out
            text = self.tokenizer.decode(content, skip_special_tokens=True)
        return GenerationResult(tuple(out), text, finish)
