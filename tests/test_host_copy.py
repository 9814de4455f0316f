"""ops.host_copy: host lists reach the device as the same values, and on a GPU without the
host first waiting for the work queued on the stream (what a pageable copy may do)."""

from __future__ import annotations

import pytest
import torch

from ninfer_runtime.ops.host_copy import to_device

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_values_reach_the_device_as_they_were() -> None:
    ints = to_device([[1, -2], [3, 1 << 40]], torch.int64, DEVICE)
    floats = to_device([0.5, 2.0, -3.25], torch.float32, torch.device(DEVICE))
    assert ints.device.type == floats.device.type == DEVICE
    assert ints.dtype == torch.int64 and ints.tolist() == [[1, -2], [3, 1 << 40]]
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 2.0, -3.25]
    assert to_device([], torch.int64, DEVICE).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="waiting is a GPU stream's")
def test_the_copy_is_queued_behind_the_stream_not_waited_for() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of the GPU spinning
    spinning = torch.cuda.Event()
    spinning.record()
    copied = to_device(list(range(100)), torch.int64, DEVICE)
    assert not spinning.query(), "the host waited for the queued work"
    assert copied.tolist() == list(range(100))  # read after the spin, in stream order
