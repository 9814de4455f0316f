"""Speculative decoding in the engine, on tiny random-init artifacts with their MTP layer.

Random MTP weights accept almost nothing, so the acceptance paths run through an oracle
proposer that drafts the true continuation (known from a plain run) with mistakes planted where
a pattern says. What must hold: outputs equal plain decoding token for token (greedy, and
seeded sampling with penalties), the GDN state and the next logits after a rejection equal
those recomputed from the accepted tokens alone, the MTP drafts equal the single-sequence MTP
recursion, the counters count what happened, and aborting frees every slot and page.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from engine_helpers import TickingClock, count_replays, greedy, prompt, request

from ninfer_runtime import LLM
from ninfer_runtime.engine import AdmissionError, Engine, EngineConfig, EngineRequest
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.device_setup import warm_up_proposer
from ninfer_runtime.engine.request import RequestOutput, SamplingParams
from ninfer_runtime.engine.spec import Committed, MTPProposer, make_proposer
from ninfer_runtime.engine.warmup import Gpu, warmup_steps
from ninfer_runtime.models.cache import GDNSlots
from ninfer_runtime.models.layers import decoder_layer
from ninfer_runtime.models.loading import DraftModels, LoadedModel, load_artifact
from ninfer_runtime.ops.norm import rms_norm
from ninfer_runtime.ops.rope import rope_cos_sin

VOCAB = 1152
BASE = {"prefill_chunk": 16, "max_context": 128, "max_concurrency": 4}


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], LoadedModel]:
    """`spec_model("dense" | "moe")` -> a tiny random artifact with its MTP layer, loaded."""
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.sources import open_source

    cache: dict[str, LoadedModel] = {}

    def load(kind: str) -> LoadedModel:
        if kind not in cache:
            path = tmp_path_factory.mktemp("spec") / f"tiny_{kind}_mtp.ninfer"
            build(open_source(f"tiny_{kind}", random_init=True), path,
                  BuildOptions(include_vision=False, include_mtp=True))
            cache[kind] = load_artifact(path, "cpu", mtp=True)
        return cache[kind]

    return load


def make_engine(loaded: LoadedModel, proposer: object = None, **config: object) -> Engine:
    cfg = EngineConfig(**{**BASE, **config})  # type: ignore[arg-type]
    return Engine(loaded.model, cfg, generation_config=loaded.generation_config,
                  wall_clock=TickingClock(), proposer=proposer or make_proposer(cfg, loaded.drafts))


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)

    def last(self, rid: str) -> RequestOutput:
        return self.outputs[rid][-1]


def drain(eng: Engine, requests: Sequence[EngineRequest] = (), *,
          after_step: Callable[[Engine], None] | None = None) -> Run:
    for req in requests:
        eng.add_request(req)
    run = Run()
    for _ in range(1000):
        if not eng.has_unfinished():
            return run
        for out in eng.step():
            assert out.new_token_ids
            assert not run.outputs.get(out.request_id, [None])[-1] or \
                not run.outputs[out.request_id][-1].finished
            run.outputs.setdefault(out.request_id, []).append(out)
            run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if after_step is not None:
            after_step(eng)
    raise AssertionError("the engine does not make progress")


def drafts_per_step(eng: Engine, reqs: Sequence[EngineRequest]) -> list[dict[str, list[int]]]:
    """Every running request's drafts after each step of draining `reqs`."""
    record: list[dict[str, list[int]]] = []
    drain(eng, reqs, after_step=lambda e: record.append(
        {rid: list(s.drafts) for rid, s in e.scheduler.running.items()}))
    return record


def warmed_up(eng: Engine) -> Engine:
    """The engine after its proposer's start-up warm-up (which a GPU start runs on the
    proposer's real caches, before any request)."""
    assert eng.proposer is not None
    steps = warmup_steps(eng.config, eng.model_config, Gpu(132, dequantized_experts=True))
    warm_up_proposer(eng.proposer, eng.model, eng.config, steps, eng.kv_pool.num_pages)
    return eng


def mixed(n: int = 6, max_tokens: int = 9, seed: int = 0, **sampling: object) -> list:
    lengths = [1, 5, 17, 40, 70, 3, 29, 11]
    return [request(f"r{i}", prompt(lengths[i % 8], seed + i), greedy(max_tokens - i % 3,
                                                                      **sampling))
            for i in range(n)]


class Oracle:
    """Drafts the true continuation from `sequences` (prompt + output of a plain run), with
    the draft at index miss(round) made wrong (index K: all right). Checks what the engine
    says was committed against the sequences."""

    taps: tuple[int, ...] = ()

    def __init__(self, sequences: dict[str, list[int]], num_drafts: int,
                 miss: Callable[[int], int]):
        self.sequences = sequences
        self.num_drafts = num_drafts
        self.miss = miss
        self.rounds: Counter[str] = Counter()

    def cache_bytes_per_token(self, int8_kv: bool) -> int:
        return 0

    def allocate(self, num_pages: int, page_size: int, int8_kv: bool) -> None:
        pass

    def propose(self, hidden: torch.Tensor, taps: torch.Tensor | None,
                committed: Sequence[Committed]) -> list[list[int]]:
        out = []
        for c in committed:
            seq = self.sequences[c.request_id]
            assert list(c.next_token_ids) == seq[c.start + 1:c.next_position + 1]
            assert c.rows.stop <= hidden.shape[0]
            if not c.propose:
                out.append([])
                continue
            drafts = seq[c.next_position + 1:c.next_position + 1 + self.num_drafts]
            drafts += [0] * (self.num_drafts - len(drafts))
            wrong = self.miss(self.rounds[c.request_id])
            self.rounds[c.request_id] += 1
            if wrong < self.num_drafts:
                drafts[wrong] = (drafts[wrong] + 1) % 1000
            out.append(drafts)
        return out


def continuation(loaded: LoadedModel, reqs: Sequence[EngineRequest], extra: int,
                 **config: object) -> dict[str, list[int]]:
    """prompt + the plain engine's output with `extra` more tokens than each asks for."""
    longer = [replace(r, sampling=replace(r.sampling, max_tokens=r.sampling.max_tokens + extra))
              for r in reqs]
    run = drain(make_engine(loaded, **{"max_context": 256, **config}), longer)
    return {r.request_id: [*r.prompt_token_ids, *run.tokens[r.request_id]] for r in reqs}


# ---- outputs equal plain decoding ----

@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_greedy_mtp_equals_plain_decoding(spec_model: Callable, kind: str, kv_dtype: str) -> None:
    loaded = spec_model(kind)
    reqs = mixed()
    plain = drain(make_engine(loaded, kv_dtype=kv_dtype), reqs)
    for k in (1, 3):
        eng = make_engine(loaded, kv_dtype=kv_dtype, spec="mtp", draft_tokens=k)
        run = drain(eng, reqs)
        assert run.tokens == plain.tokens
        for req in reqs:
            spec = run.last(req.request_id).stats.spec
            assert spec.rounds >= 1 and spec.drafted_tokens == k * spec.rounds
            assert len(spec.accepted_per_position) == k
            assert sum(spec.accepted_per_position) == spec.accepted_tokens
        assert eng.state_pool.allocator.num_free == eng.state_pool.num_slots == 4 * (1 + k)
        assert eng.kv_pool.allocator.num_free == eng.kv_pool.num_pages


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_mtp_under_a_step_budget_equals_plain_decoding(spec_model: Callable,
                                                              kind: str) -> None:
    """The least budget (a verify segment for each of 4 requests) over chunks of 8: verify
    segments take more than the prompt tokens they follow, so a running prompt waits out some
    steps."""
    loaded = spec_model(kind)
    reqs = mixed()
    plain = drain(make_engine(loaded), reqs)
    eng = make_engine(loaded, spec="mtp", draft_tokens=3, prefill_chunk=8, max_batched_tokens=16)
    assert drain(eng, reqs).tokens == plain.tokens
    records = eng.intervals()
    assert all(r["computed_prefill_tokens"] + 4 * r["decode_ready"] <= 16 for r in records)
    assert any(r["running"] > r["prefilling"] + r["decode_ready"] for r in records)


def expected_counters(miss: Callable[[int], int], max_tokens: int, k: int) -> tuple[int, ...]:
    """(rounds, accepted, per position...) of a request whose round r accepts miss(r)."""
    emitted, accepted, per_position = 1, 0, [0] * k  # the first token comes from the prefill
    for r in itertools.count():
        if emitted >= max_tokens:
            return (r, accepted, *per_position)
        a = miss(r)
        emitted += a + 1
        accepted += a
        for i in range(a):
            per_position[i] += 1
    raise AssertionError


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_partial_and_full_acceptance(spec_model: Callable, kind: str) -> None:
    """An oracle accepting 3, 0, 1, 2, 3, ... drafts of K = 3 in turn (the last round's
    surplus cut at max_tokens): the plain tokens, and counters that count exactly that."""
    loaded = spec_model(kind)
    k, pattern = 3, [3, 0, 1, 2, 3, 3, 1]
    reqs = mixed(5, max_tokens=14)
    sequences = continuation(loaded, reqs, k + 1)
    oracle = Oracle(sequences, k, lambda r: pattern[r % len(pattern)])
    eng = make_engine(loaded, oracle, spec="mtp", draft_tokens=k)
    run = drain(eng, reqs)
    for req in reqs:
        rid, n = req.request_id, req.sampling.max_tokens
        assert run.tokens[rid] == sequences[rid][len(req.prompt_token_ids):][:n]
        spec = run.last(rid).stats.spec
        assert (spec.rounds, spec.accepted_tokens, *spec.accepted_per_position) == \
            expected_counters(lambda r: pattern[r % len(pattern)], n, k)
        assert max(len(o.new_token_ids) for o in run.outputs[rid]) == k + 1
        assert run.last(rid).finish_reason == "length" and len(run.tokens[rid]) == n
    records = eng.intervals()
    assert sum(r["committed_decode_tokens"] for r in records) == sum(
        r.sampling.max_tokens for r in reqs)
    rounds = [n for r in records for n in r["rows_per_round"]]  # requests per round, not tokens
    assert max(rounds) <= len(reqs) and sum(rounds) < sum(r.sampling.max_tokens for r in reqs)


def test_stop_token_inside_an_accepted_block(spec_model: Callable) -> None:
    loaded = spec_model("dense")
    req = request("s", prompt(12, 3), greedy(12))
    out = continuation(loaded, [req], 4)["s"][12:]
    stop = next(i for i in range(3, 12) if out[i] not in out[:i])
    stopping = request("s", req.prompt_token_ids, SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=(out[stop],)))
    run = drain(make_engine(loaded, Oracle({"s": [*req.prompt_token_ids, *out]}, 3,
                                           lambda r: 3), spec="mtp", draft_tokens=3),
                [stopping])
    assert run.tokens["s"] == out[:stop + 1]
    assert run.last("s").finish_reason == "stop"


def test_seeded_sampling_with_penalties_equals_plain_decoding(spec_model: Callable) -> None:
    """Each emitted token is sampled with the noise of its output index and penalties that
    count the drafts before it, so a seed gives the plain output, with MTP drafts and with an
    oracle that drafts the plain output itself (mostly accepted)."""
    loaded = spec_model("moe")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=21, max_tokens=12,
                              ignore_eos=True, repetition_penalty=3.0, presence_penalty=2.0,
                              frequency_penalty=1.0, logprobs=2)
    reqs = [request(f"q{i}", prompt(n, 30 + i), sampling) for i, n in enumerate((4, 23, 9))]
    plain = drain(make_engine(loaded), reqs)
    mtp = drain(make_engine(loaded, spec="mtp", draft_tokens=2), reqs)
    sequences = {r.request_id: [*r.prompt_token_ids, *plain.tokens[r.request_id], 0, 0, 0]
                 for r in reqs}
    eng = make_engine(loaded, Oracle(sequences, 3, lambda r: (3, 2, 0)[r % 3]), spec="mtp",
                      draft_tokens=3)
    oracle = drain(eng, reqs)
    assert mtp.tokens == plain.tokens == oracle.tokens
    for req in reqs:
        rid = req.request_id
        assert oracle.last(rid).stats.spec.accepted_tokens > 4
        flat = [lp for o in oracle.outputs[rid] for lp in o.new_logprobs]
        reference = [lp for o in plain.outputs[rid] for lp in o.new_logprobs]
        assert [lp.token_id for lp in flat] == oracle.tokens[rid]
        for mine, theirs in zip(flat, reference, strict=True):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    again = drain(make_engine(loaded, spec="mtp", draft_tokens=2), reqs)
    assert again.tokens == mtp.tokens


# ---- rollback ----

def test_rollback_state_and_next_logits_equal_recomputation(spec_model: Callable) -> None:
    """After every step (rejections at each draft index), each request's GDN conv and
    recurrent state equal those of a fresh forward over its committed tokens alone, and every
    emitted token's logprobs are those of scoring its prefix from scratch."""
    loaded = spec_model("dense")
    model, llm = loaded.model, LLM.from_model(loaded.model)
    reqs = mixed(3, max_tokens=10, logprobs=VOCAB)
    sequences = continuation(loaded, reqs, 4, kv_dtype="bf16")
    checked = Counter()

    def check_states(eng: Engine) -> None:
        for rid, state in eng.scheduler.running.items():
            if state.prefilling or not state.output:
                continue
            cache = model.new_cache()
            model.forward(torch.tensor(sequences[rid][:state.num_computed]), 0, cache)
            mine = [c for c in eng.caches if isinstance(c, GDNSlots)]
            fresh = [c for c in cache.layers if isinstance(c, GDNSlots)]
            for a, b in zip(mine, fresh, strict=True):
                torch.testing.assert_close(a.conv[state.slot], b.conv[0], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(a.recurrent[state.slot], b.recurrent[0], rtol=1e-4,
                                           atol=1e-5)
            checked[rid] += 1

    eng = make_engine(loaded, Oracle(sequences, 3, lambda r: (0, 1, 2, 3)[r % 4]),
                      kv_dtype="bf16", spec="mtp", draft_tokens=3)
    run = drain(eng, reqs, after_step=check_states)
    for req in reqs:
        rid = req.request_id
        assert checked[rid] >= 3
        seq = list(req.prompt_token_ids)
        for out in run.outputs[rid]:
            for token, lp in zip(out.new_token_ids, out.new_logprobs, strict=True):
                expected = torch.log_softmax(llm.score(seq)[-1], -1)
                got = torch.full((VOCAB,), float("nan"))
                for t, v in lp.top:
                    got[t] = v
                torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
                seq.append(token)


# ---- the MTP proposer ----

def reference_drafts(loaded: LoadedModel, tokens: list[int],
                     k: int) -> tuple[list[int], list[torch.Tensor]]:
    """The MTP recursion on one sequence (Qwen3_5MTP.forward) after `tokens`, whose last token
    is sampled but not yet computed: the K drafts and the MTP hidden each came from."""
    model, mtp = loaded.model, loaded.drafts.mtp
    n = len(tokens) - 1
    hidden = model.forward(torch.tensor(tokens[:n]), 0, model.new_cache())
    cache = mtp.new_cache()
    h, logits = mtp.forward(torch.tensor(tokens[1:]), hidden, 0, cache)
    drafts, hiddens = [int(logits[-1].argmax())], [h[-1]]
    for j in range(1, k):
        h, logits = mtp.forward(torch.tensor(drafts[-1:]), h[-1:], n + j - 1, cache)
        drafts.append(int(logits[-1].argmax()))
        hiddens.append(h[-1])
    return drafts, hiddens


def test_mtp_drafts_are_the_single_sequence_recursion(spec_model: Callable) -> None:
    """With continuous batching (prompt chunks beside verify steps), the drafts the batched
    MTP proposer makes after every step, and the MTP hidden states they come from, equal the
    MTP applied to that sequence alone."""
    loaded = spec_model("dense")
    mtp, k = loaded.drafts.mtp, 3
    recorded: list[torch.Tensor] = []

    def argmax(hidden: torch.Tensor) -> torch.Tensor:
        recorded.append(hidden)
        return mtp.logits(hidden).argmax(-1)

    checked = Counter()

    def check(eng: Engine) -> None:
        steps = recorded[-k:]
        for rid, state in eng.scheduler.running.items():
            if state.drafts:
                drafts, hiddens = reference_drafts(loaded, state.token_ids(
                    0, state.num_computed + 1), k)
                assert state.drafts == drafts
                for rows, h in zip(steps, hiddens, strict=True):
                    assert (rows - h).abs().amax(-1).min() < 1e-4
                checked[rid] += 1

    eng = make_engine(loaded, MTPProposer(mtp, k, argmax), kv_dtype="bf16", spec="mtp",
                      draft_tokens=k)
    drain(eng, mixed(4, max_tokens=6), after_step=check)
    assert len(checked) == 4 and sum(checked.values()) >= 12


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_warm_up_leaves_nothing_behind(spec_model: Callable, kind: str) -> None:
    """The warm-up's passes (every prompt shape class, every decode batch size) write the MTP's
    K/V into pages requests get later: the drafts are still a fresh proposer's, step for
    step."""
    loaded, reqs = spec_model(kind), mixed(4, max_tokens=6)
    fresh = drafts_per_step(make_engine(loaded, spec="mtp", draft_tokens=3), reqs)
    assert drafts_per_step(warmed_up(make_engine(loaded, spec="mtp", draft_tokens=3)),
                           reqs) == fresh
    assert sum(bool(d) for step in fresh for d in step.values()) >= 8


def test_draft_head_hook_changes_drafts_not_outputs(spec_model: Callable) -> None:
    """--lm-head-draft drafts through another argmax (here: the best of the even ids): the
    drafts follow it, the verified output does not change."""
    loaded = spec_model("dense")
    mtp = loaded.drafts.mtp
    even = torch.arange(0, VOCAB, 2)
    seen: list[torch.Tensor] = []

    def even_argmax(hidden: torch.Tensor) -> torch.Tensor:
        ids = even[mtp.logits(hidden)[:, even].argmax(-1)]
        seen.append(ids)
        return ids

    reqs = mixed(3)
    plain = drain(make_engine(loaded), reqs)
    eng = make_engine(loaded, MTPProposer(mtp, 2, even_argmax), spec="mtp", draft_tokens=2,
                      lm_head_draft=True)
    assert drain(eng, reqs).tokens == plain.tokens
    assert seen and all((ids % 2 == 0).all() for ids in seen)


def test_lm_head_draft_from_the_artifact(tmp_path: Path, spec_model: Callable) -> None:
    """An artifact with the MTP layer and a 64-token draft head: every draft is one of those
    64 ids, and the output is the plain one."""
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.draft_vocab import with_draft_vocab
    from ninfer_convert.sources import open_source
    from ninfer_runtime.artifact import Artifact

    path = tmp_path / "draft_head.ninfer"
    build(with_draft_vocab(open_source("tiny_dense", random_init=True), 64), path,
          BuildOptions(include_vision=False, include_mtp=True))
    loaded = load_artifact(path, "cpu", mtp=True, lm_head_draft=True)
    assert loaded.drafts.draft_argmax is not None
    subset = set(Artifact.open(path).weight("draft_head.token_ids").tolist())
    drafted: set[int] = set()

    def collect(eng: Engine) -> None:
        for state in eng.scheduler.running.values():
            drafted.update(state.drafts)

    reqs = mixed(3)
    plain = drain(make_engine(loaded), reqs)
    run = drain(make_engine(loaded, spec="mtp", draft_tokens=2, lm_head_draft=True), reqs,
                after_step=collect)
    assert run.tokens == plain.tokens
    assert drafted and drafted <= subset
    with pytest.raises(ValueError, match="no draft head was loaded"):
        make_engine(spec_model("dense"), spec="mtp", lm_head_draft=True)


# ---- slots, pages, admission ----

def test_abort_mid_spec_frees_slots_and_pages(spec_model: Callable) -> None:
    loaded = spec_model("dense")
    eng = make_engine(loaded, spec="mtp", draft_tokens=3, max_concurrency=2, page_size=16,
                      max_context=64)
    pages, slots = eng.kv_pool.num_pages, eng.state_pool.num_slots
    assert slots == 2 * 4
    a, b = request("a", prompt(6, 1), greedy(30)), request("b", prompt(20, 2), greedy(8))
    for req in (a, b):
        eng.add_request(req)
    for _ in range(3):
        eng.step()
    assert eng.scheduler.running["a"].drafts and eng.state_pool.allocator.num_free == 0
    eng.abort_request("a")
    assert eng.state_pool.allocator.num_free == 4
    assert eng.kv_pool.allocator.num_free == pages - 2  # b: 20 + 8 + 3 tokens in 2 pages
    drain(eng)
    assert eng.kv_pool.allocator.num_free == pages and eng.state_pool.allocator.num_free == slots


def test_admission_reserves_the_draft_positions(spec_model: Callable) -> None:
    loaded = spec_model("dense")
    fits = request("fits", prompt(100, 0), greedy(28))  # exactly the 128-token pool
    plain = make_engine(loaded, kv_capacity=128, page_size=16, max_context=256)
    plain.add_request(fits)
    eng = make_engine(loaded, kv_capacity=128, page_size=16, max_context=256, spec="mtp")
    with pytest.raises(AdmissionError, match=r"\+ 3 draft tokens exceeds the KV pool of 128"):
        eng.add_request(fits)


def test_engine_checks_its_proposer(spec_model: Callable) -> None:
    loaded = spec_model("dense")
    with pytest.raises(ValueError, match="proposer"):
        Engine(loaded.model, EngineConfig(spec="mtp"))
    with pytest.raises(ValueError, match="drafts 2 tokens, the config 3"):
        Engine(loaded.model, EngineConfig(spec="mtp"),
               proposer=MTPProposer(loaded.drafts.mtp, 2))
    with pytest.raises(ValueError, match="needs the model's MTP head"):
        make_proposer(EngineConfig(spec="mtp"), DraftModels())
    with pytest.raises(ValueError, match="lm_head_draft needs a spec method"):
        EngineConfig(lm_head_draft=True)


def test_artifact_without_mtp_is_refused(tiny_artifact: Callable[[str], Path]) -> None:
    from ninfer_runtime.artifact import ArtifactError

    with pytest.raises(ArtifactError, match="--spec mtp needs the MTP layer"):
        Engine.from_artifact(tiny_artifact("dense"), EngineConfig(spec="mtp"))


# ---- model pieces: taps, the GDN path split ----

def test_taps_are_the_residual_stream_after_those_layers(spec_model: Callable) -> None:
    model = spec_model("moe").model
    cfg = model.config
    ids = prompt(11, 5)
    batch = StepBatch.build([Segment(ids, 0, [0], 0, "all")], 16, "cpu")
    hidden, taps = model.forward_taps(batch, model.allocate_cache(1, 16, 1, False), (3, 0, 2))
    torch.testing.assert_close(hidden, model.forward_batch(
        batch, model.allocate_cache(1, 16, 1, False)), rtol=0, atol=0)
    x, h, streams = model.embed_tokens[batch.token_ids], None, []
    caches = model.allocate_cache(1, 16, 1, False)
    rope = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta)
    for w, cache in zip(model.layers, caches, strict=True):
        x, h = decoder_layer(x, h, w, cache, batch, rope, cfg)
        streams.append(x + h)
    assert taps.shape == (11, 3 * cfg.hidden_size)
    torch.testing.assert_close(taps, torch.cat([streams[3], streams[0], streams[2]], -1))
    torch.testing.assert_close(hidden, rms_norm(streams[-1], model.norm, cfg.rms_norm_eps))


def test_verify_segments_beside_prompt_chunks_take_their_own_gdn_paths(
        spec_model: Callable) -> None:
    """A step of a verify segment (with snapshot slots) and a prompt chunk equals the two run
    apart; the verify segment leaves the state after each token in its snapshot slots, its
    last in its own slot, and never writes the slot it started from elsewhere."""
    model = spec_model("dense").model
    first, chunk = prompt(9, 1), prompt(13, 2)
    draft = [5, 6, 7]
    together = model.allocate_cache(8, 16, 8, False)
    model.forward_batch(StepBatch.build([Segment(first, 0, [0], 0, "none")], 16, "cpu"),
                        together)
    apart = model.allocate_cache(8, 16, 8, False)
    for a, b in zip(apart, together, strict=True):
        for name, t in vars(b).items():
            if t is not None:
                getattr(a, name).copy_(t)
    verify = Segment(draft, 9, [0], 0, "all", snapshot_slots=[1, 2, 0])
    prefill = Segment(chunk, 0, [1], 3, "last")
    batch = StepBatch.build([verify, prefill], 16, "cpu")
    assert (batch.recurrent_tokens, batch.recurrent_seqs) == (3, 1)
    assert batch.snapshot_slots.tolist() == [1, 2, 0]
    both = model.forward_batch(batch, together)
    alone = [model.forward_batch(StepBatch.build([s], 16, "cpu"), apart)
             for s in (verify, prefill)]
    torch.testing.assert_close(both, torch.cat(alone), rtol=1e-5, atol=1e-5)
    gdn = [(a, b) for a, b in zip(together, apart, strict=True) if isinstance(a, GDNSlots)]
    for a, b in gdn:
        for slot in (0, 1, 2, 3):
            torch.testing.assert_close(a.recurrent[slot], b.recurrent[slot])
            torch.testing.assert_close(a.conv[slot], b.conv[slot])
    # slot 1 holds the state after the first verify token: continuing from it with the
    # second token gives slot 2's state
    step = StepBatch.build([Segment(draft[1:2], 10, [0], 1, "all")], 16, "cpu")
    model.forward_batch(step, together)
    for a, _ in gdn:
        torch.testing.assert_close(a.recurrent[1], a.recurrent[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must precede"):
        StepBatch.build([prefill, verify], 16, "cpu")
    with pytest.raises(ValueError, match="2 snapshot slots for a segment of 3"):
        StepBatch.build([Segment(draft, 9, [0], 0, snapshot_slots=[1, 0])], 16, "cpu")



def test_mtp_draft_steps_through_graph_buffers(spec_model: Callable) -> None:
    """The padded first pass and the chain steps replayed from static buffers (the CUDA-graph
    path, uncaptured on the CPU) draft what the single-sequence recursion drafts, and the
    engine's tokens stay the plain ones."""
    loaded = spec_model("dense")
    k, reqs = 3, mixed(4, max_tokens=6)
    proposer = MTPProposer(loaded.drafts.mtp, k)
    eng = make_engine(loaded, proposer, kv_dtype="bf16", spec="mtp", draft_tokens=k)
    proposer.capture_graphs(4, 8, capture=False)
    assert proposer.graphs is not None
    replays = count_replays(chain=proposer.graphs, first=proposer.first_graphs)

    def check(eng: Engine) -> None:
        for state in eng.scheduler.running.values():
            if state.drafts:
                assert state.drafts == reference_drafts(
                    loaded, state.token_ids(0, state.num_computed + 1), k)[0]

    run = drain(eng, reqs, after_step=check)
    assert run.tokens == drain(make_engine(loaded, kv_dtype="bf16"), reqs).tokens
    chain = {n: c for (kind, n), c in replays.items() if kind == "chain"}
    first = {n: c for (kind, n), c in replays.items() if kind == "first"}
    assert sum(chain.values()) >= 2 * 6 and len(chain) > 1  # several batch sizes
    assert sum(first.values()) >= 3 and all(n % (k + 1) == 0 for n in first)


def test_verify_steps_run_through_the_target_graph_buffers(spec_model: Callable) -> None:
    """Every round of requests that all decode is a verify step of K+1 tokens per request that
    the target's decode graphs (uncaptured on the CPU) cover, at each batch size."""
    from ninfer_runtime.engine.device_setup import step_graphs

    loaded = spec_model("dense")
    k, reqs = 3, mixed(4, max_tokens=6)
    eng = make_engine(loaded, kv_dtype="bf16", spec="mtp", draft_tokens=k)
    eng.graphs = step_graphs(loaded.model, eng.caches, eng.config, capture=False)
    assert eng.config.max_concurrency == 4
    replays = count_replays(verify=eng.graphs)
    run = drain(eng, reqs)
    assert run.tokens == drain(make_engine(loaded, kv_dtype="bf16"), reqs).tokens
    assert {n for _, n in replays} >= {4 * (k + 1), k + 1}  # all four, and the last alone


def test_a_lone_prompt_replays_its_chunk_graphs_beside_mtp(spec_model: Callable) -> None:
    """A prompt prefilling alone in chunks of 16 replays the target's prompt-chunk graphs
    (uncaptured on the CPU) with MTP on, whose draft head reads every row's hidden state from
    the graph's buffers: 40 tokens = 2 chunks through the graph + 8 eagerly, and the tokens of
    plain decoding."""
    from ninfer_runtime.engine.device_setup import step_graphs

    loaded = spec_model("dense")
    reqs = [request("long", prompt(40, 3), greedy(6))]
    eng = make_engine(loaded, kv_dtype="bf16", spec="mtp", draft_tokens=3, max_concurrency=1)
    eng.graphs = step_graphs(loaded.model, eng.caches, eng.config, capture=False)
    replays = count_replays(step=eng.graphs)
    run = drain(eng, reqs)
    assert run.tokens == drain(make_engine(loaded, kv_dtype="bf16", max_concurrency=1),
                               reqs).tokens
    assert replays[("step", 16)] == 2
