"""What the elementwise kernel tests share: device, dtypes, inputs and the closeness rule.

On CUDA the kernels run for real in bf16; on a CPU-only machine they run under Triton's
interpreter, which truncates fp32 -> bf16 instead of rounding, so fp16 stands in for bf16.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_runtime.ops.kv_quant import kv_group_size

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float16, torch.float32]


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public ops launch their Triton kernels (use it with `pytest.mark.usefixtures`)."""
    monkeypatch.setenv("NINFER_OPS", "triton")


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.to(DEVICE, dtype)


def check(actual: torch.Tensor, expected: torch.Tensor, atol_steps: float = 1.0) -> None:
    """fp32 to 1e-5; half types within a rounding step or two, at most 1% of elements off."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    step = 2.0 ** -(8 if expected.dtype == torch.bfloat16 else 11)
    torch.testing.assert_close(actual, expected, rtol=2 * step, atol=atol_steps * step)
    assert (actual != expected).float().mean() <= 0.01


def empty_caches(pages: int, page: int, nkv: int, d: int, int8: bool,
                 dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Zeroed K/V pages [pages, page, nkv, d] and, for int8, their fp16 group scales (else
    None, None): store_kv's cache arguments."""
    shape = (pages, page, nkv, d)
    if not int8:
        return [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(2)] + [None, None]
    scales = (pages, page, nkv, d // kv_group_size(d))
    return ([torch.zeros(shape, dtype=torch.int8, device=DEVICE) for _ in range(2)]
            + [torch.zeros(scales, dtype=torch.float16, device=DEVICE) for _ in range(2)])
