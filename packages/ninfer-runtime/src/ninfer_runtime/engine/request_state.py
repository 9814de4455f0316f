"""The engine's record of one request from admission to finish (plain data, no tensors but
the sampler's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_runtime.engine.request import EngineRequest, RequestStats
from ninfer_runtime.engine.sampler import SamplerState


@dataclass(eq=False, slots=True)
class RequestState:
    """A request's progress. Its tokens are the prompt then the output; `num_computed` of them
    are in its KV pages and state slot. While prefilling, the next step computes a prompt chunk;
    afterwards the last output token is the one input of each decode step."""

    request: EngineRequest
    sampler: SamplerState
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # reserved at admission, for every token
    slot: int | None = None  # GDN state slot, set at admission
    extra_slots: list[int] = field(default_factory=list)  # speculative: K per-position slots
    drafts: list[int] = field(default_factory=list)  # speculative: to verify in the next step
    num_computed: int = 0
    stats: RequestStats = field(default_factory=RequestStats)
    first_scheduled: float | None = None  # perf_counter() of its first step
    first_token: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def max_len(self) -> int:
        """Tokens it may ever hold: its KV reservation."""
        return self.prompt_len + self.request.sampling.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    def token_ids(self, lo: int, hi: int) -> list[int]:
        """Its tokens at positions lo .. hi-1 (the prompt, then the output)."""
        prompt = self.request.prompt_token_ids
        n = len(prompt)
        return [*prompt[lo:hi], *self.output[max(lo - n, 0):max(hi - n, 0)]]

    def next_tokens(self, prefill_chunk: int) -> list[int]:
        """This step's input: the next prompt chunk, or the last sampled token (followed by
        the drafts to verify, with speculative decoding)."""
        if self.prefilling:
            prompt = self.request.prompt_token_ids
            return list(prompt[self.num_computed:self.num_computed + prefill_chunk])
        assert self.num_computed == self.prompt_len + len(self.output) - 1, "not decode-ready"
        return [self.output[-1], *self.drafts]
