"""Tokenizer: a `tokenizers` tokenizer.json, the chat template and the stop tokens, in one object.

The chat template is rendered the way Hugging Face `apply_chat_template` renders it (sandboxed
Jinja with trim_blocks/lstrip_blocks, `raise_exception`, a non-escaping `tojson`), so the
template a real checkpoint ships renders the same prompt here as in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from importlib import resources
from typing import Any, Literal, NoReturn, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

# Stop tokens when the generation config names none: Qwen's end of turn and end of text.
_FALLBACK_EOS = ("<|im_end|>", "<|endoftext|>")
# What a byte-level decoder yields for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT = "\ufffd"

_STANDIN_TEMPLATE = "qwen3_5_chat_template.jinja"


class TokenizerError(ValueError):
    """A tokenizer.json, token or generation config that NInfer cannot use."""


class ChatTemplateError(TokenizerError):
    """The chat template is missing, does not compile, or rejects the conversation."""


class TokenizerSource(Protocol):
    """What `Tokenizer.from_artifact` reads (an opened `.ninfer` artifact provides it)."""

    @property
    def tokenizer_json(self) -> str | None: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def generation_config(self) -> Mapping[str, Any] | None: ...


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: Jinja's own tojson sorts keys and HTML-escapes <, >, & and '; chat templates are
    # written against the transformers filter, which is plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): "
                                f"{e.message}") from e


def _with_parsed_arguments(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Messages whose tool-call arguments are mappings.

    OpenAI clients send `function.arguments` as a JSON string; Qwen templates iterate over it as
    a mapping. Parse it here, copying only the messages that change.
    """
    out: list[Mapping[str, Any]] = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls or not any(isinstance(_function(c).get("arguments"), str) for c in calls):
            out.append(message)
            continue
        parsed = []
        for call in calls:
            function = _function(call)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as e:
                    raise ChatTemplateError(f"message {index}: arguments of tool call "
                                            f"{function.get('name')!r} are not JSON: {e}") from e
                if not isinstance(arguments, dict):
                    raise ChatTemplateError(f"message {index}: arguments of tool call "
                                            f"{function.get('name')!r} are not a JSON object")
                function = {**function, "arguments": arguments}
            parsed.append({**call, "function": function} if "function" in call else function)
        out.append({**message, "tool_calls": parsed})
    return out


def _function(call: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function part of a tool call: OpenAI nests it under "function", others do not."""
    return call.get("function", call)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never splitting a UTF-8 character.

    A token can end in the middle of a multi-byte character; the byte-level decoder then ends
    the text with one U+FFFD for the incomplete character. Each call decodes a short window of
    recent tokens and returns the text past what was already returned, holding back such a
    trailing U+FFFD until the next token completes (or really is) that character. When the
    window ends on a whole character it shrinks to its last few tokens, which stay as context
    for decoders that look at neighbouring tokens.
    """

    _CONTEXT_TOKENS = 4

    def __init__(self, backend: _BackendTokenizer, skip_special_tokens: bool = False) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(self._ids) already returned

    def add(self, token_ids: Iterable[int]) -> str:
        """Feed new tokens; return the text they complete (may be "")."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        complete = not text.endswith(_REPLACEMENT)
        end = len(text) if complete else len(text) - 1
        piece = text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        if complete and len(self._ids) > self._CONTEXT_TOKENS:
            # NOTE: decoding is prefix-stable once the text ends on a whole character:
            # decode(window + more) starts with decode(window), so what follows is new text.
            self._ids = self._ids[-self._CONTEXT_TOKENS:]
            self._emitted = len(self._decode(self._ids))
        return piece

    def flush(self) -> str:
        """End of stream: return whatever is held back, even an incomplete character."""
        piece = self._decode(self._ids)[self._emitted:]
        self._ids = []
        self._emitted = 0
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)


class Tokenizer:
    """Encoding, decoding, streaming detokenization and the chat template of one model."""

    def __init__(self, backend: _BackendTokenizer, chat_template: str | None,
                 eos_token_ids: Sequence[int]) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile_template(chat_template)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)

    @classmethod
    def from_json(cls, tokenizer_json: str, chat_template: str | None = None,
                  generation_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Build from tokenizer.json text, a chat template and generation_config.json contents.

        Stop tokens come from generation_config's `eos_token_id` (an id or a list); without
        one they are <|im_end|> and <|endoftext|>, whichever the vocabulary has.
        """
        try:
            backend = _BackendTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust side raises plain Exception for any bad input
            raise TokenizerError(f"tokenizer.json is not a valid tokenizer: {e}") from e
        eos = (generation_config or {}).get("eos_token_id")
        if eos is None:
            eos_ids = [i for i in map(backend.token_to_id, _FALLBACK_EOS) if i is not None]
        else:
            eos_ids = [eos] if isinstance(eos, int) else list(eos)
        if not eos_ids or not all(isinstance(i, int) for i in eos_ids):
            raise TokenizerError(f"no usable stop tokens: generation_config eos_token_id={eos!r} "
                                 f"and the vocabulary has none of {', '.join(_FALLBACK_EOS)}")
        return cls(backend, chat_template, eos_ids)

    @classmethod
    def from_artifact(cls, artifact: TokenizerSource) -> Tokenizer:
        """Build from what an artifact carries (tokenizer.json, template, generation config)."""
        if not artifact.tokenizer_json:
            raise TokenizerError(f"{artifact!r} carries no tokenizer.json")
        return cls.from_json(artifact.tokenizer_json, artifact.chat_template,
                             artifact.generation_config)

    @cached_property
    def vocab_size(self) -> int:
        """One past the largest token id (regular and added tokens).

        The model's embedding can have more rows (Qwen pads 248077 ids to 248320); ids in
        between are never produced by encode.
        """
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it (<|im_start|>...) become their ids."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer (one per sequence)."""
        return IncrementalDetokenizer(self._backend, skip_special_tokens)

    def token_id(self, text: str) -> int:
        """The id of a single token, e.g. "<|im_end|>"."""
        token_id = self._backend.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"{text!r} is not a token of this vocabulary")
        return token_id

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, enable_thinking: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for a conversation (OpenAI-style messages and tools).

        Extra keyword arguments reach the template as variables (chat_template_kwargs such as
        preserve_thinking or add_vision_id).
        """
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        try:
            return self._template.render(
                messages=_with_parsed_arguments(messages), tools=tools,
                add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                **kwargs)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template rejected the conversation: {e}") from e


def load_standin(kind: Literal["tiny", "qwen"]) -> tuple[str, str]:
    """(tokenizer.json text, chat template) of a packaged stand-in tokenizer.

    "tiny" puts the Qwen special tokens at 1000.. (the tiny profiles' ids); "qwen" puts them at
    the real Qwen ids 248044.. (random-init artifacts of the real profiles). Both share the same
    1000 regular tokens; scripts/make_standin_tokenizer.py builds them.
    """
    if kind not in ("tiny", "qwen"):
        raise ValueError(f"unknown stand-in tokenizer {kind!r}; expected 'tiny' or 'qwen'")
    files = resources.files("ninfer_runtime.profiles")
    return (files.joinpath(f"standin_tokenizer_{kind}.json").read_text(encoding="utf-8"),
            files.joinpath(_STANDIN_TEMPLATE).read_text(encoding="utf-8"))
