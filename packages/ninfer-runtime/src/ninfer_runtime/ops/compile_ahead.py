"""Tuning candidates compiled side by side before they are timed.

Triton's autotuner, like the decode tuner (`tuner.tuned_plan`), compiles each candidate
just before it times it, one after another. On an empty Triton cache (a fresh machine, a new
Triton) compilation is most of an engine's start: the 27B's one-step bench took 269 s to
start with 201 compilations on the H100 (docs/perf.md, twenty-first run), 45 s once the cache
held most of them (twenty-second); a paged attention candidate takes ~4 s to build for sm_90
on one core. Triton builds kernels on threads (`triton.AsyncCompileMode`: ptxas and most of
its passes leave the GIL): four attention candidates took 14.6 s one after another and 7.7 s
on two threads of a two-core machine.

So in the engine's warm-up (`warming_up`, where the steps meet every tuning key), the first
launch of any autotuned kernel for a key, ours or a library's (fla-core's GDN prompt kernels
were 59 of a 27B start's 170 compilations on the twenty-fifth run's H100), first compiles
every candidate its pruning keeps, side by side, then lets the autotuner time them as before:
`Autotuner.run` is wrapped for the warm-up's duration, so that after it a launch pays
nothing; and a tuner of our own has its candidates' kernels compiled side by side
(`compile_candidates`: each candidate run once where `launch` only submits compilations)
before it times them.
NINFER_COMPILE_WORKERS sets the threads (default: the CPUs, at most 16); 1 compiles as Triton
alone does. Nothing changes under the interpreter.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from ninfer_runtime.ops.dispatch import INTERPRET

try:
    import triton
    from triton.runtime.autotuner import Autotuner
except ImportError:  # CPU-only install: nothing here is used
    triton = None
    Autotuner = ()

log = logging.getLogger("ninfer.compile")
_ahead = False  # inside `_compiling_ahead`: launches only submit their compilations
_warming = False  # inside `warming_up`: an autotuned kernel's new key compiles ahead
_tuned_keys: set[tuple] = set()  # (kernel, tuning key) whose candidates were compiled


def workers() -> int:
    """Compile threads: NINFER_COMPILE_WORKERS, by default the CPUs this process may use (at
    most 16); 1 (and always under the interpreter) turns compiling ahead off."""
    if INTERPRET:
        return 1
    value = os.environ.get("NINFER_COMPILE_WORKERS")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"NINFER_COMPILE_WORKERS={value!r}: expected a positive integer")
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(16, cpus or 1)


@contextmanager
def warming_up() -> Iterator[None]:
    """Within: an autotuned kernel meeting a tuning key the first time compiles its
    candidates side by side before its autotuner times them (the engine's start-up
    warm-up): `Autotuner.run` is wrapped until the outermost warm-up ends."""
    global _warming
    if _warming or triton is None or workers() == 1:
        yield
        return
    run = Autotuner.run

    def compiled_ahead_run(tuner: Autotuner, *args: Any, **kwargs: Any) -> Any:
        if not _ahead and not kwargs.get("warmup") and "grid" in kwargs:
            _compile_new_key(tuner, args, kwargs)
        return run(tuner, *args, **kwargs)

    _warming, Autotuner.run = True, compiled_ahead_run
    try:
        yield
    finally:
        _warming, Autotuner.run = False, run


def _compile_new_key(tuner: Autotuner, args: tuple, kwargs: dict) -> None:
    """The candidates of `tuner` for the key of this launch compiled side by side, the first
    time the key is met and unless the tuner holds a choice for it already (fla-core's
    autotuners load shipped choices for some GPUs before `Autotuner.run`); the launch's
    kwargs hold Triton's grid and warmup flag."""
    tuning = tuning_key(tuner, args, kwargs)
    key = (id(tuner), tuning)
    if key in _tuned_keys or tuning in getattr(tuner, "cache", {}):
        return
    _tuned_keys.add(key)
    rest = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    with _compiling_ahead():
        _submit(tuner, kwargs["grid"], args, rest)


def compile_candidates(run: Callable[[Any], None], candidates: Iterable[Any]) -> None:
    """Every candidate's kernels compiled side by side: `run(candidate)` (what the tuner
    times) with its `launch`es only compiling; nothing where compiling ahead is off."""
    if workers() == 1:
        return
    with _compiling_ahead():
        for candidate in candidates:
            run(candidate)


@contextmanager
def _compiling_ahead() -> Iterator[None]:
    """Within: `launch` compiles instead of launching, on `workers()` threads, and leaving
    waits for every compilation. A candidate that fails to compile is left for its tuner to
    meet (and skip) as before."""
    global _ahead
    if _ahead:
        yield
        return
    with ThreadPoolExecutor(workers()) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
        _ahead = True
        try:
            yield
        finally:
            _ahead = False


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, a @triton.jit or @triton.autotune kernel; inside
    `compile_candidates` only compiled (every candidate of an autotuned one)."""
    if _ahead:
        _submit(kernel, grid, args, kwargs)
        return
    kernel[grid](*args, **kwargs)


def _submit(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> None:
    """The kernel's compilation (every kept candidate's, autotuned) handed to the pool. Only
    a head start: whatever goes wrong here, the launch or the tuner compiles as it would
    have."""
    try:
        kernel.warmup(*args, grid=grid, **kwargs)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("compiling %s ahead failed (%s: %s); it compiles at its launch",
                    getattr(kernel, "fn", kernel), type(e).__name__, e)


def tuning_key(kernel: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """The values of the autotuner's key arguments and the dtypes of its tensor arguments,
    which is what it tunes for (`Autotuner.run`)."""
    named = {**dict(zip(kernel.arg_names, args, strict=False)), **kwargs}  # the rest by name
    named = {name: value for name, value in named.items() if name in kernel.arg_names}
    return (*(named[k] for k in kernel.keys if k in named),
            *(str(v.dtype) for v in named.values() if hasattr(v, "dtype")))
