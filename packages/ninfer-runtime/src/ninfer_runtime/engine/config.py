"""Engine settings, resolved before the engine is built (no "auto" survives construction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpecMethod = Literal["none", "mtp", "dflash"]
SPEC_METHODS = ("none", "mtp", "dflash")
# A step's tokens when max_batched_tokens is not given (vLLM's default on GPUs of 70 GiB and
# more): an 8K prompt prefilling alone is one step, whose GEMMs dequantize each weight once
# (the 27B's 8K prefill 8,500 -> 10,023 tok/s against 1,024-token steps, docs/perf.md,
# thirteenth run), in the activation workspace eight 1,024-token chunks took before.
DEFAULT_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class EngineConfig:
    max_context: int = 8192  # prompt + completion tokens per request
    prefill_chunk: int = 8192  # prompt tokens computed per request per step, at most
    # tokens computed per step over every request (vLLM's max_num_batched_tokens): decode
    # tokens first, then prompt chunks in admission order; None: DEFAULT_BATCHED_TOKENS, or a
    # decode step of max_concurrency requests where that is more
    max_batched_tokens: int | None = None
    kv_dtype: Literal["int8", "bf16"] = "int8"  # INT8 with one scale per 64 elements, or bf16
    kv_capacity: int | Literal["auto"] = "auto"  # KV pool size in tokens
    max_concurrency: int = 8  # requests running at once (decode batch size)
    max_queue: int = 256  # waiting requests beyond which new ones are refused (HTTP 429)
    device: str = "cpu"
    page_size: int = 64  # tokens per KV page
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (GPU only)
    # with cuda_graphs, also a step of one short prompt chunk alone (engine.device_setup.
    # graph_shapes): the 35B's 8K prompt in 1,024-token chunks 17.5k -> 26.7k tok/s on an H100,
    # the same tokens (docs/perf.md, seventeenth run)
    prompt_graphs: bool = True
    # launch a plain decode step before the previous one's tokens are read (engine.Engine.step)
    overlap_decode: bool = True
    spec: SpecMethod = "none"  # speculative decoding: the proposer of draft tokens
    draft_tokens: int = 3  # K: drafts per request per step (with spec)
    lm_head_draft: bool = False  # drafts through the artifact's vocabulary-subset draft head

    def __post_init__(self) -> None:
        if self.max_context < 2 or self.prefill_chunk < 1 or self.max_concurrency < 1:
            raise ValueError(f"invalid engine config {self}")
        if self.kv_dtype not in ("int8", "bf16"):
            raise ValueError(f"kv_dtype must be int8 or bf16, got {self.kv_dtype!r}")
        if self.kv_capacity != "auto" and int(self.kv_capacity) < self.page_size:
            raise ValueError(f"kv_capacity {self.kv_capacity} is below one page")
        if self.spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {', '.join(SPEC_METHODS)}, got {self.spec!r}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {self.draft_tokens}")
        if self.lm_head_draft and self.spec == "none":
            raise ValueError("lm_head_draft needs a spec method (mtp or dflash) to draft for")
        if self.max_batched_tokens is not None and self.max_batched_tokens < self.decode_tokens:
            raise ValueError(f"max_batched_tokens {self.max_batched_tokens} is below a decode "
                             f"step of max_concurrency requests ({self.decode_tokens} tokens)")

    @property
    def spec_tokens(self) -> int:
        """Draft tokens verified per request per step: K with spec, else 0."""
        return 0 if self.spec == "none" else self.draft_tokens

    @property
    def prompt_chunk(self) -> int:
        """The most prompt tokens of one request a step computes: a chunk, and a prompt
        leaves room for one token."""
        return min(self.prefill_chunk, self.max_context - 1)

    @property
    def step_tokens(self) -> int:
        """The most tokens a step computes: every running request a full chunk or a decode
        segment, within the step's budget."""
        budget = self.max_batched_tokens or max(DEFAULT_BATCHED_TOKENS, self.decode_tokens)
        return min(self.max_concurrency * max(self.prompt_chunk, 1 + self.spec_tokens), budget)

    @property
    def decode_tokens(self) -> int:
        """The tokens of a decode (verify) step of max_concurrency requests."""
        return self.max_concurrency * (1 + self.spec_tokens)
