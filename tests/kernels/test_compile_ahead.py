"""Tuning candidates compiled side by side (ops.compile_ahead), with stand-in kernels that
record what they were asked: compiling needs no GPU to be asked for, and Triton's
`AsyncCompileMode` is plain Python. That real kernels compile so and then launch is for the
GPU machine (an engine start with a cold Triton cache, docs/perf.md)."""

from __future__ import annotations

import pytest
import torch
from triton.runtime import _async_compile
from triton.runtime.autotuner import Autotuner

from ninfer_runtime.ops import compile_ahead


class Kernel:
    """A @triton.jit kernel's launch surface: `kernel[grid](...)` and `kernel.warmup(...)`."""

    def __init__(self, calls: list, fail: bool = False):
        self.calls, self.fail = calls, fail

    def warmup(self, *args, grid, **kwargs) -> None:
        if self.fail:
            raise RuntimeError("cannot compile")
        # a compile only is handed to the pool: Triton's async mode is on
        self.calls.append(("compile", args, kwargs, _async_compile.active_mode.get() is not None))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", args, kwargs))


class Tuned(Kernel, Autotuner):
    """An autotuned kernel's: its argument names and key, as `Autotuner.run` reads them, and
    a launch through `Autotuner.run` (`recorded_launches`), as Triton's `kernel[grid]`."""

    def __init__(self, calls: list):
        Kernel.__init__(self, calls)
        self.arg_names, self.keys = ["x", "n", "BLOCK"], ["n", "BLOCK"]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


@pytest.fixture(autouse=True)
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Autotuner.run`, which Triton's `kernel[grid]` calls, a stand-in that records the
    launch."""
    def run(tuner, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        tuner.calls.append(("launch", args, kwargs))

    monkeypatch.setattr(Autotuner, "run", run)


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling ahead on (CI's interpreter turns it off) and no tuning key seen yet."""
    monkeypatch.setattr(compile_ahead, "workers", lambda: 2)
    monkeypatch.setattr(compile_ahead, "_tuned_keys", set())


@pytest.fixture
def warming(on) -> None:
    """In the engine's warm-up, where autotuned kernels compile a new key ahead."""
    with compile_ahead.warming_up():
        yield


def test_an_autotuned_kernel_compiles_its_candidates_once_a_key(warming) -> None:
    calls: list = []
    kernel, x = Tuned(calls), torch.zeros(4)
    compile_ahead.launch(kernel, (1,), x, 64, BLOCK=16)
    assert [c[0] for c in calls] == ["compile", "launch"] and calls[0][3]
    assert calls[1][1:] == ((x, 64), {"BLOCK": 16})  # launched with what it was given
    calls.clear()
    compile_ahead.launch(kernel, (1,), torch.ones(4), 64, BLOCK=16)  # same key: tuned already
    assert [c[0] for c in calls] == ["launch"]
    for new_key in ((x, 128), (x.half(), 64)):  # another key value, another dtype
        calls.clear()
        compile_ahead.launch(kernel, (1,), *new_key, BLOCK=16)
        assert [c[0] for c in calls] == ["compile", "launch"]
    assert compile_ahead.tuning_key(kernel, (x, 64), {"BLOCK": 16}) == (64, 16, "torch.float32")


def test_after_the_warm_up_a_new_key_is_timed_as_triton_does(on) -> None:
    """Outside the warm-up a launch pays no tuning key's computation: a key first met then
    compiles its candidates one at a time, in the autotuner."""
    calls: list = []
    compile_ahead.launch(Tuned(calls), (1,), torch.zeros(1), 1, BLOCK=1)
    assert [c[0] for c in calls] == ["launch"]


def test_a_plain_kernel_just_launches(warming) -> None:
    calls: list = []
    compile_ahead.launch(Kernel(calls), (1,), 3)
    assert [c[0] for c in calls] == ["launch"]


def test_a_tuner_s_candidates_only_compile_then_it_times_them(on) -> None:
    calls: list = []
    kernel = Kernel(calls)
    compile_ahead.compile_candidates(lambda c: compile_ahead.launch(kernel, (c,), c), [1, 2, 3])
    assert [(c[0], c[1], c[3]) for c in calls] == [("compile", (c,), True) for c in (1, 2, 3)]
    calls.clear()
    compile_ahead.launch(kernel, (1,), 1)  # afterwards: launches again
    assert [c[0] for c in calls] == ["launch"]


def test_a_library_s_kernel_launched_directly_compiles_ahead_too(on) -> None:
    """fla-core launches its autotuned kernels itself (`kernel[grid](...)`): within the
    warm-up they compile a new key's candidates side by side as ours do; after it, Triton's
    own `Autotuner.run` is back."""
    calls: list = []
    kernel, x = Tuned(calls), torch.zeros(4)
    plain_run = Autotuner.run
    with compile_ahead.warming_up():
        assert Autotuner.run is not plain_run
        kernel[(2,)](x, 64, BLOCK=16)
        kernel[(2,)](x, 64, BLOCK=16)
    assert [c[0] for c in calls] == ["compile", "launch", "launch"] and calls[0][3]
    assert calls[0][1:3] == ((x, 64), {"BLOCK": 16})  # compiled for what it was given
    assert Autotuner.run is plain_run
    calls.clear()
    kernel[(2,)](x, 32, BLOCK=16)
    assert [c[0] for c in calls] == ["launch"]


def test_a_key_the_tuner_has_chosen_for_already_compiles_nothing_ahead(warming) -> None:
    """fla-core's autotuners may load a shipped choice for a key before `Autotuner.run`: then
    only that config compiles, at the launch."""
    calls: list = []
    kernel, x = Tuned(calls), torch.zeros(4)
    kernel.cache = {compile_ahead.tuning_key(kernel, (x, 64), {"BLOCK": 16}): "chosen"}
    kernel[(2,)](x, 64, BLOCK=16)
    assert [c[0] for c in calls] == ["launch"]


def test_off_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_ahead, "workers", lambda: 1)
    calls: list = []
    compile_ahead.compile_candidates(lambda c: compile_ahead.launch(Kernel(calls), (c,), c), [1])
    assert calls == []
    with compile_ahead.warming_up():
        compile_ahead.launch(Tuned(calls), (1,), torch.zeros(1), 1, BLOCK=1)
    assert [c[0] for c in calls] == ["launch"]


def test_a_failed_compile_ahead_still_launches(warming, caplog: pytest.LogCaptureFixture
                                                 ) -> None:
    calls: list = []
    kernel = Tuned(calls)
    kernel.fail = True
    compile_ahead.launch(kernel, (1,), torch.zeros(1), 1, BLOCK=1)
    assert [c[0] for c in calls] == ["launch"] and "compiles at its launch" in caplog.text


def test_workers_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_ahead, "INTERPRET", False)
    monkeypatch.setenv("NINFER_COMPILE_WORKERS", "3")
    assert compile_ahead.workers() == 3
    monkeypatch.delenv("NINFER_COMPILE_WORKERS")
    assert 1 <= compile_ahead.workers() <= 16
    for bad in ("0", "many"):
        monkeypatch.setenv("NINFER_COMPILE_WORKERS", bad)
        with pytest.raises(ValueError, match="NINFER_COMPILE_WORKERS"):
            compile_ahead.workers()
    monkeypatch.setattr(compile_ahead, "INTERPRET", True)  # the interpreter compiles nothing
    assert compile_ahead.workers() == 1
