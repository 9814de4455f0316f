"""The ceilings the benches divide by: the card's own, measured; the H200's without a GPU."""

from __future__ import annotations

import pytest
import torch

from ninfer_bench import ceilings as module
from ninfer_bench.ceilings import H200, Ceilings, against_bandwidth, against_flops, ceilings


def test_without_a_gpu_the_h200_figures_stand_in_and_say_so() -> None:
    assert ceilings("cpu") == H200
    assert "no GPU" in H200.describe() and "4.24 TB/s" in H200.describe()


def test_rows_divide_by_the_cards_ceilings(monkeypatch: pytest.MonkeyPatch) -> None:
    card = Ceilings(bandwidth=2e12, bf16_flops=500e12, source="a test card")
    monkeypatch.setattr(module, "ceilings", lambda device="cuda": card)
    assert against_bandwidth(2e6, 2.0) == {"ceiling": "2e+12 B/s", "ratio_to_ceiling": 0.5}
    assert against_flops(5e8, 1.0) == {"ceiling": "5e+14 FLOP/s",
                                       "ratio_to_ceiling": pytest.approx(1.0)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a GPU")
def test_a_gpu_is_measured_and_its_buffers_given_back() -> None:
    ceilings.cache_clear()
    reserved = torch.cuda.memory_reserved()
    measured = ceilings("cuda")
    assert torch.cuda.get_device_name() in measured.source
    # under the fastest HBM and tensor cores sold (H200: 4.8 TB/s, 989 TFLOP/s on paper)
    assert 0.3e12 < measured.bandwidth < 5e12 and 50e12 < measured.bf16_flops < 1000e12
    assert torch.cuda.memory_reserved() <= reserved  # the memory plan sees the card as before
