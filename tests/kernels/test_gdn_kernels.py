"""The GDN kernels (fused decode, varlen conv, chunked rule) against their torch references.

On CPU the kernels run in Triton's interpreter with exact fp32 dots, so fp32 results agree to
rounding; on CUDA the chunked kernel's dots are tf32 for half inputs and get a looser bound.
Shapes are tiny but keep the real structure: grouped value heads (3 per k-head, as in the
27B), dk != dv, segments of 1 token, shorter than the conv window, and across chunk boundaries.
dv 32 splits into two decode column tiles under the interpreter, so each k-head's q/k conv
window is shared by 3 heads x 2 tiles = 6 decode programs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer_runtime.ops import gdn, quant_linear
from ninfer_runtime.ops.conv import (
    causal_conv1d,
    causal_conv1d_varlen,
    causal_conv1d_varlen_ref,
)
from ninfer_runtime.ops.dispatch import graph_kernels, graphing
from ninfer_runtime.ops.gdn import (
    DECODE_TICKETS,
    OutputNorm,
    chunk_gated_delta_rule,
    gated_delta_rule_varlen,
    gated_delta_rule_varlen_ref,
    gdn_decode,
    gdn_decode_norm,
    gdn_decode_ref,
    gdn_gating,
    gdn_gating_ref,
    recurrent_gated_delta_rule,
)
from ninfer_runtime.ops.norm import gated_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
NK, NV, DK, DV, K, SLOTS = 2, 6, 16, 32, 4, 9
CONV_DIM = 2 * NK * DK + NV * DV


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_OPS", "triton")
    monkeypatch.setenv("NINFER_GDN_PROMPT", "ninfer")  # ours, even where fla-core is installed


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.to(DEVICE, dtype)


def segments(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return cu.to(DEVICE), torch.tensor(slots).to(DEVICE)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float | None = None) -> None:
    """Half types within a few rounding steps (the conv output is rounded before use, so an
    fp32-order flip of one bit there moves everything downstream a little); fp32 to 1e-5, or
    to `tol` where tf32 dots are involved."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        tol = tol or 1e-5
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    else:
        step = 2.0 ** -(8 if expected.dtype == torch.bfloat16 else 11)
        torch.testing.assert_close(actual, expected, rtol=4 * step, atol=4 * step)


def decode_inputs(n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """gdn_decode's arguments but the segments: strided row views, as the layer cuts them."""
    a_log = (torch.rand(NV, generator=torch.Generator().manual_seed(7)) * 2 + 0.01).log()
    ba = rand(n, 2 * NV, seed=2, dtype=dtype)
    return {
        "mixed_qkv": rand(n, CONV_DIM + 40, seed=1, dtype=dtype)[:, 8:8 + CONV_DIM],
        "b": ba[:, :NV], "a": ba[:, NV:],
        "conv_weight": rand(CONV_DIM, K, seed=3, dtype=dtype) * 0.5,
        "A_log": a_log.to(DEVICE), "dt_bias": rand(NV, seed=4),
        "conv_states": rand(SLOTS, CONV_DIM, K - 1, seed=5, dtype=dtype),
        "states": rand(SLOTS, NV, DK, DV, seed=6) * 0.3,
    }


def run_decode(fn, x: dict[str, torch.Tensor], cu: torch.Tensor, slots: torch.Tensor,
               snapshots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    conv, states = x["conv_states"].clone(), x["states"].clone()
    args = {**x, "conv_states": conv, "states": states}
    return fn(**args, cu_seqlens=cu, slots=slots, snapshot_slots=snapshots), conv, states


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
def test_gating_matches_reference(dtype: torch.dtype) -> None:
    """A prompt chunk's gating in one launch: a and b are column views of one projection,
    37 tokens (a partial last program), 6 heads (a padded tile), a + dt_bias on both sides
    of softplus's linear threshold (20)."""
    ba = rand(37, 2 * NV, seed=11, dtype=dtype) * 12
    b, a = ba.chunk(2, dim=-1)
    a_log = (torch.rand(NV, generator=torch.Generator().manual_seed(12)) * 2 + 0.01).log()
    dt_bias = rand(NV, seed=13) + 10
    g, beta = gdn_gating(a, b, a_log.to(DEVICE), dt_bias)
    ref_g, ref_beta = gdn_gating_ref(a, b, a_log.to(DEVICE), dt_bias)
    close(g, ref_g)
    close(beta, ref_beta)
    assert (a + dt_bias > 20).any() and (a + dt_bias < 20).any()


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
def test_decode_matches_reference(dtype: torch.dtype) -> None:
    """Single tokens on scattered slots, a 3-token segment updated in place, and an empty
    segment (a padded batch entry), whose slot 8 must come back as it was."""
    cu, slots = segments([1, 1, 3, 0, 1], [4, 0, 7, 8, 2])
    x = decode_inputs(6, dtype)
    out, conv, states = run_decode(gdn_decode, x, cu, slots)
    ref_out, ref_conv, ref_states = run_decode(gdn_decode_ref, x, cu, slots)
    close(out, ref_out)
    close(conv, ref_conv)
    close(states, ref_states)
    untouched = [s for s in range(SLOTS) if s not in (4, 0, 7, 2)]
    assert torch.equal(states[untouched], x["states"][untouched])
    assert torch.equal(conv[untouched], x["conv_states"][untouched])
    # the q/k conv-window tickets are handed back: the next launch starts from zero
    assert not DECODE_TICKETS.on(x["mixed_qkv"].device).any()


def test_decode_snapshots_hold_the_state_after_each_token() -> None:
    """Speculative verification: 4 tokens of one sequence, the state after each in its own
    slot; the own slot stays as it was. A second sequence's last token snapshots into its own
    slot. Each snapshot equals the prompt path run over the tokens up to it."""
    cu, slots = segments([4, 2], [0, 1])
    snapshots = torch.tensor([5, 8, 3, 6, 2, 1], device=DEVICE)
    x = decode_inputs(6, torch.float32)
    out, conv, states = run_decode(gdn_decode, x, cu, slots, snapshots)
    ref_out, ref_conv, ref_states = run_decode(gdn_decode_ref, x, cu, slots, snapshots)
    close(out, ref_out)
    close(conv, ref_conv)
    close(states, ref_states)
    assert torch.equal(states[0], x["states"][0]) and torch.equal(conv[0], x["conv_states"][0])

    g, beta = gdn_gating(x["a"], x["b"], x["A_log"], x["dt_bias"])
    for i, snap in enumerate([5, 8, 3, 6]):
        y, conv_state = causal_conv1d(x["mixed_qkv"][:i + 1], x["conv_weight"],
                                      x["conv_states"][0])
        q, k, v = y.split([NK * DK, NK * DK, NV * DV], dim=-1)
        o, state = chunk_gated_delta_rule(
            q.reshape(-1, NK, DK), k.reshape(-1, NK, DK), v.reshape(-1, NV, DV), g[:i + 1],
            beta[:i + 1], x["states"][0])
        close(conv[snap], conv_state)
        close(states[snap], state, tol=1e-4)
        close(out[i], o[i], tol=1e-4)


def test_decode_reference_is_the_layer_path() -> None:
    """The fused reference computes what conv varlen + gating + the varlen rule compute."""
    cu, slots = segments([1, 1, 1], [3, 0, 6])
    x = decode_inputs(3, torch.float32)
    fused, conv, states = run_decode(gdn_decode_ref, x, cu, slots)
    conv2, states2 = x["conv_states"].clone(), x["states"].clone()
    y = causal_conv1d_varlen_ref(x["mixed_qkv"], x["conv_weight"], conv2, cu, slots)
    q, k, v = y.split([NK * DK, NK * DK, NV * DV], dim=-1)
    g, beta = gdn_gating(x["a"], x["b"], x["A_log"], x["dt_bias"])
    out = gated_delta_rule_varlen_ref(q.reshape(3, NK, DK), k.reshape(3, NK, DK),
                                      v.reshape(3, NV, DV), g, beta, states2, cu, slots)
    close(fused, out)
    close(conv, conv2)
    close(states, states2)


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("lengths", [[1, 5, 2, 70, 1], [130, 2, 64, 65]])
def test_conv_varlen_matches_reference(dtype: torch.dtype, lengths: list[int]) -> None:
    """Decode rows, segments shorter than the window, ones of one to five time tiles (32
    rows), whose tiles each read back into the one before."""
    channels = 100
    cu, slots = segments(lengths, [3, 0, 5, 1, 4][:len(lengths)])
    x = rand(sum(lengths), channels + 7, seed=1, dtype=dtype)[:, 3:3 + channels]
    weight = rand(channels, K, seed=2, dtype=dtype)
    states = rand(6, channels, K - 1, seed=3, dtype=dtype)
    got_states, ref_states = states.clone(), states.clone()
    out = causal_conv1d_varlen(x, weight, got_states, cu, slots)
    ref = causal_conv1d_varlen_ref(x, weight, ref_states, cu, slots)
    close(out, ref)
    assert torch.equal(got_states, ref_states)


@pytest.mark.parametrize("split", [[24, 40, 36], [64, 36], [100]])
def test_conv_varlen_writes_each_part_contiguous(split: list[int]) -> None:
    """With `split` (the layer's q | k | v) each part is its own contiguous tensor holding the
    same bits as those columns of the whole output, and the states move as without it (parts
    from channel 24 take channel blocks of 8, from 64 the usual 64)."""
    lengths = [1, 5, 2, 70, 1]
    cu, slots = segments(lengths, [3, 0, 5, 1, 4])
    x = rand(sum(lengths), 107, seed=1, dtype=HALF)[:, 3:103]
    weight = rand(100, K, seed=2, dtype=HALF)
    states = rand(6, 100, K - 1, seed=3, dtype=HALF)
    whole_states, part_states, ref_states = states.clone(), states.clone(), states.clone()
    whole = causal_conv1d_varlen(x, weight, whole_states, cu, slots)
    parts = causal_conv1d_varlen(x, weight, part_states, cu, slots, split=split)
    refs = causal_conv1d_varlen_ref(x, weight, ref_states, cu, slots, split=split)
    assert len(parts) == len(refs) == len(split)
    for part, ref, cols in zip(parts, refs, whole.split(split, dim=-1), strict=True):
        assert part.is_contiguous() and ref.is_contiguous()
        assert torch.equal(part, cols)
        close(part, ref)
    assert torch.equal(part_states, whole_states)
    with pytest.raises(ValueError, match="split"):
        causal_conv1d_varlen(x, weight, states.clone(), cu, slots, split=[50, 49])


def test_empty_segments_keep_their_state() -> None:
    """A zero-length segment (a padded batch entry) leaves its slot as it was, in the conv
    and in the chunked rule (whose references cannot take empty segments)."""
    cu, slots = segments([2, 0], [0, 1])
    conv = rand(2, 8, K - 1, seed=3)
    got = conv.clone()
    causal_conv1d_varlen(rand(2, 8, seed=1), rand(8, K, seed=2), got, cu, slots)
    assert torch.equal(got[1], conv[1]) and not torch.equal(got[0], conv[0])

    states = rand(2, NV, DK, DV, seed=6)
    got = states.clone()
    gated_delta_rule_varlen(**chunked_inputs(2, torch.float32), states=got, cu_seqlens=cu,
                            slots=slots)
    assert torch.equal(got[1], states[1]) and not torch.equal(got[0], states[0])


def chunked_inputs(n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    qkv = rand(n, 2 * NK * DK + NV * DV, seed=1, dtype=dtype)
    q, k, v = qkv.split([NK * DK, NK * DK, NV * DV], dim=-1)  # strided, as in the layer
    a_log = (torch.rand(NV, generator=torch.Generator().manual_seed(7)) * 2 + 0.01).log()
    g, beta = gdn_gating(rand(n, NV, seed=2), rand(n, NV, seed=3), a_log.to(DEVICE),
                         rand(NV, seed=4))
    return {"q": q.reshape(n, NK, DK), "k": k.reshape(n, NK, DK), "v": v.reshape(n, NV, DV),
            "g": g, "beta": beta}


# dots are exact in the interpreter; on the GPU tf32 for half inputs (the states' bound too)
CHUNK_TOL = 1e-2 if DEVICE == "cuda" else 2e-5


@pytest.mark.parametrize(("lengths", "dtype"), [
    ([1, 64, 100, 3], HALF), ([1, 64, 100, 3], torch.float32),
    ([70, 200, 5], torch.float32),  # a prompt of four chunks after one of two
])
def test_chunked_varlen_matches_reference(lengths: list[int], dtype: torch.dtype) -> None:
    """A decode row, exactly one chunk, a chunk and a bit, a short prompt, several chunks
    behind another sequence's (each chunk's starting state is stored by the scan and read by
    the output kernel at the same block); scattered slots."""
    cu, slots = segments(lengths, [5, 0, 2, 7][:len(lengths)])
    x = chunked_inputs(sum(lengths), dtype)
    states = rand(SLOTS, NV, DK, DV, seed=6) * 0.3
    got, ref = states.clone(), states.clone()
    out = gated_delta_rule_varlen(**x, states=got, cu_seqlens=cu, slots=slots)
    expected = gated_delta_rule_varlen_ref(**x, states=ref, cu_seqlens=cu, slots=slots)
    if dtype == torch.float32:
        close(out, expected, tol=CHUNK_TOL)
    else:
        close(out, expected)
    close(got, ref, tol=CHUNK_TOL)


@pytest.mark.skipif(DEVICE != "cuda", reason="fla-core's kernels (a GPU extra) run on a GPU")
def test_the_fla_prompt_path_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """NINFER_GDN_PROMPT=fla: fla-core's chunked kernels, not ours, on the segments of
    `test_chunked_varlen_matches_reference`, give the reference's outputs and states to
    within its bf16 intermediates."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    monkeypatch.setenv("NINFER_GDN_PROMPT", "fla")
    monkeypatch.setattr(gdn, "_launch_chunked", None)  # taking ours would fail
    cu, slots = segments([1, 64, 100, 3], [5, 0, 2, 7])
    x = chunked_inputs(168, HALF)
    states = rand(SLOTS, NV, DK, DV, seed=6) * 0.3
    got, ref = states.clone(), states.clone()
    out = gated_delta_rule_varlen(**x, states=got, cu_seqlens=cu, slots=slots).float()
    expected = gated_delta_rule_varlen_ref(**x, states=ref, cu_seqlens=cu, slots=slots).float()
    assert (out - expected).abs().max() <= 2e-2 * expected.abs().max()
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert torch.equal(got[1], states[1])  # slots no segment names keep their states


def test_prompt_kernels_are_fla_where_installed_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NINFER_GDN_PROMPT picks whose chunked kernels run prompts; unset, fla-core's where it
    imports; asking for fla without it, or for neither, is an error that names the fix."""
    monkeypatch.delenv("NINFER_GDN_PROMPT")
    monkeypatch.setattr(gdn, "fla_installed", lambda: True)
    assert gdn.prompt_kernels() == "fla"
    monkeypatch.setenv("NINFER_GDN_PROMPT", "ninfer")
    assert gdn.prompt_kernels() == "ninfer"
    monkeypatch.setattr(gdn, "fla_installed", lambda: False)
    monkeypatch.delenv("NINFER_GDN_PROMPT")
    assert gdn.prompt_kernels() == "ninfer"
    monkeypatch.setenv("NINFER_GDN_PROMPT", "fla")
    with pytest.raises(RuntimeError, match=r"ninfer-runtime\[gpu\]"):
        gdn.prompt_kernels()
    monkeypatch.setenv("NINFER_GDN_PROMPT", "flash")
    with pytest.raises(ValueError, match="NINFER_GDN_PROMPT"):
        gdn.prompt_kernels()


def test_graphs_warm_up_the_kernels_they_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla-core's prompt kernels read segment bounds on the host, so a graph holds ours; the
    eager runs before a capture (`graph_kernels`) must launch ours too, or our scan's
    autotuner first times its configs inside the capture and invalidates it."""
    monkeypatch.delenv("NINFER_GDN_PROMPT", raising=False)
    monkeypatch.setattr(gdn, "fla_installed", lambda: True)
    on_gpu = SimpleNamespace(is_cuda=True)
    assert gdn._takes_fla(on_gpu)
    with graph_kernels():
        assert graphing() and not gdn._takes_fla(on_gpu)
        with graph_kernels():
            pass
        assert graphing()  # nested: the outer one still holds
    assert not graphing() and gdn._takes_fla(on_gpu)


def test_chunked_is_stable_on_correlated_keys() -> None:
    """Nearly identical keys with beta ~ 1 and no decay: the triangular system's power series
    would blow up; the inverse by recursive doubling (products of the inverse's own blocks)
    must still match the recurrence."""
    n = 130
    x = chunked_inputs(n, torch.float32)
    x["k"] = rand(1, NK, DK, seed=9) + 0.01 * x["k"]
    x["g"], x["beta"] = torch.full_like(x["g"], -1e-3), torch.full_like(x["beta"], 0.999)
    state = rand(1, NV, DK, DV, seed=6)
    got = state.clone()
    out = gated_delta_rule_varlen(**x, states=got, cu_seqlens=torch.tensor([0, n]).to(DEVICE),
                                  slots=torch.tensor([0]).to(DEVICE))
    expected, final = recurrent_gated_delta_rule(**x, state=state[0])
    close(out, expected, tol=CHUNK_TOL)
    close(got[0], final, tol=CHUNK_TOL)


@pytest.mark.parametrize(("group", "snapshots"), [(None, False), (64, False), (32, True)])
def test_decode_applies_the_output_norm(group: int | None, snapshots: bool) -> None:
    """`gdn_decode_norm`: the decode kernel's last program of each head group normalises the
    group's heads (gated norm) and writes out_proj's decode operand, the bits of
    gdn_decode, then gated_rms_norm, then out_proj's own activation pass (group 64: two heads
    of 32 a group; 32: one), for single tokens and a 3-token segment; with snapshots
    (speculative verification) every token's state goes to its own slot; the tickets are
    handed back. No operand where a group would split a program's heads (group 128 of 6
    heads of 32)."""
    cu, slots = segments([1, 3, 0, 1], [4, 7, 8, 2])
    snap = torch.tensor([0, 1, 3, 5, 6], device=DEVICE) if snapshots else None
    x = decode_inputs(5, HALF)
    z = rand(5, NV * DV + 8, seed=9, dtype=HALF)[:, 8:].view(5, NV, DV)  # a strided view
    weight = 1 + rand(DV, seed=10, dtype=HALF) * 0.1
    spec = None if group is None else (group, group == 32)
    (normed, operand), conv, states = run_decode(
        lambda **kw: gdn_decode_norm(**kw, norm=OutputNorm(z, weight, 1e-6, spec)), x, cu,
        slots, snap)
    o, ref_conv, ref_states = run_decode(gdn_decode, x, cu, slots, snap)
    expect = gated_rms_norm(o, z, weight, 1e-6)
    assert torch.equal(normed, expect)
    assert torch.equal(conv, ref_conv) and torch.equal(states, ref_states)
    assert not DECODE_TICKETS.on(x["mixed_qkv"].device).any()
    if spec is None:
        assert operand is None
        return
    flat = expect.reshape(5, NV * DV)
    want = quant_linear.activation_operands(flat, *spec)
    assert operand is not None and torch.equal(operand.xo, want.xo)
    assert torch.equal(operand.inv, want.inv)
    assert not spec[1] or torch.equal(operand.xsum, want.xsum)
    wide = run_decode(lambda **kw: gdn_decode_norm(**kw, norm=OutputNorm(z, weight, 1e-6,
                                                                         (128, False))),
                      x, cu, slots, snap)[0]
    assert wide[1] is None and torch.equal(wide[0], expect)


@pytest.mark.parametrize("dv", [16, 32, 128])
def test_prompt_tiles_fit_the_head_on_the_gpu(dv: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan's and output kernel's GPU tiles divide dv (their state tiles are unmasked, their
    grids dv / BV programs a head) for every candidate list, one config long or more: fitted
    per dv, not by the autotuner's pruning hook, which Triton skips for a single config (the
    output kernel's one config launched nothing at dv 32 on the GPU, docs/perf.md, sixteenth
    run)."""
    monkeypatch.setattr(gdn, "INTERPRET", False)
    for tiles in (gdn._SCAN_TILES, gdn._OUTPUT_TILES, ((128, 4, 2),)):
        fitted = gdn._fitted(tiles, dv)
        assert fitted and all(dv % bv == 0 for bv, _, _ in fitted)
    gdn.scan_kernel.cache_clear()
    try:
        assert all(dv % c.kwargs["BV"] == 0 for c in gdn.scan_kernel(dv).configs)
    finally:
        gdn.scan_kernel.cache_clear()
