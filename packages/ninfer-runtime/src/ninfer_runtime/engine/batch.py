"""The step object: everything one forward needs to know about the sequences it advances.

A step is a flat batch of tokens: each sequence contributes one segment (one token when it
decodes, a prompt chunk when it prefills), back to back. Linear layers, MLPs and MoE run over
all tokens at once; attention and the GDN mixer run per segment, over the sequence's KV pages
and GDN state slot. The model reads nothing else: no globals, no per-layer side channels.

The GDN mixer has two paths: recurrent (token by token, fused; decode and speculative verify)
and chunked (prompt chunks). A step's leading segments may take the recurrent path and the rest
the chunked one (`recurrent_tokens`): a decode step is all recurrent; a speculative verify
segment (a segment with `snapshot_slots`) is always recurrent, because the state after each of
its tokens must be kept for rollback, so verify segments go first and prompt chunks after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

import torch

from ninfer_runtime.ops.host_copy import to_device

LogitsRows = Literal["none", "last", "all"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's share of a step: `token_ids` at positions start .., written into `pages`
    (its page table, covering at least start + len(token_ids) tokens), continuing the GDN state
    in `state_slot`; `logits` says which of its rows need logits."""

    token_ids: Sequence[int]
    start: int
    pages: Sequence[int]
    state_slot: int
    logits: LogitsRows = "last"
    # speculative verify: the GDN state after token i goes to slot snapshot_slots[i] (distinct
    # slots; the last one may be state_slot), so that any accepted prefix can be resumed
    snapshot_slots: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class StepBatch:
    """N tokens of B sequences (all int64, on the model's device)."""

    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    cu_seqlens: torch.Tensor  # [B+1]: sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1]
    context_lens: torch.Tensor  # [B]: tokens in the KV cache once this step is stored
    page_tables: torch.Tensor  # [B, max_pages], rows padded with page 0
    slot_mapping: torch.Tensor  # [N]: flat KV slot (page * page_size + offset) of each token
    state_slots: torch.Tensor  # [B]: GDN state slot of each sequence
    # [R]: rows whose logits the caller needs, increasing (each segment's in order)
    logits_rows: torch.Tensor
    # cu_seqlens of the segments after the first recurrent_seqs (the chunked path's), counted
    # from row recurrent_tokens: one tensor for every layer of the step (fla-core caches the
    # chunk indices it derives from it, on the host, by the tensor)
    chunked_cu_seqlens: torch.Tensor
    # the step's one host-to-device copy: every tensor of the step but the page tables is a
    # view of it as built (`replace` may swap one out), so a CUDA graph's static step takes
    # them all in one copy (cuda_graph.load)
    packed: torch.Tensor
    # [recurrent_tokens]: GDN state slot after each recurrent row (None: the segments' own)
    snapshot_slots: torch.Tensor | None = None
    # NOTE: host-side, so layers choose the GDN path without a device sync: rows [0,
    # recurrent_tokens) of the first recurrent_seqs segments take the recurrent (decode) path,
    # the others the chunked (prompt) path
    recurrent_tokens: int = 0
    recurrent_seqs: int = 0
    # host-side too: the step is one sequence's prompt chunk, and this is its context once
    # stored (0 for any other step): attention may gather that context once for the chunk
    # (ops.attention's lone prompt paths; from position 0 the chunk is its whole context)
    lone_prompt_context: int = 0

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def logits_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of hidden [N, ...] whose logits the step needs: hidden itself where that
        is every row (increasing rows, R of N, are all of them), as in a decode step, which
        so takes no gather launch."""
        rows = self.logits_rows
        return hidden if rows.shape[0] == hidden.shape[0] else hidden[rows]

    @classmethod
    def build(cls, segments: Sequence[Segment], page_size: int,
              device: torch.device | str) -> StepBatch:
        """Host lists -> one tensor each, copied to `device` once."""
        if not segments:
            raise ValueError("a step needs at least one segment")
        verify = sum(s.snapshot_slots is not None for s in segments)
        if any(s.snapshot_slots is not None for s in segments[verify:]):
            raise ValueError("verify segments (with snapshot slots) must precede the others")
        for seg in segments[:verify]:
            assert seg.snapshot_slots is not None
            if len(seg.snapshot_slots) != len(seg.token_ids):
                raise ValueError(f"{len(seg.snapshot_slots)} snapshot slots for a segment of "
                                 f"{len(seg.token_ids)} tokens")
        # a step of single tokens is all recurrent; otherwise only its verify segments are
        recurrent = segments if all(len(s.token_ids) == 1 for s in segments) else \
            segments[:verify]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        for seg in segments:
            n, end = len(seg.token_ids), seg.start + len(seg.token_ids)
            if n == 0 or len(seg.pages) * page_size < end:
                raise ValueError(f"segment of {n} tokens at {seg.start} does not fit its "
                                 f"{len(seg.pages)} pages of {page_size}")
            first = len(tokens)
            tokens.extend(seg.token_ids)
            positions.extend(range(seg.start, end))
            slots.extend(seg.pages[p // page_size] * page_size + p % page_size
                         for p in range(seg.start, end))
            if seg.logits == "all":
                rows.extend(range(first, first + n))
            elif seg.logits == "last":
                rows.append(first + n - 1)
        width = max(len(seg.pages) for seg in segments)
        fields = {
            "token_ids": tokens,
            "positions": positions,
            "cu_seqlens": [0, *accumulate(len(s.token_ids) for s in segments)],
            "context_lens": [s.start + len(s.token_ids) for s in segments],
            "slot_mapping": slots,
            "state_slots": [s.state_slot for s in segments],
            "logits_rows": rows,
            "chunked_cu_seqlens": [0, *accumulate(len(s.token_ids)
                                                  for s in segments[len(recurrent):])],
        }
        if verify:
            fields["snapshot_slots"] = [slot for s in recurrent
                                        for slot in (s.snapshot_slots or [s.state_slot])]
        tables = [p for s in segments for p in (*s.pages, *[0] * (width - len(s.pages)))]
        tensors, packed, flat_tables = _to_device(fields, tables, device)
        return cls(**tensors, packed=packed,
                   page_tables=flat_tables.view(len(segments), width),
                   recurrent_tokens=sum(len(s.token_ids) for s in recurrent),
                   recurrent_seqs=len(recurrent),
                   lone_prompt_context=segments[0].start + len(segments[0].token_ids)
                   if len(segments) == 1 and not recurrent else 0)


def _to_device(fields: dict[str, list[int]], tables: list[int], device: torch.device | str
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One int64 tensor per field, the packed buffer they are views of, and the page tables
    after it, all copied to `device` in one transfer (a step's eight small copies cost the
    host more than the data) that does not wait for the device (`host_copy`), each starting
    on 16 bytes so that Triton sees the same pointer alignment whatever the lengths."""
    padded = [values + [0] * (len(values) % 2) for values in fields.values()]
    lengths = [len(v) for v in padded]
    flat = to_device([v for values in (*padded, tables) for v in values], torch.int64, device)
    packed, flat_tables = flat.split([sum(lengths), len(tables)])
    parts = packed.split(lengths)
    return ({name: part[:len(values)] for (name, values), part in
             zip(fields.items(), parts, strict=True)}, packed, flat_tables)
