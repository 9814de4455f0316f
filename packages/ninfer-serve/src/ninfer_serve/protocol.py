"""Request bodies of the OpenAI routes, validated, and their mapping to engine SamplingParams.

Validation is strict (a string where a number belongs is a 400, never coerced) and the ranges are
declared on the fields, so a bad value is rejected before any work with a message naming it.
Unknown fields are ignored, as OpenAI-compatible servers do; known fields this server cannot honour
(images, structured output, echo, suffix) are rejected rather than silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ninfer_runtime.engine.request import SamplingParams
from ninfer_serve.errors import APIError

MAX_TOP_LOGPROBS = 20
MAX_N = 16
_INT64 = 2**63


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM, SGLang)


class SamplingRequest(_Model):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's default: special tokens (<|im_start|>, <|vision_pad|>, ...) are left out of the
    # text; <think> and <tool_call> are not special, so the reasoning and tool parsers see them
    skip_special_tokens: bool = True

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # earlier reasoning, for interleaved thinking
    reasoning: str | None = None  # the same under vLLM's name

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template reads it (text content, `reasoning_content`)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{index}]: content part type {part.type!r} is "
                                   "not supported (this server takes text only)",
                                   param=f"messages.{index}.content")
                texts.append(part.text)
            out["content"] = "".join(texts)
        else:
            out["content"] = self.content or ""
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


class FunctionDef(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Model):
    type: str


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    # NOTE: generation is not constrained: "required" and a named function are accepted, and
    # whatever calls the model writes are returned.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """Tools to render into the prompt and parse back; None when calls are off."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def check(self) -> None:
        """Cross-field rules pydantic cannot express on single fields."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, f"response_format {self.response_format.type!r} is not "
                           "supported", param="response_format")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise APIError(400, f"tool_choice names {self.tool_choice.function.name!r}, "
                               "which is not in tools", param="tool_choice")
        elif self.tool_choice == "required" and not self.tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        _check_stream_options(self)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        _check_stream_options(self)

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a string or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return prompt  # type: ignore[return-value]
        if len(prompt) == 1:
            return prompt[0]  # type: ignore[return-value]
        raise APIError(400, "batched prompts are not supported; send one request per prompt",
                       param="prompt")


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def _check_stream_options(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")


_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")


def defaults_from_generation_config(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The artifact's sampling defaults (generation_config.json), as SamplingParams fields."""
    out = {k: generation_config[k] for k in _DEFAULT_KEYS if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def sampling_params(req: SamplingRequest, *, defaults: Mapping[str, Any], max_tokens: int,
                    vocab_size: int, logprobs: int | None) -> SamplingParams:
    """Request fields over artifact defaults over SamplingParams' own defaults."""
    for token_id in req.stop_token_ids or []:
        if not 0 <= token_id < vocab_size:
            raise APIError(400, f"stop_token_ids: {token_id} is not a token id (vocabulary "
                           f"size {vocab_size})", param="stop_token_ids")
    values = dict(defaults)
    for key in _DEFAULT_KEYS:
        value = getattr(req, key)
        if value is not None:
            values[key] = value
    if values.get("top_k", 0) < 0:
        values["top_k"] = 0
    return SamplingParams(**values, seed=req.seed, max_tokens=max_tokens,
                          stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos, logprobs=logprobs)


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; with a seed, choice i samples with seed + i so that the choices differ."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]
