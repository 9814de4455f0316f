"""Compile, for sm_90, every Triton kernel specialization that a set of CPU tests launches.

Triton's interpreter, which runs the kernel tests on CPU-only machines, accepts kernels that
Triton's code generator rejects: it compiles the code after a constexpr branch's return too,
and a bf16 weight's uint32 bitcast there failed on the GPU only (7564065). Triton compiles
for a GPU target without a GPU, so this finds such failures on a CPU:

1. record: pytest runs the tests under TRITON_INTERPRET=1 with this module as a plugin, which
   specializes every launch as Triton's launcher does for an sm_90 target (argument types,
   16-divisible pointers and ints, ints of 1 and None as constexprs; the constexprs with the
   autotune config and heuristics the interpreter used; num_warps, num_stages) and adds its
   H200 twin: the launch as the GPU tests make it, in bf16 where fp16 stands in for it on a
   CPU (tests/kernels/kernel_helpers.py; FP16_BY_DESIGN names the tensors that stay fp16),
   with PDL's GDC and the inline PTX (ASM) on, which the interpreter cannot run. Dot
   precisions need no twin: launch.dot_precision gives fp16 and bf16 the same. Only the
   interpreter's autotune config is compiled, not the GPU's.
2. compile: a process pool without the interpreter compiles each unique specialization for
   GPUTarget("cuda", 90, 64), prints one line per failure and exits 1 if any failed.

    .venv/bin/python scripts/hopper_compile.py       # tests/kernels: 631 specializations
    .venv/bin/python scripts/hopper_compile.py tests/kernels/test_moe.py -k grouped  # 28
    .venv/bin/python scripts/hopper_compile.py --json /tmp/specs.json   # keep the records

On 2 cores tests/kernels records in 3-5 min and compiles in ~13 min (Triton 3.9; 3.6: ~7
min), seconds once Triton's cache holds the kernels; the MoE subset takes ~45 s in all.

With the GPU machine's Triton (3.6; see scripts/sass_report.py), from records made with the
venv's (3.6's interpreter fails the MoE kernel tests):

    PYTHONPATH=/tmp/t36 .venv/bin/python scripts/hopper_compile.py --compile-only \
        --json /tmp/specs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 64)
DEFAULT_TESTS = ["tests/kernels"]
RECORDS_ENV = "HOPPER_COMPILE_RECORDS"  # the folder the plugin writes its records into
# constexprs the GPU sets where the interpreter cannot: PDL (launch.options) and inline PTX
GPU_CONSTEXPRS = {"GDC": True, "ASM": True}
# fp16 tensors of a bf16 model too: the decode kernels' activation operands
# (quant_linear.activation_operands) and the INT8 KV cache's scales (kv_quant.SCALE_DTYPE)
FP16_BY_DESIGN = {"xo_ptr", "k_scale", "v_scale"}


def _named(name: str, names: set | dict) -> str | None:
    """The entry of `names` that `name` is, itself or prefixed ("g_xo_ptr", "D_ASM": a
    kernel that runs two stages names each stage's parameters so), else None."""
    return next((n for n in names if name == n or name.endswith("_" + n)), None)


@dataclass(frozen=True)
class Specialization:
    """One compilation of a kernel: what Triton's launcher keys its cache on."""

    module: str
    qualname: str
    file: str
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr")
    constexprs: tuple[tuple[str, Any], ...]  # (parameter, value)
    attrs: tuple[tuple[str, str], ...]  # (parameter, launcher's attribute: "D" = 16-divisible)
    num_warps: int | None
    num_stages: int | None
    test: str = field(default="", compare=False)  # the first test that launched it

    @classmethod
    def from_json(cls, obj: dict) -> Specialization:
        pairs = ("signature", "constexprs", "attrs")
        return cls(**{k: tuple(map(tuple, v)) if k in pairs else v for k, v in obj.items()})

    def h200_twin(self) -> Specialization:
        """The launch as an H200 makes it: bf16 for fp16 (but FP16_BY_DESIGN),
        GPU_CONSTEXPRS."""
        return dataclasses.replace(
            self, signature=tuple((n, "*bf16" if t == "*fp16" and not _named(n, FP16_BY_DESIGN)
                                   else t) for n, t in self.signature),
            constexprs=tuple((n, GPU_CONSTEXPRS.get(_named(n, GPU_CONSTEXPRS), v))
                             for n, v in self.constexprs),
            test=f"{self.test} (H200 twin)")

    def summary(self) -> str:
        types = ",".join(t for _, t in self.signature if t != "constexpr")
        consts = " ".join(f"{n}={v}" for n, v in self.constexprs)
        return f"({types}) {consts} warps={self.num_warps} stages={self.num_stages}"


# ---- record: the pytest plugin (-p hopper_compile) ----

_launches: dict[Specialization, None] = {}  # insertion-ordered set
_current_test = ""


@cache
def _binder(fn: interpreter.InterpretedFunction):
    """Triton's own argument binder and specializer of `fn`, for an sm_90 backend."""
    jit = JITFunction(fn.fn, **fn.kwargs)
    return create_function_from_signature(jit.signature, jit.params, make_backend(TARGET))


def _specialize(fn: interpreter.InterpretedFunction, args: tuple, kwargs: dict
                ) -> Specialization:
    bound, spec, options = _binder(fn)(*args, **kwargs)
    names = list(bound)
    return Specialization(
        module=fn.fn.__module__, qualname=fn.fn.__qualname__, file=fn.fn.__code__.co_filename,
        signature=tuple((n, ty) for n, (ty, _) in zip(names, spec, strict=True)),
        constexprs=tuple((n, v) for n, (ty, v) in zip(names, spec, strict=True)
                         if ty == "constexpr"),
        attrs=tuple((n, a) for n, (ty, a) in zip(names, spec, strict=True)
                    if ty != "constexpr" and a),
        num_warps=options.get("num_warps"), num_stages=options.get("num_stages"),
        test=_current_test)


def pytest_configure(config: pytest.Config) -> None:
    run = interpreter.InterpretedFunction.run

    def recorded_run(fn, *args, grid, warmup, **kwargs):
        spec = _specialize(fn, args, kwargs)
        _launches.setdefault(spec)
        _launches.setdefault(spec.h200_twin())
        return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recorded_run


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current_test
    _current_test = item.nodeid


def pytest_unconfigure(config: pytest.Config) -> None:
    path = Path(os.environ[RECORDS_ENV]) / f"{os.getpid()}.json"
    path.write_text(json.dumps([dataclasses.asdict(s) for s in _launches]))


def record(tests: list[str], pytest_args: list[str], jobs: int
           ) -> tuple[list[Specialization], bool]:
    """Runs the tests under the interpreter with the plugin: their unique specializations,
    and whether every test passed (a failed test's later launches are missing)."""
    with tempfile.TemporaryDirectory() as records:
        env = dict(os.environ, TRITON_INTERPRET="1", **{RECORDS_ENV: records})
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
        workers = ["-n", str(jobs)] if jobs > 1 else []
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "hopper_compile", "-p",
               "no:cacheprovider", *workers, *tests, *pytest_args]
        print("record:", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        if done.returncode not in (0, 1):  # 1: some tests failed, the rest still compile
            sys.exit(f"pytest exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr}")
        print("pytest:", lines[-1] if lines else "(no output)")
        specs = {Specialization.from_json(obj): None for path in sorted(Path(records).iterdir())
                 for obj in json.loads(path.read_text())}
    return list(specs), done.returncode == 0


# ---- compile, without the interpreter ----

@cache
def _kernel(module: str, qualname: str, file: str) -> JITFunction:
    """The JITFunction under the module's autotuners and heuristics; a test module is
    imported from its folder as pytest does."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        sys.path.insert(0, str(Path(file).parent))
        mod = importlib.import_module(module)
    for obj in vars(mod).values():
        while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
            obj = obj.fn
        if isinstance(obj, JITFunction) and obj.fn.__qualname__ == qualname:
            return obj
    raise LookupError(f"no kernel {qualname} in {module}")


def _reason(error: BaseException) -> str:
    """The first line of the innermost cause (Triton chains a call's error to its caller's)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = getattr(error, "error_message", None) or str(error) or type(error).__name__
    return text.strip().splitlines()[0]


def compile_one(spec: Specialization) -> str | None:
    """None when `spec` compiles for TARGET, else why not."""
    try:
        fn = _kernel(spec.module, spec.qualname, spec.file)
        backend = make_backend(TARGET)
        index = {p.name: i for i, p in enumerate(fn.params)}
        src = ASTSource(fn, dict(spec.signature), dict(spec.constexprs),
                        {(index[n],): backend.parse_attr(a) for n, a in spec.attrs})
        options = {k: v for k, v in (("num_warps", spec.num_warps),
                                     ("num_stages", spec.num_stages)) if v is not None}
        triton.compile(src, target=TARGET, options=options)
    except Exception as error:  # every failure is reported, none stops the run
        return _reason(error)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="other arguments (-k ...) go to pytest")
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS, help="pytest paths")
    parser.add_argument("--json", type=Path, help="where the records are written (or read)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the records of --json instead of recording")
    parser.add_argument("--jobs", type=int, default=2, help="pytest and compile workers")
    args, pytest_args = parser.parse_known_args()
    passed = True
    if args.compile_only:
        if args.json is None:
            parser.error("--compile-only needs --json")
        specs = [Specialization.from_json(o) for o in json.loads(args.json.read_text())]
    else:
        start = time.perf_counter()
        specs, passed = record(args.tests, pytest_args, args.jobs)
        print(f"recorded {len(specs)} specializations in {time.perf_counter() - start:.0f} s")
        if args.json:
            args.json.write_text(json.dumps([dataclasses.asdict(s) for s in specs], indent=1))
    # fresh workers: Triton imported under the interpreter cannot compile
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        reasons = list(pool.map(compile_one, specs))
    failed = [(s, r) for s, r in zip(specs, reasons, strict=True) if r is not None]
    for spec, reason in failed:
        print(f"FAILED {spec.module}.{spec.qualname} {spec.summary()}: {reason} "
              f"[{spec.test}]")
    kernels = len({(s.module, s.qualname) for s in specs})
    print(f"triton {triton.__version__}, sm_90: {len(specs) - len(failed)} of {len(specs)} "
          f"specializations of {kernels} kernels compiled, {len(failed)} failed "
          f"({time.perf_counter() - start:.0f} s)")
    if not passed:
        print("some tests failed under the interpreter: their later launches are missing")
    sys.exit(0 if passed and not failed else 1)


if __name__ == "__main__":
    main()
