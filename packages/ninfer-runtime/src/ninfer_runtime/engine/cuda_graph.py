"""CUDA graphs of the forward: one graph per step shape, replayed instead of launched.

A decode step of a 27B model is several hundred small kernels; launched one by one from Python
their launch time exceeds their run time, and so can a 1,024-token prompt chunk's on the 35B
MoE (a slow host took ~100 ms of Python a chunk against 42 ms of kernels, docs/perf.md,
fifteenth run). Each graph records the whole forward (and lm_head) for one step shape: B
sequences of T tokens each (T = 1 for plain decode, K + 1 for a speculative verify, a prompt
chunk's length for a lone prompt chunk) and the number of rows whose logits it returns.
Replaying it needs the step's inputs at the addresses the graph recorded, so every captured
shape owns a static StepBatch whose tensors the real step is copied into (page tables padded
to the longest a request can have), and returns static outputs that are only valid until the
next replay.

The same static-buffer path runs without capture (`capture=False`, and always on the CPU), so
the copying and padding are tested on machines without a GPU.

NOTE: everything inside the forward must launch from shapes alone (no host reads of device
values) and Triton's autotuning must have run for every shape before capture: `capture_all`
runs each shape twice eagerly first, under `graph_kernels` as the capture (so that an op with
a faster kernel a graph cannot hold warms up the one it can).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

import torch

from ninfer_runtime.engine.batch import LogitsRows, Segment, StepBatch
from ninfer_runtime.engine.kv_pool import pages_for
from ninfer_runtime.ops.dispatch import graph_kernels

# (step, *inputs) -> outputs, e.g. hidden, logits[, taps]
Forward = Callable[..., tuple[torch.Tensor, ...]]


@dataclass(frozen=True, slots=True)
class GraphShape:
    """B segments of T tokens each, `logits_rows` of whose rows the step returns logits for
    (0, B for each segment's last row, or B * T)."""

    num_seqs: int
    tokens_per_seq: int
    logits_rows: int

    @classmethod
    def of(cls, num_seqs: int, tokens_per_seq: int, logits: LogitsRows) -> GraphShape:
        rows = {"none": 0, "last": num_seqs, "all": num_seqs * tokens_per_seq}[logits]
        return cls(num_seqs, tokens_per_seq, rows)

    @property
    def logits(self) -> LogitsRows:
        """Which rows of each segment: "all" wins where T = 1 (the same rows as "last")."""
        if self.logits_rows == 0:
            return "none"
        return "all" if self.logits_rows == self.num_seqs * self.tokens_per_seq else "last"

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.tokens_per_seq


ExampleBatch = Callable[[GraphShape], StepBatch]  # a valid step of the shape
# example tensors the forward takes beside the step (a draft model's previous hidden state)
ExampleInputs = Callable[[GraphShape], tuple[torch.Tensor, ...]]


def shape_of(batch: StepBatch) -> GraphShape | None:
    """The graph shape a step would replay, or None when its segments differ in length."""
    n, b = batch.num_tokens, batch.state_slots.shape[0]
    if n % b:
        return None
    return GraphShape(b, n // b, batch.logits_rows.shape[0])


def example_step(shape: GraphShape, page_size: int, device: torch.device | str) -> StepBatch:
    """A step of the shape's segments from position 0 on pages 0.. (state slot 0): what a
    graph records; what it writes there is overwritten before anyone reads it."""
    pages = range(pages_for(shape.tokens_per_seq, page_size))
    segment = Segment([0] * shape.tokens_per_seq, 0, pages, 0, shape.logits)
    return StepBatch.build([segment] * shape.num_seqs, page_size, device)


_FIELDS = tuple(f.name for f in fields(StepBatch))


class _Captured:
    """One shape's static inputs, outputs and (on a GPU) its graph."""

    def __init__(self, example: StepBatch, max_pages: int, inputs: tuple[torch.Tensor, ...]):
        self.static = _padded(example, max_pages)
        self.packed_at = _packed_offsets(self.static)
        # tensor fields the static step keeps outside its packed buffer: copied every step
        self.apart = [name for name in _FIELDS if name not in ("packed", "page_tables")
                      and name not in self.packed_at
                      and isinstance(getattr(self.static, name), torch.Tensor)]
        self.inputs = tuple(t.clone() for t in inputs)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def load(self, batch: StepBatch, inputs: tuple[torch.Tensor, ...]) -> None:
        """Copy the step's inputs into the static ones (same shapes, page tables padded): its
        packed tensors in one copy, the page tables and any tensor swapped out of the packed
        buffer (or at another place in it) one by one."""
        for src, dst in zip(inputs, self.inputs, strict=True):
            dst.copy_(src, non_blocking=True)
        self.static.packed.copy_(batch.packed, non_blocking=True)
        tables = batch.page_tables
        self.static.page_tables[:, : tables.shape[1]].copy_(tables, non_blocking=True)
        base, size = batch.packed.data_ptr(), batch.packed.element_size()
        for name, at in self.packed_at.items():
            src = getattr(batch, name)
            if src.data_ptr() != base + at * size:  # not where the packed copy put it
                getattr(self.static, name).copy_(src, non_blocking=True)
        for name in self.apart:
            getattr(self.static, name).copy_(getattr(batch, name), non_blocking=True)


def _packed_offsets(batch: StepBatch) -> dict[str, int]:
    """Where in batch.packed (in elements) each tensor field that lies inside it starts."""
    start, size = batch.packed.data_ptr(), batch.packed.element_size()
    end = start + batch.packed.numel() * size
    offsets = {}
    for name in _FIELDS:
        t = getattr(batch, name)
        if name != "packed" and isinstance(t, torch.Tensor) and start <= t.data_ptr() < end:
            offsets[name] = (t.data_ptr() - start) // size
    return offsets


# host-side fields a graph does not record, at the value it runs with: a graph takes the general
# path, which serves a prompt chunk wherever it starts (lone_prompt_context)
_UNRECORDED = {"lone_prompt_context": 0}


def _padded(batch: StepBatch, max_pages: int) -> StepBatch:
    """Fresh tensors for `batch`, views of a fresh packed buffer where `batch`'s are of its,
    page tables widened to max_pages (padding is page 0), the unrecorded host fields at their
    graph value."""
    tables = batch.page_tables.new_zeros((batch.page_tables.shape[0], max_pages))
    tables[:, : batch.page_tables.shape[1]] = batch.page_tables
    packed = batch.packed.clone()
    at = _packed_offsets(batch)
    tensors = {name: packed[at[name]:][:t.numel()].view_as(t) if name in at else t.clone()
               for name in _FIELDS if isinstance(t := getattr(batch, name), torch.Tensor)}
    return replace(batch, **(tensors | {"page_tables": tables, "packed": packed} | _UNRECORDED))


class StepGraphs:
    """Graphs (or, with capture=False, static-buffer eager runs) of `forward` per shape."""

    def __init__(self, forward: Forward, example: ExampleBatch, max_pages: int, *,
                 capture: bool = True, example_inputs: ExampleInputs | None = None):
        self.forward = forward
        self.example = example
        self.example_inputs = example_inputs
        self.max_pages = max_pages
        self.capture = capture
        self._shapes: dict[GraphShape, _Captured] = {}
        self._pool = None
        self.replays = 0  # steps run through a graph (or its static buffers), for benchmarks

    @property
    def shapes(self) -> list[GraphShape]:
        return list(self._shapes)

    def capture_all(self, shapes: Iterable[GraphShape]) -> None:
        """Warm up (autotune) and capture every shape, largest first so that the smaller
        graphs reuse the largest one's memory pool."""
        for shape in sorted(shapes, key=lambda s: -s.num_tokens):
            inputs = self.example_inputs(shape) if self.example_inputs is not None else ()
            entry = _Captured(self.example(shape), self.max_pages, inputs)
            if self.capture:
                self._record(entry)
            self._shapes[shape] = entry

    def _record(self, entry: _Captured) -> None:
        device = entry.static.token_ids.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with graph_kernels():
            with torch.cuda.stream(stream):
                for _ in range(2):  # autotuning and lazy initialisation: here, not in capture
                    self.forward(entry.static, *entry.inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                entry.outputs = self.forward(entry.static, *entry.inputs)
        entry.graph = graph

    def can_run(self, batch: StepBatch, *inputs: torch.Tensor) -> bool:
        shape = shape_of(batch)
        if shape not in self._shapes:
            return False
        entry = self._shapes[shape]
        return _matches(batch, entry.static) and len(inputs) == len(entry.inputs) and all(
            a.shape == b.shape and a.dtype == b.dtype
            for a, b in zip(inputs, entry.inputs, strict=True))

    def run(self, batch: StepBatch, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The forward's outputs (hidden [N, H], logits of the step's logits rows, ...) for
        the step and the extra inputs; valid until the next run."""
        shape = shape_of(batch)
        assert shape is not None and self.can_run(batch, *inputs), "no graph for this step"
        entry = self._shapes[shape]
        entry.load(batch, inputs)
        self.replays += 1
        if entry.graph is None:
            return self.forward(entry.static, *entry.inputs)
        entry.graph.replay()
        return entry.outputs

    def replay(self, shape: GraphShape) -> None:
        """Replay `shape`'s captured graph on whatever its static inputs hold (benchmarks:
        the step's GPU time with no host work between replays)."""
        graph = self._shapes[shape].graph
        assert graph is not None, f"{shape} was not captured"
        graph.replay()


def _matches(batch: StepBatch, static: StepBatch) -> bool:
    """Same tensor shapes (page tables at most as wide), the same optional tensors present
    (snapshot slots) and the same host-side fields, which choose kernels (recurrent_tokens):
    a graph replays only the step it recorded. The unrecorded fields aside (`_UNRECORDED`)."""
    for name in _FIELDS:
        if name in _UNRECORDED:
            continue
        mine, theirs = getattr(batch, name), getattr(static, name)
        if isinstance(mine, torch.Tensor) != isinstance(theirs, torch.Tensor):
            return False
        if not isinstance(mine, torch.Tensor):
            if mine != theirs:
                return False
        elif name == "page_tables":
            if mine.shape[0] != theirs.shape[0] or mine.shape[1] > theirs.shape[1]:
                return False
        elif mine.shape != theirs.shape:
            return False
    return True
