"""The offline LLM API over the reference model: scoring, greedy and sampled generation,
stopping, and loading a converted artifact end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _hf import hf_model, ninfer_weights
from ninfer_runtime import LLM, GenerationResult
from ninfer_runtime.models import Qwen3_5Model

PROMPT = [5, 17, 300, 42, 999, 7, 123, 64]


@pytest.fixture(scope="module")
def model() -> Qwen3_5Model:
    _, cfg = hf_model("tiny_dense")
    return Qwen3_5Model(cfg, ninfer_weights("tiny_dense"))


@pytest.fixture(scope="module")
def llm(model: Qwen3_5Model) -> LLM:
    return LLM.from_model(model)


def test_score_is_the_full_forward(llm: LLM, model: Qwen3_5Model) -> None:
    logits = llm.score(PROMPT)
    expected = model.logits(model.forward(torch.tensor(PROMPT), 0, model.new_cache()))
    assert logits.shape == (len(PROMPT), model.config.vocab_size)
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"
    torch.testing.assert_close(logits, expected)


def test_greedy_generation_follows_the_argmax_of_full_scoring(llm: LLM) -> None:
    """Each decoded token (cached, one step at a time) is the argmax of a fresh full pass."""
    result = llm.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    assert result.text is None  # no tokenizer
    seq = list(PROMPT)
    for token in result.token_ids:
        assert llm.score(seq)[-1].argmax().item() == token
        seq.append(token)


def test_stop_tokens_and_eos(llm: LLM, model: Qwen3_5Model) -> None:
    first = llm.generate(PROMPT, max_tokens=1, temperature=0).token_ids[0]
    stopped = llm.generate(PROMPT, max_tokens=5, temperature=0, stop_token_ids=[first])
    assert stopped.token_ids == (first,) and stopped.finish_reason == "stop"
    with_eos = LLM.from_model(model, generation_config={"eos_token_id": first})
    assert with_eos.generate(PROMPT, max_tokens=5, temperature=0).finish_reason == "stop"
    ignored = with_eos.generate(PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 3


def test_seeded_sampling(llm: LLM) -> None:
    kwargs = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    a = llm.generate(PROMPT, seed=3, **kwargs)
    assert llm.generate(PROMPT, seed=3, **kwargs) == a
    assert llm.generate(PROMPT, seed=4, **kwargs) != a
    greedy = llm.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
    top1 = llm.generate(PROMPT, max_tokens=4, temperature=1.5, top_k=1, seed=0,
                        ignore_eos=True)
    assert top1.token_ids == greedy.token_ids


@pytest.mark.parametrize("prompt,kwargs,message", [
    ("hello", {}, "needs a tokenizer"),
    ([], {}, "empty"),
    ([1, 10**6], {}, "outside the vocabulary"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_are_rejected(llm: LLM, prompt: object, kwargs: dict,
                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, **kwargs)


def test_loads_a_converted_artifact(tmp_path: Path) -> None:
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.sources import open_source
    from ninfer_runtime.artifact import Artifact

    path = build(open_source("tiny_dense", random_init=True), tmp_path / "tiny.ninfer",
                 BuildOptions(include_vision=False))
    llm = LLM(path, device="cpu")
    assert llm.model.dtype == torch.float32
    assert llm.eos_token_ids == {1000, 1002}  # the tiny profile's generation config
    result = llm.generate("hello world", max_tokens=4, temperature=0, ignore_eos=True)
    assert isinstance(result.text, str) and len(result.token_ids) == 4
    artifact = Artifact.open(path)
    reference = Qwen3_5Model(artifact.config, artifact.weights())
    ids = llm.tokenizer.encode("hello world")
    expected = reference.logits(reference.forward(torch.tensor(ids), 0, reference.new_cache()))
    torch.testing.assert_close(llm.score(ids), expected)
