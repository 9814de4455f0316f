"""Speculative verification at the sampler (`sample_verify`), on synthetic logits over a tiny
vocabulary: it emits what sequential plain sampling emits for the same seed, and its output
distribution is the plain sampler's (chi-square over many seeds), penalties on and off, with
top-k / top-p."""

from __future__ import annotations

import pytest
import torch

from ninfer_runtime.engine.request import SamplingParams
from ninfer_runtime.engine.sampler import SamplerState, sample, sample_verify
from ninfer_runtime.ops.sampling import apply_penalties, filter_logits

CPU = torch.device("cpu")
V = 8
PROMPT = (1, 5)
# chi-square critical values at significance 0.001 by degrees of freedom
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}

SETTINGS = {
    "plain": {"temperature": 1.0},
    "greedy": {"temperature": 0.0},
    "greedy+penalties": {"temperature": 0.0, "repetition_penalty": 1.5,
                         "presence_penalty": 0.7},
    "filters": {"temperature": 0.8, "top_k": 5, "top_p": 0.9},
    "penalties": {"temperature": 1.2, "repetition_penalty": 1.6, "presence_penalty": 0.8,
                  "frequency_penalty": 0.5},
    "everything": {"temperature": 0.7, "top_k": 6, "top_p": 0.95, "min_p": 0.02,
                   "repetition_penalty": 1.4, "presence_penalty": 0.5,
                   "frequency_penalty": 0.6},
}


def state(seed: int, **sampling: object) -> SamplerState:
    return SamplerState.create(SamplingParams(seed=seed, logprobs=2, **sampling), PROMPT, V,
                               CPU)


def plain_emission(logits: torch.Tensor, drafts: list[int],
                   st: SamplerState) -> list[tuple[int, object]]:
    """What plain decoding emits: one token per row while the tokens agree with the drafts
    (rows stand for the target's logits given that prefix)."""
    out = []
    for i in range(logits.shape[0]):
        token, logprob = sample(logits[i:i + 1], [st])[0]
        out.append((token, logprob))
        if i == len(drafts) or token != drafts[i]:
            return out
    raise AssertionError


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_verify_emits_what_plain_sampling_emits(setting: str) -> None:
    """Per seed and draft: the same tokens, logprobs, and sampler state afterwards; drafts
    that repeat tokens, drafts that are the plain samples (accepted), and wrong ones."""
    gen = torch.Generator().manual_seed(1)
    states, plain_states, logits, drafts = [], [], [], []
    for seed in range(60):
        rows = torch.randn(4, V, generator=gen) * 2
        st, twin, probe = made = [state(seed, **SETTINGS[setting]) for _ in range(3)]
        for s in made:  # a token generated earlier: frequency and presence count it
            sample(torch.zeros(1, V), [s])
        run = [sample(rows[i:i + 1], [probe])[0][0] for i in range(3)]  # the plain tokens
        d = [run, [2, 2, 2], [run[0], (run[1] + 1) % V, run[2]]][seed % 3]
        states.append(st)
        plain_states.append(twin)
        logits.append(rows)
        drafts.append(d)
    emitted = sample_verify(torch.cat(logits), states, drafts)
    accepted = 0
    for rows, d, st, twin, got in zip(logits, drafts, states, plain_states, emitted,
                                      strict=True):
        expected = plain_emission(rows, d, twin)
        assert [t for t, _ in got] == [t for t, _ in expected]
        for (_, mine), (_, theirs) in zip(got, expected, strict=True):
            assert mine.logprob == pytest.approx(theirs.logprob)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top])
        assert st.step == twin.step
        if st.counts is not None:
            assert torch.equal(st.counts, twin.counts)
        accepted += len(got) - 1
    assert accepted >= 20  # the acceptance paths ran


def target_distribution(logits: torch.Tensor, sampling: dict, output: list[int]) -> torch.Tensor:
    """The plain sampler's distribution for one row, from the ops it is built of."""
    counts = torch.zeros(1, V, dtype=torch.int32)
    for t in output:
        counts[0, t] += 1
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, list(PROMPT)] = True
    scores = apply_penalties(logits[None], seen, counts,
                             torch.tensor([sampling.get("repetition_penalty", 1.0)]),
                             torch.tensor([sampling.get("frequency_penalty", 0.0)]),
                             torch.tensor([sampling.get("presence_penalty", 0.0)]))
    scores = filter_logits(scores / sampling["temperature"],
                           torch.tensor([sampling.get("top_k", 0)]),
                           torch.tensor([sampling.get("top_p", 1.0)]),
                           torch.tensor([sampling.get("min_p", 0.0)]))
    return scores.softmax(-1)[0]


def chi_square(observed: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the outcomes the distribution allows, and its degrees of
    freedom; an outcome it forbids makes the statistic infinite."""
    n = observed.sum()
    allowed = expected_p > 0
    if observed[~allowed].sum():
        return float("inf"), 0
    expected = n * expected_p[allowed]
    return float(((observed[allowed] - expected) ** 2 / expected).sum()), int(allowed.sum()) - 1


@pytest.mark.parametrize("setting", ["plain", "filters", "penalties", "everything"])
def test_verify_output_distribution_is_the_plain_samplers(setting: str) -> None:
    """4000 seeded verifications of drafts [d1, d2] over fixed rows: the first emitted token
    is distributed as the target's first row (d1 accepted with probability p(d1), else a draw
    from the rest), the second, given d1 was accepted, as the second row's distribution with
    d1 in the output (penalties count it). With penalties, a distribution that ignores the
    drafted token's is rejected by the same test."""
    sampling = SETTINGS[setting]
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(3, V, generator=gen) * 1.5
    output = [4]  # generated before this step
    p1 = target_distribution(rows[0], sampling, output)
    d1 = int(p1.argmax())  # a draft that is often accepted
    d2 = int(p1.argsort()[-2])
    p2 = target_distribution(rows[1], sampling, output + [d1])
    n = 4000
    states = [state(10_000 + seed, **sampling) for seed in range(n)]
    forced = torch.zeros(n, V).index_fill_(1, torch.tensor(output), 50.0)
    assert {t for t, _ in sample(forced, states)} == set(output)
    emitted = sample_verify(rows.repeat(n, 1), states, [[d1, d2]] * n)
    first = torch.bincount(torch.tensor([e[0][0] for e in emitted]), minlength=V).float()
    second = torch.bincount(torch.tensor([e[1][0] for e in emitted if len(e) > 1]),
                            minlength=V).float()
    for observed, p in ((first, p1), (second, p2)):
        statistic, dof = chi_square(observed, p)
        assert dof >= 1 and statistic < CHI2_CRITICAL[dof], (setting, statistic, dof)
    assert first[d1] == second.sum()  # emitted a second token exactly when d1 was accepted
    if setting == "penalties":
        ignored = target_distribution(rows[1], sampling, output)  # d1 not counted
        statistic, dof = chi_square(second, ignored)
        assert statistic > CHI2_CRITICAL.get(dof, 0.0)


def test_greedy_verification_accepts_exactly_the_argmax_prefix() -> None:
    rows = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0],
                         [2.0, 0.0, 1.0, 0, 0, 0, 0, 0],
                         [0.0, 0.0, 5.0, 0, 0, 0, 0, 0],
                         [0.0, 0.0, 0.0, 4, 0, 0, 0, 0]])
    cases = {(1, 0, 2): [1, 0, 2, 3], (1, 0, 7): [1, 0, 2], (1, 2, 2): [1, 0], (0, 0, 2): [1]}
    for drafts, expected in cases.items():
        st = state(0, temperature=0.0)
        assert [t for t, _ in sample_verify(rows, [st], [list(drafts)])[0]] == expected
        assert st.step == len(expected)
    # row 1 counts the accepted draft 3: the repetition penalty turns its choice to 2
    penalised = state(0, temperature=0.0, repetition_penalty=3.0)
    rows2 = torch.tensor([[0.0, 0, 0, 3.0, 0, 0, 0, 0], [0.0, 0, 1.0, 2.0, 0, 0, 0, 0]])
    assert [t for t, _ in sample_verify(rows2, [penalised], [[3]])[0]] == [3, 2]
