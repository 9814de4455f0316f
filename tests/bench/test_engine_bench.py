"""`ninfer-bench engine` end to end on the CPU: the rows it reports and the files it writes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ninfer_bench.cli import main
from ninfer_bench.engine_bench import (
    Compilation,
    Footprint,
    _compilation,
    footprint,
    triton_compiles,
)
from ninfer_runtime.models.loading import load_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.sources import open_source

    path = tmp_path_factory.mktemp("engine_bench") / "tiny_dense_mtp.ninfer"
    return build(open_source("tiny_dense", random_init=True), path,
                 BuildOptions(weights="nvfp4", include_vision=False, include_mtp=True))


@pytest.mark.parametrize("spec", [[], ["--spec", "mtp", "--draft-tokens", "2"]])
def test_engine_bench_reports_prefill_and_decode_rows(artifact: Path, tmp_path: Path,
                                                      spec: list[str]) -> None:
    # 3 requests of 70 tokens: more than one page each (the pool must hold whole pages)
    result = CliRunner().invoke(main, [
        "engine", str(artifact), "--context-lengths", "40,70", "--concurrency", "1,3",
        "--decode-tokens", "6", "--device", "cpu", "--no-breakdown", "--output",
        str(tmp_path), "--prefill-chunk", "32", "--max-batched-tokens", "48", *spec])
    assert result.exit_code == 0, result.output
    [report_file] = tmp_path.glob("engine-*.json")
    report = json.loads(report_file.read_text())
    assert report["spec"] == ("mtp2" if spec else "none")
    assert (report["prefill_chunk"], report["step_tokens"]) == (32, 48)
    rows = [(r["what"], r["context"], r["concurrency"]) for r in report["rows"]]
    assert rows == [("prefill-first", 40, 1), ("prefill", 40, 1), ("decode", 40, 1),
                    ("decode", 40, 3), ("prefill-first", 70, 1), ("prefill", 70, 1),
                    ("decode", 70, 1), ("decode", 70, 3)]
    for r in report["rows"]:
        assert r["tok_s"] > 0 and r["ratio"] == pytest.approx(r["tok_s"] / r["ceiling_tok_s"])
        if r["what"] == "decode":  # every timed step advances all C requests
            assert r["tokens_per_step"] >= r["concurrency"]
            if not spec:
                assert r["tokens_per_step"] == r["concurrency"]
    text = report_file.with_suffix(".md").read_text()
    assert "| decode | 70 | 3 |" in text and "prefill chunk 32 (48 tokens a step)" in text
    # no GPU: the H200's published ceilings stand in, and the report says so
    assert report["ceilings"]["bandwidth"] == 4.24e12 and "no GPU here" in text


def test_footprint_counts_the_weights_one_token_reads(artifact: Path) -> None:
    model = load_artifact(artifact, "cpu").model
    fp = footprint(model, "int8")
    cfg = model.config
    assert fp.weight_bytes > cfg.vocab_size * cfg.hidden_size // 2  # at least the 4-bit lm_head
    assert fp.active_params > cfg.num_layers * cfg.hidden_size**2
    assert fp.state_bytes > 0 and fp.kv_bytes_per_token > 0


def test_step_weight_bytes_count_each_routed_expert_once() -> None:
    """An MoE step reads the experts its rows route to once each: with uniform routing, 8 of
    256 for one row, 256 * (1 - (1 - 8/256)^8) = 57.4 for eight; a dense model's step reads
    the same weights whatever its rows."""
    moe = Footprint(weight_bytes=1000, active_params=0, kv_bytes_per_token=0, state_bytes=0,
                    expert_bytes=10, num_experts=256, top_k=8)
    assert moe.step_weight_bytes(1) == pytest.approx(1000)
    assert moe.step_weight_bytes(8) == pytest.approx(1000 + (57.42083 - 8) * 10, rel=1e-6)
    assert moe.step_weight_bytes(10_000) == pytest.approx(1000 + 248 * 10)
    dense = Footprint(weight_bytes=1000, active_params=0, kv_bytes_per_token=0, state_bytes=0)
    assert dense.step_weight_bytes(8) == 1000


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_decode_counts_the_steps_that_replay_graphs(artifact: Path, spec: str) -> None:
    """measure_decode says how many timed steps ran through the target's graphs (here their
    uncaptured static buffers, as on a GPU) and how often the proposer's ran."""
    from ninfer_bench.engine_bench import graph_replay_ms, measure_decode
    from ninfer_runtime.engine import Engine, EngineConfig
    from ninfer_runtime.engine.device_setup import request_pages, step_graphs

    k = 2 if spec == "mtp" else 0
    config = EngineConfig(max_context=64, max_concurrency=2, device="cpu", spec=spec,
                          draft_tokens=k or 3)
    eng = Engine.from_artifact(artifact, config)
    plain = measure_decode(eng, 8, 2, 4)
    assert plain.graph_steps == 0  # no graphs on the CPU
    eng.graphs = step_graphs(eng.model, eng.caches, eng.config, capture=False)
    if eng.proposer is not None:
        eng.proposer.capture_graphs(2, request_pages(eng.config), capture=False)
    run = measure_decode(eng, 8, 2, 4)
    assert run.steps > 0 and run.graph_steps == run.steps
    assert graph_replay_ms(eng, 2) is None  # static buffers, no captured graph to time
    assert (run.draft_graph_runs > 0) == (spec == "mtp")
    # the same requests give the same greedy tokens, with or without graphs; others do not
    assert plain.digest == run.digest == measure_decode(eng, 8, 2, 4).digest
    assert measure_decode(eng, 9, 2, 4).digest != run.digest


def test_host_profile_names_the_python_functions_of_a_prefill_and_of_decode_steps(
        artifact: Path) -> None:
    """The host's side: the engine's own functions appear, with call counts, for the prefill
    and for the decode steps; the profiled requests leave nothing behind; the report's
    markdown shows both tables."""
    from ninfer_bench.engine_bench import host_profile, markdown
    from ninfer_runtime.engine import Engine, EngineConfig

    eng = Engine.from_artifact(artifact, EngineConfig(max_context=64, max_concurrency=2,
                                                      device="cpu"))
    host = host_profile(eng, 20, 2, steps=3, top=200)
    assert list(host) == ["prefill of 20 tokens", "3 decode steps ctx20_c2"]
    for entry in host.values():
        assert entry["seconds"] > 0
        steps = [f for f in entry["functions"] if f["name"].endswith("(step)")
                 and "engine" in f["name"]]
        assert steps and all(f["calls"] >= 1 and f["total_ms"] >= f["own_ms"] for f in steps)
    [decode_step] = [f for f in host["3 decode steps ctx20_c2"]["functions"]
                     if f["name"].startswith("ninfer_runtime/engine/engine.py")
                     and f["name"].endswith("(step)")]
    assert decode_step["calls"] == 3
    assert not eng.has_unfinished()
    text = markdown({"artifact": "a", "spec": "none", "startup_s": 1.0, "rows": [],
                     "breakdown": {}, "host": host})
    assert "host side of the prefill of 20 tokens under cProfile" in text
    assert "host side of the 3 decode steps ctx20_c2 under cProfile" in text


def test_profiled_requests_all_run_when_each_prompt_takes_a_step(artifact: Path) -> None:
    """With one prompt a step (a budget of one prompt), the first of 8 requests decodes 7
    tokens before the last is admitted: the profiles' requests (the host's here; the kernel
    breakdown's take the same, `_room`) must outlast that (the breakdown's asked for 4 tokens
    before, and the engine bench stopped: never ran together)."""
    from ninfer_bench.engine_bench import host_profile
    from ninfer_runtime.engine import Engine, EngineConfig

    eng = Engine.from_artifact(artifact, EngineConfig(
        max_context=64, max_concurrency=8, prefill_chunk=32, max_batched_tokens=28,
        device="cpu"))
    host = host_profile(eng, 20, 8, steps=2, top=200)
    assert "2 decode steps ctx20_c8" in host and not eng.has_unfinished()


def _hook_call(kernel: str, signature: dict[str, str], constants: dict, divisible: list[int]
               ) -> dict:
    """The keywords Triton passes its jit_cache_hook for one kernel variant."""
    fn = SimpleNamespace(name=kernel)
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    return {"key": (), "repr": kernel, "fn": fn,
            "compile": {"signature": signature, "constants": constants, "configs": [attrs]}}


def test_triton_compiles_records_each_variant_and_what_sets_it_apart() -> None:
    """The hook Triton calls before compiling a kernel variant is installed for the block only,
    lets the compilation go on, and names the variant's argument types, constants and
    16-divisible arguments; a later variant is told apart from the closest earlier one."""
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook
    signature = {"x": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    with triton_compiles() as startup:
        assert knobs.runtime.jit_cache_hook(
            **_hook_call("_k", signature, {(2,): 64}, [0, 1])) is False
        knobs.runtime.jit_cache_hook(**_hook_call("_k", signature, {(2,): 128}, [0]))
    assert knobs.runtime.jit_cache_hook is before
    assert startup[0] == Compilation("_k", frozenset({"x: *bf16", "n: i32", "BLOCK=64",
                                                      "x %16", "n %16"}))
    with triton_compiles() as later:  # n no longer divisible by 16, at BLOCK 64
        knobs.runtime.jit_cache_hook(**_hook_call("_k", signature, {(2,): 64}, [0]))
        knobs.runtime.jit_cache_hook(**_hook_call("_other", {"y": "*fp32"}, {}, []))
    assert later[0].unlike(startup) == ["not n %16"]  # closer to BLOCK 64 than to BLOCK 128
    assert later[1].unlike(startup) == ["y: *fp32"]
    # an int argument equal to 1 is a compile-time constant: it sets the variant apart
    one = _compilation(_hook_call("_k", {"x": "*bf16", "n": "constexpr", "BLOCK": "constexpr"},
                                  {(1,): 1, (2,): 64}, [0]))
    assert one.unlike(startup) == ["n=1", "not n %16", "not n: i32"]



def test_tuned_choices_name_each_plan_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report lists what the tuners picked: decode GEMV plans by weight shape and row
    tile (and those tuned to share the MLP's launch), MoE stage plans, attention configs by
    their autotune key."""
    import torch
    import triton

    from ninfer_bench.engine_bench import tuned_choices
    from ninfer_runtime.ops import attention, moe, quant_linear

    config = quant_linear.DecodeConfig(128, 256, 4, 3, 2)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(quant_linear, "_decode_plans", {
        (5120, 17408, 8, False, 0, torch.bfloat16, False, cuda):
            quant_linear.DecodePlan(config, 1024, 17),
        (5120, 17408, 8, True, 0, torch.bfloat16, False, cuda):
            quant_linear.DecodePlan(config, 2560, 7),
        (5120, 17408, 8, True, 0, torch.bfloat16, False, cuda, (4, 3)):
            quant_linear.DecodePlan(config, 2048, 9)})
    monkeypatch.setattr(moe, "_stage_plans", {
        (1, 8, 512, 2048, 0, True, torch.bfloat16, cuda):
            moe._StagePlan(quant_linear.DecodeConfig(128, 256, 4, 2, 2, 5, capped=True), 2)})
    monkeypatch.setattr(attention._paged_attention_kernel, "cache", {
        (16, 6, 256, True, 64, True, False, True, 128, "torch.bfloat16"):
            triton.Config({"BLOCK_N": 32, "PREFETCH": 1}, num_warps=8, num_stages=1)})
    lines = tuned_choices()
    assert lines[0] == ("decode GEMV 5120 x 17408, 8-row tile: BN 128 BK 256, 4 warps, "
                        "3 stages, 2 dots, 17 splits")
    assert lines[1] == ("decode GEMV 5120 x 17408, one row: BN 128 BK 256, 4 warps, "
                        "3 stages, 2 dots, 7 splits")
    assert lines[2] == ("decode GEMV 5120 x 17408, one row, in the MLP's launch: BN 128 BK "
                        "256, 4 warps, 3 stages, 2 dots, 9 splits")
    assert lines[3] == ("MoE gate_up stage 512 x 2048, 1 tokens x top-8: BN 128 BK 256, 4 "
                        "warps, 2 stages, 2 dots, capped at 5 an SM, 2 splits")
    assert lines[4].startswith("paged attention BLOCK_M 16, GROUP_HEADS 6, HEAD_DIM 256, "
                               "QUANT True, NUM_SPLITS 64, CAUSAL True, HAS_WINDOW False, "
                               "ASM True, min_split_tokens 128: ")
    assert "PREFETCH: 1" in lines[4] and len(lines) == 5


def test_the_kernel_breakdown_counts_each_kernels_launches() -> None:
    """Per kernel name: the CUDA time summed, the launches counted (host events left out),
    and the markdown shows the time a launch."""
    import torch

    from ninfer_bench.engine_bench import by_kernel, markdown

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=n, device_type=d, device_time=t) for n, d, t in [
        ("_decode_kernel", cuda, 10.0), ("_router_kernel", cuda, 3.0),
        ("_decode_kernel", cuda, 14.0), ("aten::empty", cpu, 99.0)]]
    rows = by_kernel(SimpleNamespace(events=lambda: events))
    assert rows == [("_decode_kernel", 24.0, 2), ("_router_kernel", 3.0, 1)]
    text = markdown({"artifact": "a", "spec": "none", "startup_s": 1.0, "rows": [],
                     "breakdown": {"eager decode step ctx8_c1": rows}})
    assert "27 us of kernels in 3 launches" in text
    assert "| `_decode_kernel` | 24.0 | 88.9% | 2 | 12.00 |" in text


def test_the_header_names_the_gdn_prompt_kernels() -> None:
    """A GPU report says whose chunked GDN kernels ran its prompts (fla-core's or ours: the
    prefill figures differ by ~5%); a CPU one (reference ops) says nothing of them."""
    from ninfer_bench.engine_bench import markdown

    report = {"artifact": "a", "spec": "none", "startup_s": 1.0, "rows": [], "breakdown": {},
              "prefill_chunk": 8192, "step_tokens": 8192}
    assert "GDN prompt kernels" not in markdown(report | {"gdn_prompt_kernels": None})
    assert "8,192 tokens a step), GDN prompt kernels fla's, startup" in markdown(
        report | {"gdn_prompt_kernels": "fla"})
