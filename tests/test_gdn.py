"""Gated DeltaNet core: the chunked (prompt) and recurrent (decode) forms are one function."""

from __future__ import annotations

import inspect

import pytest
import torch

from ninfer_runtime.ops.gdn import (
    chunk_gated_delta_rule,
    gdn_gating,
    l2norm,
    recurrent_gated_delta_rule,
)

T, NK, NV, DK, DV = 200, 2, 4, 32, 16  # grouped value heads, dk != dv


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    a_log = (torch.rand(NV, generator=gen) * 2 + 0.01).log()
    g, beta = gdn_gating(randn(T, NV), randn(T, NV), a_log, randn(NV))
    return {"q": randn(T, NK, DK), "k": randn(T, NK, DK), "v": randn(T, NV, DV), "g": g,
            "beta": beta, "state": randn(NV, DK, DV)}


@pytest.fixture(scope="module")
def recurrent(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return recurrent_gated_delta_rule(**inputs)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_recurrent_form_is_the_delta_rule(inputs: dict[str, torch.Tensor]) -> None:
    """One step by hand, straight from the update equations (including GQA and scaling)."""
    x = {n: t[:1] if n != "state" else t for n, t in inputs.items()}
    out, state = recurrent_gated_delta_rule(**x)
    s = x["state"].clone()
    for h in range(NV):
        q = l2norm(x["q"][0, h // (NV // NK)]) * DK**-0.5
        k = l2norm(x["k"][0, h // (NV // NK)])
        s[h] *= x["g"][0, h].exp()
        s[h] += torch.outer(k, x["beta"][0, h] * (x["v"][0, h] - s[h].T @ k))
        close(out[0, h], s[h].T @ q)
    close(state, s)


@pytest.mark.parametrize("chunk_size", [1, 63, 64, 65, T])
def test_chunked_matches_recurrent(inputs: dict[str, torch.Tensor], recurrent: tuple,
                                   chunk_size: int) -> None:
    out, state = chunk_gated_delta_rule(**inputs, chunk_size=chunk_size)
    assert out.shape == (T, NV, DV) and state.shape == (NV, DK, DV)
    assert state.dtype == torch.float32
    close(out, recurrent[0])
    close(state, recurrent[1])


def test_chunked_prompt_split_continues_from_state(inputs: dict[str, torch.Tensor],
                                                   recurrent: tuple) -> None:
    """A prompt processed in pieces, each starting from the previous final state."""
    state, outs = inputs["state"], []
    for lo, hi in [(0, 70), (70, 71), (71, T)]:
        piece = {n: t[lo:hi] for n, t in inputs.items() if n != "state"}
        out, state = chunk_gated_delta_rule(**piece, state=state)
        outs.append(out)
    close(torch.cat(outs), recurrent[0])
    close(state, recurrent[1])


def test_zero_initial_state_is_the_default(inputs: dict[str, torch.Tensor]) -> None:
    x = {n: t[:50] for n, t in inputs.items() if n != "state"}
    a = chunk_gated_delta_rule(**x)
    b = chunk_gated_delta_rule(**x, state=torch.zeros(NV, DK, DV))
    close(a[0], b[0])
    close(a[1], b[1])


def test_matches_transformers_reference(inputs: dict[str, torch.Tensor],
                                        recurrent: tuple) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    # the torch function itself: where fla is installed, transformers wraps it to dispatch to
    # fla's Triton kernel, which refuses CPU tensors (the GPU image has fla beside transformers)
    torch_chunk_gated_delta_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    # q/k expanded to the value heads here: older transformers (5.17) does not expand them
    q, k = (inputs[n].repeat_interleave(NV // NK, dim=1)[None] for n in ("q", "k"))
    out, state = torch_chunk_gated_delta_rule(
        q, k, *(inputs[n][None] for n in ("v", "g", "beta")),
        initial_state=inputs["state"][None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    close(recurrent[0], out[0])
    close(recurrent[1], state[0])


def test_gating() -> None:
    a, b = torch.tensor([[0.5, -1.0]]), torch.tensor([[0.0, 2.0]])
    a_log, dt_bias = torch.tensor([0.0, 1.0]), torch.tensor([1.0, -0.5])
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    expected_g = -torch.tensor([1.0, torch.e]) * torch.log1p(torch.exp(a[0] + dt_bias))
    close(g[0], expected_g)
    close(beta[0], torch.tensor([0.5, 1 / (1 + torch.exp(torch.tensor(-2.0)).item())]))
    assert (g <= 0).all()
