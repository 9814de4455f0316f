"""Shared fixtures: tiny Hugging Face Qwen3.5 checkpoints written exactly as real ones are.

`tiny_checkpoint(kind, ...)` returns a directory made by transformers' `save_pretrained` from a
tiny-profile config with every weight randomised, plus what transformers leaves out of a real
release: random `mtp.*` tensors in an extra shard (transformers drops them on load), the
stand-in tokenizer.json and chat template, a generation_config. Checkpoints are cached per
session and argument set; treat them as read-only.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer_runtime.config import FULL_ATTENTION
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.tokenizer import load_standin

# Triton kernels are tested on CPU-only machines through Triton's interpreter, which must be
# chosen before any kernel is defined: nothing imported above may import ninfer_runtime.ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INDEX = "model.safetensors.index.json"


@pytest.fixture
def untuned_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Triton autotuner on the first of its configs that fits the call (its pruning
    still applies), and the decode plans untimed. Tokens do not depend on the config, and on
    a fresh GPU machine every candidate of every key would be compiled and timed: with the
    attention, GDN and MoE tuners tuning, three `test_engine_kernels` tests took 388 s on the
    H200 (docs/perf.md, ninth run). Under the interpreter every tuner has one config already."""
    from triton.runtime.autotuner import Autotuner

    from ninfer_runtime.ops import quant_linear, tuner

    prune = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs",
                        lambda autotuner, kwargs: prune(autotuner, kwargs)[:1])
    monkeypatch.setattr(tuner, "DECODE_TUNING", False)
    monkeypatch.setattr(quant_linear, "_decode_plans", {})


def _hf_classes(moe: bool, vision: bool) -> tuple[type, type, type, type]:
    """(config class, model class, text config class, decoder layer class)."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    p = "Qwen3_5Moe" if moe else "Qwen3_5"
    model = f"{p}ForConditionalGeneration" if vision else f"{p}ForCausalLM"
    config = f"{p}Config" if vision else f"{p}TextConfig"
    layer = Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer
    return (getattr(transformers, config), getattr(transformers, model),
            getattr(transformers, f"{p}TextConfig"), layer)


def _randomize(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor random (transformers zero-inits the (1 + w) norms), O(1) activations."""
    out = {}
    for name, t in sorted(state.items()):
        if name.endswith("A_log"):
            out[name] = torch.empty(t.shape).uniform_(0.0, 2.5, generator=gen)
        elif t.dim() == 1:
            out[name] = torch.randn(t.shape, generator=gen) * 0.1 + (
                1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
        else:
            out[name] = torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5
    return out


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused experts.{gate_up,down}_proj -> experts.{e}.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{base}{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """experts.{e}.{gate,up,down}_proj.weight -> fused experts.gate_up_proj / down_proj."""
    out, groups = {}, {}
    for name, t in state.items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = tail.split(".")[:2]
        groups.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
    for head, projs in groups.items():
        n = len(projs["down_proj"])
        out[f"{head}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[f"{head}.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def _mtp_state(kind: str, text: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """mtp.* as the official releases carry them: one full-attention decoder layer."""
    _, _, text_cls, layer_cls = _hf_classes(kind == "moe", False)
    with torch.device("meta"):
        layer = layer_cls(text_cls(**text), text["layer_types"].index(FULL_ATTENTION))
    h = text["hidden_size"]
    state = {f"mtp.layers.0.{n}": t for n, t in layer.state_dict().items()}
    state["mtp.fc.weight"] = torch.empty(h, 2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{norm}.weight"] = torch.empty(h)
    return _split_experts({k: v.to(torch.bfloat16) for k, v in _randomize(state, gen).items()})


def write_tiny_checkpoint(directory: Path, kind: str = "dense", *, vision: bool = False,
                          mtp: bool = True, fused_experts: bool = False,
                          max_shard_size: str | None = None, seed: int = 0,
                          text_overrides: dict[str, Any] | None = None,
                          tokenizer: bool = True) -> Path:
    """A tiny checkpoint of profile tiny_<kind> in `directory` (see the module docstring).

    Text weights are bf16 except A_log/dt_bias (fp32, as in the releases); the vision tower
    stays fp32. `fused_experts` rewrites transformers' per-expert tensors into the fused 3-D
    layout (one file, no index); `max_shard_size` makes save_pretrained write several shards
    and an index, which the mtp shard joins.
    """
    hf = copy.deepcopy(get_profile(f"tiny_{kind}").hf_config)
    hf["text_config"].update(text_overrides or {})
    config_cls, model_cls, _, _ = _hf_classes(kind == "moe", vision)
    config = config_cls(**(hf if vision else hf["text_config"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = model_cls(config)
    state = _randomize(model.state_dict(), gen)
    for name in state:
        if not name.startswith("model.visual.") and not name.endswith(("A_log", "dt_bias")):
            state[name] = state[name].to(torch.bfloat16)
    model.load_state_dict(state, assign=True)
    model.tie_weights()  # assign=True replaced the tied lm_head with its own tensor
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if fused_experts:
        files = sorted(directory.glob("*.safetensors"))
        tensors = {k: v for f in files for k, v in load_file(f).items()}
        for f in files:
            f.unlink()
        (directory / INDEX).unlink(missing_ok=True)
        save_file(fuse_experts(tensors), directory / "model.safetensors", {"format": "pt"})
    if mtp:
        mtp_state = _mtp_state(kind, hf["text_config"], gen)
        if fused_experts:
            mtp_state = fuse_experts(mtp_state)
        save_file(mtp_state, directory / "mtp.safetensors", {"format": "pt"})
        if (directory / INDEX).is_file():
            index = json.loads((directory / INDEX).read_text())
            index["weight_map"] |= dict.fromkeys(mtp_state, "mtp.safetensors")
            (directory / INDEX).write_text(json.dumps(index, indent=2))
    if tokenizer:
        tokenizer_json, template = load_standin("tiny")
        (directory / "tokenizer.json").write_text(tokenizer_json)
        (directory / "chat_template.jinja").write_text(template)
    (directory / "generation_config.json").write_text(
        json.dumps(get_profile(f"tiny_{kind}").generation_config))
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(kind="dense"|"moe", **options)` -> a cached checkpoint directory
    (options as for `write_tiny_checkpoint`)."""
    cache: dict[str, Path] = {}

    def make(kind: str = "dense", **options: Any) -> Path:
        key = json.dumps([kind, options], sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"tiny_{kind}")
            cache[key] = write_tiny_checkpoint(directory, kind, **options)
        return cache[key]

    return make
