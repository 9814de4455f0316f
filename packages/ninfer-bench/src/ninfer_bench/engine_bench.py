"""In-process engine throughput: prefill and decode of one artifact against their ceilings.

No server, no HTTP: the engine is driven directly, so the figures are the runtime's own (the
serving suites measure the whole stack). For each context length L:

- prefill: one request of L prompt tokens; prefill tok/s = L / (time to its first token);
  ceiling = bf16 matmul FLOP/s / (2 x active parameters per token), attention excluded.
  Timed twice: `prefill-first`, the first such request after start-up (whatever the start-up
  warm-up left undone shows here, and the Triton kernels it compiled are listed), and
  `prefill`, the same request again;
- decode at C = 1, 2, ...: C requests of L prompt tokens decode `decode_tokens` each; the
  aggregate tok/s counts only steps in which all C requests decode (no prefill in the step),
  and a digest of the greedy tokens they produce tells whether two runs computed the same;
  ceiling = C x bandwidth / bytes one step reads (the weights its rows use, an MoE's routed
  experts once each (`Footprint.step_weight_bytes`), + C x (the KV of L tokens + the GDN
  state read and written));
- where the time goes: the prefill of L tokens and one eager decode step per C under
  torch.profiler, CUDA kernel time summed by kernel name (decode graphs are replayed
  otherwise, which hides their kernels); and the host's side of the same prefill and of
  graphed decode steps under cProfile, Python time by function: where the GPU waits on the
  host (the 35B-A3B's prompt chunks, every decode step's scheduling and sampling), this says
  which code to cut. On a GPU, also the device's timeline over graphed decode steps
  (`ninfer_bench.timeline`): the time the GPU idles between its activities, by the two
  activities either side of each gap (what a step adds to its graph replay).

Both ceilings are the card's own, measured before the engine starts (`ninfer_bench.ceilings`).

With a speculative mode (`spec`), a decode step is one round: the verify of K+1 tokens per
request and the proposer's drafts. Random weights accept almost nothing, so the figure that
carries over to real weights is the round's time (ms/step, against a plain step of the same
C); tokens per round at a given acceptance then give the throughput.
"""

from __future__ import annotations

import cProfile
import hashlib
import pstats
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from ninfer_bench.ceilings import Ceilings, ceilings
from ninfer_bench.timeline import Timeline, timeline
from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.engine import Engine, EngineConfig, EngineRequest, SamplingParams
from ninfer_runtime.engine.cuda_graph import GraphShape, StepGraphs
from ninfer_runtime.engine.kv_pool import kv_bytes_per_token
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model
from ninfer_runtime.ops.gdn import prompt_kernels
from ninfer_runtime.quant import PackedWeight


def _nbytes(w: object) -> int:
    if isinstance(w, torch.Tensor):
        return w.nbytes
    if isinstance(w, PackedWeight):
        return sum(p.nbytes for p in w.parts.values())
    if hasattr(w, "__dataclass_fields__"):
        return sum(_nbytes(getattr(w, f)) for f in w.__dataclass_fields__)
    if isinstance(w, list | tuple):
        return sum(_nbytes(x) for x in w)
    return 0


def _params(w: object) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel()
    if isinstance(w, PackedWeight):
        return int(torch.Size(w.shape).numel())
    if hasattr(w, "__dataclass_fields__"):
        return sum(_params(getattr(w, f)) for f in w.__dataclass_fields__)
    if isinstance(w, list | tuple):
        return sum(_params(x) for x in w)
    return 0


@dataclass(frozen=True)
class Footprint:
    """What one decoded token reads, and the multiply-adds one prompt token costs."""

    weight_bytes: int  # weights one decode step reads (MoE: the experts top-k selects)
    active_params: int  # multiply-adds per prompt token (MoE: top-k experts + shared)
    kv_bytes_per_token: int
    state_bytes: int  # GDN state of one sequence
    expert_bytes: int = 0  # MoE: one routed expert's weights summed over the layers
    num_experts: int = 0
    top_k: int = 0

    def step_weight_bytes(self, rows: int) -> float:
        """Weights a decode step of `rows` token rows reads: each routed expert at most once,
        so an MoE step reads E * (1 - (1 - k/E)^rows) routed experts per layer on average when
        routing is uniform (random weights route about so), 57.4 of 256 for 8 rows of the
        35B-A3B against 8 for one."""
        if not self.num_experts:
            return self.weight_bytes
        e, k = self.num_experts, self.top_k
        distinct = e * (1 - (1 - k / e) ** rows)
        return self.weight_bytes + (distinct - k) * self.expert_bytes


def footprint(model: Qwen3_5Model, kv_dtype: str) -> Footprint:
    cfg = model.config
    weight_bytes = _nbytes(model.layers) + _nbytes(model.lm_head) + _nbytes(model.norm)
    params = _params(model.layers) + _params(model.lm_head)
    expert_bytes = 0
    if cfg.num_experts:  # of the E + 1 stacked experts (the shared one last), a token reads
        # / multiplies its top-k and the shared one
        experts = [(layer.mlp.experts_gate_up, layer.mlp.experts_down) for layer in model.layers]
        expert_bytes = _nbytes(experts) // (cfg.num_experts + 1)
        unused = 1 - (cfg.num_experts_per_tok + 1) / (cfg.num_experts + 1)
        weight_bytes -= int(unused * _nbytes(experts))
        params -= int(unused * _params(experts))
    gdn = [k for k in cfg.layer_types if k != FULL_ATTENTION]
    state = len(gdn) * cfg.linear_num_value_heads * cfg.linear_key_head_dim \
        * cfg.linear_value_head_dim * 4
    return Footprint(weight_bytes, params, kv_bytes_per_token(cfg, kv_dtype, model.dtype), state,
                     expert_bytes, cfg.num_experts or 0, cfg.num_experts_per_tok or 0)


def _request(rid: str, length: int, max_tokens: int, vocab: int) -> EngineRequest:
    gen = torch.Generator().manual_seed(len(rid) + length)
    ids = torch.randint(0, min(vocab, 100_000), (length,), generator=gen).tolist()
    return EngineRequest(rid, tuple(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         ignore_eos=True), time.perf_counter())


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


@dataclass(frozen=True)
class Compilation:
    """One kernel variant Triton compiled: its name and specialization, each item an argument's
    type (`q: *bf16`), its compile-time value (`BLOCK_M=64`, also an int argument equal to 1)
    or its 16-divisibility (`stride_qt %16`)."""

    kernel: str
    spec: frozenset[str]

    def unlike(self, others: Sequence[Compilation]) -> list[str]:
        """What sets this variant apart from the closest of `others` of the same kernel (all
        of it when there is none): its own items, then `not ...` for the closest one's."""
        same = [o.spec for o in others if o.kernel == self.kernel]
        closest = min(same, key=lambda o: len(o ^ self.spec), default=frozenset())
        return sorted(self.spec - closest) + [f"not {item}" for item in sorted(closest - self.spec)]


def _compilation(hook_kwargs: dict) -> Compilation:
    """The Compilation a `jit_cache_hook` call describes (Triton 3.6-3.9 pass the signature,
    the constants and the attributes by argument index); the hook's own summary if not."""
    try:
        fn, job = hook_kwargs["fn"], hook_kwargs["compile"]
        names = list(job["signature"])
        constants = job["constants"]
        spec = {f"{name}={constants[(i,)]}" if kind == "constexpr" else f"{name}: {kind}"
                for i, (name, kind) in enumerate(job["signature"].items())}
        spec |= {f"{names[index[0]]} %16" for index in job["configs"][0]}
        return Compilation(fn.name, frozenset(spec))
    except (KeyError, AttributeError, IndexError, TypeError):
        return Compilation(str(hook_kwargs.get("repr", "?")), frozenset())


@contextmanager
def triton_compiles() -> Iterator[list[Compilation]]:
    """The Triton kernel variants compiled inside the block (each one the process had not
    compiled before: what a warmed-up engine should never meet while serving). Empty without
    Triton."""
    compiled: list[Compilation] = []
    try:
        from triton import knobs
    except ImportError:
        yield compiled
        return

    def record(**kwargs: object) -> bool:
        compiled.append(_compilation(kwargs))
        return False  # compile as usual

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = previous


def tuned_choices() -> list[str]:
    """What the start-up's tuning picked, a line each: every decode GEMV plan (weight N x K,
    row tile or one row, `quant_linear.decode_plan_rows`), MoE expert stage plan and
    paged-attention config (its autotune key), so a report shows which candidates win and
    which are never chosen."""
    from ninfer_runtime.ops import attention, moe, quant_linear

    lines = []
    for (n, k, rows, one_row, *rest), plan in quant_linear._decode_plans.items():
        shown = "one row" if one_row else f"{rows}-row tile"
        if isinstance(rest[-1], tuple):  # tuned to share gate|up's launch (`mlp_decode`)
            shown += ", in the MLP's launch"
        lines.append(f"decode GEMV {n} x {k}, {shown}: {plan.config.describe()}, "
                     f"{plan.splits} splits")
    for (tokens, top_k, n, k, _, swiglu, *_), stage in moe._stage_plans.items():
        lines.append(f"MoE {'gate_up' if swiglu else 'down'} stage {n} x {k}, {tokens} tokens "
                     f"x top-{top_k}: {stage.config.describe()}, {stage.splits} splits")
    names = attention._paged_attention_kernel.keys
    for key, config in getattr(attention._paged_attention_kernel, "cache", {}).items():
        shown = ", ".join(f"{name} {value}" for name, value in zip(names, key, strict=False))
        lines.append(f"paged attention {shown}: {config}")
    return lines


def measure_prefill(engine: Engine, length: int) -> float:
    """Seconds from the first step of a lone request of `length` tokens to its first token."""
    engine.add_request(_request(f"prefill-{length}", length, 1, engine.model_config.vocab_size))
    _sync(engine)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync(engine)
    return time.perf_counter() - start


def _room(engine: Engine, length: int) -> int:
    """The most tokens a request of `length` prompt tokens may decode: what a few profiled
    steps ask for, since the first request of several decodes while the others prefill (the
    first of 8 prompts of 8K tokens, one step each, decodes 7 tokens before the last starts)
    and must still run when they all do."""
    return engine.config.max_context - length


def _start_decoding(engine: Engine, prefix: str, length: int, concurrency: int,
                    tokens: int) -> None:
    """Admit `concurrency` requests of `length` prompt tokens and step until all decode."""
    vocab = engine.model_config.vocab_size
    for i in range(concurrency):
        engine.add_request(_request(f"{prefix}-{length}-{concurrency}-{i}", length, tokens,
                                    vocab))
    while engine.num_running() < concurrency or any(
            s.prefilling for s in engine.scheduler.running.values()):
        if not engine.has_unfinished():
            raise RuntimeError(f"{concurrency} requests of {length} tokens never ran together "
                               f"(KV capacity {engine.config.kv_capacity})")
        engine.step()


@dataclass(frozen=True)
class DecodeRun:
    seconds: float
    steps: int  # rounds with spec
    tokens: int
    graph_steps: int  # steps whose target forward replayed a CUDA graph
    draft_graph_runs: int  # the proposer's graph replays over those steps
    # the greedy tokens from the first timed step on, hashed: runs that must compute the
    # same (PDL on and off, same tuned plans) must agree on it
    digest: str


def _replays(engine: Engine) -> tuple[int, int]:
    """Graph replays so far: the target's, and the proposer's (all its StepGraphs)."""
    target = engine.graphs.replays if engine.graphs is not None else 0
    proposer = vars(engine.proposer).values() if engine.proposer is not None else ()
    return target, sum(g.replays for g in proposer if isinstance(g, StepGraphs))


def measure_decode(engine: Engine, length: int, concurrency: int, tokens: int) -> DecodeRun:
    """Time and tokens over the steps in which all `concurrency` requests decode, and how many
    of those steps ran through graphs (a step that falls back to eager is several times
    slower, so a figure is only read with its graph count)."""
    _start_decoding(engine, "decode", length, concurrency, tokens)
    _sync(engine)
    before = _replays(engine)
    ids: dict[str, list[int]] = {}

    def step() -> int:
        outputs = engine.step()
        for o in outputs:
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
        return sum(len(o.new_token_ids) for o in outputs)

    start, steps, produced = time.perf_counter(), 0, 0
    while engine.num_running() == concurrency:
        tokens = step()
        produced += tokens
        # a step that returns no tokens launched one whose tokens the next returns
        # (overlapped decode): steps count forwards, each returning its tokens once
        steps += tokens > 0
    _sync(engine)
    elapsed = time.perf_counter() - start
    after = _replays(engine)
    while engine.has_unfinished():
        step()
    digest = hashlib.sha1(repr(sorted(ids.items())).encode()).hexdigest()[:12]
    return DecodeRun(elapsed, steps, produced, after[0] - before[0], after[1] - before[1],
                     digest)


def graph_replay_ms(engine: Engine, concurrency: int, times: int = 50) -> float | None:
    """Milliseconds per back-to-back replay of the plain decode graph of `concurrency` rows
    (None without captured graphs): a step's GPU time, so that ms/step minus this is what the
    host adds to a step (scheduling, sampling, reading the tokens, the outputs)."""
    graphs, shape = engine.graphs, GraphShape.of(concurrency, 1, "all")
    if graphs is None or not graphs.capture or shape not in graphs.shapes:
        return None
    graphs.replay(shape)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(times):
        graphs.replay(shape)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / times


def decode_timeline(engine: Engine, length: int, concurrency: int, steps: int = 16
                    ) -> dict | None:
    """The device's timeline over `steps` steady-state decode steps of `concurrency`
    requests as the engine runs them (`ninfer_bench.timeline`; None off a GPU): what the
    GPU waits between its graph replays."""
    from torch.profiler import ProfilerActivity, profile

    if torch.device(engine.config.device).type != "cuda":
        return None
    _start_decoding(engine, "timeline", length, concurrency, _room(engine, length))
    for _ in range(4):  # into the overlapped steady state
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync(engine)
    while engine.has_unfinished():
        engine.step()
    return asdict(timeline([(e.name, e.time_range.start, e.time_range.end)
                            for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA], steps))


def kernel_breakdown(engine: Engine, length: int, concurrency: int
                     ) -> list[tuple[str, float, int]]:
    """CUDA time (us) and launches per kernel name of one eager decode step of `concurrency`
    requests (`by_kernel`)."""
    from torch.profiler import ProfilerActivity, profile

    _start_decoding(engine, "profile", length, concurrency, _room(engine, length))
    graphs, engine.graphs = engine.graphs, None
    try:
        engine.step()  # warm
        _sync(engine)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            _sync(engine)
    finally:
        engine.graphs = graphs
    while engine.has_unfinished():
        engine.step()
    return by_kernel(prof)


def prefill_breakdown(engine: Engine, length: int) -> list[tuple[str, float, int]]:
    """CUDA time (us) and launches per kernel name over the prefill of a lone request of
    `length` tokens, all its chunks (the profiler sees the kernels of replayed prompt-chunk
    graphs too: the seventeenth run's breakdowns with graphs name them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        measure_prefill(engine, length)
    return by_kernel(prof)


@dataclass(frozen=True)
class HostFunction:
    name: str  # path inside its package (or module) : line (function)
    calls: int
    own_ms: float  # time in the function itself
    total_ms: float  # with what it calls


def _host_functions(prof: cProfile.Profile, top: int) -> list[dict]:
    """The `top` functions by own time, as HostFunction dicts (the report is JSON)."""
    rows = []
    for (path, line, func), (_, calls, own, total, _) in pstats.Stats(prof).stats.items():
        short = "/".join(path.split("/site-packages/")[-1].split("/src/")[-1].split("/")[-3:])
        rows.append(HostFunction(f"{short}:{line}({func})", calls, 1e3 * own, 1e3 * total))
    return [asdict(r) for r in sorted(rows, key=lambda r: -r.own_ms)[:top]]


def host_profile(engine: Engine, length: int, concurrency: int, steps: int = 16,
                 top: int = 25) -> dict[str, dict]:
    """Python time by function (cProfile, which slows the host down about twofold) over the
    prefill of a lone request of `length` tokens and over `steps` decode steps of
    `concurrency` requests as the engine runs them (graphed where it has graphs)."""
    prof = cProfile.Profile()
    prof.enable()
    seconds = measure_prefill(engine, length)
    prof.disable()
    out = {f"prefill of {length} tokens": {"seconds": seconds,
                                           "functions": _host_functions(prof, top)}}
    _start_decoding(engine, "host", length, concurrency, _room(engine, length))
    _sync(engine)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    _sync(engine)
    prof.disable()
    out[f"{steps} decode steps ctx{length}_c{concurrency}"] = {
        "seconds": time.perf_counter() - start, "functions": _host_functions(prof, top)}
    while engine.has_unfinished():
        engine.step()
    return out


def by_kernel(prof: object) -> list[tuple[str, float, int]]:
    """A profile's CUDA time (us) and launches summed per kernel name, largest time first:
    a decode step's time per launch tells a kernel's fixed cost from its streaming."""
    totals: dict[str, float] = defaultdict(float)
    launches: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            launches[event.name] += 1
    return [(name, us, launches[name])
            for name, us in sorted(totals.items(), key=lambda kv: -kv[1])]


def run(artifact: str, *, contexts: Sequence[int], concurrency: Sequence[int],
        decode_tokens: int, device: str = "cuda", kv_dtype: str = "int8",
        prefill_chunk: int = 1024, max_batched_tokens: int | None = None,
        cuda_graphs: bool = EngineConfig.cuda_graphs,
        prompt_graphs: bool = EngineConfig.prompt_graphs,
        overlap_decode: bool = EngineConfig.overlap_decode, breakdown: bool = True,
        device_timeline: bool = False, spec: str = "none", draft_tokens: int = 3,
        lm_head_draft: bool = False) -> dict:
    """Every measurement above for one artifact, as a report dict (the device timeline with
    the breakdown, or alone with device_timeline)."""
    longest = max(contexts) + decode_tokens + 8
    config = EngineConfig(max_context=longest, max_concurrency=max(concurrency),
                          prefill_chunk=prefill_chunk, max_batched_tokens=max_batched_tokens,
                          device=device, kv_dtype=kv_dtype, cuda_graphs=cuda_graphs,  # type: ignore[arg-type]
                          prompt_graphs=prompt_graphs, overlap_decode=overlap_decode,
                          spec=spec, draft_tokens=draft_tokens,  # type: ignore[arg-type]
                          lm_head_draft=lm_head_draft)
    limits = ceilings(device)  # measured before the engine plans the card's memory
    start = time.perf_counter()
    with triton_compiles() as startup_compiles:
        engine = Engine.from_artifact(artifact, config)
    mode = "none" if spec == "none" else f"{spec}{draft_tokens}" + \
        (" lm-head-draft" if lm_head_draft else "")
    report: dict = {"artifact": artifact, "spec": mode, "overlap_decode": overlap_decode,
                    "prefill_chunk": config.prefill_chunk, "step_tokens": config.step_tokens,
                    # whose chunked GDN kernels the prompts ran (a GPU's: fla-core's or ours)
                    "gdn_prompt_kernels": prompt_kernels()
                    if torch.device(device).type == "cuda" else None,
                    "ceilings": asdict(limits), "startup_s": time.perf_counter() - start,
                    "memory_plan": engine.memory_plan.table() if engine.memory_plan else None,
                    "startup_compiles": len(startup_compiles),
                    "startup_compiles_by_kernel": dict(Counter(
                        c.kernel for c in startup_compiles).most_common()),
                    "compiles": {},
                    "tuned": tuned_choices(),
                    "rows": [], "breakdown": {}, "timeline": {}, "host": {}}
    fp = footprint(engine.model, kv_dtype)
    report["footprint"] = fp.__dict__
    for length in contexts:
        # the first prompt of a length after start-up, then the same again: a gap between the
        # two is work the start-up warm-up left to the first request (compiling, tuning)
        ceiling = limits.bf16_flops / (2 * fp.active_params)
        for what in ("prefill-first", "prefill"):
            with triton_compiles() as compiled:
                seconds = measure_prefill(engine, length)
            report["rows"].append({"what": what, "context": length, "concurrency": 1,
                                   "tok_s": length / seconds, "ceiling_tok_s": ceiling,
                                   "ratio": length / seconds / ceiling})
            if compiled:
                report["compiles"][f"{what} {length}"] = [
                    f"{c.kernel}: {', '.join(c.unlike(startup_compiles)) or 'as at start-up'}"
                    for c in compiled]
        if breakdown:
            report["breakdown"][f"prefill of {length} tokens"] = prefill_breakdown(engine, length)
        for c in concurrency:
            d = measure_decode(engine, length, c, decode_tokens)
            rows = c * (1 + (draft_tokens if spec != "none" else 0))
            step_bytes = fp.step_weight_bytes(rows) + c * (length * fp.kv_bytes_per_token
                                                + 2 * fp.state_bytes)
            ceiling = c * limits.bandwidth / step_bytes
            report["rows"].append({"what": "decode", "context": length, "concurrency": c,
                                   "tok_s": d.tokens / d.seconds, "ceiling_tok_s": ceiling,
                                   "ratio": d.tokens / d.seconds / ceiling,
                                   "ms_per_step": 1e3 * d.seconds / max(1, d.steps),
                                   "tokens_per_step": d.tokens / max(1, d.steps),
                                   "steps": d.steps, "graph_steps": d.graph_steps,
                                   "draft_graph_runs": d.draft_graph_runs,
                                   "greedy_digest": d.digest,
                                   "graph_replay_ms": graph_replay_ms(engine, c)
                                   if spec == "none" else None})
            if breakdown:
                report["breakdown"][f"eager decode step ctx{length}_c{c}"] = \
                    kernel_breakdown(engine, length, c)
            if breakdown or device_timeline:
                report["timeline"][f"decode ctx{length}_c{c}"] = \
                    decode_timeline(engine, length, c)
        if breakdown:
            report["host"].update(host_profile(engine, length, concurrency[0]))
    return report


def markdown(report: dict, top: int = 15) -> str:
    overlap = "" if report.get("overlap_decode", True) else ", decode not overlapped"
    chunks = f", prefill chunk {report['prefill_chunk']:,} ({report['step_tokens']:,} tokens " \
        "a step)" if "prefill_chunk" in report else ""
    if report.get("gdn_prompt_kernels"):
        chunks += f", GDN prompt kernels {report['gdn_prompt_kernels']}'s"
    lines = [f"artifact `{report['artifact']}`, spec {report['spec']}{overlap}{chunks}, "
             f"startup {report['startup_s']:.1f} s "
             f"({report.get('startup_compiles', 0)} Triton compilations: "
             + (", ".join(f"{name} {n}" for name, n in
                          report.get("startup_compiles_by_kernel", {}).items()) or "none")
             + ")", "",
             *([Ceilings(**report["ceilings"]).describe(), ""] if "ceilings" in report else []),
             "| what | context | C | tok/s | ceiling tok/s | ratio | ms/step | tokens/step "
             "| graphed steps | graph replay ms | greedy tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        graphed = f"{r['graph_steps']}/{r['steps']}" if "steps" in r else ""
        replay = r.get("graph_replay_ms")
        lines.append(f"| {r['what']} | {r['context']} | {r['concurrency']} | {r['tok_s']:.1f} "
                     f"| {r['ceiling_tok_s']:.1f} | {100 * r['ratio']:.1f}% "
                     f"| {r.get('ms_per_step', 0):.2f} | {r.get('tokens_per_step', 0):.2f} "
                     f"| {graphed} | {'' if replay is None else f'{replay:.2f}'} "
                     f"| {r.get('greedy_digest', '')} |")
    for key, rows in report["breakdown"].items():
        total = sum(us for _, us, _ in rows)
        lines += ["", f"{key}: {total:.0f} us of kernels in {sum(n for *_, n in rows):,} "
                  "launches", "", "| kernel | us | share | launches | us a launch |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{name[:70]}` | {us:.1f} | {100 * us / total:.1f}% | {n} | {us / n:.2f} |"
                  for name, us, n in rows[:top]]
    for key, found in report.get("timeline", {}).items():
        if found is None:
            continue
        t = Timeline.from_dict(found)
        lines += ["", f"{key}, the device's timeline over {t.steps} steps: "
                  f"{t.step_us:.1f} us a step, the GPU busy {t.step_us - t.idle_us_a_step:.1f} "
                  f"and idle {t.idle_us_a_step:.1f} (gaps of 1 us and more, by the activities "
                  "either side):", "", "| before | after | gaps | us a step |", "|---|---|---|---|"]
        lines += [f"| `{g.before[:60]}` | `{g.after[:60]}` | {g.count} | {g.us / t.steps:.1f} |"
                  for g in t.gaps[:top]]
        lines += ["", "The activities that run at most twice a step, by their own time:", "",
                  "| activity | a step | us a step |", "|---|---|---|"]
        lines += [f"| `{a.name[:70]}` | {a.count / t.steps:.2f} | {a.us / t.steps:.1f} |"
                  for a in t.rare[:top]]
    for key, host in report.get("host", {}).items():
        lines += ["", f"host side of the {key} under cProfile: {host['seconds']:.3f} s", "",
                  "| function | calls | own ms | with callees ms |", "|---|---|---|---|"]
        lines += [f"| `{f['name'][:90]}` | {f['calls']} | {f['own_ms']:.1f} "
                  f"| {f['total_ms']:.1f} |" for f in host["functions"]]
    for key, compiled in report.get("compiles", {}).items():
        lines += ["", f"Triton compilations during {key}, each with what sets it apart from "
                  "the closest variant the start-up compiled:", ""]
        lines += [f"- `{line[:400]}`" for line in compiled]
    if report.get("tuned"):
        lines += ["", "Tuned at start-up:", ""] + [f"- {line}" for line in report["tuned"]]
    if report.get("memory_plan"):
        lines += ["", "```", report["memory_plan"], "```"]
    return "\n".join(lines) + "\n"
