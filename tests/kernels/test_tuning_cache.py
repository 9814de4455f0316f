"""The decode tuner's disk cache: a plan chosen by one process is reused by the next, a
changed candidate list or a corrupt file is timed again, never misread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_runtime.ops import quant_linear, tuning_cache

KEY = (4096, 5120, 0, torch.float16, torch.device("cuda", 0))
OPTIONS = ["plan-a", "plan-b", "plan-c"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "tuning" / "H200-triton3.json"
    monkeypatch.setattr(tuning_cache, "cache_file", lambda device: path)
    monkeypatch.setattr(quant_linear, "DECODE_TUNING", True)
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

    def run(candidate: object) -> None:
        raise AssertionError("a cached plan must not be timed")

    plans: dict = {}
    plan = quant_linear.tuned_plan(plans, KEY, lambda: list(OPTIONS), run, KEY[-1])
    assert plan == "plan-b" and plans[KEY] == "plan-b"


def test_tuned_plan_off_the_gpu_takes_the_first(cache: Path) -> None:
    tuning_cache.store(cache, tuning_cache.entry_key(KEY, OPTIONS), 2)
    plan = quant_linear.tuned_plan({}, KEY, lambda: list(OPTIONS), lambda c: None,
                                   torch.device("cpu"))
    assert plan == "plan-a"


def test_candidates_are_timed_after_evicting_the_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed replay reads a buffer twice the L2's size before the candidate runs, so the
    candidates stream their weights from memory as in a step; times come back in order."""
    import triton.testing

    events: list[object] = []
    l2 = 4096
    monkeypatch.setattr(quant_linear, "_l2_bytes", lambda device: l2)
    real_sum = torch.sum

    def tracked_sum(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        events.append(("read", t.nbytes))
        return real_sum(t, *args, **kwargs)

    monkeypatch.setattr(torch, "sum", tracked_sum)

    def bench(fn, rep: int, return_mode: str) -> float:  # noqa: ANN001
        before = len(events)
        fn()
        return float(len(events) - before) * 10 + len(events)

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", bench)
    times = quant_linear._cold_times(OPTIONS, events.append, torch.device("cpu"))
    assert events == [("read", 2 * l2), "plan-a", ("read", 2 * l2), "plan-b",
                      ("read", 2 * l2), "plan-c"]
    assert times == [22.0, 24.0, 26.0]
