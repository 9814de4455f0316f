"""The skinny plain-weight GEMV (a few rows through a small bf16 weight) against F.linear.

On the CPU it runs under Triton's interpreter in fp16 (which mishandles bf16 dots), on a GPU
in bf16. Shapes keep what matters: 1 to 16 rows (8- and 16-row tiles), row counts off the
16-row weight tile, K off the 128-input tile, and K split over several programs whose parts
the last to arrive adds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer_runtime.ops import linear as linear_ops
from ninfer_runtime.ops import norm as norm_ops
from ninfer_runtime.ops import quant_linear, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
ATOL = 2e-2 if DEVICE == "cuda" else 2e-3  # an output rounding of bf16 / fp16


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "triton")


def rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=DTYPE)


@pytest.mark.parametrize("m", [1, 3, 9, 16])
@pytest.mark.parametrize(("n", "k"), [(5, 64), (96, 640), (40, 1000)])
def test_matches_f_linear(m: int, n: int, k: int) -> None:
    x, w = rand(m, k, seed=m), rand(n, k, seed=n + k) / k**0.5
    split_len, splits = skinny_linear.k_split(n, k, torch.device(DEVICE))
    assert (splits > 1) == (k >= 2 * 128)  # these shapes split whenever K allows
    out = skinny_linear.skinny_linear(x, w)
    torch.testing.assert_close(out, F.linear(x.float(), w.float()).to(DTYPE),
                               atol=ATOL, rtol=1e-2)
    # the last part of each row tile reset its arrival counter for the next call
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()


def test_more_k_parts_than_the_last_program_loads_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """40 K parts of a row tile: the last to arrive adds them in two rounds of loads (32 at a
    time, `_PARTS_IN_FLIGHT`), masking the second round's missing parts."""
    monkeypatch.setattr(skinny_linear, "_PROGRAMS_PER_SM", 64)
    x, w = rand(3, 40 * 128, seed=5), rand(16, 40 * 128, seed=6) / 64
    assert skinny_linear.k_split(16, 40 * 128, torch.device(DEVICE))[1] == 40
    torch.testing.assert_close(skinny_linear.skinny_linear(x, w),
                               F.linear(x.float(), w.float()).to(DTYPE), atol=ATOL, rtol=1e-2)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()


def test_linear_takes_it_for_few_rows_through_small_plain_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kernel = skinny_linear.skinny_linear
    monkeypatch.setattr(skinny_linear, "skinny_linear",
                        lambda x, w, **kw: calls.append(x.shape[0]) or kernel(x, w, **kw))
    w = rand(24, 256, seed=1)
    for rows in (1, 16, 17):
        out = linear_ops.linear(rand(rows, 256, seed=rows), w)
        assert out.shape == (rows, 24)
    linear_ops.linear(rand(2, 256, seed=0).float(), w.float())  # fp32 stays with F.linear
    assert calls == [1, 16]
    big = torch.zeros(skinny_linear.MAX_WEIGHT_BYTES // 2 // 256 + 1, 256, dtype=DTYPE,
                      device=DEVICE)
    assert not skinny_linear.applies(rand(1, 256, seed=0), big)


def test_auto_mode_keeps_f_linear_until_validated_on_a_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "auto")
    x, w = rand(1, 256, seed=0), rand(24, 256, seed=1)
    assert not skinny_linear.applies(x.cpu(), w.cpu())


@pytest.mark.parametrize(("m", "k", "group", "sums"),
                         [(1, 640, 256, False), (3, 1000, 128, True), (16, 2048, 128, True)])
def test_writes_the_decode_operand_of_its_input(m: int, k: int, group: int, sums: bool) -> None:
    """With an operand buffer the kernel also writes x's decode operand, the bits the decode
    GEMV's own activation pass makes (groups past the programs' count in a loop: K 2048 in
    groups of 128 on one row tile), and its product does not change."""
    x, w = rand(m, k, seed=m) * 8, rand(24, k, seed=k) / k**0.5
    operand = quant_linear.DecodeOperand.empty(m, k, group, sums, x.device)
    out = skinny_linear.skinny_linear(x, w, operand)
    assert torch.equal(out, skinny_linear.skinny_linear(x, w))
    expect = quant_linear.activation_operands(x, group, sums)
    assert torch.equal(operand.xo, expect.xo) and torch.equal(operand.inv, expect.inv)
    assert operand.sums == sums and (not sums or torch.equal(operand.xsum, expect.xsum))


def test_linear_with_operand_only_where_the_skinny_kernel_runs() -> None:
    w = rand(24, 256, seed=1)
    x = rand(2, 256, seed=2)
    out, operand = linear_ops.linear_with_operand(x, w, (128, False))
    assert operand is not None and operand.group == 128
    assert torch.equal(out, linear_ops.linear(x, w))
    for args in ((x, w, None), (x.float(), w.float(), (128, False)),
                 (rand(17, 256, seed=3), w, (128, False))):
        out, operand = linear_ops.linear_with_operand(*args)
        assert operand is None and torch.equal(out, linear_ops.linear(*args[:2]))


@pytest.mark.parametrize(("m", "k", "residual", "spec"),
                         [(1, 640, True, (256, False)), (3, 1000, True, (128, True)),
                          (2, 2048, False, None), (4, 2048, True, (128, False))])
def test_runs_the_norm_before_it(m: int, k: int, residual: bool,
                                 spec: tuple[int, bool] | None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With a deferred norm (ops.norm.DeferredNorm: the RMSNorm of x + h whose output the
    GEMV reads) the launch runs that norm in its prologue: the residual, the norm's output,
    the product and the decode operand are the bits of the norm kernel followed by the
    GEMV (K split over programs, K off the tile, rows off the tile, with h and without)."""
    x = rand(m, k, seed=m) * 4
    h = rand(m, k, seed=m + 1) if residual else None
    weight = rand(k, seed=k) * 0.1
    w = rand(24, k, seed=k + 1) / k**0.5
    if residual:
        expect_x, normed = norm_ops.add_rms_norm(x, h, weight, 1e-6)
    else:
        expect_x, normed = x, norm_ops.rms_norm(x, weight, 1e-6)
    expect, expect_operand = linear_ops.linear_with_operand(normed, w, spec)
    norm = norm_ops.defer_add_rms_norm(x, h, weight, 1e-6)
    assert skinny_linear.takes_norm(norm)
    monkeypatch.setattr(norm_ops.DeferredNorm, "run", None)  # never a launch of its own
    out, operand = linear_ops.linear_with_operand(norm.out, w, spec, norm)
    assert torch.equal(norm.out, normed) and torch.equal(norm.residual, expect_x)
    assert torch.equal(out, expect)
    assert (operand is None) == (spec is None)
    if spec is not None:
        assert torch.equal(operand.xo, expect_operand.xo)
        assert torch.equal(operand.inv, expect_operand.inv)
        assert not spec[1] or torch.equal(operand.xsum, expect_operand.xsum)
    assert not quant_linear.TILE_COUNTERS.on(x.device).any()


def test_a_norm_of_more_rows_runs_first() -> None:
    """Rows that the prologue cannot hold at once (`_NORM_ELEMENTS`) get the norm kernel
    before the GEMV: the same bits."""
    x, h, weight = rand(9, 2048, seed=1), rand(9, 2048, seed=2), rand(2048, seed=3) * 0.1
    w = rand(16, 2048, seed=4) / 64
    norm = norm_ops.defer_add_rms_norm(x, h, weight, 1e-6)
    assert not skinny_linear.takes_norm(norm)
    out, _ = linear_ops.linear_with_operand(norm.out, w, None, norm)
    residual, normed = norm_ops.add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(norm.residual, residual) and torch.equal(norm.out, normed)
    assert torch.equal(out, linear_ops.linear(normed, w))
