"""The Qwen3.5 model against transformers (fp32, tiny random dense and MoE), and the caching
invariants: incremental decoding and split prefill equal one-shot scoring; the MTP head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _hf import hf_model, ninfer_weights, quantizable_names
from ninfer_convert.quantize import quantize
from ninfer_runtime.models import Qwen3_5Model, Qwen3_5MTP, WeightError
from ninfer_runtime.quant import PackedWeight, get_scheme

PROFILES = ["tiny_dense", "tiny_moe"]
T = 70  # crosses a 64-token GDN chunk boundary


def token_ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=PROFILES)
def profile(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(profile: str) -> Qwen3_5Model:
    _, cfg = hf_model(profile)
    return Qwen3_5Model(cfg, ninfer_weights(profile))


@pytest.fixture(scope="module")
def full_logits(model: Qwen3_5Model) -> torch.Tensor:
    ids = token_ids(T, model.config.vocab_size)
    return model.logits(model.forward(ids, 0, model.new_cache()))


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = 1e-4 * max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


def test_logits_match_transformers(profile: str, full_logits: torch.Tensor) -> None:
    hf, cfg = hf_model(profile)
    with torch.no_grad():
        expected = hf(token_ids(T, cfg.vocab_size)[None]).logits[0]
    assert full_logits.shape == (T, cfg.vocab_size) and full_logits.dtype == torch.float32
    assert expected.abs().max() > 1.0  # random weights give non-trivial logits
    assert_logits_close(full_logits, expected)


def test_yarn_scaled_rope_matches_transformers(profile: str, full_logits: torch.Tensor) -> None:
    """A config extended with YaRN (as the model card takes 262K positions to ~1M; here an
    original context of 32, which the 70 tokens pass) rotates as transformers does: its
    logits, not the unscaled model's."""
    yarn = (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 32))
    hf, cfg = hf_model(profile, rope=yarn)
    assert cfg.rope_scaling == dict(yarn) and cfg.context_limit == 128
    ids = token_ids(T, cfg.vocab_size)
    model = Qwen3_5Model(cfg, ninfer_weights(profile))
    logits = model.logits(model.forward(ids, 0, model.new_cache()))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert_logits_close(logits, expected)
    # and far from the unscaled logits (200x the tolerance above)
    assert (logits - full_logits).abs().max() > 0.02 * full_logits.abs().max()


def test_incremental_decoding_matches_full_scoring(model: Qwen3_5Model,
                                                   full_logits: torch.Tensor) -> None:
    """Prefill (chunked GDN path) then one token per step (recurrent path, KV appends)."""
    ids, prompt = token_ids(T, model.config.vocab_size), 60
    cache = model.new_cache()
    steps = [model.logits(model.forward(ids[:prompt], 0, cache))]
    for pos in range(prompt, T):
        steps.append(model.logits(model.forward(ids[pos:pos + 1], pos, cache)))
    assert cache.num_tokens == T
    assert_logits_close(torch.cat(steps), full_logits)


def test_split_prefill_matches_one_call(model: Qwen3_5Model, full_logits: torch.Tensor) -> None:
    ids, cache, parts = token_ids(T, model.config.vocab_size), model.new_cache(), []
    for lo, hi in [(0, 2), (2, 3), (3, 66), (66, T)]:
        parts.append(model.logits(model.forward(ids[lo:hi], lo, cache)))
    assert_logits_close(torch.cat(parts), full_logits)


def test_start_pos_must_continue_the_cache(model: Qwen3_5Model) -> None:
    cache = model.new_cache()
    model.forward(torch.tensor([1, 2, 3]), 0, cache)
    with pytest.raises(ValueError, match="does not continue the cache"):
        model.forward(torch.tensor([4]), 2, cache)


def test_missing_or_misshapen_weights_are_named() -> None:
    _, cfg = hf_model("tiny_dense")
    weights = dict(ninfer_weights("tiny_dense"))
    name = "layers.3.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-1]
    with pytest.raises(WeightError, match=f"{name}.*shape"):
        Qwen3_5Model(cfg, weights)
    del weights[name]
    with pytest.raises(WeightError, match=f"lack the tensor '{name}'"):
        Qwen3_5Model(cfg, weights)


def test_shared_expert_of_another_size_is_named() -> None:
    """The shared expert runs stacked with the routed ones, so its size must be theirs: a
    config where it is not gets a clear error, not a shape failure deep in a kernel."""
    _, cfg = hf_model("tiny_moe")
    other = dataclasses.replace(cfg, shared_expert_intermediate_size=2 * cfg.moe_intermediate_size)
    with pytest.raises(WeightError, match="shared expert's intermediate size"):
        Qwen3_5Model(other, dict(ninfer_weights("tiny_moe")))


@pytest.mark.parametrize("scheme", ["nvfp4", "groupwise-int"])
def test_packed_weights_run_as_their_dequantization(scheme: str) -> None:
    """Quantized linears (stacked experts included) give the logits of their dequantized
    values: the model reads PackedWeights through the ops without repacking them."""
    _, cfg = hf_model("tiny_moe")
    packed = dict(ninfer_weights("tiny_moe"))
    for name in quantizable_names("tiny_moe"):
        w = packed[name]
        packed[name] = PackedWeight(get_scheme(scheme), quantize(scheme, w), tuple(w.shape))
    dense = {n: w.dequantize() if isinstance(w, PackedWeight) else w for n, w in packed.items()}
    assert "layers.0.mlp.experts.gate_up_proj" in quantizable_names("tiny_moe")
    ids = token_ids(20, cfg.vocab_size)
    logits = []
    for weights in (packed, dense):
        m = Qwen3_5Model(cfg, weights)
        logits.append(m.logits(m.forward(ids, 0, m.new_cache())))
    assert_logits_close(*logits)


# --- MTP ---------------------------------------------------------------------------------------

def mtp_only(profile: str) -> dict[str, torch.Tensor]:
    """Just the tensors the MTP head may read."""
    w = ninfer_weights(profile, with_mtp=True)
    return {n: t for n, t in w.items()
            if n.startswith("mtp.") or n in ("embed_tokens.weight", "lm_head.weight")}


@pytest.fixture(scope="module")
def mtp(profile: str) -> Qwen3_5MTP:
    _, cfg = hf_model(profile)
    return Qwen3_5MTP(cfg, mtp_only(profile))  # constructing proves it needs nothing else


def test_mtp_reads_only_mtp_embed_and_lm_head(profile: str) -> None:
    _, cfg = hf_model(profile)
    weights = mtp_only(profile)
    assert any(n.startswith("mtp.layers.0.mlp.") for n in weights)
    for needed in ("embed_tokens.weight", "lm_head.weight", "mtp.fc.weight",
                   "mtp.layers.0.self_attn.qkv_proj.weight"):
        partial = {n: t for n, t in weights.items() if n != needed}
        with pytest.raises(WeightError, match=needed):
            Qwen3_5MTP(cfg, partial)


def test_mtp_shapes_and_incremental_equals_whole(model: Qwen3_5Model, mtp: Qwen3_5MTP) -> None:
    vocab, n = model.config.vocab_size, 20
    ids = token_ids(n + 1, vocab)
    hidden = model.forward(ids[:n], 0, model.new_cache())
    # position t pairs the target's hidden at t with the next token t+1
    whole_h, whole_logits = mtp.forward(ids[1:], hidden, 0, mtp.new_cache())
    assert whole_h.shape == (n, model.config.hidden_size)
    assert whole_logits.shape == (n, vocab) and whole_logits.dtype == torch.float32
    assert torch.isfinite(whole_logits).all()
    cache = mtp.new_cache()
    steps = [mtp.forward(ids[1:8], hidden[:7], 0, cache)[1]]
    for t in range(7, n):
        steps.append(mtp.forward(ids[t + 1:t + 2], hidden[t:t + 1], t, cache)[1])
    assert_logits_close(torch.cat(steps), whole_logits)
    # causal: changing the last inputs leaves the earlier outputs alone
    other = ids[1:].clone()
    other[-1] = (other[-1] + 1) % vocab
    _, changed = mtp.forward(other, hidden, 0, mtp.new_cache())
    assert_logits_close(changed[:-1], whole_logits[:-1])  # not bitwise: MoE groups tokens
    assert (changed[-1] - whole_logits[-1]).abs().max() > 0.1
