"""Speculative decoding with the DFlash draft (engine.spec.dflash) on tiny random artifacts.

A random draft accepts almost nothing, which is the hard case for exactness (every round
rolls back); acceptance itself is covered with the oracle proposer in test_spec_engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import TickingClock, count_replays
from test_spec_engine import BASE, drafts_per_step, drain, mixed, warmed_up

from ninfer_runtime.engine import Engine, EngineConfig
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.engine.spec import DFlashProposer, make_proposer
from ninfer_runtime.models.loading import DraftModels, LoadedModel, load_artifact


@pytest.fixture(scope="module")
def dflash_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], LoadedModel]:
    """`dflash_model("dense" | "moe")` -> a tiny random artifact with a random DFlash draft
    and a draft head, loaded."""
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.dflash import with_dflash
    from ninfer_convert.draft_vocab import with_draft_vocab
    from ninfer_convert.sources import open_source

    cache: dict[str, LoadedModel] = {}

    def load(kind: str) -> LoadedModel:
        if kind not in cache:
            path = tmp_path_factory.mktemp("dflash") / f"tiny_{kind}_dflash.ninfer"
            source = with_draft_vocab(with_dflash(open_source(f"tiny_{kind}", random_init=True),
                                                  "random"), 512)
            build(source, path, BuildOptions(include_vision=False, include_mtp=False))
            cache[kind] = load_artifact(path, "cpu", dflash=True, lm_head_draft=True)
        return cache[kind]

    return load


def make_engine(loaded: LoadedModel, proposer: object = None, **config: object) -> Engine:
    cfg = EngineConfig(**{**BASE, **config})  # type: ignore[arg-type]
    return Engine(loaded.model, cfg, generation_config=loaded.generation_config,
                  wall_clock=TickingClock(),
                  proposer=proposer or make_proposer(cfg, loaded.drafts, loaded.model))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_dflash_equals_plain_decoding(dflash_model: Callable, kind: str) -> None:
    loaded = dflash_model(kind)
    reqs = mixed()
    plain = drain(make_engine(loaded), reqs)
    for k, head in ((3, False), (7, True)):
        eng = make_engine(loaded, spec="dflash", draft_tokens=k, lm_head_draft=head)
        run = drain(eng, reqs)
        assert run.tokens == plain.tokens
        for req in reqs:
            spec = run.last(req.request_id).stats.spec
            assert spec.rounds >= 1 and spec.drafted_tokens == k * spec.rounds
        assert eng.state_pool.allocator.num_free == eng.state_pool.num_slots == 4 * (1 + k)
        assert eng.kv_pool.allocator.num_free == eng.kv_pool.num_pages


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_dflash_warm_up_leaves_nothing_behind(dflash_model: Callable, kind: str) -> None:
    """The warm-up's context injections and block passes write the draft's K/V into pages
    requests get later: the drafts are still a fresh proposer's, step for step."""
    loaded, reqs = dflash_model(kind), mixed(4, max_tokens=6)
    fresh = drafts_per_step(make_engine(loaded, spec="dflash", draft_tokens=3), reqs)
    assert drafts_per_step(warmed_up(make_engine(loaded, spec="dflash", draft_tokens=3)),
                           reqs) == fresh
    assert sum(bool(d) for step in fresh for d in step.values()) >= 8


def reference_drafts(loaded: LoadedModel, tokens: list[int], k: int) -> list[int]:
    """The draft run on one sequence from scratch: the target's taps over every computed token
    as context, then one block [last token, MASK x k]."""
    model, draft = loaded.model, loaded.drafts.dflash
    n, size = len(tokens) - 1, 16
    pages = list(range(-(-(n + k + 1) // size)))
    caches = model.allocate_cache(len(pages), size, 1, int8_kv=False)
    context = StepBatch.build([Segment(tokens[:n], 0, pages, 0)], size, "cpu")
    _, taps = model.forward_taps(context, caches, draft.config.target_layer_ids)
    kv = draft.allocate_cache(len(pages), size)
    draft.store_context(taps, context, kv)
    block = StepBatch.build([Segment([tokens[n]] + [draft.config.mask_token_id] * k, n,
                                     pages, 0, "all")], size, "cpu")
    hidden = draft.propose(block.token_ids, block, kv, model.embed_tokens)
    return model.logits(hidden[1:]).argmax(-1).tolist()


def test_dflash_drafts_are_the_single_sequence_draft(dflash_model: Callable) -> None:
    """With continuous batching (prompt chunks beside verify steps, every request rolling
    back), the drafts after every step equal the draft run on that sequence alone: the
    committed context reached the draft's caches at the right positions, and nothing of a
    rejected block survives."""
    loaded = dflash_model("dense")
    k = 3
    checked: Counter[str] = Counter()

    def check(eng: Engine) -> None:
        for rid, state in eng.scheduler.running.items():
            if state.drafts:
                assert state.drafts == reference_drafts(
                    loaded, state.token_ids(0, state.num_computed + 1), k)
                checked[rid] += 1

    eng = make_engine(loaded, kv_dtype="bf16", spec="dflash", draft_tokens=k)
    drain(eng, mixed(4, max_tokens=6), after_step=check)
    assert len(checked) == 4 and sum(checked.values()) >= 12


def test_dflash_needs_its_draft(tiny_artifact: Callable[[str], Path],
                                dflash_model: Callable) -> None:
    from ninfer_runtime.artifact import ArtifactError

    with pytest.raises(ArtifactError, match="--spec dflash needs a DFlash draft"):
        Engine.from_artifact(tiny_artifact("dense"), EngineConfig(spec="dflash"))
    with pytest.raises(ValueError, match="needs the artifact's DFlash draft"):
        make_proposer(EngineConfig(spec="dflash"), DraftModels())
    loaded = dflash_model("dense")
    with pytest.raises(ValueError, match="does not fit the DFlash draft's block of 16"):
        DFlashProposer(loaded.drafts.dflash, loaded.model.embed_tokens, torch.argmax, 16)


def test_dflash_block_pass_through_graph_buffers(dflash_model: Callable) -> None:
    """The block pass and the padded context injection replayed from static buffers (the
    CUDA-graph path, uncaptured on the CPU) draft what the draft drafts on the sequence
    alone: the padding's K/V never reaches a draft."""
    loaded = dflash_model("dense")
    k = 3
    proposer = make_proposer(EngineConfig(spec="dflash", draft_tokens=k), loaded.drafts,
                             loaded.model)
    eng = make_engine(loaded, proposer, kv_dtype="bf16", spec="dflash", draft_tokens=k)
    proposer.capture_graphs(4, 8, capture=False)
    replays = count_replays(block=proposer.graphs, context=proposer.context_graphs)

    def check(eng: Engine) -> None:
        for state in eng.scheduler.running.values():
            if state.drafts:
                assert state.drafts == reference_drafts(
                    loaded, state.token_ids(0, state.num_computed + 1), k)

    drain(eng, mixed(4, max_tokens=6), after_step=check)
    block = {n: c for (kind, n), c in replays.items() if kind == "block"}
    context = {n: c for (kind, n), c in replays.items() if kind == "context"}
    assert sum(block.values()) >= 6 and len(block) > 1
    assert sum(context.values()) >= 3 and all(n % (k + 1) == 0 for n in context)
