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
