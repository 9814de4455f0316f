"""The offline API: load a `.ninfer` artifact, score token sequences, generate text.

`score` is one forward of the whole sequence (the model's single-sequence path). `generate`
runs the engine as a batch of one (unquantized KV, so its output is the reference model's),
which gives it the engine's sampling and stopping rules.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ninfer_runtime.engine.config import EngineConfig
from ninfer_runtime.engine.engine import Engine, eos_token_ids
from ninfer_runtime.engine.request import EngineRequest, SamplingParams
from ninfer_runtime.models import Qwen3_5Model
from ninfer_runtime.models.loading import load_artifact

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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLM:
    """`LLM(path)` loads an artifact; `LLM.from_model` wraps a model built in memory."""

    def __init__(self, path: str | Path, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None):
        loaded = load_artifact(path, device if device is not None else default_device(), dtype)
        self._setup(loaded.model, loaded.tokenizer, loaded.generation_config)

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
        self.generation_config = dict(generation_config)
        self.eos_token_ids = eos_token_ids(generation_config, model.config)

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

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits at every position, fp32 [T, vocab] on the CPU: row t scores token t+1."""
        ids = torch.tensor(self._token_ids(token_ids), dtype=torch.long)
        hidden = self.model.forward(ids, 0, self.model.new_cache())
        return self.model.logits(hidden).cpu()

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
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_tokens=max_tokens, ignore_eos=ignore_eos,
                                stop_token_ids=tuple(stop_token_ids or ()))
        config = EngineConfig(max_context=len(ids) + max_tokens, max_concurrency=1,
                              kv_dtype="bf16", device=str(self.model.device))
        engine = Engine(self.model, config, generation_config=self.generation_config)
        engine.add_request(EngineRequest("generate", tuple(ids), params, time.perf_counter()))
        out: list[int] = []
        finish: FinishReason = "length"
        while engine.has_unfinished():
            for output in engine.step():
                out.extend(output.new_token_ids)
                if output.finish_reason == "stop":
                    finish = "stop"
        text = None
        if self.tokenizer is not None:
            content = out[:-1] if finish == "stop" else out
            text = self.tokenizer.decode(content, skip_special_tokens=True)
        return GenerationResult(tuple(out), text, finish)
