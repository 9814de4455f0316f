"""Every Triton kernel at once, in the real engine: NINFER_OPS=triton must give the tokens the
torch references give (under TRITON_INTERPRET=1 on a CPU-only machine, for real on a GPU).

Quantized NVFP4 / groupwise-int weights and the INT8 KV cache put every kernel family on the
path: quantized linear, fused norms and RoPE, KV store and paged attention, GDN conv / chunked /
decode, MoE routing and experts, sampling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import drain, engine, greedy, prompt, request

from ninfer_runtime.models.loading import load_artifact

# the tokens do not depend on the kernels' configs: none is tuned here
pytestmark = pytest.mark.usefixtures("untuned_kernels")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory):
    from ninfer_convert.build import BuildOptions, build
    from ninfer_convert.sources import open_source

    def make(kind: str, weights: str) -> Path:
        path = tmp_path_factory.mktemp("kernels") / f"tiny_{kind}_{weights}.ninfer"
        return build(open_source(f"tiny_{kind}", random_init=True), path,
                     BuildOptions(weights=weights, include_vision=False, include_mtp=False))

    return make


def assert_kernels_give_the_reference_tokens(loaded, reqs: list, config: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = {}
    for mode in ("ref", "triton"):
        monkeypatch.setenv("NINFER_OPS", mode)
        tokens[mode] = drain(engine(loaded, **config), reqs).tokens
    assert tokens["triton"] == tokens["ref"]


@pytest.mark.parametrize(("kind", "weights"), [("dense", "nvfp4"), ("moe", "groupwise-int")])
def test_kernels_give_the_reference_tokens(quantized, monkeypatch: pytest.MonkeyPatch,
                                           kind: str, weights: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # fp32 on both devices, so that rounding cannot flip a greedy choice of the random model
    loaded = load_artifact(quantized(kind, weights), device, dtype=torch.float32)
    reqs = [request(f"r{i}", prompt(n, i), greedy(4)) for i, n in enumerate((1, 9, 21))]
    config = {"kv_dtype": "int8", "prefill_chunk": 8, "max_context": 64, "max_concurrency": 3,
              "device": device}
    assert_kernels_give_the_reference_tokens(loaded, reqs, config, monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="too slow for the interpreter")
@pytest.mark.parametrize(("kind", "weights"), [("dense", "nvfp4"), ("moe", "nvfp4")])
def test_a_long_prompt_gives_the_reference_tokens(quantized, monkeypatch: pytest.MonkeyPatch,
                                                  kind: str, weights: str) -> None:
    """A prompt of 1,500 tokens in chunks of 512: the prompt-size paths (the dequantized
    cuBLAS GEMMs, the MoE grouped GEMMs, attention over many pages, GDN across chunks) give
    the reference runtime's greedy tokens."""
    loaded = load_artifact(quantized(kind, weights), "cuda", dtype=torch.float32)
    reqs = [request("long", prompt(1500, 7), greedy(8)), request("short", prompt(5, 8),
                                                                 greedy(8))]
    config = {"kv_dtype": "int8", "prefill_chunk": 512, "max_context": 1536,
              "max_concurrency": 2, "device": "cuda"}
    assert_kernels_give_the_reference_tokens(loaded, reqs, config, monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PDL launches exist on a GPU only")
@pytest.mark.parametrize(("kind", "weights"), [("dense", "nvfp4"), ("moe", "nvfp4")])
def test_dependent_launches_give_the_tokens_of_plain_launches(
        quantized, monkeypatch: pytest.MonkeyPatch, kind: str, weights: str) -> None:
    """PDL (NINFER_PDL=1) changes when kernels start, never what they compute: a kernel that
    read its inputs before waiting for its predecessor would change the greedy tokens. bf16 and
    CUDA graphs, as served."""
    from ninfer_runtime.ops import launch

    loaded = load_artifact(quantized(kind, weights), "cuda", dtype=torch.bfloat16)
    reqs = [request(f"r{i}", prompt(n, i), greedy(24)) for i, n in enumerate((3, 17, 40))]
    config = {"kv_dtype": "int8", "prefill_chunk": 16, "max_context": 128,
              "max_concurrency": 3, "device": "cuda"}
    tokens = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("NINFER_PDL", pdl)
        launch._pdl.cache_clear()
        tokens[pdl] = drain(engine(loaded, **config), reqs).tokens
    launch._pdl.cache_clear()
    assert tokens["1"] == tokens["0"]


# Where a producer hands the next GEMV its decode operand: the GDN norm's 4 heads of 32 (the
# norm kernel's for the prompt, the GDN decode's own for one-token steps) make a
# groupwise-int operand group (128), not an nvfp4 one (256); in_proj_ba's skinny kernel writes
# in_proj_qkvz's, the router's the experts' gate|up stage's, the dense gate|up GEMV down's
# (inside the MLP's one launch, `mlp_decode`; off, the MLP runs as two GEMVs without it).
# The tiny MoE's bf16 router logits tie exactly for a decode token (margins: docs/perf.md,
# twelfth run), and which expert a tie picks is the kernel's choice: the MoE is checked
# against itself only.
@pytest.mark.parametrize(("kind", "weights", "gdn_operand", "against_reference"),
                         [("dense", "nvfp4", False, True), ("dense", "groupwise-int", True, True),
                          ("moe", "nvfp4", False, False)])
def test_half_steps_give_the_reference_logits(quantized, monkeypatch: pytest.MonkeyPatch,
                                              kind: str, weights: str, gdn_operand: bool,
                                              against_reference: bool) -> None:
    """The token tests above run fp32, which never takes the decode GEMV (half activations
    only) nor the operands its producers write for it. In half precision a prompt of 5
    tokens (decode GEMV rows too) and two one-token steps are as close to the fp32 logits as
    the reference ops in the same half type are (half rounding), and give the same logits bit
    for bit whether the producers hand their operands on or each GEMV makes its own.

    Both half runs are measured against fp32, not against each other: in bf16 each is ~4% of
    the largest logit off, so their difference can reach twice that (the H100 showed one logit
    of 8,064 at 4.3% while each path's own error stayed at the reference's)."""
    from ninfer_runtime.models import layers
    from ninfer_runtime.ops import quant_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16 dots
    ids = torch.tensor(prompt(7, 3))

    def run(mode: str, dtype: torch.dtype = dtype) -> torch.Tensor:
        monkeypatch.setenv("NINFER_OPS", mode)
        model = load_artifact(quantized(kind, weights), device, dtype=dtype).model
        cache = model.new_cache()
        steps = [model.logits(model.forward(ids[:5], 0, cache))]
        steps += [model.logits(model.forward(ids[p:p + 1], p, cache)) for p in (5, 6)]
        return torch.cat(steps)

    handed = {"norm": [], "fused norm": [], "skinny": [], "mlp block": []}

    def spy(name: str, producer):
        def call(*args):
            out = producer(*args)
            # a producer's last output is the operand; the MLP block's whole output is its own
            handed[name].append(out is not None and (name == "mlp block" or out[-1] is not None))
            return out
        return call

    for name, producer in (("norm", "gated_rms_norm_with_operand"),
                           ("fused norm", "gdn_decode_norm"), ("skinny", "linear_with_operand"),
                           ("mlp block", "mlp_decode")):
        monkeypatch.setattr(layers, producer, spy(name, getattr(layers, producer)))
    triton = run("triton")
    # the prompt's 5 rows take the norm kernel, the one-token steps the GDN decode's own
    assert set(handed["norm"]) == set(handed["fused norm"]) == {gdn_operand}
    assert True in handed["skinny"]
    # the dense MLP's gate|up hands down its operand inside one launch (the MoE has none)
    assert (True in handed["mlp block"]) == (kind == "dense")
    monkeypatch.setattr(layers, "decode_operand_spec", lambda *args: None)
    monkeypatch.setattr(layers, "gate_up_operand_spec", lambda *args: None)
    monkeypatch.setattr(quant_linear, "MLP_BLOCK", False)
    handed["skinny"].clear()
    handed["mlp block"].clear()
    own = run("triton")
    assert not any(handed["skinny"]) and not any(handed["mlp block"])
    if device == "cuda":
        assert torch.equal(own, triton)
    else:  # the interpreter's fp32 dots are numpy's BLAS, whose sums can depend on a column's
        # place in the tile (OpenBLAS on an AMD EPYC: 61 of the 1,280 SiLU products of the
        # first MLP 1 ulp apart, as the fused gate|up GEMV pairs gate and up rows in its tiles
        # and the plain one does not); the operands themselves are the same bits either way
        torch.testing.assert_close(own, triton, rtol=0, atol=1e-2 * triton.abs().max().item())
    if against_reference:
        exact = run("ref", torch.float32)
        half_rounding = (run("ref").float() - exact).abs().max().item()
        assert 0 < half_rounding < 0.1 * exact.abs().max().item()
        assert (triton.float() - exact).abs().max().item() <= 2 * half_rounding


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_half_prompts_run_the_nvfp4_gemms_on_fp16_operands(quantized,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           kind: str) -> None:
    """A 24-token prompt in half precision takes the dense prompt GEMM for every projection
    (the MoE's experts keep their tile decode): on fp16 operands it gives the logits of the
    same GEMM decoding its nvfp4 tiles to the half type, to half rounding."""
    from ninfer_runtime.ops import quant_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16 dots
    monkeypatch.setenv("NINFER_OPS", "triton")
    made = []
    operand = quant_linear.gemm_operand
    monkeypatch.setattr(quant_linear, "gemm_operand",
                        lambda a: made.append(a.shape) or operand(a))
    ids = torch.tensor(prompt(24, 5))

    def logits(fp16_operands: bool) -> torch.Tensor:
        monkeypatch.setattr(quant_linear, "PROMPT_FP16_OPERANDS", fp16_operands)
        model = load_artifact(quantized(kind, "nvfp4"), device, dtype=dtype).model
        return model.logits(model.forward(ids, 0, model.new_cache())).float()

    fp16 = logits(True)
    assert {shape[0] for shape in made} == {24}  # every projection's, none of the experts'
    made.clear()
    tiles = logits(False)
    assert not made
    torch.testing.assert_close(fp16, tiles, rtol=0, atol=2e-2 * tiles.abs().max().item())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_norms_run_in_their_readers_launch(quantized, monkeypatch: pytest.MonkeyPatch,
                                           kind: str) -> None:
    """Decode steps in half precision run a layer's norms inside the launches that read them
    first (ops.norm.DeferredNorm: in_proj_ba's and the router's prologue, the decode GEMVs'
    activation pass), no norm kernel of their own: the same tokens as with the norm kernel
    before them (the bits: tests/kernels, test_skinny_linear, test_moe, test_linear)."""
    from ninfer_runtime.models import layers
    from ninfer_runtime.ops import norm as norm_ops
    from ninfer_runtime.ops import rms_math

    device = "cuda" if torch.cuda.is_available() else "cpu"
    half = torch.bfloat16 if device == "cuda" else torch.float16
    loaded = load_artifact(quantized(kind, "nvfp4"), device, dtype=half)
    reqs = [request("r", prompt(6, 0), greedy(3))]
    config = {"kv_dtype": "int8", "prefill_chunk": 16, "max_context": 32,
              "max_concurrency": 1, "device": device}
    monkeypatch.setenv("NINFER_OPS", "triton")
    fused, ran = [], []
    prologue_args, run = rms_math.prologue_args, norm_ops.DeferredNorm.run
    for module in ("skinny_linear", "quant_linear"):
        monkeypatch.setattr(f"ninfer_runtime.ops.{module}.prologue_args",
                            lambda x, norm: fused.append(norm) or prologue_args(x, norm))
    monkeypatch.setattr(norm_ops.DeferredNorm, "run",
                        lambda norm: ran.append(norm.x.shape[0]) or run(norm))
    deferred = drain(engine(loaded, **config), reqs).tokens
    assert any(fused) and 1 not in ran  # a decode step's norms ran in their readers
    monkeypatch.setattr(layers, "defer_add_rms_norm", lambda *args: None)
    fused.clear()
    assert drain(engine(loaded, **config), reqs).tokens == deferred
    assert not any(fused)
