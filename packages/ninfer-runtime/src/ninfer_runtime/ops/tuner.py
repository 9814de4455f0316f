"""How a decode kernel's plan is chosen: timed on the GPU at its weight shape's first call.

A GEMV's speed in a step depends on what a probe easily hides: the weight streams from memory
(the step's other weights have evicted it) right behind the small kernel before it. So each
candidate (config, K split) is timed as CUDA-graph replays of calls that cycle through enough
copies of the weight to miss the L2, in rounds that take every candidate in turn, and the
fastest is kept for the key (`quant_linear`'s dense GEMVs, `moe`'s expert stages). The choice
is written to disk (`tuning_cache`), so a later process on the same GPU model and Triton
version skips the timing.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable

import torch

from ninfer_runtime.ops import tuning_cache
from ninfer_runtime.ops.compile_ahead import compile_candidates

DECODE_TUNING = True  # False: the first config and split target, untimed (tests)


def tuned_plan(plans: dict, key: tuple, candidates: Callable[[], list],
               runs: Callable[[], list[Callable[[object], None]]], device: torch.device
               ) -> object:
    """plans[key], chosen on the key's first call: on the GPU with DECODE_TUNING, the
    candidate a previous process chose (`tuning_cache`) or else the fastest, timed by
    `streaming_times` over the calls `runs()` makes (each runs a candidate on its own copy
    of the weights); otherwise the first."""
    plan = plans.get(key)
    if plan is None:
        options = candidates()
        plan = options[0]
        if DECODE_TUNING and len(options) > 1 and device.type == "cuda":
            plan = options[_chosen_index(key, options, runs, device)]
        plans[key] = plan
    return plan


def _chosen_index(key: tuple, options: list, runs: Callable[[], list[Callable[[object], None]]],
                  device: torch.device) -> int:
    path = tuning_cache.cache_file(device)
    entry = tuning_cache.entry_key(key, options)
    index = tuning_cache.lookup(path, entry, len(options))
    if index is None:
        times = streaming_times(options, runs())
        index = times.index(min(times))
        tuning_cache.store(path, entry, index)
    return index


_TUNING_ROUNDS = 3  # a candidate's time is its median over rounds that take every candidate


def streaming_times(options: list, runs: list[Callable[[object], None]]) -> list[float]:
    """Each candidate's time a call: the median, over `_TUNING_ROUNDS` rounds that time
    every candidate in turn, of CUDA-graph replays of calls that take the `runs` in turn
    (each a call on its own copy of the weights: together they exceed the L2,
    `weight_copy_count`).

    In a step, a GEMV streams its weight from memory (the step's other weights evicted it)
    right after the small kernel before it, and so do these calls. The previous timing (one
    weight, each call behind a read of twice the L2, one measurement a candidate) ranked the
    27B's 5120 x 6144 candidates within 0.5 us of one another where calls streaming over
    copies differed by 2.8 us (docs/perf.md, twenty-fifth run; the engine's picks there
    differed more for another reason, `decode_plan_rows`). Rounds keep whatever one moment
    gives a candidate from deciding."""
    from triton.testing import do_bench_cudagraph

    compile_candidates(runs[0], options)  # built side by side, then timed one by one

    def cycled(candidate: object) -> Callable[[], None]:
        turn = itertools.cycle(runs)
        return lambda: next(turn)(candidate)

    rep = max(1, 20 // _TUNING_ROUNDS)  # ms of replays a measurement
    rounds = [[do_bench_cudagraph(cycled(c), rep=rep, return_mode="median") for c in options]
              for _ in range(_TUNING_ROUNDS)]
    return [statistics.median(times) for times in zip(*rounds, strict=True)]


_STREAM_L2S = 3  # a tuned call meets a weight copy again after this many L2s of other bytes


def weight_copy_count(nbytes: int, device: torch.device) -> int:
    """How many copies of a call's `nbytes` of weights the decode tuners cycle through: enough
    that a copy is met again only after ~3 L2s of other bytes (1 where one call reads that
    much)."""
    return max(1, math.ceil(_STREAM_L2S * _l2_bytes(device) / nbytes))


def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size
