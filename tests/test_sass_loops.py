"""The prompt kernels' inner loops in sm_90 SASS, compiled on a CPU (scripts/sass_report.py):
what docs/perf.md's 2026-12-05 (third and fourth session) changes rest on, kept true. Hopper
issues conversions (I2F, F2FP) at a fraction of the FP32 rate, so INT8 attention tiles convert
no code with I2F and walk the tiles every row sees without a mask, nvfp4 prompt GEMMs on fp16
operands multiply and round no weight in fp32, and the MoE align sorts without one-hot expert
vectors (~20 s on 2 cores). The kernels compile in a child process: the tests run under
Triton's interpreter, which compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="needs Triton's CUDA backend")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# a child process: the loops of each kernel, largest first, as [instructions, opcode counts]
_CHILD = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    sys.path.insert(0, "scripts")
    import sass_report as sr
    import triton

    def loops(kernel):
        with tempfile.TemporaryDirectory() as tmp:
            found = sr.loops(sr.sass(kernel.asm["cubin"], Path(tmp))[0])
        return [[loop.instructions, dict(loop.opcodes)] for loop in found]

    attn = triton.Config({"BLOCK_N": 64, "PREFETCH": 0}, num_warps=8, num_stages=2)
    gemm = triton.Config({"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8}, num_warps=8,
                         num_stages=3)
    out = {"attention": loops(sr.attention_kernel(128, 8, 1, attn))}
    for operand in (True, False):
        out[f"dense {operand}"] = loops(sr.gemm_kernel("nvfp4", operand, gemm))
    for place in (True, False):
        out[f"align {place}"] = loops(sr.align_kernel(place))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def loops() -> dict[str, list[tuple[int, Counter]]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: [(n, Counter(ops)) for n, ops in kernel] for name, kernel in found.items()}


def test_int8_prompt_attention_converts_no_code_and_masks_only_the_diagonal(loops) -> None:
    """A 35B prompt tile (128 rows of 8 q heads, BN 64, 8 warps): no I2F anywhere; of the two
    KV walks the whole-tile one (the smaller) selects no score, the masked one does."""
    walks = loops["attention"]
    assert len(walks) >= 2 and not any(ops["I2F"] for _, ops in walks)
    (_, masked), (_, whole) = walks[:2]
    assert whole["MUFU"] >= 32 and masked["MUFU"] >= 32  # both walk KV tiles: exp2 a score
    assert whole["FSEL"] == 0 < masked["FSEL"]
    assert whole["F2FP"] <= 16  # P's conversion only, no K/V element's


def test_nvfp4_prompt_gemms_on_fp16_operands_multiply_no_weight_in_fp32(loops) -> None:
    """The K loop of the prefill GEMM (BM 128, BN 128, 8 warps): on fp16 operands no FMUL or
    I2F and an F2FP per block scale pair (the e4m3 -> f16x2 cvt), where the bf16 tile decode
    has an FMUL per weight and an F2FP per two; a third fewer instructions at least."""
    (fp16_n, fp16), (bf16_n, bf16) = (loops[f"dense {operand}"][0] for operand in (True, False))
    assert fp16["FMUL"] == fp16["I2F"] == 0 < bf16["FMUL"]
    assert 4 * fp16["F2FP"] <= bf16["F2FP"]
    assert fp16_n < 2 / 3 * bf16_n


def test_the_moe_align_places_and_counts_pairs_without_one_hot_expert_vectors(loops) -> None:
    """A 35B prompt chunk's align (9,216 pairs, spans of 512): every loop of the place kernel
    (a span's pairs, 16 chunks of 32; the block owners) and of the count kernel takes under
    400 instructions a thread, where one-hot [32, 512] sums took ~2,750 a chunk of pairs,
    ~3,500 a chunk of blocks and ~800 a chunk of counts (2026-12-05, fifteenth run: 98 and 22
    us a chunk-layer)."""
    for kernel in ("align True", "align False"):
        assert loops[kernel] and max(n for n, _ in loops[kernel]) < 400, kernel
