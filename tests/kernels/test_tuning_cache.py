"""The decode tuner's disk cache: a plan chosen by one process is reused by the next, a
changed candidate list or a corrupt file is timed again, never misread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_runtime.ops import quant_linear, tuner, tuning_cache
from ninfer_runtime.quant import PackedWeight, get_scheme

KEY = (4096, 5120, 0, torch.float16, torch.device("cuda", 0))
OPTIONS = ["plan-a", "plan-b", "plan-c"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "tuning" / "H200-triton3.json"
    monkeypatch.setattr(tuning_cache, "cache_file", lambda device: path)
    monkeypatch.setattr(tuner, "DECODE_TUNING", True)
    return path


def test_entry_key_drops_the_device_and_tracks_the_candidates() -> None:
    other_gpu = (*KEY[:-1], torch.device("cuda", 1))
    assert tuning_cache.entry_key(KEY, OPTIONS) == tuning_cache.entry_key(other_gpu, OPTIONS)
    assert tuning_cache.entry_key(KEY, OPTIONS) != tuning_cache.entry_key(KEY, OPTIONS[:2])
    assert "cuda" not in tuning_cache.entry_key(KEY, OPTIONS)


def test_store_then_lookup(cache: Path) -> None:
    entry = tuning_cache.entry_key(KEY, OPTIONS)
    assert tuning_cache.lookup(cache, entry, 3) is None
    tuning_cache.store(cache, entry, 2)
    tuning_cache.store(cache, "other", 0)
    assert tuning_cache.lookup(cache, entry, 3) == 2
    assert tuning_cache.lookup(cache, entry, 2) is None  # out of range: not trusted
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temporary left


def test_corrupt_file_is_an_empty_cache(cache: Path) -> None:
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    entry = tuning_cache.entry_key(KEY, OPTIONS)
    assert tuning_cache.lookup(cache, entry, 3) is None
    tuning_cache.store(cache, entry, 1)
    assert tuning_cache.lookup(cache, entry, 3) == 1


def test_tuned_plan_reuses_a_stored_choice_without_timing(cache: Path) -> None:
    tuning_cache.store(cache, tuning_cache.entry_key(KEY, OPTIONS), 1)

    def runs() -> list:
        raise AssertionError("a cached plan must not be timed")

    plans: dict = {}
    plan = tuner.tuned_plan(plans, KEY, lambda: list(OPTIONS), runs, KEY[-1])
    assert plan == "plan-b" and plans[KEY] == "plan-b"


def test_tuned_plan_off_the_gpu_takes_the_first(cache: Path) -> None:
    tuning_cache.store(cache, tuning_cache.entry_key(KEY, OPTIONS), 2)
    plan = tuner.tuned_plan({}, KEY, lambda: list(OPTIONS), lambda: [],
                                   torch.device("cpu"))
    assert plan == "plan-a"


def test_candidates_are_timed_streaming_over_weight_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidates are compiled (side by side, where that is on) on the first copy; a
    candidate's timed calls take the copies' runs in turn (a copy is met again only after
    the others), each candidate from the first copy; every round times every candidate, and
    a candidate's time is its median over the rounds (here the first round favours the
    first candidate, as the engine's warm-up did: it does not decide)."""
    import triton.testing

    events: list[tuple[str, int]] = []
    runs = [lambda c, i=i: events.append((c, i)) for i in range(3)]
    compiled = []
    monkeypatch.setattr(tuner, "compile_candidates",
                        lambda run, options: compiled.append((run, list(options))))
    monkeypatch.setattr(tuner, "_TUNING_ROUNDS", 3)
    measured = iter([1.0, 5.0,  # round 1: plan-a looks fastest
                     9.0, 4.0, 8.0, 4.5])

    def bench(fn, rep: int, return_mode: str) -> float:  # noqa: ANN001
        for _ in range(4):
            fn()
        return next(measured)

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", bench)
    times = tuner.streaming_times(OPTIONS[:2], runs)
    one_measurement = [0, 1, 2, 0]
    assert events == [(plan, i) for _ in range(3) for plan in OPTIONS[:2]
                      for i in one_measurement]
    assert times == [8.0, 4.5]
    assert compiled == [(runs[0], OPTIONS[:2])]


def test_weight_copies_exceed_the_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough zero-filled stand-ins of the same shapes that the copies hold ~3 L2s; the first
    is the weight itself; nvfp4's aliased parts stay aliased; a weight that large alone gets
    no copy."""
    n, k = 64, 256
    parts = {"weight": torch.ones(n, k // 2, dtype=torch.uint8),
             "weight_scale": torch.ones(n, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
             "weight_scale_2": torch.ones(n)}
    w = PackedWeight(get_scheme("nvfp4"), parts, (n, k))
    ops = quant_linear._operands(w)
    size = ops.words.nbytes + ops.scale.nbytes
    monkeypatch.setattr(tuner, "_l2_bytes", lambda device: 2 * size)
    copies = quant_linear._weight_copies(ops, torch.device("cpu"))
    assert len(copies) == 6 and copies[0] is ops
    for c in copies[1:]:
        assert c.words.shape == ops.words.shape and c.words.dtype == ops.words.dtype
        assert c.scale.shape == ops.scale.shape and not c.words.any()
        assert c.zero is c.scale and c.gscale is ops.gscale
        assert c.words.data_ptr() != ops.words.data_ptr()
    monkeypatch.setattr(tuner, "_l2_bytes", lambda device: size // 4)
    assert quant_linear._weight_copies(ops, torch.device("cpu")) == [ops]


@pytest.mark.parametrize(("l2_experts", "count"), [(3, 5), (100, 8)])
def test_moe_stage_tuner_rotates_the_routing_over_other_experts(
        l2_experts: int, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert stages' tuner streams by routing each copy of its call to other experts: as
    many copies as ~3 L2s of the experts a call reads ask for, at most E over their number,
    each a distinct set of experts."""
    from ninfer_runtime.ops import moe

    w = moe._Experts.of(torch.zeros(16, 8, 32, dtype=torch.bfloat16), "gate_up")
    per_expert = 8 * 32 * 2
    monkeypatch.setattr(tuner, "_l2_bytes", lambda device: l2_experts * per_expert)
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)  # two experts
    rotated = moe._rotated_ids(ids, w)
    assert len(rotated) == count and rotated[0] is ids
    sets = [frozenset(r.flatten().tolist()) for r in rotated]
    assert len(set(sets)) == count and all(len(s) == 2 for s in sets)
    assert all(r.dtype == ids.dtype and r.shape == ids.shape for r in rotated)
