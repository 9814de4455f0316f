"""scripts/hopper_compile.py on the MoE prompt-path tests and the dense decode MLP's: every
kernel specialization they launch under the interpreter (and its bf16 H200 twin) compiles for
sm_90 (~100 s on 2 cores): align, the grouped GEMM (its tile decode) and the weighted sum of
the in-register path, the dequantization and SiLU of the dequantized one; the MLP's two decode
GEMVs in one launch (`quant_linear._mlp_block_kernel`), as two, and the activation pass. The
GPU found 7564065's failure in the grouped GEMM; this finds such failures on a CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="needs Triton's CUDA backend")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(("tests", "select", "kernels"), [
    ("tests/kernels/test_moe.py", "grouped or dequantiz", 5),
    ("tests/kernels/test_linear.py", "mlp_block", 3),
])
def test_kernels_compile_for_sm90(tests: str, select: str, kernels: int) -> None:
    done = subprocess.run(
        [sys.executable, "scripts/hopper_compile.py", tests, "-k", select], cwd=ROOT,
        capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert f"specializations of {kernels} kernels compiled, 0 failed" in summary, summary
