"""The paged attention and KV store kernels against their torch references.

On a CPU-only machine the kernels run under Triton's interpreter (tests/conftest.py), which
mishandles tl.dot on bf16, so the CPU runs use fp32 and fp16 queries; on CUDA they use bf16.
Shapes are tiny (the interpreter is slow) but keep what matters: GQA groups that are not a
power of two, contexts of 1 token and of several pages, tiles smaller and larger than a page,
segments spanning several query blocks, decode rows beside prompt chunks, split contexts, and
the DFlash draft's non-causal and sliding-window masks.
"""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
import triton
from kernel_helpers import empty_caches

from ninfer_runtime.ops import attention, quant_linear
from ninfer_runtime.ops.attention import (
    _paged_attention_triton,
    _store_kv_triton,
    fresh_prompt_attention,
    launch_plan,
    paged_attention,
    paged_attention_ref,
    paged_attention_with_operand,
    store_kv,
    store_kv_ref,
    visible_keys,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(autouse=True)
def first_config_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No autotuning on the GPU either: each new key would compile and time every candidate,
    and these tests are about results (under the interpreter there is one config anyway)."""
    kernel = attention._paged_attention_kernel
    monkeypatch.setattr(kernel, "configs", kernel.configs[:1])


def prefetching(monkeypatch: pytest.MonkeyPatch, tiles: int) -> None:
    """Run the kernel's one config with K/V tiles loaded `tiles` ahead (PREFETCH)."""
    kernel = attention._paged_attention_kernel
    base = kernel.configs[0]
    monkeypatch.setattr(kernel, "configs", [triton.Config(
        {**base.kwargs, "PREFETCH": tiles}, num_warps=base.num_warps,
        num_stages=base.num_stages)])


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x.to(device=DEVICE, dtype=dtype)


def paged_step(query_lens: list[int], contexts: list[int], *, nq: int, nkv: int, d: int,
               page: int, int8: bool, dtype: torch.dtype) -> dict:
    """A step's attention inputs: each sequence's whole context stored (by the reference) on
    pages handed out shuffled, its last query_lens[b] positions queried."""
    counts = [-(-c // page) for c in contexts]
    perm = torch.randperm(sum(counts) + 2, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [perm[sum(counts[:b]):sum(counts[:b + 1])] for b in range(len(counts))]
    caches = empty_caches(sum(counts) + 2, page, nkv, d, int8, dtype)
    for b, ctx in enumerate(contexts):
        slots = torch.tensor([tables[b][p // page] * page + p % page for p in range(ctx)],
                             device=DEVICE)
        store_kv_ref(rand(ctx, nkv, d, seed=10 + b, dtype=dtype) * 2,
                     rand(ctx, nkv, d, seed=20 + b, dtype=dtype), *caches, slots)
    width = max(counts)
    n = sum(query_lens)
    return {
        "q": rand(n, nq, d, seed=3, dtype=dtype), "k_cache": caches[0], "v_cache": caches[1],
        "k_scale": caches[2], "v_scale": caches[3],
        "page_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE),
        "cu_seqlens": torch.tensor([0, *accumulate(query_lens)], device=DEVICE),
        "context_lens": torch.tensor(contexts, device=DEVICE), "scale": d**-0.5,
    }


def assert_matches_reference(step: dict, *, causal: bool = True, window: int | None = None,
                             **launch: object) -> None:
    expected = paged_attention_ref(**step, causal=causal, window=window)
    out, operand = _paged_attention_triton(**step, causal=causal, window=window, **launch)
    assert operand is None  # none asked for
    assert out.shape == expected.shape and out.dtype == expected.dtype
    atol, rtol = TOL[step["q"].dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("int8,page", [(True, 16), (False, 16), (True, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_batch(int8: bool, page: int, dtype: torch.dtype, splits: int | None,
                      prefetch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One query token per sequence (6 q heads per kv head), contexts from 1 token to several
    pages; split over 4 programs per sequence with 16-token splits, or as planned; each K/V
    tile loaded when used, or one or two tiles ahead while this one computes (PREFETCH: the
    last iterations' look-ahead reads nothing)."""
    if prefetch:
        prefetching(monkeypatch, prefetch)
    step = paged_step([1, 1, 1, 1], [1, 17, 64, 100], nq=12, nkv=2, d=32, page=page,
                      int8=int8, dtype=dtype)
    assert_matches_reference(step, num_splits=splits, min_split_tokens=16)


@pytest.mark.parametrize("at_once", [2, 16])
def test_the_merge_takes_many_splits_in_rounds(at_once: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """16 splits of at least 16 keys: contexts of 1 to 250 tokens work 1 to 16 of them (the
    rest store lse -inf and a zero output; the buffers start as NaN here, so every partial
    the merge reads must have been stored); the merge takes them 2 a round (its running max
    rescales the rounds before) or all in one, and gives the reference either way."""
    monkeypatch.setattr(attention, "MERGE_SPLITS_AT_ONCE", at_once)
    empty = torch.empty

    def nan_filled(*shape, dtype=None, **kwargs):  # the partials' buffers
        out = empty(*shape, dtype=dtype, **kwargs)
        return out.fill_(float("nan")) if dtype == torch.float32 else out

    monkeypatch.setattr(attention.torch, "empty", nan_filled)
    step = paged_step([1, 1, 1, 1], [1, 17, 100, 250], nq=12, nkv=2, d=32, page=16, int8=True,
                      dtype=DTYPES[0])
    gate = rand(4, 12, 32, seed=7, dtype=DTYPES[0])
    assert_matches_reference({**step, "gate": gate}, num_splits=16, min_split_tokens=16)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 2])
def test_mixed_batch_of_prompt_chunks_and_decode_rows(
        int8: bool, dtype: torch.dtype, splits: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk continuing 30 cached tokens, a decode row, a whole 21-token prompt and a 1-token
    prompt; 32-row blocks hold 10 tokens of 3 q heads, so the long segments span several."""
    monkeypatch.setattr(attention, "PREFILL_BLOCK_M", 32)
    step = paged_step([12, 1, 21, 1], [42, 9, 21, 1], nq=6, nkv=2, d=64, page=16, int8=int8,
                      dtype=dtype)
    assert_matches_reference(step, num_splits=splits, min_split_tokens=16)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("splits", [None, 2, 4])
def test_prompt_blocks_walk_whole_tiles_unmasked(int8: bool, splits: int | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles every row of a block sees go through the kernel's unmasked loop: a chunk after 80
    cached tokens (two whole 32-key tiles before its diagonal), a 70-token prompt whose later
    10-token blocks start past one or two tiles, and a decode row; split contexts start their
    unmasked walk at their own first key."""
    monkeypatch.setattr(attention, "PREFILL_BLOCK_M", 32)
    step = paged_step([12, 70, 1], [92, 70, 75], nq=6, nkv=2, d=64, page=16, int8=int8,
                      dtype=DTYPES[0])
    assert_matches_reference(step, num_splits=splits, min_split_tokens=16)


@pytest.mark.parametrize("splits", [1, 4])
def test_output_gate_is_fused(splits: int) -> None:
    step = paged_step([3, 1], [20, 33], nq=4, nkv=2, d=32, page=16, int8=True,
                      dtype=DTYPES[0])
    gate = rand(4, 4, 64, seed=7, dtype=DTYPES[0])[..., :32]  # a strided view, as the model's
    assert_matches_reference({**step, "gate": gate}, num_splits=splits, min_split_tokens=16)


def test_several_scale_groups_per_head() -> None:
    """head_dim 128: two int8 groups per head, each with its own scale."""
    step = paged_step([2, 1], [40, 70], nq=4, nkv=1, d=128, page=64, int8=True,
                      dtype=DTYPES[0])
    assert_matches_reference(step, num_splits=2, min_split_tokens=16)


def test_visible_keys() -> None:
    """Queries at positions 3..5 of 6 keys: causal, non-causal, and windows of 2 either way."""
    rows = lambda m: ["".join("x" if v else "." for v in row) for row in m.tolist()]  # noqa: E731
    assert rows(visible_keys(3, 6)) == ["xxxx..", "xxxxx.", "xxxxxx"]
    assert rows(visible_keys(3, 6, causal=False)) == ["xxxxxx"] * 3
    assert rows(visible_keys(3, 6, window=2)) == ["..xx..", "...xx.", "....xx"]
    assert rows(visible_keys(3, 6, causal=False, window=2)) == ["..xxx.", "...xxx", "....xx"]


@pytest.mark.parametrize("causal,window", [(False, None), (True, 5), (False, 7), (True, 40)])
@pytest.mark.parametrize("splits", [None, 4])
def test_non_causal_and_windowed(causal: bool, window: int | None, splits: int | None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The DFlash draft's masks: 16-token blocks (non-causal: every row sees the whole block)
    after 0, 24 and 54 context tokens beside a decode row; windows shorter than a block and
    longer than a page, so a block's rows start their windows at different keys. 32-row tiles
    of 4 q heads put two query blocks in each block segment."""
    monkeypatch.setattr(attention, "PREFILL_BLOCK_M", 32)
    step = paged_step([16, 1, 16, 16], [16, 33, 40, 70], nq=8, nkv=2, d=32, page=16,
                      int8=False, dtype=DTYPES[0])
    assert_matches_reference(step, causal=causal, window=window, num_splits=splits,
                             min_split_tokens=16)


def test_plan_gives_every_sequence_its_query_blocks() -> None:
    """Sequence b's blocks start at (cu[b] - b) // block_q + b: each has room for all of its
    ceil(len / block_q) blocks, the last ends inside the grid, and decode needs B programs."""
    for lens in ([1] * 5, [7, 1, 40, 3, 1], [1, 64], [100]):
        plan = launch_plan(sum(lens), len(lens), 6, 4, 1)
        cu = [0, *accumulate(lens)]
        starts = [(cu[b] - b) // plan.block_q + b for b in range(len(lens))] + [plan.num_blocks]
        assert plan.block_m >= attention.DECODE_BLOCK_M and plan.block_q * 6 <= plan.block_m
        assert all(starts[b + 1] - starts[b] >= -(-n // plan.block_q)
                   for b, n in enumerate(lens))
    decode = launch_plan(8, 8, 6, 4, 1)
    assert decode.num_blocks == 8 and decode.block_m == 8 and decode.block_q == 1
    assert launch_plan(8, 8, 12, 4, 1).block_m == 16  # 12 q heads a kv head: 16 rows
    assert launch_plan(8, 8, 6, 4, 1, num_splits=16).num_splits == 16


@pytest.mark.parametrize("int8,d", [(True, 32), (True, 128), (False, 64)])
def test_store_kv_kernel_is_the_reference_bit_for_bit(int8: bool, d: int) -> None:
    """Quantize + scatter of K and V (3 kv heads: not a power of two), including rounding
    ties, an all-zero group and one huge group; a negative slot (graph padding) is skipped."""
    n, nkv, page, pages = 12, 3, 16, 4
    dtype = DTYPES[-1]
    k, v = rand(n, nkv, d, seed=1, dtype=dtype) * 3, rand(n, nkv, d, seed=2, dtype=dtype)
    k[0, 0] = torch.arange(d) % 8 - 3.5  # with 127 below: scale 1, every other value a tie
    k[0, 0, 0] = 127
    k[1, 1] = 0
    v[2, 2, :16] *= 1e4
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(0))[:n]
    slots = slots.to(DEVICE)
    expected = empty_caches(pages, page, nkv, d, int8, dtype)
    store_kv_ref(k[1:], v[1:], *expected, slots[1:])
    got = empty_caches(pages, page, nkv, d, int8, dtype)
    _store_kv_triton(k, v, *got, torch.cat([slots.new_tensor([-1]), slots[1:]]))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True) if a is not None)
    _store_kv_triton(k[:1], v[:1], *got, slots[:1])
    store_kv_ref(k[:1], v[:1], *expected, slots[:1])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True) if a is not None)
    if int8:  # the ties went to even, as torch.round does
        assert got[0].view(-1, nkv, d)[slots[0], 0, 1:8].tolist() == [-2, -2, 0, 0, 2, 2, 4]


def test_public_ops_dispatch_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """NINFER_OPS=triton routes the model's calls to the kernels (on CUDA "auto" does)."""
    monkeypatch.setenv("NINFER_OPS", "triton")
    calls: list[str] = []
    for name in ("_store_kv_triton", "_paged_attention_triton"):
        kernel = getattr(attention, name)
        monkeypatch.setattr(attention, name,
                            lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    step = paged_step([2, 1], [5, 18], nq=4, nkv=2, d=32, page=16, int8=True, dtype=DTYPES[0])
    k, v = rand(3, 2, 32, seed=5, dtype=DTYPES[0]), rand(3, 2, 32, seed=6, dtype=DTYPES[0])
    slots = torch.tensor([3, 4, step["page_tables"][1, 1].item() * 16 + 1], device=DEVICE)
    expected = [t.clone() for t in (step["k_cache"], step["v_cache"], step["k_scale"],
                                    step["v_scale"])]
    store_kv_ref(k, v, *expected, slots)
    store_kv(k, v, step["k_cache"], step["v_cache"], step["k_scale"], step["v_scale"], slots)
    assert torch.equal(step["k_cache"], expected[0]) and torch.equal(step["v_scale"],
                                                                     expected[3])
    out = paged_attention(**step)
    atol, rtol = TOL[DTYPES[0]]
    torch.testing.assert_close(out, paged_attention_ref(**step), atol=atol, rtol=rtol)
    out = paged_attention(**step, causal=False, window=4)
    torch.testing.assert_close(out, paged_attention_ref(**step, causal=False, window=4),
                               atol=atol, rtol=rtol)
    assert calls == ["_store_kv_triton", "_paged_attention_triton", "_paged_attention_triton"]


@pytest.mark.parametrize(("group", "sums"), [(32, False), (16, True)])
def test_the_split_merge_writes_o_projs_operand(group: int, sums: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a split context the merge also writes the decode operand of the gated output
    read as [N, nq * d] (o_proj's input), the bits o_proj's own activation pass makes of it
    (a head of 32 is one group of 32 or two of 16); unsplit, or where a head would hold part
    of a group, none (and the same output)."""
    monkeypatch.setenv("NINFER_OPS", "triton")
    dtype = DTYPES[-1]
    step = paged_step([1, 1, 1], [40, 17, 64], nq=4, nkv=2, d=32, page=16, int8=True,
                      dtype=dtype)
    gate = rand(3, 4, 32, seed=7, dtype=dtype)
    out, operand = _paged_attention_triton(**step, gate=gate, num_splits=4, min_split_tokens=16,
                                           operand_spec=(group, sums))
    assert torch.equal(out, _paged_attention_triton(**step, gate=gate, num_splits=4,
                                                    min_split_tokens=16)[0])
    expect = quant_linear.activation_operands(out.reshape(3, 128), group, sums)
    assert operand is not None and operand.group == group
    assert torch.equal(operand.xo, expect.xo) and torch.equal(operand.inv, expect.inv)
    assert not sums or torch.equal(operand.xsum, expect.xsum)
    assert _paged_attention_triton(**step, gate=gate, num_splits=1,
                                   operand_spec=(group, sums))[1] is None
    out, operand = paged_attention_with_operand(**step, gate=gate, spec=(64, sums))
    assert operand is None
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, paged_attention_ref(**step, gate=gate), atol=atol, rtol=rtol)


@pytest.mark.parametrize("ops", ["ref", "triton"])
@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16] if DEVICE == "cpu" else DTYPES)
def test_a_fresh_prompt_attends_its_gathered_pages_as_the_reference(
        ops: str, int8: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone prompt from position 0 (70 tokens on shuffled 16-token pages, 3 q heads a kv
    head, gated): its pages gathered, dequantized and attended by torch's fused kernel give
    the reference's output (fp16 K/V for half queries: within half rounding), through torch's
    passes and through the gather and gated-output kernels. The kernel gets [1, heads, T, d]
    inputs: the fused kernels take no other rank."""
    monkeypatch.setenv("NINFER_OPS", ops)
    ranks: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: ranks.append(q.dim() + k.dim() + v.dim())
                        or sdpa(q, k, v, **kw))
    step = paged_step([70], [70], nq=6, nkv=2, d=64, page=16, int8=int8, dtype=dtype)
    gate = rand(70, 6, 64, seed=7, dtype=dtype)
    out = fresh_prompt_attention(step["q"], step["k_cache"], step["v_cache"], step["k_scale"],
                                 step["v_scale"], step["page_tables"][0], step["scale"], gate)
    assert ranks == [12]
    expected = paged_attention_ref(**step, gate=gate)
    assert out.shape == expected.shape and out.dtype == dtype and out.is_contiguous()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("int8", [True, False])
def test_the_gather_kernel_writes_the_references_kv(int8: bool, head_major: bool) -> None:
    """`_gather_kv_kernel`: the first 45 tokens of shuffled 16-token pages (a partial last
    page, a partial last program) as [nkv, T, d] or [T, nkv, d], contiguous, bit for bit the
    reference's dequantized values (fp16, as half models attend them)."""
    step = paged_step([45], [45], nq=4, nkv=2, d=64, page=16, int8=int8, dtype=DTYPES[0])
    pages = step["page_tables"][0]
    for cache, scales in ((step["k_cache"], step["k_scale"]), (step["v_cache"], step["v_scale"])):
        out = attention._gather_kv_triton(cache, scales, pages, 45, torch.float16,
                                          head_major=head_major)
        expected = attention.gather_kv(cache, scales, pages, 45, torch.float16)
        assert out.is_contiguous()
        assert torch.equal(out, expected.transpose(0, 1) if head_major else expected)


@pytest.mark.parametrize("gated", [True, False])
def test_the_output_kernel_lays_out_and_gates_attentions_output(gated: bool) -> None:
    """`_gated_output_kernel`: an fp16 output [nq, T, d] with the token-major strides
    attention leaves becomes [T, nq, d] in the model's dtype, times sigmoid(gate) when
    gated, as the reference's copy and multiply make it (within one rounding)."""
    o = rand(37, 3, 64, seed=5, dtype=torch.float16).transpose(0, 1)
    gate = rand(37, 3, 64, seed=6, dtype=DTYPES[0]) if gated else None
    out = attention._gated_output_triton(o, gate, DTYPES[0])
    expected = o.transpose(0, 1).to(DTYPES[0])
    if gated:
        expected = expected * torch.sigmoid(gate)
    assert out.shape == (37, 3, 64) and out.dtype == DTYPES[0] and out.is_contiguous()
    atol, rtol = TOL[DTYPES[0]]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16] if DEVICE == "cpu" else DTYPES)
def test_a_chunk_after_context_attends_its_gathered_context_as_the_reference(
        int8: bool, dtype: torch.dtype) -> None:
    """The last 30 of a prompt's 70 tokens (shuffled 16-token pages, 3 q heads a kv head,
    gated): its whole context gathered into contiguous fp16 pages and attended by the paged
    kernel unquantized gives the reference's output (within half rounding)."""
    step = paged_step([30], [70], nq=6, nkv=2, d=64, page=16, int8=int8, dtype=dtype)
    gate = rand(30, 6, 64, seed=7, dtype=dtype)
    out = attention.gathered_context_attention(
        step["q"], step["k_cache"], step["v_cache"], step["k_scale"], step["v_scale"],
        step["page_tables"][0], 70, step["cu_seqlens"], step["context_lens"], step["scale"],
        gate)
    expected = paged_attention_ref(**step, gate=gate)
    assert out.shape == expected.shape and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("context", "switch", "path"), [
    (40, "1", "fresh"), (72, "1", "gathered"), (0, "1", None), (40, "0", None),
    (72, "0", None)])
def test_long_lone_prompts_take_a_gathered_path(context: int, switch: str, path: str | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels on, a step the batch marks as a lone prompt chunk (its context > 0)
    takes a gathered path from FRESH_PROMPT_MIN_TOKENS tokens (lowered here): from position
    0 the fused one, after cached context the gathered context's; unless
    NINFER_FRESH_PROMPT=0, and no other step does: the same output either way, and no o_proj
    operand (a prompt step's o_proj makes its own)."""
    monkeypatch.setenv("NINFER_OPS", "triton")
    monkeypatch.setenv("NINFER_FRESH_PROMPT", switch)
    monkeypatch.setattr(attention, "FRESH_PROMPT_MIN_TOKENS", 40)
    taken: list[tuple[str, int]] = []

    def spy(name: str):
        path = getattr(attention, name)
        return lambda q, *a: taken.append((name.split("_")[0], q.shape[0])) or path(q, *a)

    for name in ("fresh_prompt_attention", "gathered_context_attention"):
        monkeypatch.setattr(attention, name, spy(name))
    for n in (39, 40):
        ctx = context and context - 40 + n  # a fresh prompt's context is its own length
        step = paged_step([n], [ctx or n], nq=4, nkv=2, d=32, page=16, int8=True,
                          dtype=DTYPES[0])
        gate = rand(n, 4, 32, seed=8, dtype=DTYPES[0])
        out, operand = paged_attention_with_operand(**step, gate=gate, spec=None,
                                                    lone_context=ctx)
        atol, rtol = TOL[DTYPES[0]]
        torch.testing.assert_close(out, paged_attention_ref(**step, gate=gate), atol=atol,
                                   rtol=rtol)
        assert operand is None
    assert taken == ([(path, 40)] if path else [])


def test_the_plan_holds_the_gathered_context_only_where_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`lone_prompt_gather_bytes`: fp16 K and V of the whole context in whole pages where the
    gathered path can run (the kernels' mode), else 0."""
    args = (1000, 16, 4, 256, torch.device(DEVICE))
    monkeypatch.setenv("NINFER_OPS", "triton")
    assert attention.lone_prompt_gather_bytes(*args) == 2 * 1008 * 4 * 256 * 2
    monkeypatch.setenv("NINFER_FRESH_PROMPT", "0")
    assert attention.lone_prompt_gather_bytes(*args) == 0
    monkeypatch.setenv("NINFER_FRESH_PROMPT", "1")
    monkeypatch.setenv("NINFER_OPS", "auto")
    assert attention.lone_prompt_gather_bytes(*args) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's fused attention kernels run on a GPU")
def test_the_real_heads_take_a_fused_kernel_on_the_gpu() -> None:
    """The 27B's and the 35B-A3B's attention heads (24 / 4 and 16 / 2 of 256) in fp16: a
    fused kernel takes them, so their long fresh prompts take `fresh_prompt_attention`."""
    for nq, nkv in ((24, 4), (16, 2)):
        assert attention._fused_kernel_runs(torch.device(DEVICE), torch.float16, nq, nkv, 256)
