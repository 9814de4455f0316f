import pytest
import torch

from ninfer_runtime.ops.counters import CounterPool


def test_a_pool_is_one_zeroed_buffer_per_device_and_kernel_family() -> None:
    cpu = torch.device("cpu")
    a, b = CounterPool("a", 8), CounterPool("b", 8)
    assert a.on(cpu).data_ptr() == a.on(cpu, 8).data_ptr()  # graphs keep its address
    assert a.on(cpu).data_ptr() != b.on(cpu).data_ptr()  # PDL overlaps families
    assert a.on(cpu).dtype == torch.int32 and not a.on(cpu).any()


def test_asking_for_more_counters_than_the_pool_holds_is_named() -> None:
    with pytest.raises(AssertionError, match="small: 9 counters needed, the pool holds 8"):
        CounterPool("small", 8).on(torch.device("cpu"), 9)
