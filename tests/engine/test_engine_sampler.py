"""Sampling: penalties and filters on hand-computed cases, per-request seeding independent of
the batch, logprobs, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_runtime.engine.request import AdmissionError, SamplingParams
from ninfer_runtime.engine.sampler import SamplerState, check_sampling, sample
from ninfer_runtime.ops.sampling import apply_penalties, filter_logits

CPU = torch.device("cpu")
V = 6


def test_penalties_change_exactly_the_seen_and_generated_tokens() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False, False, True, False]])  # prompt or output
    counts = torch.tensor([[0, 2, 0, 0, 1, 0]])  # generated: token 1 twice, token 4 once

    def run(rep: float, freq: float, pres: float) -> list[float]:
        return apply_penalties(logits, seen, counts, torch.tensor([rep]), torch.tensor([freq]),
                               torch.tensor([pres]))[0].tolist()


    assert run(1.0, 0.0, 0.0) == logits[0].tolist()
    # repetition 2: seen positive logits halve, seen negative ones double; others stay
    assert run(2.0, 0.0, 0.0) == [1.0, -2.0, 3.0, 0.5, -4.0, 1.0]
    # frequency 0.5 and presence 0.25 apply to generated tokens only (not prompt token 0)
    assert run(1.0, 0.5, 0.25) == [2.0, -1.0 - 1.0 - 0.25, 3.0, 0.5, -2.0 - 0.5 - 0.25, 1.0]


def test_filters_keep_the_expected_tokens() -> None:
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])

    def kept(top_k: list[int], top_p: list[float], min_p: list[float]) -> list[list[int]]:
        scores = probs.log().expand(len(top_k), 5)
        out = filter_logits(scores, torch.tensor(top_k), torch.tensor(top_p),
                            torch.tensor(min_p))
        return [torch.isfinite(row).nonzero().flatten().tolist() for row in out]

    assert kept([0, 2, 0, 0, 3], [1.0, 1.0, 0.6, 0.75, 0.5], [0.0] * 5) == [
        [0, 1, 2, 3, 4],  # off
        [1, 2],  # top-k 2
        [1, 2],  # 0.4 < 0.6 <= 0.4 + 0.3
        [1, 2, 3],  # 0.7 < 0.75
        [1, 2],  # top-3 renormalised (0.47, 0.35, 0.18): 0.47 < 0.5
    ]
    # min-p 0.3 keeps p >= 0.12; min-p 0.5 keeps p >= 0.2, then top-p 0.6 of (0.57, 0.43)
    assert kept([0, 0], [1.0, 0.6], [0.3, 0.5]) == [[1, 2, 3], [1, 2]]
    assert kept([1], [1e-6], [1.0]) == [[1]]  # the most likely token always survives


def states(params: list[SamplingParams], prompt: tuple[int, ...] = (0,)) -> list[SamplerState]:
    return [SamplerState.create(p, prompt, V, CPU) for p in params]


def test_greedy_rows_take_the_argmax_of_the_penalised_logits() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.9, 0.0, 0.0, 0.0]] * 2)
    plain, penalised = SamplingParams(temperature=0.0), SamplingParams(
        temperature=0.0, repetition_penalty=1.2)
    out = sample(logits, states([plain, penalised], prompt=(1,)))
    assert [token for token, _ in out] == [1, 2]  # 2.0 / 1.2 < 1.9


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(12, V, generator=torch.Generator().manual_seed(0))
    mine = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=11)
    others = [SamplingParams(temperature=t, top_k=k, seed=s)
              for t, k, s in [(1.0, 0, 1), (0.0, 0, None), (1.5, 2, 3)]]

    def draws(row: int, companions: list[SamplingParams]) -> list[int]:
        """Six steps of `mine` at batch row `row`, the companions in the other rows."""
        st = states(companions[:row] + [mine] + companions[row:])
        out = []
        for step in range(6):
            batch = logits[step + 1:step + 1 + len(st)].clone()  # the others' logits
            batch[row] = logits[step]
            out.append(sample(batch, st)[row][0])
        return out

    alone = draws(0, [])
    assert draws(0, others) == alone
    assert draws(2, others) == alone
    assert draws(1, others[:1]) == alone
    assert len(set(alone)) > 1  # really sampled
    reseeded = states([SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=12)])
    assert [sample(logits[s:s + 1], reseeded)[0][0] for s in range(6)] != alone


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=5.0)
    (token, lp), = sample(logits, states([params], prompt=(1,)))
    expected = torch.log_softmax(logits[0], -1)
    assert token == 2  # the penalty moved the choice, not the logprobs
    assert math.isclose(lp.logprob, expected[2].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2, 0]
    assert all(math.isclose(v, expected[t].item(), rel_tol=1e-6) for t, v in lp.top)
    (_, none), = sample(logits, states([SamplingParams(temperature=0.0)]))
    assert none is None
    (_, bare), = sample(logits, states([SamplingParams(temperature=0.0, logprobs=0)]))
    assert bare.token_id == 1 and bare.top == ()


def test_counts_follow_the_output() -> None:
    st, = states([SamplingParams(temperature=0.0, frequency_penalty=1.0)], prompt=(4,))
    logits = torch.tensor([[0.0, 5.0, 4.5, 0.0, 0.0, 0.0]])
    tokens = [sample(logits, [st])[0][0] for _ in range(3)]
    assert tokens == [1, 2, 1]  # 5 - 1 < 4.5, then 4.5 - 1 < 5 - 1
    assert st.counts.tolist() == [0, 2, 1, 0, 0, 0]
    assert st.seen.tolist() == [False, True, True, False, True, False]


@pytest.mark.parametrize("change,message", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"), ({"logprobs": V + 1}, "logprobs"),
    ({"stop_token_ids": (V,)}, "stop_token_ids"),
])
def test_bad_parameters_are_refused(change: dict, message: str) -> None:
    with pytest.raises(AdmissionError, match=message):
        check_sampling(SamplingParams(**change), V)
