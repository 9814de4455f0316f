"""The MTP proposer: the checkpoint's multi-token-prediction layer, applied K times.

Every target step first runs the MTP over all committed rows of all requests as one batch (the
"first pass", specdecode.md B.3): row t pairs the target's final-normed hidden at t with the
token at t+1 and writes the MTP layer's K/V at t, so its cache holds every committed position.
For a decode-ready request the pass's last row (position C-1, paired with the newly sampled
token at C) gives draft d1 for position C+1. Then K-1 single-token steps: d_j at position
C+j-1 with the MTP's own previous output hidden gives d_{j+1}. Their K/V entries are
overwritten by the next first pass, which starts at the first uncommitted position.

Drafts are the argmax of the full lm_head, or of the compact draft head (--lm-head-draft).
They stay on the device until all K are known: one host copy per step.

CUDA graphs (capture_graphs) cover both kinds of draft step. In a round where every request
is decode-ready, the first pass runs each request's segment padded to K+1 rows (a fixed shape):
the padding rows write MTP K/V past the committed positions, where the chain steps overwrite
them before anything reads them (each step stores its position before attending to it), and
the draft comes from the request's last committed row. Rounds with prompt chunks run it
eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs, example_step
from ninfer_runtime.engine.kv_pool import kv_bytes_per_token
from ninfer_runtime.engine.spec.proposer import Committed, padded_rows
from ninfer_runtime.models.cache import PagedKV
from ninfer_runtime.models.loading import DraftArgmax
from ninfer_runtime.models.mtp import Qwen3_5MTP
from ninfer_runtime.ops.host_copy import to_device


class MTPProposer:
    taps: tuple[int, ...] = ()

    def __init__(self, mtp: Qwen3_5MTP, num_drafts: int, draft_argmax: DraftArgmax | None = None):
        self.mtp = mtp
        self.num_drafts = num_drafts
        self.argmax = draft_argmax or (lambda hidden: mtp.logits(hidden).argmax(-1))
        self.kv: PagedKV | None = None
        self.page_size = 0
        self.graphs: StepGraphs | None = None  # the single-token chain steps
        self.first_graphs: StepGraphs | None = None  # the padded first pass

    def cache_bytes_per_token(self, int8_kv: bool) -> int:
        """One attention layer's K/V in the target's KV format."""
        cfg = self.mtp.config
        return kv_bytes_per_token(cfg, "int8" if int8_kv else "bf16", self.mtp.dtype) \
            // cfg.layer_types.count(FULL_ATTENTION)

    def allocate(self, num_pages: int, page_size: int, int8_kv: bool) -> None:
        self.kv = self.mtp.allocate_cache(num_pages, page_size, int8_kv)
        self.page_size = page_size

    def _chain_step(self, step: StepBatch, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv is not None
        hidden = self.mtp.forward_batch(step, hidden, self.kv)
        return hidden, self.argmax(hidden)

    def _first_pass(self, batch: StepBatch, hidden: torch.Tensor, last: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP over committed rows; the hidden and draft of rows `last` (one per
        proposing request)."""
        assert self.kv is not None
        h = self.mtp.forward_batch(batch, hidden, self.kv)[last]
        return h, self.argmax(h)

    def capture_graphs(self, max_concurrency: int, max_pages: int, *,
                       capture: bool = True) -> None:
        """The padded first pass and the K-1 chain steps: graphs per batch size."""
        device, h, k = self.mtp.device, self.mtp.config.hidden_size, self.num_drafts

        def hidden(rows: int) -> torch.Tensor:
            return torch.zeros(rows, h, dtype=self.mtp.dtype, device=device)

        example = partial(example_step, page_size=self.page_size, device=device)

        def first_inputs(shape: GraphShape) -> tuple[torch.Tensor, torch.Tensor]:
            n, t = shape.num_seqs, shape.tokens_per_seq
            return hidden(n * t), torch.arange(n, device=device) * t + t - 1

        self.first_graphs = StepGraphs(self._first_pass, example, max_pages, capture=capture,
                                       example_inputs=first_inputs)
        self.first_graphs.capture_all(GraphShape.of(b, k + 1, "none")
                                      for b in range(1, max_concurrency + 1))
        self.graphs = StepGraphs(
            self._chain_step, example, max_pages, capture=capture,
            example_inputs=lambda shape: (hidden(shape.num_seqs),))
        self.graphs.capture_all(GraphShape.of(b, 1, "last")
                                for b in range(1, max_concurrency + 1))

    def _padded_first_pass(self, hidden: torch.Tensor, committed: Sequence[Committed]
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first pass through its graph, when the round allows (`padded_rows`)."""
        t = self.num_drafts + 1
        padded = padded_rows(committed, t, self.page_size)
        if self.first_graphs is None or padded is None:
            return None
        segments, rows = padded
        batch = StepBatch.build(segments, self.page_size, self.mtp.device)
        last = [i * t + len(c.rows) - 1 for i, c in enumerate(committed)]
        index = to_device(rows + last, torch.int64, hidden.device)
        inputs = (hidden[index[:len(rows)]], index[len(rows):])
        if not self.first_graphs.can_run(batch, *inputs):
            return None
        h, d1 = self.first_graphs.run(batch, *inputs)
        return h.clone(), d1.clone()  # the graph's output buffers are reused

    def propose(self, hidden: torch.Tensor, taps: torch.Tensor | None,
                committed: Sequence[Committed]) -> list[list[int]]:
        assert self.kv is not None, "allocate() first"
        out: list[list[int]] = [[] for _ in committed]
        if not committed:
            return out
        device = self.mtp.device
        proposing = [i for i, c in enumerate(committed) if c.propose]
        graphed = self._padded_first_pass(hidden, committed)
        if graphed is not None:
            h, d1 = graphed
        else:
            first = StepBatch.build([Segment(c.next_token_ids, c.start, c.pages, 0,
                                             "last" if c.propose else "none")
                                     for c in committed], self.page_size, device)
            rows = to_device([r for c in committed for r in c.rows], torch.int64, hidden.device)
            h, d1 = self._first_pass(first, hidden[rows], first.logits_rows)
        if not proposing:
            return out
        drafts = [d1]
        for j in range(1, self.num_drafts):
            step = StepBatch.build(
                [Segment([0], committed[i].next_position + j - 1, committed[i].pages, 0)
                 for i in proposing], self.page_size, device)
            # the token ids are the previous drafts, still on the device
            step = replace(step, token_ids=drafts[-1])
            if self.graphs is not None and self.graphs.can_run(step, h):
                h, ids = self.graphs.run(step, h)
                drafts.append(ids.clone())  # the graph's output buffer is reused
            else:
                h, ids = self._chain_step(step, h)
                drafts.append(ids)
        for i, ids in zip(proposing, torch.stack(drafts, dim=1).tolist(), strict=True):
            out[i] = ids
        return out
