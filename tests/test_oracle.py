"""End to end against transformers: save_pretrained -> ninfer-convert -> LLM.score.

The bf16 artifact must reproduce Qwen3_5(Moe)ForCausalLM's logits on the checkpoint's weights;
a quantized artifact must reproduce transformers run on the artifact's dequantized weights
(quantization error is the converter's business, tested in test_quant.py; here the runtime
must add none). fp32 on CPU; max abs error <= 1e-4 relative to the logit scale.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_convert.build import BuildOptions, build
from ninfer_convert.mapping import plan_tensors
from ninfer_convert.sources import open_source
from ninfer_runtime import LLM
from ninfer_runtime.artifact import Artifact
from ninfer_runtime.quant import PackedWeight


def hf_model_on(artifact: Artifact) -> torch.nn.Module:
    """transformers' text model carrying the artifact's (dequantized) weights, in fp32."""
    import transformers

    cfg = artifact.config
    prefix = "Qwen3_5Moe" if cfg.is_moe else "Qwen3_5"
    text = cfg.hf_config.get("text_config", cfg.hf_config)
    model = getattr(transformers, f"{prefix}ForCausalLM")(
        getattr(transformers, f"{prefix}TextConfig")(**text)).float().eval()
    params = model.state_dict()
    state = {}
    for plan in plan_tensors(cfg, set(params), include_mtp=False, include_vision=False):
        w = artifact.weight(plan.name)
        w = w.dequantize() if isinstance(w, PackedWeight) else w.float()
        if plan.combine == "concat":
            sizes = [params[s].shape[0] for s in plan.sources]
            state.update(zip(plan.sources, w.split(sizes), strict=True))
        else:  # one tensor each ("squeeze1" drops conv1d's channel dim)
            (source,) = plan.sources
            state[source] = w.reshape(params[source].shape)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("weights", ["bf16", "nvfp4", "groupwise-int"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_artifact_logits_match_transformers(kind, weights, tiny_checkpoint, tmp_path):
    source = open_source(str(tiny_checkpoint(kind)))
    path = build(source, tmp_path / f"{kind}_{weights}.ninfer", BuildOptions(weights=weights))
    artifact = Artifact.open(path)
    assert artifact.weights_id == weights
    ids = torch.randint(0, artifact.config.vocab_size, (70,),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model_on(artifact)(ids[None]).logits[0].float()
    got = LLM(path, device="cpu").score(ids.tolist())
    assert got.shape == expected.shape
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= 1e-4 * scale
