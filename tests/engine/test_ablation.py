"""ops.ablation (NINFER_ABLATE): the timing-only switch skips exactly the named ops, and only
on a decode step's few rows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from engine_helpers import drain, engine, greedy, prompt, request

from ninfer_runtime.models import layers
from ninfer_runtime.models.loading import LoadedModel
from ninfer_runtime.ops import ablation

# the layer-level op each ablation skips (act is the GEMV's activation pass: kernels only)
SPIED = {"norm": ("_add_norm",), "skinny": ("linear_with_operand",),
         "gdn": ("gdn_decode_norm",), "rope": ("qk_norm_rope_store",),
         "attn": ("paged_attention_with_operand",)}


def test_unknown_ops_are_refused() -> None:
    assert ablation._parse(" norm, gdn ,") == {"norm", "gdn"}
    assert ablation._parse("") == frozenset()
    with pytest.raises(ValueError, match="unknown ops \\['mlp'\\]"):
        ablation._parse("norm,mlp")


def calls_by_rows(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                  ablated: frozenset[str]) -> Counter[tuple[str, bool]]:
    """(op, whether on at most DECODE_ROWS rows) -> calls, over a 24-token prompt and four
    decode steps with `ablated` skipped."""
    calls: Counter[tuple[str, bool]] = Counter()

    def spy(name: str, fn: Callable) -> Callable:
        def counted(x, *args, **kwargs):
            calls[name, x.shape[0] <= ablation.DECODE_ROWS] += 1
            return fn(x, *args, **kwargs)
        return counted

    with monkeypatch.context() as patch:
        patch.setattr(ablation, "ABLATED", ablated)
        for names in SPIED.values():
            for name in names:
                patch.setattr(layers, name, spy(name, getattr(layers, name)))
        run = drain(engine(loaded, prefill_chunk=32, max_batched_tokens=32),
                    [request("r", prompt(24, 0), greedy(5))])
    assert len(run.tokens["r"]) == 5  # the garbage step still samples
    return calls


@pytest.mark.parametrize("op", sorted(SPIED))
def test_an_ablated_op_is_skipped_on_decode_rows_only(
        op: str, tiny_model: Callable[[str], LoadedModel],
        monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = tiny_model("dense")
    kept = calls_by_rows(loaded, monkeypatch, frozenset())
    skipped = calls_by_rows(loaded, monkeypatch, frozenset({op}))
    for name in SPIED[op]:
        assert kept[name, True] > 0 and skipped[name, True] == 0, name
        assert skipped[name, False] == kept[name, False], name  # prompt rows as ever
    others = {name for key, names in SPIED.items() if key != op for name in names}
    assert all(skipped[name, True] == kept[name, True] for name in others)


def test_an_ablated_activation_pass_hands_shared_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer_runtime.ops.quant_linear import activation_operands

    monkeypatch.setattr(ablation, "ABLATED", frozenset({"act"}))
    x = torch.randn(3, 512)
    first, again = activation_operands(x, 256, True), activation_operands(x + 1, 256, True)
    assert first.xo.shape == (8, 3, 64) and first.inv.shape == first.xsum.shape == (2, 3)
    assert first.sums and first.xo is again.xo and not first.xo.any() and not first.inv.any()
    assert not activation_operands(x, 256, False).sums
