"""What a kernel boundary costs a decode step, against a barrier inside one kernel (GPU, ~1 min).

A short decode GEMV pays ~4.6 us a call beyond its bytes (docs/perf.md, twenty-eighth run) and
the 35B-A3B's ~10 launches a layer take ~64 us where its bytes take ~11 (twenty-ninth): the
decode steps are chains of kernel boundaries. A persistent kernel over several of a layer's
ops would replace each boundary by a wait inside the kernel. Before building one, this times
the two on the same work: STEPS steps, each streaming its own slab of MB megabytes (beyond the
L2 over the steps) over P programs (the SMs x --per-sm), each step reading a value the step
before it wrote:

- `kernels`: a launch a step, with programmatic dependent launch as the engine's kernels use
  it (`ops.launch`: wait for the predecessor, then read);
- `kernels, no PDL`: the same, plain launches;
- `persistent`: one launch, the P programs (all resident) meeting at a grid barrier between
  steps (an arrival counter, released by each program, then a spin until all arrived);
- `persistent, no barrier`: the same streaming without the barrier (no step waits).

Per step, kernels - persistent is what a boundary costs beyond a barrier, persistent - no
barrier what the barrier costs, and the last column the slab's bytes at the copy bandwidth.
Times are CUDA-graph replays (`ninfer_bench.kernels.linear._timed`) over the whole chain. A
program streams whole 4 KB blocks, so a slab under P x 4 KB leaves programs idle.

    python3 scripts/boundary_probe.py [--mb 0,1,4,16] [--steps 64] [--per-sm 2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ninfer_bench.ceilings import ceilings
from ninfer_bench.kernels.linear import _timed, save_table
from ninfer_runtime.ops.launch import options, wait_for_inputs

_BLOCK = 1024  # int32 words a program loads an iteration (4 KB)
VARIANTS = ("kernels", "kernels, no PDL", "persistent", "persistent, no barrier")


@triton.jit
def _stream(w_ptr, n_words, pid, programs, BLOCK: tl.constexpr):
    """The sum of program pid's share (of `programs`) of n_words int32 words at w_ptr."""
    per = tl.cdiv(tl.cdiv(n_words, programs), BLOCK) * BLOCK
    lo = pid * per
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(lo, tl.minimum(lo + per, n_words), BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    return tl.sum(acc)


@triton.jit
def _step_kernel(w_ptr, n_words, step, tok_ptr, out_ptr, BLOCK: tl.constexpr,
                 GDC: tl.constexpr):
    """Step `step`: read the token the previous step wrote (0), stream the step's slab (at
    w_ptr) from an address that depends on it, store the program's sum; program 0 writes the next
    token."""
    pid = tl.program_id(0)
    wait_for_inputs(GDC)
    tok = tl.load(tok_ptr + step)
    total = _stream(w_ptr + tok, n_words, pid, tl.num_programs(0), BLOCK)
    tl.store(out_ptr + pid, total)
    if pid == 0:
        tl.store(tok_ptr + step + 1, tok)


@triton.jit
def _persistent_kernel(w_ptr, n_words, steps, tok_ptr, counter_ptr, out_ptr,
                       BARRIER: tl.constexpr, BLOCK: tl.constexpr):
    """The steps of `_step_kernel` in one launch; with BARRIER, no program starts a step
    before every program has finished the one before (the counter is zero at launch)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    total = 0
    for step in range(steps):
        tok = tl.load(tok_ptr + step, volatile=True)
        total += _stream(w_ptr + tok + n_words.to(tl.int64) * step, n_words, pid, programs,
                         BLOCK)
        if pid == 0:
            tl.store(tok_ptr + step + 1, tok)
        if BARRIER:
            tl.debug_barrier()  # the program's stores are issued before it arrives
            tl.atomic_add(counter_ptr, 1, sem="release")
            target = (step + 1) * programs
            while tl.atomic_add(counter_ptr, 0, sem="acquire") < target:
                pass
            tl.debug_barrier()  # no thread reads on before the spin ended
    tl.store(out_ptr + pid, total)


def _calls(mb: float, steps: int, programs: int) -> dict:
    """The four variants' calls over fresh slabs of mb MB a step."""
    n_words = max(_BLOCK, int(mb * (1 << 20)) // 4 // _BLOCK * _BLOCK) if mb else 0
    w = torch.ones(max(1, steps * n_words), dtype=torch.int32, device="cuda")
    tok = torch.zeros(steps + 1, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(programs, dtype=torch.int32, device="cuda")

    def kernels(launch: dict):
        def chain() -> None:
            for step in range(steps):
                _step_kernel[(programs,)](w[step * n_words:], n_words, step, tok, out,
                                          BLOCK=_BLOCK, **launch)
        return chain

    def persistent(barrier: bool):
        def one() -> None:
            counter.zero_()
            _persistent_kernel[(programs,)](w, n_words, steps, tok, counter, out,
                                            BARRIER=barrier, BLOCK=_BLOCK)
        return one

    return dict(zip(VARIANTS, (kernels(options(w.device)),
                               kernels({"GDC": False, "launch_pdl": False}),
                               persistent(True), persistent(False)), strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", default="0,1,4,16", help="megabytes a step streams")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--per-sm", type=int, default=2, help="programs an SM (all resident)")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * args.per_sm
    bandwidth = ceilings().bandwidth
    lines = [f"{args.steps} steps, {programs} programs ({args.per_sm} an SM); us a step",
             "", "| MB a step | " + " | ".join(VARIANTS) + " | bytes at the bandwidth |",
             "|---|" + "---|" * (len(VARIANTS) + 1)]
    for mb in (float(m) for m in args.mb.split(",")):
        times = [_timed(call) / args.steps for call in _calls(mb, args.steps, programs).values()]
        lines.append(f"| {mb:g} | " + " | ".join(f"{t:.2f}" for t in times)
                     + f" | {mb * (1 << 20) / bandwidth * 1e6:.2f} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    save_table(lines, "boundary_probe.md")


if __name__ == "__main__":
    main()
