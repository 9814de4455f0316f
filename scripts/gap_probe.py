"""What each kind of stream operation between two CUDA graph replays costs a step (GPU, ~1 min).

The 35B-A3B's engine step is ~0.10 ms longer than its graph replay (docs/perf.md, thirty-fifth
and thirty-sixth runs) though only ~8 operations run beside the replay: host -> device copies
of the step's inputs, device -> device copies into the graph's static buffers, the sampling
kernel and the ids' copy back. Copies go to the copy engines, and a copy in a compute stream
waits for the kernel before it and makes the kernel after it wait: its cost may be a
copy-engine round trip, not its bytes. This times each kind on its own, a step being a replay
of a graph of LAUNCHES tiny kernels (`--launches`, ~2 ms like the 35B's step) followed by the
operation, STEPS steps queued back to back (the host runs ahead, as overlapped decode keeps
it), and the engine's sequence of them; per step, minus the replay alone:

    python3 scripts/gap_probe.py [--launches 400] [--steps 100]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ninfer_bench.kernels.linear import save_table


def _graph(launches: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `launches` dependent one-element kernels."""
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            x.add_(1.0)
    return graph, x


def _operations() -> dict[str, Callable[[], None]]:
    """Each kind of between-replays operation, on buffers of the engine's sizes (a 1-row
    step's packed inputs and page tables ~1 KB, the ids 8 B), and the engine's sequence of
    them as it is and as it could be."""
    flat = torch.zeros(288, dtype=torch.int64, device="cuda")  # the step: packed | tables
    packed, tables = flat[:32], flat[32:]
    pinned_flat = torch.zeros_like(flat, device="cpu").pin_memory()
    static_flat = torch.zeros_like(flat)  # a graph's static step, one row of the same width
    static_packed, static_tables = static_flat[:32], static_flat[32:]
    wide_tables = torch.zeros(2, 512, dtype=torch.int64, device="cuda")
    ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    host_ids = torch.zeros(1, dtype=torch.int64).pin_memory()
    logits = torch.randn(1, 248_320, device="cuda")

    def sample_and_return() -> None:
        torch.argmax(logits, dim=-1, out=ids)  # the sampling kernel's stand-in
        host_ids.copy_(ids, non_blocking=True)
        torch.cuda.Event().record()

    def engine(copy: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[], None]:
        def step() -> None:  # the transfer, the ids fed in, the load, then the sampling
            flat.copy_(pinned_flat, non_blocking=True)
            packed[:1].copy_(ids)
            copy(static_packed, packed)
            copy(static_tables, tables)
            sample_and_return()
        return step

    def straight() -> None:  # the transfer into the static step itself: no device copies
        static_flat.copy_(pinned_flat, non_blocking=True)
        static_packed[:1].copy_(ids)
        sample_and_return()

    return {
        "nothing": lambda: None,
        "host -> device, pinned, 2.3 KB": lambda: flat.copy_(pinned_flat, non_blocking=True),
        "device -> device, 256 B (copy_: a memcpy)":
            lambda: static_packed.copy_(packed, non_blocking=True),
        "device -> device, 256 B (a kernel)": lambda: torch.add(packed, 0, out=static_packed),
        "device -> device, strided 2 KB (copy_)":
            lambda: wide_tables[0, :256].copy_(tables, non_blocking=True),
        "device -> host, pinned, 8 B": lambda: host_ids.copy_(ids, non_blocking=True),
        "one tiny kernel": lambda: ids.add_(1),
        "argmax over the vocabulary (out=)": lambda: torch.argmax(logits, dim=-1, out=ids),
        "event record": lambda: torch.cuda.Event().record(),
        "the engine's sequence (7 operations)":
            engine(lambda dst, src: dst.copy_(src, non_blocking=True)),
        "the same, its device copies by kernels":
            engine(lambda dst, src: torch.add(src, 0, out=dst)),
        "the same, the transfer into the static step (5 operations)": straight,
    }


def _per_step(graph: torch.cuda.CUDAGraph, between: Callable[[], None], steps: int) -> float:
    """Microseconds a step of `steps` queued (replay, operation) steps, best of 3."""
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # the queue is busy before the timing starts, as the engine's is
        start.record()
        for _ in range(steps):
            graph.replay()
            between()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / steps)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--launches", type=int, default=400, help="tiny kernels in the graph")
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    graph, _ = _graph(args.launches)
    ops = _operations()
    for op in ops.values():  # compile and allocate before timing
        op()
    torch.cuda.synchronize()
    base = _per_step(graph, ops["nothing"], args.steps)
    lines = [f"{torch.cuda.get_device_name()}; a step = a replay of {args.launches} tiny "
             f"kernels ({base:.1f} us) and the operation; {args.steps} steps queued",
             "", "| between replays | us a step | over the replay alone |", "|---|---|---|"]
    for name, op in ops.items():
        us = _per_step(graph, op, args.steps)
        lines.append(f"| {name} | {us:.1f} | {us - base:+.1f} |")
        print(lines[-1], flush=True)
    save_table(lines, "gap_probe.md")


if __name__ == "__main__":
    main()
