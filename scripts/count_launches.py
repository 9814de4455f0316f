"""Count the kernel launches of one prefill step and one eager decode step, by kernel.

A prompt chunk of the 35B-A3B is host-bound on the H200 (docs/perf.md, sixth run): the GPU
waits while Python launches its many short kernels. This counts them on a CPU-only machine:
the tiny profile (same layer structure as the real one) runs with NINFER_OPS=triton under
TRITON_INTERPRET=1; every torch op that launches a kernel on a GPU and every Triton launch of
the step is counted (ops inside the interpreter's own work are not).

    .venv/bin/python scripts/count_launches.py [tiny_moe|tiny_dense]   (~3 min for tiny_moe)
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ["NINFER_OPS"] = "triton"

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from ninfer_convert.build import BuildOptions, build  # noqa: E402
from ninfer_convert.sources import open_source  # noqa: E402
from ninfer_runtime.engine import Engine, EngineConfig, EngineRequest  # noqa: E402
from ninfer_runtime.engine.request import SamplingParams  # noqa: E402
from ninfer_runtime.models.loading import load_artifact  # noqa: E402

# views, metadata and allocations: no kernel on a GPU
NO_LAUNCH = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
             "aten.new_empty.default", "aten.view.default", "aten.view.dtype",
             "aten._unsafe_view.default", "aten.slice.Tensor", "aten.select.int",
             "aten.t.default", "aten.as_strided.default", "aten.unsqueeze.default",
             "aten.squeeze.dim", "aten.expand.default", "aten.transpose.int",
             "aten.permute.default", "aten.split.Tensor", "aten.split_with_sizes.default",
             "aten.chunk.default", "aten.unbind.int", "aten.reshape.default",
             "aten.detach.default", "aten.detach_.default", "aten.alias.default",
             "aten.lift_fresh.default", "aten.promote_types.default"}


class LaunchCounter(TorchDispatchMode):
    """Counts torch ops and Triton launches while `on`, not those inside a Triton launch."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.on = False
        self.depth = 0
        run = interpreter.InterpretedFunction.run
        counter = self

        def counted_run(fn, *args, **kwargs):
            if counter.on and not counter.depth:
                counter.counts["triton " + fn.fn.__name__] += 1
            counter.depth += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                counter.depth -= 1

        interpreter.InterpretedFunction.run = counted_run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        same_dtype_copy = str(func) == "aten.to.dtype" and out is args[0]
        if self.on and not self.depth and str(func) not in NO_LAUNCH and not same_dtype_copy:
            self.counts["torch " + str(func)] += 1
        return out

    def take(self) -> collections.Counter[str]:
        counts, self.counts = self.counts, collections.Counter()
        return counts


def main(profile: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = build(open_source(profile, random_init=True), Path(tmp) / "model.ninfer",
                     BuildOptions(weights="nvfp4", include_vision=False, include_mtp=False))
        loaded = load_artifact(path, "cpu", dtype=torch.bfloat16)
    layers = len(loaded.model.config.layer_types)
    engine = Engine(loaded.model, EngineConfig(max_context=512, max_concurrency=1,
                                               prefill_chunk=128, kv_dtype="int8", device="cpu"))
    prompt = tuple(torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(0))
                   .tolist())
    engine.add_request(EngineRequest("r", prompt, SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True), arrival_time=time.perf_counter()))
    counter = LaunchCounter()
    with counter:
        engine.step()  # the first chunk
        counter.on = True
        engine.step()  # a chunk after cached context
        counter.on = False
        steps = {"prefill chunk of 128 tokens": counter.take()}
        engine.step()  # the last chunk and the first token
        engine.step()
        counter.on = True
        engine.step()
        counter.on = False
        steps["decode step, eager"] = counter.take()
    print(f"{profile}: {layers} layers")
    for name, counts in steps.items():
        total = sum(counts.values())
        print(f"\n{name}: {total} launches ({total / layers:.1f} a layer)")
        for kernel, n in counts.most_common():
            print(f"{n:5d}  {kernel}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny_moe")
