"""The proposer interface: what a draft model (MTP, DFlash, a test oracle) sees of the engine.

After every target forward the engine tells the proposer which rows of the step became part of
their sequences (`Committed`: a prompt chunk, or the accepted prefix of a verify segment) with
the tokens that follow them, and asks it for K drafts for every request that is decode-ready.
The proposer owns its caches, addressed by the page ids of each request's target page table
(allocated at engine start, beside the target's), so it needs no bookkeeping of its own:
a request's pages and positions travel in `Committed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ninfer_runtime.engine.batch import LogitsRows, Segment


@dataclass(frozen=True, slots=True)
class Committed:
    """One request's rows of a target step that are now part of its sequence.

    Rows `rows` of the step's hidden states (and taps) sit at positions start, start+1, ..;
    next_token_ids[i] is the token at position start+i+1 (the next prompt token, an accepted
    draft, or, for the last row of a decode-ready request, the newly sampled token). With
    `propose` the request is decode-ready and wants drafts for the positions after it.
    """

    request_id: str
    rows: range
    start: int
    next_token_ids: Sequence[int]
    pages: Sequence[int]
    propose: bool

    @property
    def next_position(self) -> int:
        """Position of the last next token: the first input of the request's next step."""
        return self.start + len(self.rows)


class Proposer(Protocol):
    """Drafts K tokens per decode-ready request, one call per engine step."""

    num_drafts: int  # K
    taps: tuple[int, ...]  # target layers whose outputs `propose` reads (forward_taps)

    def cache_bytes_per_token(self, int8_kv: bool) -> int:
        """Bytes its caches take per token of the KV pool (the startup memory plan counts
        them beside the target's)."""

    def allocate(self, num_pages: int, page_size: int, int8_kv: bool) -> None:
        """Allocate its caches: `num_pages` pages of `page_size` tokens, addressed by the page
        ids of the requests' target page tables (int8_kv: the engine's KV dtype)."""

    def capture_graphs(self, max_concurrency: int, max_pages: int, *,
                       capture: bool = True) -> None:
        """After allocate(): record its fixed-shape draft steps for 1..max_concurrency
        requests as CUDA graphs (capture=False: the same static-buffer path, uncaptured)."""

    def propose(self, hidden: torch.Tensor, taps: torch.Tensor | None,
                committed: Sequence[Committed]) -> list[list[int]]:
        """Take in the committed rows of the step (hidden [N, H]: the target's final-normed
        hidden of every row of the step; taps [N, len(taps) * H] or None when none were
        asked for) and return, per entry of `committed`, K drafts when it proposes, else []."""


def padded_rows(committed: Sequence[Committed], rows_per_seq: int, page_size: int,
                logits: LogitsRows = "none") -> tuple[list[Segment], list[int]] | None:
    """A decode-only round's committed rows as segments of exactly rows_per_seq tokens, for a
    draft step's CUDA graph: each padded with token 0 at the positions after its committed
    ones, and the step's row indices (the padding repeats the last committed row). A draft
    model that stores K/V for these rows must overwrite the padding's positions before it
    reads them. None when some request does not propose, has more rows, or lacks the pages.
    """
    if not all(c.propose and len(c.rows) <= rows_per_seq
               and len(c.pages) * page_size >= c.start + rows_per_seq for c in committed):
        return None
    segments, rows = [], []
    for c in committed:
        pad = rows_per_seq - len(c.rows)
        segments.append(Segment([*c.next_token_ids, *[0] * pad], c.start, c.pages, 0, logits))
        rows += [*c.rows, *[c.rows[-1]] * pad]
    return segments, rows
