"""The DFlash draft: config parsing, conversion (--dflash), and the runtime model.

The runtime oracle (`reference_hidden`) is written straight from specdecode.md A.1-A.5 on the
z-lab checkpoint's own tensors: per sequence, context K/V from hidden_norm(fc(taps)) concatenated
with the block's K/V, dense attention (no mask for full layers, causal + window for sliding
ones), and RoPE from transformers' Qwen3RotaryEmbedding. The draft under test runs on the
converted artifact over paged caches, its context stored in two chunks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import save_file

from ninfer_convert.build import BuildOptions, build
from ninfer_convert.cli import main
from ninfer_convert.dflash import draft_layout, random_draft_config, with_dflash
from ninfer_convert.sources import open_source
from ninfer_runtime.artifact import Artifact
from ninfer_runtime.engine.batch import Segment, StepBatch
from ninfer_runtime.models.dflash import (
    DFlashConfig,
    DFlashConfigError,
    DFlashDraft,
    build_target_layer_ids,
    load_dflash,
)
from ninfer_runtime.ops.rope import rope_cos_sin
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.quant import PackedWeight

S, F_ = "sliding_attention", "full_attention"
TARGET = "tiny_dense"  # hidden 128, 8 layers, vocab 1152
MASK = 1026
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 64}


def draft_config(*, nested: bool = True, **changes: Any) -> dict[str, Any]:
    """A small z-lab-format config for the tiny target: 3 layers (sliding, full, sliding,
    window 5), 3 taps, block 8, YaRN RoPE."""
    special = {"block_size": 8, "mask_token_id": MASK, "target_layer_ids": [1, 4, 6]}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 256, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "rope_parameters": YARN, "vocab_size": 1152,
        "num_target_layers": 8, "layer_types": [S, F_, S], "sliding_window": 5,
        "tie_word_embeddings": False,
    }
    if nested:
        config["dflash_config"] = special
    else:
        config |= special
    return config | changes


def write_draft(directory: Path, config: dict[str, Any], *, drop: str | None = None,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """config.json and model.safetensors (bf16, norms around 1) in `directory`; returns the
    tensors in fp32."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    cfg = DFlashConfig.from_hf(config)
    state = {}
    for name, (shape, _) in sorted(draft_layout(cfg).items()):
        t = torch.randn(shape, generator=gen)
        state[name] = (1 + 0.1 * t if len(shape) == 1 else t * shape[-1] ** -0.5).bfloat16()
    if drop is not None:
        del state[drop]
    save_file(state, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return {k: v.float() for k, v in state.items()}


def convert(out: Path, draft: str, weights: str = "bf16") -> Artifact:
    source = with_dflash(open_source(TARGET, random_init=True), draft)
    build(source, out, BuildOptions(weights=weights, include_vision=False, include_mtp=False))
    return Artifact.open(out)


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


# -- config -------------------------------------------------------------------------------------


def test_config_reads_nested_and_top_level_fields_alike() -> None:
    nested, top = DFlashConfig.from_hf(draft_config()), DFlashConfig.from_hf(
        draft_config(nested=False))
    assert nested == top
    assert (nested.block_size, nested.mask_token_id, nested.target_layer_ids) == (8, MASK,
                                                                                  (1, 4, 6))
    assert nested.causal == (True, False, True)  # sliding layers causal, the full one not
    assert [nested.window(i) for i in range(3)] == [5, None, 5]
    assert nested.rope_theta == 1e6 and nested.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert nested.tap_width == 3 * 128
    assert DFlashConfig.from_dict(json.loads(json.dumps(nested.to_dict()))) == nested
    # dflash_config wins over the top level, as in z-lab's code
    both = draft_config(block_size=16) | {"dflash_config": {"mask_token_id": 5,
                                                            "target_layer_ids": [2]}}
    assert (DFlashConfig.from_hf(both).block_size, DFlashConfig.from_hf(both).mask_token_id) \
        == (16, 5)


def test_config_causal_overrides_and_legacy_rope() -> None:
    assert DFlashConfig.from_hf(draft_config(is_causal=False)).causal == (False,) * 3
    forced = draft_config() | {"dflash_config": {**draft_config()["dflash_config"],
                                                 "causal": True}}
    assert DFlashConfig.from_hf(forced).causal == (True,) * 3
    legacy = draft_config(rope_parameters=None, rope_theta=1e7, layer_types=None,
                          sliding_window=None)
    c = DFlashConfig.from_hf(legacy)
    assert (c.rope_theta, c.rope_scaling, c.layer_types, c.causal) == (1e7, None, (F_,) * 3,
                                                                      (False,) * 3)


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["DFlash2DraftModel"]}, "not DFlashDraftModel"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "lacks 'mask_token_id'"),
    ({"layer_types": [S, F_]}, "does not describe 3"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope' is not"),
    ({"num_key_value_heads": 3}, "do not group"),
])
def test_bad_configs_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DFlashConfigError, match=message):
        DFlashConfig.from_hf(draft_config() | changes)


def test_target_layer_ids_and_random_configs_of_the_real_profiles() -> None:
    assert build_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert build_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(40, 1) == (20,)
    for name, taps in (("qwen3_6_27b", (1, 16, 31, 46, 61)),
                       ("qwen3_6_35b_a3b", (1, 10, 19, 28, 37))):
        target = get_profile(name).config
        c = DFlashConfig.from_hf(random_draft_config(target))
        c.check_target(target)
        assert (c.num_layers, c.target_layer_ids, c.block_size, c.mask_token_id) == \
            (5, taps, 16, 248070)
        assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
            (target.hidden_size, 32, 8, 128)
        assert c.layer_types == (S, S, S, S, F_) and c.sliding_window == 2048


def test_yarn_rope_matches_transformers() -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = draft_config()
    rotary = Qwen3RotaryEmbedding(Qwen3Config(**hf))
    positions = torch.tensor([0, 3, 63, 64, 200, 4000])
    cos, sin = rotary(torch.zeros(1, 6, 32), positions[None])
    c = DFlashConfig.from_hf(hf)
    ours = rope_cos_sin(positions, 32, c.rope_theta, c.rope_scaling)
    torch.testing.assert_close(ours[0], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours[1], sin[0], rtol=1e-6, atol=1e-6)
    assert rotary.attention_scaling != 1.0


# -- the runtime model against the reference ----------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


def reference_hidden(state: dict[str, torch.Tensor], hf: dict[str, Any], taps: torch.Tensor,
                     block_embeds: torch.Tensor) -> torch.Tensor:
    """One sequence: P context rows of taps, a block of T embeddings at positions P..P+T-1."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = DFlashConfig.from_hf(hf)
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p, t = taps.shape[0], block_embeds.shape[0]
    cos, sin = (x[0] for x in Qwen3RotaryEmbedding(Qwen3Config(**hf))(
        block_embeds[None], torch.arange(p + t)[None]))
    ctx = rms(taps @ state["fc.weight"].T, state["hidden_norm.weight"])
    x = block_embeds
    q_pos = torch.arange(p, p + t)[:, None]
    k_pos = torch.arange(p + t)[None, :]
    for i, kind in enumerate(cfg.layer_types):
        w = {n.removeprefix(f"layers.{i}."): v for n, v in state.items()
             if n.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = rms((h @ w["self_attn.q_proj.weight"].T).view(t, nq, hd), w["self_attn.q_norm.weight"])
        both = torch.cat([ctx, h])
        k = rms((both @ w["self_attn.k_proj.weight"].T).view(p + t, nkv, hd),
                w["self_attn.k_norm.weight"])
        v = (both @ w["self_attn.v_proj.weight"].T).view(p + t, nkv, hd)
        q, k = rotate(q, cos[p:], sin[p:]), rotate(k, cos, sin)
        mask = None  # full attention: every query sees all context and the whole block
        if kind == S:
            mask = (k_pos <= q_pos) & (q_pos - k_pos < cfg.sliding_window)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(nq // nkv, 0),
            v.transpose(0, 1).repeat_interleave(nq // nkv, 0), attn_mask=mask,
            scale=hd**-0.5).transpose(0, 1)
        x = x + attn.reshape(t, nq * hd) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        g, u = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ w["mlp.down_proj.weight"].T
    return rms(x, state["norm.weight"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, dict, dict]:
    tmp = tmp_path_factory.mktemp("dflash")
    hf = draft_config()
    state = write_draft(tmp / "draft", hf)
    return convert(tmp / "a.ninfer", str(tmp / "draft")), state, hf


@pytest.mark.parametrize("ops", ["ref", "triton"])
def test_draft_matches_the_reference(converted, ops: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences (13 and 22 context tokens, pages shuffled), context stored in two chunks,
    then one block of 8 each; with the Triton kernels too (interpreted on CPU)."""
    monkeypatch.setenv("NINFER_OPS", ops)
    artifact, state, hf = converted
    draft = load_dflash(artifact)
    page, lens, block = 8, [13, 22], 8
    pages = [[5, 1, 7], [0, 6, 2, 4]]
    caches = draft.allocate_cache(8, page)
    gen = torch.Generator().manual_seed(1)
    taps = [torch.randn(n, draft.config.tap_width, generator=gen) for n in lens]
    embed = torch.randn(1152, 128, generator=gen)
    for lo, hi in (([0, 0], [7, 12]), ([7, 12], lens)):  # two chunks
        segments = [Segment([0] * (h - lo_), lo_, pages[b], 0, "none")
                    for b, (lo_, h) in enumerate(zip(lo, hi, strict=True))]
        rows = torch.cat([taps[b][lo[b]:hi[b]] for b in range(2)])
        draft.store_context(rows, StepBatch.build(segments, page, "cpu"), caches)
    blocks = [[17] + [MASK] * (block - 1), [40] + [MASK] * (block - 1)]
    batch = StepBatch.build([Segment(blocks[b], lens[b], pages[b], 0, "none") for b in range(2)],
                            page, "cpu")
    hidden = draft.propose(batch.token_ids, batch, caches, embed)
    assert hidden.shape == (2 * block, 128)
    for b in range(2):
        expected = reference_hidden(state, hf, taps[b], embed[torch.tensor(blocks[b])])
        torch.testing.assert_close(hidden[b * block:(b + 1) * block], expected,
                                   rtol=1e-4, atol=1e-4)


def test_windows_and_causality_matter(converted) -> None:
    """The reference is sensitive to the masks: making the sliding layers full changes it, so
    the comparison above checks them."""
    _, state, hf = converted
    gen = torch.Generator().manual_seed(2)
    taps, embeds = torch.randn(12, 384, generator=gen), torch.randn(8, 128, generator=gen)
    windowed = reference_hidden(state, hf, taps, embeds)
    full = reference_hidden(state, hf | {"layer_types": [F_] * 3}, taps, embeds)
    assert (windowed - full).abs().max() > 1e-2


# -- conversion ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [True, False])
def test_convert_local_draft(tmp_path: Path, nested: bool) -> None:
    hf = draft_config(nested=nested)
    state = write_draft(tmp_path / "draft", hf)
    a = convert(tmp_path / "a.ninfer", str(tmp_path / "draft"))
    entry = a.manifest["dflash"]
    assert DFlashConfig.from_dict(entry["config"]) == DFlashConfig.from_hf(hf)
    assert entry["hf_config"] == hf and entry["random_init"] is False
    assert entry["source"] == {"kind": "local", "path": str((tmp_path / "draft").resolve())}
    w = {n.removeprefix("dflash."): a.weight(n).float() for n in a.weight_names()
         if n.startswith("dflash.")}
    assert len(w) == 3 + 3 * 9
    for i in range(3):
        p = f"layers.{i}."
        assert torch.equal(w[p + "self_attn.kv_proj.weight"], torch.cat(
            [state[p + "self_attn.k_proj.weight"], state[p + "self_attn.v_proj.weight"]]))
        assert torch.equal(w[p + "mlp.gate_up_proj.weight"], torch.cat(
            [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
        for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "self_attn.k_norm.weight"):
            assert torch.equal(w[p + n], state[p + n]), n
    for n in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        assert torch.equal(w[n], state[n])


def test_quantized_draft_and_random_init_via_cli(tmp_path: Path) -> None:
    out = tmp_path / "a.ninfer"
    result = cli("build", TARGET, "--random-init", "--weights", "groupwise-int", "--dflash",
                 "random", "--seed", "3", "--no-vision", "--device", "cpu", "-o", str(out))
    assert result.exit_code == 0, result.output
    a = Artifact.open(out)
    c = DFlashConfig.from_dict(a.manifest["dflash"]["config"])
    assert (c.num_layers, c.target_layer_ids, c.block_size, c.mask_token_id) == \
        (5, build_target_layer_ids(8, 5), 16, MASK)
    assert a.manifest["dflash"]["source"] == {"kind": "random-init", "seed": 3}
    schemes = a.manifest["weights"]
    assert schemes["dflash.fc.weight"]["scheme"] == "groupwise-int"
    assert schemes["dflash.layers.4.self_attn.kv_proj.weight"]["scheme"] == "groupwise-int"
    assert schemes["dflash.layers.4.self_attn.k_norm.weight"]["scheme"] == "bf16"
    assert isinstance(a.weight("dflash.layers.0.mlp.down_proj.weight"), PackedWeight)
    norm = a.weight("dflash.norm.weight").float()
    assert (norm - 1).abs().max() < 0.2  # plain-w norms drawn around 1
    draft = load_dflash(a)
    assert isinstance(draft, DFlashDraft) and len(draft.allocate_cache(2, 16)) == 5
    result = cli("inspect", str(out))
    assert result.exit_code == 0 and "mask 1026" in result.output, result.output


def test_artifact_without_draft_loads_none(tmp_path: Path) -> None:
    out = tmp_path / "a.ninfer"
    build(open_source(TARGET, random_init=True), out,
          BuildOptions(include_vision=False, include_mtp=False))
    a = Artifact.open(out)
    assert a.manifest["dflash"] is None and load_dflash(a) is None
    assert DFlashDraft.from_weights(a.manifest, a.weights()) is None


BAD_DRAFTS = {
    "hidden mismatch": ({"hidden_size": 64}, None, "hidden_size 64 differs from the target's 128"),
    "tap out of range": ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 8]}},
                         None, "8 is not a layer of the target (0..7)"),
    "wrong layer count": ({"num_target_layers": 64}, None, "num_target_layers 64 differs"),
    "missing tensor": ({}, "layers.1.self_attn.v_proj.weight",
                       "lacks the tensor 'layers.1.self_attn.v_proj.weight'"),
    "dflash 2": ({"architectures": ["DFlash2DraftModel"]}, None, "not DFlashDraftModel"),
}


@pytest.mark.parametrize("case", list(BAD_DRAFTS))
def test_bad_draft_fails_cleanly(tmp_path: Path, case: str) -> None:
    changes, drop, message = BAD_DRAFTS[case]
    config = draft_config()
    write_draft(tmp_path / "draft", config, drop=drop)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config | changes))
    out = tmp_path / "out"
    result = cli("build", TARGET, "--random-init", "--weights", "bf16", "--dflash",
                 str(tmp_path / "draft"), "-o", str(out / "m.ninfer"))
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())


def test_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    config = draft_config()
    write_draft(tmp_path / "draft", config)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config | {
        "intermediate_size": 128}))
    result = cli("build", TARGET, "--random-init", "--weights", "bf16", "--dflash",
                 str(tmp_path / "draft"), "-o", str(tmp_path / "m.ninfer"))
    assert result.exit_code == 1 and "'layers.0.mlp.gate_proj.weight' has shape [256, 128], " \
        "its config implies [128, 128]" in result.output, result.output
    assert not (tmp_path / "m.ninfer").exists()
