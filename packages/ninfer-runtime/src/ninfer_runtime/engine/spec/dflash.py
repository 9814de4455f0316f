"""The DFlash proposer: a block of K drafts per request from one pass of the DFlash draft.

Every target step taps the layers the draft reads (`taps` = target_layer_ids) for all rows.
The committed rows' taps become context K/V in every draft layer (`store_context`, at their
positions, in the draft's own paged caches under the target's page ids). A decode-ready
request then drafts one block [anchor, MASK x K] at positions P .. P+K, P = next_position and
the anchor the token the target sampled last (not run by the target yet): row j of the block
gives the draft for position P+j. The block's own K/V land at P .. P+K and are overwritten by
context as those positions are committed, so rejected drafts leave nothing behind.

Drafts are the argmax of the target's lm_head over the draft's final-normed hidden, or of the
compact draft head (--lm-head-draft); one host copy per step.

CUDA graphs (capture_graphs) cover the block pass and, in rounds where every request is
decode-ready, the context injection with each request's rows padded to K+1: the padding lands
at positions >= P, which the block pass overwrites (it stores before it attends).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs, example_step
from ninfer_runtime.engine.spec.proposer import Committed, padded_rows
from ninfer_runtime.models.cache import PagedKV
from ninfer_runtime.models.dflash import DFlashDraft
from ninfer_runtime.models.loading import DraftArgmax
from ninfer_runtime.ops.host_copy import to_device


class DFlashProposer:
    def __init__(self, draft: DFlashDraft, embed_tokens: torch.Tensor,
                 full_argmax: DraftArgmax, num_drafts: int,
                 draft_argmax: DraftArgmax | None = None):
        if num_drafts + 1 > draft.config.block_size:
            raise ValueError(f"--draft-tokens {num_drafts} does not fit the DFlash draft's "
                             f"block of {draft.config.block_size} (anchor included)")
        self.draft = draft
        self.embed_tokens = embed_tokens
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = draft_argmax or full_argmax
        self.num_drafts = num_drafts
        self.taps = draft.config.target_layer_ids
        self.caches: list[PagedKV] = []
        self.page_size = 0
        self.graphs: StepGraphs | None = None  # the block pass
        self.context_graphs: StepGraphs | None = None  # the padded context injection

    def cache_bytes_per_token(self, int8_kv: bool) -> int:
        """The draft keeps its K/V in the compute dtype whatever the target's KV dtype."""
        c = self.draft.config
        return 2 * c.num_layers * c.num_key_value_heads * c.head_dim * self.draft.dtype.itemsize

    def allocate(self, num_pages: int, page_size: int, int8_kv: bool) -> None:
        self.caches = self.draft.allocate_cache(num_pages, page_size)
        self.page_size = page_size

    def _block_pass(self, blocks: StepBatch) -> tuple[torch.Tensor]:
        """Drafts [B, K] of the blocks [anchor, MASK x K] of a step."""
        h = self.draft.propose(blocks.token_ids, blocks, self.caches, self.embed_tokens)
        b, k = blocks.cu_seqlens.shape[0] - 1, self.num_drafts
        drafts = self.argmax(h.view(b, k + 1, -1)[:, 1:].reshape(b * k, -1))
        return (drafts.view(b, k),)

    def _inject(self, context: StepBatch, taps: torch.Tensor) -> tuple[()]:
        self.draft.store_context(taps, context, self.caches)
        return ()

    def capture_graphs(self, max_concurrency: int, max_pages: int, *,
                       capture: bool = True) -> None:
        """The block pass and the padded context injection: graphs per batch size."""
        device, t = self.draft.device, self.num_drafts + 1
        example = partial(example_step, page_size=self.page_size, device=device)
        self.graphs = StepGraphs(self._block_pass, example, max_pages, capture=capture)
        self.graphs.capture_all(GraphShape.of(b, t, "all") for b in range(1, max_concurrency + 1))
        self.context_graphs = StepGraphs(
            self._inject, example, max_pages, capture=capture,
            example_inputs=lambda shape: (torch.zeros(
                shape.num_tokens, self.draft.config.tap_width, dtype=self.draft.dtype,
                device=device),))
        self.context_graphs.capture_all(GraphShape.of(b, t, "none")
                                        for b in range(1, max_concurrency + 1))

    def _store_context(self, taps: torch.Tensor, committed: Sequence[Committed]) -> None:
        """Every committed row's taps into the draft's caches (through the graph when the
        round allows, `padded_rows`)."""
        device = self.draft.device
        padded = padded_rows(committed, self.num_drafts + 1, self.page_size)
        if self.context_graphs is not None and padded is not None:
            segments, rows = padded
            context = StepBatch.build(segments, self.page_size, device)
            inputs = taps[to_device(rows, torch.int64, taps.device)]
            if self.context_graphs.can_run(context, inputs):
                self.context_graphs.run(context, inputs)
                return
        context = StepBatch.build([Segment(c.next_token_ids, c.start, c.pages, 0, "none")
                                   for c in committed], self.page_size, device)
        rows = to_device([r for c in committed for r in c.rows], torch.int64, taps.device)
        self.draft.store_context(taps[rows], context, self.caches)

    def propose(self, hidden: torch.Tensor, taps: torch.Tensor | None,
                committed: Sequence[Committed]) -> list[list[int]]:
        assert self.caches, "allocate() first"
        assert taps is not None, "DFlash reads the target's taps"
        out: list[list[int]] = [[] for _ in committed]
        if not committed:
            return out
        device = self.draft.device
        self._store_context(taps, committed)
        proposing = [i for i, c in enumerate(committed) if c.propose]
        if not proposing:
            return out
        k, mask = self.num_drafts, self.draft.config.mask_token_id
        blocks = StepBatch.build(
            [Segment([committed[i].next_token_ids[-1], *[mask] * k],
                     committed[i].next_position, committed[i].pages, 0, "all")
             for i in proposing], self.page_size, device)
        run = self.graphs.run if self.graphs is not None and self.graphs.can_run(blocks) \
            else self._block_pass
        [drafts] = run(blocks)
        for i, ids in zip(proposing, drafts.tolist(), strict=True):
            out[i] = ids
        return out
