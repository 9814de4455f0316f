"""The sampling kernels against their torch references (Triton's interpreter on CPU): the
penalties kernel, the counter-based noise (Philox4x32-10, checked against Random123's known
answers), and the batched draw: same tokens as the reference, greedy = argmax, draws inside
the filters and distributed as the filtered softmax, reproducible per (seed, step) and
independent of the rest of the batch."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ninfer_runtime.ops.host_copy import to_device
from ninfer_runtime.ops.sampling import (
    RowSampling,
    _launch_sample,
    _philox_uniform,
    apply_penalties,
    apply_penalties_ref,
    filter_logits,
    philox4x32_ref,
    philox_uniform_ref,
    sample_rows,
    sample_rows_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "triton")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def rows_of(settings: list[tuple[float, int, float, float]], vocab: int, seeds: list[int],
            steps: list[int]) -> RowSampling:
    """settings: (temperature, top_k, top_p, min_p) per row."""
    t, k, p, m = (list(c) for c in zip(*settings, strict=True))
    return RowSampling.build(t, k, p, m, seeds, steps, vocab, DEVICE)


def test_philox_matches_random123_known_answers() -> None:
    def words(*values: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.tensor([v]) for v in values)

    cases = [  # (key, counter) -> output, Random123 kat_vectors, philox4x32 10 rounds
        ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for key, counter, expected in cases:
        assert tuple(int(w) for w in philox4x32_ref(words(*key), words(*counter))) == expected


@triton.jit
def _uniform_kernel(seeds, steps, out, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    v = tl.arange(0, BLOCK)
    u = _philox_uniform(tl.load(seeds + r), tl.load(steps + r), v)
    tl.store(out + r * vocab + v, u, mask=v < vocab)


def test_kernel_noise_is_the_reference_noise() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 77, 123456789012345], device=DEVICE)
    steps = torch.tensor([0, 5, 2**33 + 3, 1], device=DEVICE)
    out = torch.zeros(4, 100, device=DEVICE)
    _uniform_kernel[(4,)](seeds, steps, out, 100, BLOCK=128)
    expected = philox_uniform_ref(seeds, steps, 100)
    assert torch.equal(out, expected)
    assert expected.min() > 0.0 and expected.max() < 1.0


def test_penalties() -> None:
    b, v = 3, 300
    g = torch.Generator().manual_seed(1)
    logits = randn(b, v) * 3
    seen = (torch.rand(b, v, generator=g) < 0.1).to(DEVICE)
    counts = torch.randint(0, 3, (b, v), generator=g, dtype=torch.int32).to(DEVICE)
    counts[torch.rand(b, v, generator=g).to(DEVICE) < 0.8] = 0
    params = [torch.tensor(c, device=DEVICE) for c in ([1.0, 1.3, 0.8], [0.0, 0.5, 0.1],
                                                       [0.0, 0.25, 1.0])]
    out = apply_penalties(logits, seen, counts, *params)
    expected = apply_penalties_ref(logits, seen, counts, *params)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0], logits[0])  # neutral row
    generated_only = (counts[1] > 0) & ~seen[1]  # seen through its count alone
    assert generated_only.any() and (out[1][generated_only] < logits[1][generated_only]).all()


# (temperature, top_k, top_p, min_p): greedy, plain, every filter alone and combined
MIXED = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.5, 0, 0.9, 0.0),
         (1.0, 5, 0.8, 0.0), (0.5, 0, 1.0, 0.1), (1.0, 50, 0.95, 0.05), (2.0, 3, 1.0, 0.0),
         (1.0, 0, 1.0, 0.02), (0.0, 7, 0.5, 0.3)]


def test_kernel_draws_the_reference_tokens() -> None:
    v = 300
    logits = randn(len(MIXED), v, seed=2) * 3
    rows = rows_of(MIXED, v, seeds=list(range(len(MIXED))), steps=[3] * len(MIXED))
    expected = sample_rows_ref(logits, rows)
    # several vocabulary chunks per row, the last one partial
    assert torch.equal(_launch_sample(logits, rows, block=32, blocks_per_chunk=2), expected)
    assert torch.equal(sample_rows(logits, rows), expected)
    assert expected[0] == logits[0].argmax() and expected[-1] == logits[-1].argmax()


def test_rows_without_filters_are_drawn_in_one_kernel() -> None:
    """Greedy and plain-temperature rows need no threshold; the row's last chunk to finish
    picks its token, the lowest id of a maximum tied across chunks, and leaves the row's
    counter for the next launch (run twice)."""
    v = 300
    plain = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0)]
    logits = randn(len(plain), v, seed=7) * 3
    logits[3, 250] = logits[3, 40] = logits[3].max() + 1  # a tie across chunks
    rows = rows_of(plain, v, seeds=[1, 2, 3, 4], steps=[5] * len(plain))
    assert not rows.candidates and not rows.any_min_p
    expected = sample_rows_ref(logits, rows)
    assert expected[3] == 40
    for _ in range(2):
        assert torch.equal(_launch_sample(logits, rows, block=32, blocks_per_chunk=2), expected)


def test_greedy_rows_copy_nothing_to_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An all-greedy batch's settings are constants: built once, no per-step transfer."""
    import ninfer_runtime.ops.sampling as sampling

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("an all-greedy batch copied its settings")

    monkeypatch.setattr(sampling, "to_device", no_copy)
    v, greedy = 300, [(0.0, 0, 0.9, 0.1)] * 3  # filters are moot at temperature 0
    logits = randn(len(greedy), v, seed=9)
    rows = rows_of(greedy, v, seeds=[1, 2, 3], steps=[4] * 3)
    assert rows is rows_of(greedy, v, seeds=[5, 6, 7], steps=[8] * 3)
    assert torch.equal(sample_rows(logits, rows), logits.argmax(-1))
    assert torch.equal(sample_rows_ref(logits, rows), logits.argmax(-1))


def test_settings_reach_the_device_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import ninfer_runtime.ops.sampling as sampling

    copies = []
    monkeypatch.setattr(sampling, "to_device", lambda *a: copies.append(a) or to_device(*a))
    rows = rows_of(MIXED, 300, seeds=[2**62 + i for i in range(len(MIXED))],
                   steps=list(range(len(MIXED))))
    assert len(copies) == 1
    settings = [list(c) for c in zip(*MIXED, strict=True)]
    for got, want in zip((rows.temperature, rows.top_k, rows.top_p, rows.min_p),
                         settings, strict=True):
        assert torch.equal(got.cpu(), torch.tensor(want, dtype=got.dtype))
    assert rows.seed.tolist() == [2**62 + i for i in range(len(MIXED))]
    assert rows.step.tolist() == list(range(len(MIXED)))
    assert rows.temperature.dtype == torch.float32 and rows.seed.dtype == torch.int64
    for b in range(1, 6):  # every row on 16 bytes whatever the batch size: one kernel variant
        rows = rows_of(MIXED[1:1 + b], 300, seeds=[7] * b, steps=[1] * b)
        assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (
            rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seed, rows.step))


def test_rank_filters_only_need_the_top_candidates() -> None:
    """With top-k on every sampled row the threshold comes from the top max(k) scores; the
    result is the one the full sort gives."""
    v = 200
    settings = [(1.0, 4, 1.0, 0.0), (0.8, 9, 0.7, 0.0), (1.2, 2, 1.0, 0.5)]
    rows = rows_of(settings, v, seeds=[5, 6, 7], steps=[0, 0, 0])
    assert rows.candidates == 9
    logits = randn(3, v, seed=3) * 2
    assert torch.equal(sample_rows(logits, rows), sample_rows_ref(logits, rows))


def test_draws_stay_in_the_filter_and_follow_the_softmax() -> None:
    """2000 steps of one request through the reference; the kernel's first 40 are the same."""
    n = 2000
    probs = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01])
    logits = probs.log().expand(n, 8).contiguous().to(DEVICE)
    # top-k 4 keeps 0..3; top-p 0.7 of those keeps 0..2 (0.3 + 0.25 < 0.7 * 0.85)
    rows = rows_of([(1.0, 4, 0.7, 0.0)] * n, 8, seeds=[9] * n, steps=list(range(n)))
    tokens = sample_rows_ref(logits, rows).cpu()
    assert set(tokens.tolist()) == {0, 1, 2}
    freq = torch.bincount(tokens, minlength=8)[:3].float() / n
    torch.testing.assert_close(freq, probs[:3] / probs[:3].sum(), atol=0.03, rtol=0)
    head = rows_of([(1.0, 4, 0.7, 0.0)] * 40, 8, seeds=[9] * 40, steps=list(range(40)))
    assert sample_rows(logits[:40], head).tolist() == tokens[:40].tolist()


def test_ties_with_the_last_kept_token_are_kept() -> None:
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]], device=DEVICE)
    kept = filter_logits(scores, torch.tensor([2], device=DEVICE),
                         torch.tensor([1.0], device=DEVICE), torch.tensor([0.0], device=DEVICE))
    assert torch.isfinite(kept[0]).tolist() == [True, False, True, True, False]
    # greedy: the lowest id among equal maxima
    rows = rows_of([(0.0, 0, 1.0, 0.0)], 5, seeds=[0], steps=[0])
    assert sample_rows(torch.tensor([[1.0, 4.0, 2.0, 4.0, 0.0]], device=DEVICE), rows) == 1


def test_draws_depend_on_seed_and_step_not_on_the_batch() -> None:
    v, n = 64, 6
    logits = randn(n, v, seed=4) * 2
    mine = (0.9, 0, 0.95, 0.0)
    others = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.1)]
    alone = [int(sample_rows(logits[s:s + 1], rows_of([mine], v, [11], [s]))) for s in range(n)]
    # my row at every step, between other requests with their own logits, seeds and steps
    batch = torch.cat([randn(1, v, seed=5), logits, randn(2, v, seed=6)])
    settings = [others[0]] + [mine] * n + others[1:]
    together = sample_rows(batch, rows_of(settings, v, [3, *[11] * n, 4, 5],
                                          [7, *range(n), 0, 2]))
    assert together[1:n + 1].tolist() == alone
    assert len(set(alone)) > 1  # really sampled
    reseeded = [int(sample_rows(logits[s:s + 1], rows_of([mine], v, [12], [s])))
                for s in range(n)]
    assert reseeded != alone
