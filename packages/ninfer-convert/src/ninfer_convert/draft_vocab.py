"""The vocabulary subset of `--lm-head-draft` and the draft head tensors built from it.

The subset always holds every added token of the tokenizer (special tokens, tool and think
markers) and every eos id, so a draft can propose a stop or a tool call. The rest is filled
either by BPE rank (the lowest ids of the tokenizer's BPE vocabulary are its earliest merges,
the most frequent pieces of its training text) or, with a calibration text, by how often each
token occurs in it when tokenized with the artifact's tokenizer, ties and the remainder by
rank. Ids the tokenizer never produces (the embedding's padding rows) come last.

Stored as `draft_head.token_ids` (int64, sorted) and `draft_head.weight` (those lm_head rows,
in the artifact's weight scheme); models.draft_head.DraftHead reads them.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as BackendTokenizer

from ninfer_convert.checkpoint import ConvertError, SourceTensor
from ninfer_convert.mapping import TensorPlan
from ninfer_convert.sources import ModelSource
from ninfer_runtime.models.draft_head import TOKEN_IDS, WEIGHT

DEFAULT_SIZE = 32768
STORE_PREFIX = "draft_head:"  # the draft head's tensors among the converter's sources


class DraftVocabError(ConvertError):
    """A draft vocabulary that cannot be chosen as asked."""


@dataclass(frozen=True)
class DraftVocab:
    token_ids: tuple[int, ...]  # sorted full-vocabulary ids
    record: dict[str, Any]  # how they were chosen, for the manifest

    def plans(self) -> list[TensorPlan]:
        return [TensorPlan(TOKEN_IDS, (STORE_PREFIX + "token_ids",), "one", "int64"),
                TensorPlan(WEIGHT, (STORE_PREFIX + "weight",), "one", "body")]


def choose_draft_vocab(size: int, vocab_size: int, tokenizer_json: str | None,
                       eos_ids: Sequence[int], text: str | None = None,
                       text_name: str | None = None) -> DraftVocab:
    """`size` ids of [0, vocab_size) (all of them when size >= vocab_size): the tokenizer's
    added tokens and `eos_ids`, then the most frequent tokens of `text` (when given), then by
    rank."""
    if size < 1:
        raise DraftVocabError(f"--draft-vocab {size}: the draft head needs at least one token")
    size = min(size, vocab_size)
    backend = None
    if tokenizer_json is not None:
        try:
            backend = BackendTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust side raises plain Exception for any bad input
            raise DraftVocabError(f"tokenizer.json is not a valid tokenizer: {e}") from None
    elif text is not None:
        raise DraftVocabError("--draft-vocab-text needs a tokenizer, and the source has no "
                              "tokenizer.json")
    added = sorted(backend.get_added_tokens_decoder()) if backend is not None else []
    outside = [i for i in (*added, *eos_ids) if not 0 <= i < vocab_size]
    if outside:
        raise DraftVocabError(f"token id {outside[0]} (added token or eos) is outside the "
                              f"model's vocabulary of {vocab_size}")
    always = sorted(set(added) | set(eos_ids))
    if size < len(always):
        raise DraftVocabError(f"--draft-vocab {size} cannot hold the {len(always)} added tokens "
                              "and eos ids the draft head always includes")
    rank = _rank(backend, vocab_size)
    record: dict[str, Any] = {"size": size, "method": "bpe-rank", "always_included": len(always)}
    order = rank
    if text is not None:
        counts = Counter(t for t in backend.encode(text, add_special_tokens=False).ids
                         if t < vocab_size)
        position = {t: i for i, t in enumerate(rank)}
        frequent = sorted(counts, key=lambda t: (-counts[t], position[t]))
        order = frequent + rank
        record |= {"method": "calibration-text", "calibration": {
            "file": text_name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": sum(counts.values()), "distinct": len(counts)}}
    chosen = set(always)
    for token in order:
        if len(chosen) == size:
            break
        chosen.add(token)
    return DraftVocab(tuple(sorted(chosen)), record)


def with_draft_vocab(source: ModelSource, size: int = DEFAULT_SIZE,
                     text: Path | None = None) -> ModelSource:
    """`source` with a draft head of `size` tokens chosen from its tokenizer and eos ids (and
    by frequency in the calibration text file `text`)."""
    try:
        calibration = None if text is None else text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DraftVocabError(f"{text}: cannot read the calibration text: {e}") from None
    cfg = source.config
    eos = source.generation_config.get("eos_token_id")
    eos_ids = {*cfg.eos_token_ids, *([eos] if isinstance(eos, int) else eos or [])}
    vocab = choose_draft_vocab(size, cfg.vocab_size, source.tokenizer_json, sorted(eos_ids),
                               calibration, None if text is None else text.name)
    return replace(source, draft_vocab=vocab)


def _rank(backend: BackendTokenizer | None, vocab_size: int) -> list[int]:
    """Every id of [0, vocab_size) by rank: the BPE vocabulary's ids in order, then the ids the
    tokenizer does not know (without a tokenizer: plain id order)."""
    if backend is None:
        return list(range(vocab_size))
    regular = sorted(i for i in backend.get_vocab(with_added_tokens=False).values()
                     if i < vocab_size)
    known = set(regular)
    return regular + [i for i in range(vocab_size) if i not in known]


class DraftHeadStore:
    """The draft head's two source tensors: the chosen ids, and the rows of the lm_head source
    `lm_head` (as stored: a ModelOpt NVFP4 triple keeps its layout, rows selected per part)."""

    def __init__(self, vocab: DraftVocab, lm_head: SourceTensor,
                 load: Callable[[str], dict[str, torch.Tensor]]):
        n, (rows, hidden) = len(vocab.token_ids), lm_head.shape
        self._ids = torch.tensor(vocab.token_ids, dtype=torch.int64)
        self._lm_head = lm_head
        self._load = load
        self.tensors = {
            "token_ids": SourceTensor("token_ids", (n,), "I64", "plain", 8 * n,
                                      "--lm-head-draft"),
            "weight": SourceTensor("weight", (n, hidden), lm_head.dtype_tag, lm_head.layout,
                                   lm_head.nbytes * n // rows, lm_head.origin),
        }

    def load(self, name: str) -> dict[str, torch.Tensor]:
        if name == "token_ids":
            return {"weight": self._ids.clone()}
        parts = self._load(self._lm_head.name)
        return {role: t[self._ids] if t.dim() else t for role, t in parts.items()}
