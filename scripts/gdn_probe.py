"""Where the chunked GDN prompt path's time goes (GPU, one call, ~1-2 min).

The 27B's 8K prefill spent 148 ms of ~1 s of kernels in the three chunked GDN kernels
(docs/perf.md, eleventh run: prepare 67, scan 52, output 29), ~5x its memory traffic at full
bandwidth. For one 8,192-token sequence at the 27B and 35B-A3B shapes this prints each
kernel's time (profiler, averaged over calls), the scan's and the output's time under every
autotune config (forced one at a time), the share of the prepare kernel that the triangular
inverse takes (a kernel that only inverts [C, C] tiles, at the prepare kernel's grid) and
its error against fp64 on correlated keys, and each compiled kernel's registers, spills and
shared memory, and fla-core's chunked kernels on the same prompt where it is installed (the
issue's acceptable dependency: is ours behind it?). (Its first runs timed the substitution
inverse against recursive doubling: docs/perf.md, fourteenth run.)

    python3 scripts/gdn_probe.py [--tokens 8192] [--models 27B,35B-A3B]
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from ninfer_bench.engine_bench import by_kernel
from ninfer_bench.kernels.gdn import MODELS
from ninfer_runtime.ops import gdn
from ninfer_runtime.profiles import get_profile

CALLS = 5


@triton.jit
def _inverse_kernel(a_ptr, out_ptr, C: tl.constexpr, LEVELS: tl.constexpr,
                    PRECISION: tl.constexpr):
    """One [C, C] strictly lower tile per program, inverted as the prepare kernel does."""
    r = tl.arange(0, C)[:, None] * C + tl.arange(0, C)[None, :]
    base = tl.program_id(0).to(tl.int64) * C * C
    a = tl.load(a_ptr + base + r)
    tl.store(out_ptr + base + r, gdn._unit_lower_inverse(a, C, LEVELS, PRECISION))


def _system(tiles: int, c: int, dk: int, device: str) -> torch.Tensor:
    """Strictly lower A = beta_i exp(G_i - G_j) k_i.k_j of `tiles` chunks whose normalised
    keys share a common direction (k.k up to ~0.8, as correlated keys make), fp32."""
    k = torch.randn(tiles, c, dk, device=device) + 2.0 * torch.randn(tiles, 1, dk, device=device)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(tiles, c, 1, device=device) * 0.5 + 0.5
    cum = (-0.05 * torch.rand(tiles, c, device=device)).cumsum(-1)
    decay = (cum[:, :, None] - cum[:, None, :]).clamp(max=0).exp()
    return ((beta * k) @ k.transpose(1, 2) * decay).tril(-1)


def _inverse_error(a: torch.Tensor, inv: torch.Tensor) -> float:
    """max |inv - (I + a)^-1| / max |(I + a)^-1| over the tiles, against fp64."""
    eye = torch.eye(a.shape[-1], dtype=torch.float64, device=a.device)
    exact = torch.linalg.solve_triangular(eye + a.double(), eye.expand_as(a), upper=False,
                                          unitriangular=True)
    return ((inv.double() - exact).abs().amax() / exact.abs().amax()).item()


def _inverses(tiles: int) -> None:
    """The prepare kernel's inverse alone, time and error, at TF32 (the engine's) and at
    3xTF32."""
    c = gdn.CHUNK_SIZE
    a = _system(tiles, c, 128, "cuda")
    out = torch.empty_like(a)
    for p in ("tf32", "tf32x3"):
        for w in (8, 4):
            us = sum(_kernel_times(lambda w=w, p=p: _inverse_kernel[(tiles,)](
                a, out, C=c, LEVELS=c.bit_length() - 1, PRECISION=p, num_warps=w)).values())
            print(f"  inverse of {tiles} tiles, {p}, {w} warps: {us:9.1f} us, "
                  f"rel. error {_inverse_error(a, out):.2e}")


def _kernel_times(fn) -> dict[str, float]:
    """Microseconds per call of each kernel fn launches (CALLS calls, after a warm call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    return {name: us / CALLS for name, us, _ in by_kernel(prof)}


def _resources(kernel) -> list[str]:
    """registers / spills / shared memory of every compiled variant of a (tuned) kernel."""
    fn = _jit(kernel)
    lines = []
    for cache in getattr(fn, "device_caches", {}).values():
        for compiled in cache[0].values():
            meta = compiled.metadata
            lines.append(f"    regs {compiled.n_regs} spills {compiled.n_spills} shared "
                         f"{meta.shared} warps {meta.num_warps} stages {meta.num_stages}")
    return lines


def _jit(kernel) -> triton.runtime.JITFunction:
    return kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel


def _forced(kernel, fn) -> list[tuple[str, float]]:
    """fn's time in kernel under each of its autotune configs, one at a time."""
    configs, rows = list(kernel.configs), []
    name = kernel.fn.__name__
    try:
        for config in configs:
            kernel.configs = [config]
            kernel.cache.clear()
            us = _kernel_times(fn).get(name, float("nan"))
            rows.append((f"BV {config.kwargs['BV']} warps {config.num_warps} stages "
                         f"{config.num_stages}", us))
    finally:
        kernel.configs = configs
        kernel.cache.clear()
    return rows


def _fla(states: torch.Tensor, ours) -> None:
    """fla-core's chunked gated delta rule (the issue's acceptable dependency, bf16
    intermediates) on the same prompt through the engine's own path (`ops.gdn._launch_fla`,
    NINFER_GDN_PROMPT=fla), its kernels' time and its output against ours."""
    if not gdn.fla_installed():
        print("  fla-core: not installed")
        return

    def run() -> torch.Tensor:
        os.environ["NINFER_GDN_PROMPT"] = "fla"
        try:
            return ours()
        finally:
            os.environ["NINFER_GDN_PROMPT"] = "ninfer"

    try:
        times = _kernel_times(run)
    except Exception as e:  # noqa: BLE001 - a probe line, not a reason to lose the rest
        print(f"  fla-core: {type(e).__name__}: {e}")
        return
    print(f"  fla-core (the engine's fla path): {sum(times.values()):.1f} us a call")
    for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"    {name[:58]:<58} {us:9.1f} us")
    states.zero_()
    mine = ours()
    states.zero_()
    theirs = run().float()
    print(f"  max |fla - ours| / max |ours|: "
          f"{((theirs - mine.float()).abs().max() / mine.float().abs().max()).item():.2e}")


def probe(label: str, tokens: int) -> None:
    cfg = get_profile(MODELS[label]).config
    nv, nk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q, k = (torch.randn(tokens, nk, dk, device=dev, dtype=bf16) for _ in range(2))
    v = torch.randn(tokens, nv, dv, device=dev, dtype=bf16)
    g, beta = gdn.gdn_gating(torch.randn(tokens, nv, device=dev),
                             torch.randn(tokens, nv, device=dev),
                             torch.rand(nv, device=dev).log(), torch.randn(nv, device=dev))
    states = torch.zeros(1, nv, dk, dv, device=dev)
    cu = torch.tensor([0, tokens], dtype=torch.int64, device=dev)
    slots = torch.zeros(1, dtype=torch.int64, device=dev)

    def run() -> torch.Tensor:
        return gdn.gated_delta_rule_varlen(q, k, v, g, beta, states, cu, slots)

    print(f"\n## {label}: {tokens} tokens, nk {nk}, nv {nv}, dk {dk}, dv {dv}")
    times = _kernel_times(run)
    print(f"  all kernels {sum(times.values()):.1f} us a call")
    for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {name[:60]:<60} {us:9.1f} us")
    print(f"  {gdn._gdn_chunked_kernel.__name__} per config:")
    for what, us in _forced(gdn.scan_kernel(dv), run):
        print(f"    {what:<30} {us:9.1f} us")
    _inverses(-(-tokens // gdn.CHUNK_SIZE) * nv)
    _fla(states, run)
    for kernel in (gdn._gdn_chunk_prepare_kernel, gdn._gdn_chunked_kernel,
                   gdn._gdn_chunk_output_kernel, _inverse_kernel):
        print(f"  {_jit(kernel).__name__}:")
        print("\n".join(_resources(kernel)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--models", default="27B,35B-A3B")
    args = p.parse_args()
    os.environ["NINFER_GDN_PROMPT"] = "ninfer"  # ours, timed beside fla's (its own call)
    for label in args.models.split(","):
        probe(label, args.tokens)


if __name__ == "__main__":
    main()
