"""`linear` on the real projection shapes: packed nvfp4 / groupwise-int kernels and bf16 cuBLAS.

Decode (M = 1, 2, 4, 8 tokens) streams the weight once: its ceiling is the bytes moved (packed
codes, scales, activations in, outputs out) at the card's copy bandwidth (ninfer_bench.ceilings).
Prefill (M = 256, the in-register GEMM, nvfp4 also with its tiles decoded to bf16; M = 1,024 and
4,096, dequantized for cuBLAS, nvfp4 at 1,024 also in the in-register GEMM) is tensor-core
bound: its ceiling is 2MNK at the card's bf16 matmul rate. The bf16 rows are F.linear
(cuBLAS), the reference point on the same shapes; the small unquantized projections (in_proj_ba,
the MoE router) compare cuBLAS with ops.skinny_linear. Random stored parts (the kernels' speed
does not depend on the values); small matrices are rotated over several copies so that decode
reads come from HBM, not from the 50 MB L2.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from unittest.mock import patch

import torch

from ninfer_bench.ceilings import against_bandwidth, against_flops
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.ops.linear import Weight, linear
from ninfer_runtime.ops.quant_linear import group_major
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.quant import PackedWeight, get_scheme

MODELS = {"27B": "qwen3_6_27b", "35B-A3B": "qwen3_6_35b_a3b"}
SCHEMES = ("nvfp4", "groupwise-int", "bf16")
DECODE_M = (1, 2, 4, 8)  # batched decode and speculative verification sizes
PREFILL_M = 4096
MID_M = 256  # a short prompt: the in-register GEMM (ops.quant_linear), not cuBLAS
# dequantized for cuBLAS (>= DEQUANT_MIN_M); nvfp4 also through the in-register GEMM, where the
# two cross sets DEQUANT_MIN_M
CROSS_M = 1024
L2_BYTES = 50 * 2**20
MAX_COPIES = 512


def projections(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """names -> (N, K) of every distinct dense projection shape on the decode path (MoE
    experts excluded: they run through the grouped MoE kernels)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    mlp, inter = ("shared_expert", cfg.shared_expert_intermediate_size) if cfg.is_moe \
        else ("mlp", cfg.intermediate_size)
    shapes = {
        "in_proj_qkvz": (cfg.conv_dim + cfg.linear_value_dim, h),
        "out_proj": (h, cfg.linear_value_dim),
        "qkv_proj": ((2 * nq + 2 * nkv) * hd, h),
        "o_proj": (h, nq * hd),
        f"{mlp}.gate_up_proj": (2 * inter, h),
        f"{mlp}.down_proj": (h, inter),
        "lm_head": (cfg.vocab_size, h),
    }
    names: dict[tuple[int, int], list[str]] = {}
    for name, shape in shapes.items():
        names.setdefault(shape, []).append(name)
    return {"|".join(group): shape for shape, group in names.items()}


def small_plain_projections(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """names -> (N, K) of the unquantized projections a decode step runs (ops.skinny_linear):
    GDN's in_proj_ba and, on an MoE, the router with the shared expert's gate."""
    shapes = {"in_proj_ba": (2 * cfg.linear_num_value_heads, cfg.hidden_size)}
    if cfg.is_moe:
        shapes["router_and_gate"] = (cfg.num_experts + 1, cfg.hidden_size)
    return shapes


def random_weight(scheme: str, n: int, k: int, device: str, gen: torch.Generator) -> Weight:
    """A [n, k] weight with random stored parts (plausible scales; values do not matter),
    laid out as the runtime loads it (`group_major`)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=device, generator=gen)

    codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=gen)
    if scheme == "bf16":
        return (rand(n, k) - 0.5).to(torch.bfloat16) * k ** -0.5
    if scheme == "nvfp4":
        parts = {"weight": codes, "weight_scale": (rand(n, k // 16) * 8).to(torch.float8_e4m3fn),
                 "weight_scale_2": rand(n) * 1e-3}
    else:
        parts = {"weight": codes, "weight_scale": (rand(n, k // 128) * 0.02).to(torch.bfloat16),
                 "weight_zero": torch.randint(0, 16, (n, k // 128), device=device,
                                              dtype=torch.uint8, generator=gen)}
    return group_major(PackedWeight(get_scheme(scheme), parts, (n, k)))


def weight_bytes(w: Weight) -> int:
    parts = w.parts.values() if isinstance(w, PackedWeight) else (w,)
    return sum(p.numel() * p.element_size() for p in parts)


def _copies(size: int) -> int:
    """Copies of a weight of `size` bytes that together exceed the L2 four times."""
    return min(MAX_COPIES, max(1, -(-4 * L2_BYTES // size)))


def weight_copies(scheme: str, n: int, k: int, device: str, gen: torch.Generator
                  ) -> list[Weight]:
    """A random [n, k] weight and enough copies of its shape to exceed the L2 four times (a
    decode timed over them reads from HBM, as in a step)."""
    first = random_weight(scheme, n, k, device, gen)
    return [first] + [random_weight(scheme, n, k, device, gen)
                      for _ in range(_copies(weight_bytes(first)) - 1)]


def model_weights(model: str, schemes: Iterable[str], device: str, gen: torch.Generator
                  ) -> Iterator[tuple[str, str, list[Weight]]]:
    """("names NxK", scheme, `weight_copies`) for every decode projection shape of `model` (a
    MODELS label) in each scheme: what the scripts' decode probes iterate over. A caller
    drops each shape's copies (del) before asking for the next, or both sets are live."""
    for name, (n, k) in projections(get_profile(MODELS[model]).config).items():
        for scheme in schemes:
            yield f"{name} {n}x{k}", scheme, weight_copies(scheme, n, k, device, gen)


def save_table(lines: list[str], filename: str) -> None:
    """Write a script's markdown table into $OUT (the device tool's returned folder), if
    set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], filename), "w") as f:
            f.write("\n".join(lines) + "\n")


def bf16_tile_decode():
    """A context in which nvfp4 prompt GEMMs decode their weight tiles to bf16 instead of
    running on fp16 operands (ops.quant_linear.PROMPT_FP16_OPERANDS off), for comparison."""
    from ninfer_runtime.ops import quant_linear

    return patch.object(quant_linear, "PROMPT_FP16_OPERANDS", False)


def _in_register_gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x @ w^T by ops.quant_linear's in-register GEMM at any M (linear dequantizes for cuBLAS
    from DEQUANT_MIN_M rows)."""
    from ninfer_runtime.ops import quant_linear

    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    quant_linear._launch_gemm(x, quant_linear._operands(w), out)
    return out


def _rotating(ws: list[Weight], x: torch.Tensor,
              fn: Callable[[torch.Tensor, Weight], torch.Tensor] = linear
              ) -> Callable[[], torch.Tensor]:
    """A call of fn(x, w) on the next weight copy each time (defeats L2 for small
    matrices). Each copy is called once first, outside any capture, as the engine's warm-up
    does: a weight's first call may tune, compile or read its global scales to the host."""
    for w in ws:
        fn(x, w)
    cycle = itertools.cycle(ws)
    return lambda: fn(x, next(cycle))


def _timed(call: Callable[[], torch.Tensor]) -> float:
    """Median microseconds of call as CUDA-graph replays, after a first call outside the
    capture (which compiles and tunes)."""
    from triton.testing import do_bench_cudagraph

    call()
    torch.cuda.synchronize()
    return do_bench_cudagraph(call, rep=20, return_mode="median") * 1e3


def _row(op: str, shape: str, us: float, moved: int, flops: int, decode: bool) -> dict:
    """One result: decode against the bandwidth ceiling, prefill against the FLOP one."""
    return {"op": op, "shape": shape, "time_us": us, "bytes": moved, "flops": flops,
            **(against_bandwidth(moved, us) if decode else against_flops(flops, us)),
            "achieved": (f"{moved / (us * 1e-6) / 1e12:.2f} TB/s" if decode
                         else f"{flops / (us * 1e-6) / 1e12:.0f} TFLOP/s")}


def _plan(w: Weight, x: torch.Tensor) -> str:
    """The decode plan the tuner chose for this weight (quant_linear), as a shape suffix."""
    from ninfer_runtime.ops import quant_linear

    if not isinstance(w, PackedWeight) or x.shape[0] > quant_linear.SKINNY_MAX_M:
        return ""
    plan = quant_linear.chosen_decode_plan(w, x)
    if plan is None:
        return ""
    c = plan.config
    return f" [BN={c.bn} w={c.warps} dots={c.dots} split {plan.splits}]"


def bench(device: str = "cuda") -> list[dict]:
    """Median time of linear per model, projection, scheme and M, with its ceiling ratio.

    Timed as CUDA-graph replays (as the engine runs decode): kernel time, not Python launch
    overhead, which exceeds a small GEMV's runtime. The first call autotunes.
    """
    if torch.device(device).type != "cuda":
        raise ValueError(f"the linear kernel benchmark needs a CUDA device, not {device!r}")
    # NINFER_BENCH_MODELS=27B / NINFER_BENCH_SCHEMES=nvfp4,bf16 narrow a run (GPU time is dear)
    models = [m for m in os.environ.get("NINFER_BENCH_MODELS", "").split(",") if m]
    schemes = [s for s in os.environ.get("NINFER_BENCH_SCHEMES", "").split(",") if s]
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for label, profile in MODELS.items():
        if models and label not in models:
            continue
        for name, (n, k) in projections(get_profile(profile).config).items():
            for scheme in SCHEMES:
                if schemes and scheme not in schemes:
                    continue
                ws = weight_copies(scheme, n, k, device, gen)
                first, size = ws[0], weight_bytes(ws[0])
                # lm_head is only applied to the last token of a prefill: no prefill row
                ms = DECODE_M if "lm_head" in name else (*DECODE_M, MID_M, CROSS_M, PREFILL_M)
                for m in ms:
                    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
                    shape = f"{label} {name} M={m} N={n} K={k}{_plan(first, x)}"
                    work = (size + 2 * m * (k + n), 2 * m * n * k, m in DECODE_M)
                    rows.append(_row(f"linear {scheme}", shape, _timed(_rotating(ws, x)), *work))
                    if m == MID_M and scheme == "nvfp4":
                        with bf16_tile_decode():
                            us = _timed(_rotating(ws, x))
                        rows.append(_row("linear nvfp4, bf16 tile decode", shape, us, *work))
                    if m == CROSS_M and scheme == "nvfp4":
                        us = _timed(_rotating(ws, x, _in_register_gemm))
                        rows.append(_row("linear nvfp4, in-register GEMM", shape, us, *work))
                del ws, first
        if not schemes or "bf16" in schemes:
            rows += _small_plain(label, get_profile(profile).config, device, gen)
    return rows


def _small_plain(label: str, cfg: ModelConfig, device: str, gen: torch.Generator
                 ) -> list[dict]:
    """cuBLAS (F.linear) against ops.skinny_linear on the small plain projections, decode
    sizes, weights rotated over copies beyond the L2."""
    import torch.nn.functional as F

    from ninfer_runtime.ops.skinny_linear import skinny_linear

    rows = []
    for name, (n, k) in small_plain_projections(cfg).items():
        ws = [random_weight("bf16", n, k, device, gen) for _ in range(_copies(2 * n * k))]
        for m in DECODE_M:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            for kind, fn in (("cuBLAS", F.linear), ("skinny", skinny_linear)):
                us = _timed(_rotating(ws, x, fn))
                rows.append(_row(f"linear bf16 {kind}", f"{label} {name} M={m} N={n} K={k}",
                                 us, 2 * n * k + 2 * m * (k + n), 2 * m * n * k, True))
    return rows
