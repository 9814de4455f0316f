"""ninfer-convert build: tiny transformers checkpoints, random init, ModelOpt import, bad input.

The oracle for every converted weight is computed here from the checkpoint's safetensors files
with plain torch.cat / torch.stack, independently of the converter's streaming combine.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from safetensors.torch import load_file, save_file

from ninfer_convert import build as build_module
from ninfer_convert.build import BuildOptions, build, plan_outputs
from ninfer_convert.checkpoint import Checkpoint
from ninfer_convert.cli import main
from ninfer_convert.mapping import plan_tensors
from ninfer_convert.progress import byte_progress
from ninfer_convert.quantize import quantize
from ninfer_convert.sources import hf_layout, open_source
from ninfer_runtime.artifact import Artifact
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.profiles import PROFILES, get_profile
from ninfer_runtime.quant import PackedWeight, get_scheme, stored_name
from ninfer_runtime.tokenizer import load_standin

# -- helpers ---------------------------------------------------------------------------------


def source_state(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def reference(directory: Path, *, mtp: bool = True, vision: bool = True) -> dict[str, torch.Tensor]:
    """NInfer name -> the combined source tensor in fp32 (the converter's expected output)."""
    state = source_state(directory)
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    out = {}
    for plan in plan_tensors(cfg, set(state), include_mtp=mtp, include_vision=vision):
        src = [state[s].float() for s in plan.sources]
        if plan.combine == "concat":
            t = torch.cat(src)
        elif plan.combine == "stack":
            t = torch.stack(src)
        elif plan.combine == "stack_concat":
            t = torch.stack([torch.cat(src[i:i + plan.parts])
                             for i in range(0, len(src), plan.parts)])
        elif plan.combine == "squeeze1":
            t = src[0][:, 0, :]
        else:
            t = src[0]
        out[plan.name] = t
    return out


def convert(source: str | Path, out: Path, **options: object) -> Artifact:
    build(open_source(str(source)), out, BuildOptions(**options))
    return Artifact.open(out)


def stored_bytes(a: Artifact) -> dict[str, bytes]:
    return {n: a.stored(n).contiguous().view(torch.uint8).numpy().tobytes()
            for n in a.manifest["tensors"]}


def rel_error(w: torch.Tensor, approx: torch.Tensor) -> float:
    return float((w.double() - approx.double()).norm() / w.double().norm())


def files_in(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


def cli(*args: str) -> object:
    return CliRunner().invoke(main, list(args))


# The linears that take the body's quantization (ARCHITECTURE.md "Weights IDs"); everything
# else (embeddings, norms, conv1d, A_log, dt_bias, in_proj_a/b, routers, gates, vision) stays.
QUANTIZED_LINEARS = ("in_proj_qkvz.weight", "linear_attn.out_proj.weight", "qkv_proj.weight",
                     "o_proj.weight", "gate_up_proj", "down_proj", "mtp.fc.weight",
                     "lm_head.weight")


def is_quantized_linear(name: str) -> bool:
    return not name.startswith("visual.") and any(s in name for s in QUANTIZED_LINEARS)


# -- conversion of transformers checkpoints --------------------------------------------------


@pytest.mark.parametrize("kind,vision", [("dense", True), ("moe", False)])
def test_bf16_artifact_equals_the_combined_sources(tiny_checkpoint, tmp_path, kind, vision):
    src = tiny_checkpoint(kind, vision=vision)
    a = convert(src, tmp_path / "m.ninfer", weights="bf16")
    ref = reference(src)
    assert a.weight_names() == list(ref)  # plan order, nothing extra or missing
    assert any(n.startswith("mtp.layers.0.") for n in ref)
    assert any(n.startswith("visual.") for n in ref) == vision
    for name, want in ref.items():
        got = a.weight(name)
        fp32 = name.endswith(("A_log", "dt_bias"))
        assert got.dtype == (torch.float32 if fp32 else torch.bfloat16), name
        assert torch.equal(got, want.to(got.dtype)), name
    m = a.manifest
    assert m["weights_id"] == "bf16" and m["random_init"] is False and m["profile"] is None
    assert m["source"] == {"kind": "local", "path": str(src.resolve())}
    assert m["config"] == json.loads((src / "config.json").read_text())
    assert m["generation_config"] == get_profile(f"tiny_{kind}").generation_config
    assert a.tokenizer_json == (src / "tokenizer.json").read_text()
    assert a.chat_template == (src / "chat_template.jinja").read_text()
    assert m["options"] == {"lm_head": "body", "mtp": "body", "include_mtp": True,
                            "include_vision": True, "device": "cpu"}


@pytest.mark.parametrize("weights,bound", [("nvfp4", 0.12), ("groupwise-int", 0.12)])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_quantized_artifact_dequantizes_close(tiny_checkpoint, tmp_path, kind, weights, bound):
    src = tiny_checkpoint(kind)
    a = convert(src, tmp_path / "m.ninfer", weights=weights)
    ref = reference(src)
    quantized = [n for n in ref if is_quantized_linear(n)]
    assert len(quantized) > 20
    for name, want in ref.items():
        got = a.weight(name)
        entry = a.manifest["weights"][name]
        if name not in quantized:
            assert not isinstance(got, PackedWeight) and entry["error"] is None, name
            assert torch.equal(got.float(), want.to(got.dtype).float()), name
            continue
        assert isinstance(got, PackedWeight) and entry["scheme"] == weights, name
        assert got.shape == tuple(want.shape)
        error = rel_error(want, got.dequantize())
        assert error == pytest.approx(entry["error"], rel=1e-4), name
        assert 0.0 < error < bound, name
    # The quantizer sees the fused tensor as stored (one global scale for the fused q|k|v).
    qkv = "layers.3.self_attn.qkv_proj.weight"
    direct = quantize(weights, ref[qkv].bfloat16())
    assert all(torch.equal(a.weight(qkv).parts[r].view(torch.uint8),
                           v.contiguous().view(torch.uint8)) for r, v in direct.items())


def test_lm_head_and_mtp_choices(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("dense")
    a = convert(src, tmp_path / "m.ninfer", weights="nvfp4", lm_head="bf16", mtp="bf16")
    schemes = {n: w["scheme"] for n, w in a.manifest["weights"].items()}
    assert schemes["lm_head.weight"] == "bf16"
    assert schemes["mtp.fc.weight"] == schemes["mtp.layers.0.self_attn.qkv_proj.weight"] == "bf16"
    assert schemes["layers.3.self_attn.qkv_proj.weight"] == "nvfp4"
    assert a.manifest["options"]["lm_head"] == a.manifest["options"]["mtp"] == "bf16"
    ref = reference(src)
    assert torch.equal(a.weight("lm_head.weight"), ref["lm_head.weight"].bfloat16())


def test_no_mtp_and_no_vision_leave_them_out(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("dense", vision=True)
    a = convert(src, tmp_path / "m.ninfer", weights="bf16", include_mtp=False,
                include_vision=False)
    names = a.weight_names()
    assert not [n for n in names if n.startswith(("mtp.", "visual."))]
    assert names == list(reference(src, mtp=False, vision=False))
    assert a.manifest["options"]["include_mtp"] is False


@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_fused_and_per_expert_layouts_give_identical_artifacts(tiny_checkpoint, tmp_path,
                                                               weights):
    per_expert = tiny_checkpoint("moe")
    fused = tiny_checkpoint("moe", fused_experts=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in source_state(fused)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in source_state(per_expert)
    a = convert(per_expert, tmp_path / "a.ninfer", weights=weights)
    b = convert(fused, tmp_path / "b.ninfer", weights=weights)
    assert stored_bytes(a) == stored_bytes(b)
    assert a.manifest["weights"] == b.manifest["weights"]


def test_sharded_checkpoint_with_index_converts_like_a_single_file(tiny_checkpoint, tmp_path):
    sharded = tiny_checkpoint("dense", max_shard_size="100KB")
    assert len(list(sharded.glob("model-*.safetensors"))) >= 4
    assert (sharded / "model.safetensors.index.json").is_file()
    a = convert(sharded, tmp_path / "a.ninfer", weights="groupwise-int")
    b = convert(tiny_checkpoint("dense"), tmp_path / "b.ninfer", weights="groupwise-int")
    assert stored_bytes(a) == stored_bytes(b)


def test_fp16_fp32_and_fp8_sources_are_cast(tiny_checkpoint, tmp_path):
    state = source_state(tiny_checkpoint("dense"))
    dtypes = (torch.float16, torch.float32, torch.float8_e4m3fn)
    mixed = {n: t.to(dtypes[i % 3]) for i, (n, t) in enumerate(sorted(state.items()))}
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("dense"), src)
    for f in src.glob("*.safetensors"):
        f.unlink()
    save_file(mixed, src / "model.safetensors")
    a = convert(src, tmp_path / "m.ninfer", weights="bf16")
    for name, want in reference(src).items():
        got = a.weight(name)
        assert torch.equal(got, want.to(got.dtype)), name


def test_tied_embeddings_give_the_lm_head_from_embed_tokens(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("dense", text_overrides={"tie_word_embeddings": True})
    assert "lm_head.weight" not in source_state(src)
    a = convert(src, tmp_path / "m.ninfer", weights="bf16")
    assert torch.equal(a.weight("lm_head.weight"), a.weight("embed_tokens.weight"))


@pytest.mark.parametrize("template", ["plain", "named"])
def test_chat_template_from_tokenizer_config(tiny_checkpoint, tmp_path, template):
    src = _copy(tiny_checkpoint("dense"), tmp_path / "src")
    (src / "chat_template.jinja").unlink()
    value = "{{ messages }}" if template == "plain" else [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ x }}"}]
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
    want = "{{ messages }}" if template == "plain" else "{{ x }}"
    assert open_source(str(src)).chat_template == want


# -- random init ------------------------------------------------------------------------------


def test_hf_layout_matches_transformers(tiny_checkpoint):
    """The layout random init draws from is the one transformers saves (plus mtp.*)."""
    for kind in ("dense", "moe"):
        src = tiny_checkpoint(kind, vision=True, fused_experts=True)
        saved = {k: tuple(v.shape) for k, v in source_state(src).items()}
        layout = hf_layout(get_profile(f"tiny_{kind}").config)
        assert {k: s for k, (s, _) in layout.items()} == saved


@pytest.mark.parametrize("profile", ["tiny_dense", "tiny_moe"])
def test_random_init_tiny_profile(tiny_checkpoint, tmp_path, profile):
    kind = profile.removeprefix("tiny_")
    a = convert_random(profile, tmp_path / "a.ninfer", seed=3)
    # Same weights, shapes and schemes as a real transformers checkpoint of that config.
    real = convert(tiny_checkpoint(kind, vision=True), tmp_path / "real.ninfer", weights="nvfp4")
    assert a.manifest["weights"].keys() == real.manifest["weights"].keys()
    assert all(a.manifest["weights"][n]["shape"] == w["shape"] and
               a.manifest["weights"][n]["scheme"] == w["scheme"]
               for n, w in real.manifest["weights"].items())
    m = a.manifest
    assert m["random_init"] is True and m["profile"] == profile
    assert m["source"] == {"kind": "random-init", "seed": 3}
    assert m["config"] == get_profile(profile).hf_config
    assert (a.tokenizer_json, a.chat_template) == load_standin("tiny")
    # Reproducible from the seed alone, and the seed matters.
    assert stored_bytes(a) == stored_bytes(convert_random(profile, tmp_path / "b.ninfer", seed=3))
    c = convert_random(profile, tmp_path / "c.ninfer", seed=4)
    assert a.weight("layers.0.mlp.down_proj.weight" if kind == "dense" else
                    "layers.0.mlp.experts.down_proj").parts["weight"].ne(
        c.weight("layers.0.mlp.down_proj.weight" if kind == "dense" else
                 "layers.0.mlp.experts.down_proj").parts["weight"]).any()


def convert_random(profile: str, out: Path, seed: int, weights: str = "nvfp4") -> Artifact:
    build(open_source(profile, random_init=True, seed=seed), out, BuildOptions(weights=weights))
    return Artifact.open(out)


def test_random_init_values_are_realistic(tmp_path):
    a = convert_random("tiny_dense", tmp_path / "a.ninfer", seed=0, weights="bf16")
    a_log = a.weight("layers.0.linear_attn.A_log")
    assert a_log.dtype == torch.float32 and a_log.min() >= 0 and a_log.max() <= math.log(16)
    dt = torch.nn.functional.softplus(a.weight("layers.0.linear_attn.dt_bias"))
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    assert torch.equal(a.weight("layers.0.linear_attn.norm.weight"),
                       torch.ones(32, dtype=torch.bfloat16))
    norm = a.weight("layers.0.input_layernorm.weight").float()  # applied as (1 + w)
    assert 0 < norm.abs().max() < 0.1
    assert a.weight("layers.0.mlp.gate_up_proj.weight").float().std() == pytest.approx(0.02,
                                                                                      rel=0.05)
    assert torch.equal(a.weight("visual.blocks.0.norm1.weight"),
                       torch.ones(64, dtype=torch.bfloat16))
    assert not a.weight("visual.blocks.0.attn.qkv.bias").any()


# Shapes from /work/shared/research/qwen_arch.md §3 and parameter totals from §4.
REAL_SHAPES = {
    "qwen3_6_27b": {
        "embed_tokens.weight": (248320, 5120), "lm_head.weight": (248320, 5120),
        "layers.0.linear_attn.in_proj_qkvz.weight": (10240 + 6144, 5120),
        "layers.0.linear_attn.in_proj_ba.weight": (2 * 48, 5120),
        "layers.0.linear_attn.conv1d.weight": (10240, 4),
        "layers.0.linear_attn.A_log": (48,), "layers.0.linear_attn.norm.weight": (128,),
        "layers.0.linear_attn.out_proj.weight": (5120, 6144),
        "layers.3.self_attn.qkv_proj.weight": (12288 + 1024 + 1024, 5120),
        "layers.3.self_attn.o_proj.weight": (5120, 6144),
        "layers.3.self_attn.q_norm.weight": (256,),
        "layers.0.mlp.gate_up_proj.weight": (2 * 17408, 5120),
        "layers.63.mlp.down_proj.weight": (5120, 17408),
        "mtp.fc.weight": (5120, 10240), "mtp.layers.0.self_attn.qkv_proj.weight": (14336, 5120),
        "visual.blocks.26.attn.qkv.weight": (3456, 1152),
        "visual.merger.linear_fc1.weight": (4608, 4608),
        "visual.merger.linear_fc2.weight": (5120, 4608),
    },
    "qwen3_6_35b_a3b": {
        "embed_tokens.weight": (248320, 2048), "lm_head.weight": (248320, 2048),
        "layers.0.linear_attn.in_proj_qkvz.weight": (8192 + 4096, 2048),
        "layers.0.linear_attn.conv1d.weight": (8192, 4),
        "layers.3.self_attn.qkv_proj.weight": (8192 + 512 + 512, 2048),
        "layers.0.mlp.router.weight": (256, 2048),
        "layers.0.mlp.experts.gate_up_proj": (256, 1024, 2048),
        "layers.39.mlp.experts.down_proj": (256, 2048, 512),
        "layers.0.mlp.shared_expert.gate_up_proj.weight": (1024, 2048),
        "layers.0.mlp.shared_expert_gate.weight": (1, 2048),
        "mtp.layers.0.mlp.experts.gate_up_proj": (256, 1024, 2048),
        "visual.merger.linear_fc2.weight": (2048, 4608),
    },
}
REAL_PARAMS = {"qwen3_6_27b": 26.90e9 + 0.46e9 + 0.42e9, "qwen3_8_27b": 26.90e9 + 0.46e9 + 0.42e9,
               "qwen3_6_35b_a3b": 34.66e9 + 0.45e9 + 0.84e9}


@pytest.mark.parametrize("profile", [p for p in PROFILES if not PROFILES[p].is_tiny])
def test_real_profile_plans_have_the_published_shapes(profile):
    outputs = plan_outputs(open_source(profile, random_init=True),
                           BuildOptions(weights="nvfp4", lm_head="bf16"))
    shapes = {o.name: o.shape for o in outputs}
    schemes = {o.name: o.scheme for o in outputs}
    for name, shape in REAL_SHAPES.get(profile, REAL_SHAPES["qwen3_6_27b"]).items():
        assert shapes[name] == shape, name
    params = sum(math.prod(s) for s in shapes.values())
    assert params == pytest.approx(REAL_PARAMS[profile], rel=0.005)
    cfg = get_profile(profile).config
    assert sum(n.endswith("qkv_proj.weight") and not n.startswith("mtp.")
               for n in shapes) == cfg.layer_types.count("full_attention")
    assert schemes["lm_head.weight"] == "bf16" and schemes["embed_tokens.weight"] == "bf16"
    assert schemes["layers.0.linear_attn.in_proj_qkvz.weight"] == "nvfp4"
    assert schemes["layers.0.linear_attn.A_log"] == "fp32"


# -- ModelOpt NVFP4 import --------------------------------------------------------------------


def modelopt_checkpoint(src: Path, dst: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A ModelOpt-style NVFP4 export of `src`: every decoder-layer linear quantized by
    ModelOpt itself (in_proj_a/b too, which NInfer keeps in bf16), mtp.*, routers and lm_head
    left bf16. Returns the ModelOpt parts per quantized weight."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    shutil.copytree(src, dst)
    state = source_state(src)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    out, parts = {}, {}
    for name, t in state.items():
        if name.startswith("model.layers.") and t.dim() == 2 and "proj" in name.split(".")[-2]:
            q, scale, scale_2 = NVFP4QTensor.quantize(t, 16)
            parts[name] = {"weight": q._quantized_data, "weight_scale": scale,
                           "weight_scale_2": scale_2}
            out |= {name: q._quantized_data, f"{name}_scale": scale,
                    f"{name}_scale_2": scale_2, name[:-len("weight")] + "input_scale":
                    torch.tensor(0.5)}
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
                                                            "group_size": 16}}))
    return parts


def test_modelopt_nvfp4_checkpoint_is_imported_as_is(tiny_checkpoint, tmp_path):
    parts = modelopt_checkpoint(tiny_checkpoint("moe"), tmp_path / "modelopt")
    a = convert(tmp_path / "modelopt", tmp_path / "m.ninfer", weights="nvfp4")
    direct = convert(tiny_checkpoint("moe"), tmp_path / "d.ninfer", weights="nvfp4")
    assert a.manifest["options"]["imported_from"] == "modelopt-nvfp4"
    assert "quantization_config" not in a.manifest["config"]
    plans = {p.name: p for p in plan_tensors(a.config, set(Checkpoint(
        tmp_path / "modelopt", nvfp4=True).tensors))}
    imported = 0
    for name, plan in plans.items():
        if plan.sources[0] not in parts or not plan.quantizable:
            continue
        imported += 1
        got = a.weight(name).parts
        src = [parts[s] for s in plan.sources]
        rows = [p["weight"].shape[0] for p in src]
        want = {"weight": torch.cat([p["weight"] for p in src]),
                "weight_scale": torch.cat([p["weight_scale"] for p in src]),
                "weight_scale_2": torch.cat([p["weight_scale_2"].expand(r)
                                             for p, r in zip(src, rows, strict=True)])}
        if plan.combine in ("stack", "stack_concat"):
            n = len(src) // plan.parts
            want = {k: v.reshape(n, -1, *v.shape[1:]) for k, v in want.items()}
        for role, v in want.items():
            assert torch.equal(got[role].view(torch.uint8), v.view(torch.uint8)), (name, role)
        assert a.manifest["weights"][name]["error"] is None
        if plan.combine == "one":  # our quantizer is byte-exact with ModelOpt
            assert stored_bytes_of(a, name) == stored_bytes_of(direct, name), name
    assert imported > 20
    # bf16 tensors of the export (mtp.*, lm_head) are quantized normally ...
    assert a.manifest["weights"]["mtp.fc.weight"]["error"] is not None
    assert stored_bytes_of(a, "lm_head.weight") == stored_bytes_of(direct, "lm_head.weight")
    # ... and quantized tensors NInfer keeps in bf16 are dequantized.
    ba = a.weight("layers.0.linear_attn.in_proj_ba.weight")
    deq = get_scheme("nvfp4").dequantize_parts
    want = torch.cat([deq({**parts[f"model.layers.0.linear_attn.in_proj_{x}.weight"],
                           "weight_scale_2": parts[f"model.layers.0.linear_attn.in_proj_{x}"
                                                   ".weight"]["weight_scale_2"].expand(4)})
                      for x in "ba"])
    assert torch.equal(ba, want.bfloat16())


def stored_bytes_of(a: Artifact, name: str) -> list[bytes]:
    scheme = get_scheme(a.manifest["weights"][name]["scheme"])
    return [a.stored(stored_name(name, r)).contiguous().view(torch.uint8).numpy().tobytes()
            for r in scheme.roles]


def test_modelopt_checkpoint_to_bf16_dequantizes_and_to_int_is_refused(tiny_checkpoint,
                                                                     tmp_path):
    parts = modelopt_checkpoint(tiny_checkpoint("dense"), tmp_path / "modelopt")
    a = convert(tmp_path / "modelopt", tmp_path / "m.ninfer", weights="bf16")
    o_proj = parts["model.layers.3.self_attn.o_proj.weight"]
    want = get_scheme("nvfp4").dequantize_parts({**o_proj, "weight_scale_2":
                                                 o_proj["weight_scale_2"].expand(128)})
    assert torch.equal(a.weight("layers.3.self_attn.o_proj.weight"), want.bfloat16())
    out = tmp_path / "out"
    result = cli("build", str(tmp_path / "modelopt"), "--weights", "groupwise-int", "-o",
                 str(out / "m.ninfer"))
    assert result.exit_code == 1
    assert "NVFP4-quantized" in result.output and "groupwise-int" in result.output
    assert not files_in(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quantization_agrees_with_cpu(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("moe")
    for weights in ("groupwise-int", "nvfp4"):
        cpu = convert(src, tmp_path / "cpu.ninfer", weights=weights, device="cpu")
        gpu = convert(src, tmp_path / "gpu.ninfer", weights=weights, device="cuda")
        assert gpu.manifest["options"]["device"] == "cuda"
        if weights == "groupwise-int":  # nvfp4 may differ in the last bit (see BuildOptions)
            assert stored_bytes(cpu) == stored_bytes(gpu)
        for name, w in cpu.manifest["weights"].items():
            other = gpu.manifest["weights"][name]["error"]
            assert w["error"] == other or abs(w["error"] - other) < 1e-4, name


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_build_default_output_and_inspect(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("build", "tiny_moe", "--random-init", "--seed", "7", "--weights",
                 "groupwise-int", "--lm-head", "bf16", "--no-vision", "--device", "cpu")
    assert result.exit_code == 0, result.output
    path = tmp_path / "out" / "tiny_moe_groupwise-int.ninfer"
    assert str(path.relative_to(tmp_path)) in result.output
    a = Artifact.open(path)
    assert a.manifest["options"] == {"lm_head": "bf16", "mtp": "body", "include_mtp": True,
                                     "include_vision": False, "device": "cpu"}
    assert a.manifest["source"] == {"kind": "random-init", "seed": 7}
    result = cli("inspect", str(path))
    assert result.exit_code == 0, result.output
    for fact in ("groupwise-int", "random", "tiny_moe", "layers.0.mlp.experts.gate_up_proj"):
        assert fact in result.output


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory: Path, edit) -> Path:
    """Rewrites the checkpoint as one file (no index) after `edit(state) -> state`."""
    state = source_state(directory)
    for f in directory.glob("*.safetensors"):
        f.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(edit(state), directory / "model.safetensors")
    return directory


K_PROJ = "model.layers.3.self_attn.k_proj.weight"
BAD_SOURCES = {
    "empty directory": (lambda ck, d: d.mkdir() or d, "no config.json"),
    "other model_type": (lambda ck, d: _edit_config(_copy(ck, d), model_type="llama"),
                         "not a Qwen3.5-family model"),
    "missing shard": (lambda ck, d: _unlink(_copy(ck, d), "model-00002-of-"),
                      "missing from"),
    "missing tensor": (lambda ck, d: _rewrite(_copy(ck, d), lambda s: {
        k: v for k, v in s.items() if k != K_PROJ}), f"lacks the tensor '{K_PROJ}'"),
    "unsupported dtype": (lambda ck, d: _rewrite(_copy(ck, d), lambda s: {
        **s, K_PROJ: s[K_PROJ].double()}), f"tensor '{K_PROJ}' has dtype F64"),
    "wrong shape": (lambda ck, d: _rewrite(_copy(ck, d), lambda s: {
        **s, K_PROJ: s[K_PROJ][:32]}), "the config implies"),
    "truncated shard": (lambda ck, d: _truncate(_copy(ck, d)), "truncated"),
    "inf weights": (lambda ck, d: _rewrite(_copy(ck, d), lambda s: {
        **s, K_PROJ: s[K_PROJ].index_fill(0, torch.tensor([5]), float("inf"))}),
        "cannot quantize 'layers.3.self_attn.qkv_proj.weight' to nvfp4"),
    "fp8 checkpoint": (lambda ck, d: _edit_config(_copy(ck, d), quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128]}),
        "quant_method 'fp8', quant_algo None) is not supported"),
    "unsupported rope scaling": (lambda ck, d: _edit_rope(_copy(ck, d), rope_type="longrope"),
                                 "rope_type 'longrope' is not supported"),
}


def _edit_config(d: Path, **changes: object) -> Path:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | changes))
    return d


def _edit_rope(d: Path, **changes: object) -> Path:
    config = json.loads((d / "config.json").read_text())
    config.get("text_config", config)["rope_parameters"].update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


def _unlink(d: Path, prefix: str) -> Path:
    next(f for f in d.iterdir() if f.name.startswith(prefix)).unlink()
    return d


def _truncate(d: Path) -> Path:
    f = max(d.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[:-10])
    return d


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_fails_cleanly(tiny_checkpoint, tmp_path, case):
    make, message = BAD_SOURCES[case]
    src = make(tiny_checkpoint("dense", max_shard_size="100KB"), tmp_path / "src")
    out = tmp_path / "out"
    result = cli("build", str(src), "--weights", "nvfp4", "-o", str(out / "m.ninfer"))
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert not files_in(out)


@pytest.mark.parametrize("args,message", [
    (["no_such_profile"], "'no_such_profile' is not a registered profile"),
    (["tiny_dense"], "has no Hugging Face repo; use --random-init"),
    (["{ckpt}", "--random-init"], "--random-init needs a registered profile"),
    (["tiny_dense", "--random-init", "--revision", "main"], "--revision applies only"),
    (["tiny_dense", "--random-init", "-o", "{file}/m.ninfer"], "is not a directory"),
    (["tiny_dense", "--random-init", "-o", "{dir}"], "is a directory"),
])
def test_bad_arguments_fail_cleanly(tiny_checkpoint, tmp_path, args, message):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    fill = {"ckpt": str(tiny_checkpoint("dense")), "file": str(tmp_path / "file"),
            "dir": str(tmp_path / "dir")}
    args = [a.format(**fill) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out" / "m.ninfer")]
    before = sorted(tmp_path.rglob("*"))
    result = cli("build", *args, "--weights", "bf16")
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_interrupted_build_leaves_no_file(tiny_checkpoint, tmp_path, monkeypatch, interrupt):
    calls = []
    real_convert = build_module.convert_tensor

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 20:
            raise interrupt()
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(build_module, "convert_tensor", flaky)
    out = tmp_path / "out"
    result = cli("build", str(tiny_checkpoint("dense")), "--weights", "nvfp4", "-o",
                 str(out / "m.ninfer"))
    assert result.exit_code != 0 and len(calls) == 20
    assert not files_in(out)


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_shows_bytes_on_a_terminal_only(terminal):
    out = io.StringIO()
    with byte_progress(3_000_000, "m.ninfer", Console(file=out, force_terminal=terminal,
                                                      width=120)) as advance:
        advance(1_000_000)
        advance(2_000_000)
    assert ("3.0/3.0 MB" in out.getvalue()) == terminal
    assert bool(out.getvalue()) == terminal


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_random_init_draws_on_the_build_device_reproducibly(device: str) -> None:
    """--random-init draws where the build quantizes (a 27B model is minutes of CPU draws):
    the same (seed, name) gives the same values on one device type, handed over on the CPU;
    the CPU's values are the ones every earlier CPU build drew."""
    from ninfer_convert.sources import RandomTensors

    layout = hf_layout(get_profile("tiny_dense").config)
    name = next(n for n in layout if n.endswith("mlp.down_proj.weight"))
    a = RandomTensors(layout, seed=5, device=device).load(name)["weight"]
    b = RandomTensors(layout, seed=5, device=device).load(name)["weight"]
    assert a.device.type == "cpu" and torch.equal(a, b)
    assert 0.015 < a.float().std() < 0.025  # N(0, 0.02)
    if device == "cpu":  # as drawn before draws could move: one CPU generator, N(0, 0.02)
        digest = hashlib.sha256(f"5:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        want = (torch.randn(a.numel(), generator=gen) * 0.02).to(a.dtype).view(a.shape)
        assert torch.equal(a, want)


def test_the_default_artifact_is_named_for_its_profiles_config(tmp_path: Path) -> None:
    """A cache built from an older tiny_dense config (say 4,096 positions, before the engine
    refused contexts past them) is never served for the current one."""
    from ninfer_convert.demo import DEFAULT_PROFILE, artifact_name, default_artifact

    config = get_profile(DEFAULT_PROFILE).hf_config
    older = json.loads(json.dumps(config))
    older["text_config"]["max_position_embeddings"] = 4096
    assert artifact_name(older) != artifact_name(config)
    (tmp_path / artifact_name(older)).write_bytes(b"a stale cache")
    path = default_artifact(tmp_path)
    assert path.name == artifact_name(config) and path.stat().st_size > 1000
