"""Next-token sampling ops: penalties, top-k / top-p / min-p filters, and draws.

The row-wise ops take logits [B, V] and one parameter per row ([B] tensors), so one request's
result never depends on the other rows of the batch. Semantics follow vLLM: penalties apply to
the raw logits, then temperature, then min-p, top-k and top-p (top-p over what the other two
kept, renormalised). Every filter keeps a prefix of the tokens sorted by score, so a row's
filters reduce to one threshold: the score of the last token of the kept prefix; tokens tied
with it are kept too (as vLLM's top-k does), so the result depends on scores alone, never on
how a sort orders ties.

`sample_rows` draws every row of a batch at once on the device, by the Gumbel-max trick: the
token maximising score / temperature + Gumbel noise is a draw from the filtered softmax. The
noise of token v at a request's step comes from a counter-based generator (Philox4x32-10 keyed
by the request's seed, counter (v, step)), so a draw depends only on (seed, step, logits row):
not on the batch, the device, or whether the torch reference or the Triton kernel ran (the
two produce the same noise bit for bit).

The Triton path: `apply_penalties` is one elementwise kernel; `sample_rows` finds each row's
threshold from the top candidates (torch.topk, whose values are exact whatever it does with
ties) where a row filters, and then runs one kernel over [rows, vocab chunks] that applies
temperature, threshold and noise, keeps each chunk's best token, and in a row's last chunk to
finish (an atomic ticket) picks the row's token from its chunks'. Noise is computed only for
blocks that hold a kept token. Without filters (greedy, or plain temperature) that one kernel
is the whole draw: a decode step's sampling runs behind its forward on the device, so each
small launch it saves shortens the step.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from ninfer_runtime.ops.counters import CounterPool
from ninfer_runtime.ops.dispatch import use_triton
from ninfer_runtime.ops.host_copy import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the references still run
    triton = None

# Philox4x32-10 (Salmon et al., Random123): multipliers and Weyl key increments
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
_U32 = 0xFFFFFFFF


# ---- references ----


def apply_penalties_ref(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                        repetition: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor) -> torch.Tensor:
    """Penalised fp32 logits [B, V].

    seen [B, V] bool: tokens of the prompt (a token with a positive count is seen too, so
    callers may pass the prompt alone); counts [B, V]: how often each token was generated. A
    seen token's logit is divided by repetition[b] when positive and multiplied by it otherwise
    (> 1 discourages repeats); then every logit loses frequency[b] * count + presence[b] *
    (count > 0). Neutral values (1, 0, 0) change nothing.
    """
    logits = logits.float()
    counts = counts.float()
    seen = seen | (counts > 0)
    rep = repetition.float()[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.float()[:, None] * counts - presence.float()[:, None] * (counts > 0)


def _kept_prefix(sorted_scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """How many of the best tokens each row keeps, from its scores sorted descending [B, C]
    (C covering every row's top-k / top-p prefix). Probabilities are taken relative to the
    most likely token: the softmax normaliser cancels in every test below."""
    rel = (sorted_scores - sorted_scores[:, :1]).exp()
    ranks = torch.arange(sorted_scores.shape[-1], device=sorted_scores.device)
    keep = rel >= min_p[:, None]
    keep &= (ranks[None, :] < top_k[:, None]) | (top_k[:, None] <= 0)
    kept = rel * keep
    mass = top_p[:, None] * kept.sum(-1, keepdim=True)
    keep &= (kept.cumsum(-1) - kept < mass) | (top_p[:, None] >= 1.0)
    return keep.sum(-1)


def filter_logits(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """scores [B, V] (temperature applied) with the filtered-out tokens set to -inf.

    Per row: min_p keeps tokens at least min_p times as likely as the most likely one; top_k
    (0 = off) the k most likely; top_p the smallest prefix of the remaining distribution,
    renormalised, whose mass reaches top_p. Tokens tied with the last kept one are kept as
    well. The most likely token always survives.
    """
    ordered = scores.sort(dim=-1, descending=True).values
    kept = _kept_prefix(ordered, top_k, top_p, min_p)
    threshold = ordered.gather(-1, (kept - 1)[:, None])
    return scores.masked_fill(scores < threshold, float("-inf"))


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a int64 in [0, 2^32) and b < 2^32, in 16-bit halves
    so that no int64 product overflows."""
    low = (a & 0xFFFF) * b
    mid = (a >> 16) * b + (low >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low & 0xFFFF)


def philox4x32_ref(key: tuple[torch.Tensor, torch.Tensor],
                   counter: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcast together): the four
    output words for a two-word key and a four-word counter."""
    (k0, k1), (c0, c1, c2, c3) = key, counter
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _U32, (k1 + PHILOX_W1) & _U32
    return c0, c1, c2, c3


def philox_uniform_ref(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, vocab] in (0, 1): Philox4x32-10 with key = seed[b] (64 bits), counter =
    (token, step[b] low word, step[b] high word, 0); the first output word's top 23 bits + 1/2,
    scaled by 2^-23 (exact in fp32). The kernels compute the same numbers."""
    ids = torch.arange(vocab, dtype=torch.int64, device=seed.device)[None, :]
    seed, step = seed[:, None], step[:, None]
    word, *_ = philox4x32_ref((seed & _U32, (seed >> 32) & _U32),
                              (ids, step & _U32, (step >> 32) & _U32, torch.zeros_like(ids)))
    return ((word >> 9).float() + 0.5) * 2.0**-23


@dataclass(frozen=True, slots=True)
class RowSampling:
    """One sampling setting per row of a logits batch, on the logits' device.

    temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 switch those filters off; seed and
    step key the row's noise. `candidates` (host-known, so no sync is needed to size the top-k
    pass): how many best scores cover every sampled row's top-k / top-p prefix: 0 when no row
    filters by rank, the vocabulary when a row has top-p without top-k. `any_min_p`: some
    sampled row has min_p > 0.
    """

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64
    candidates: int
    any_min_p: bool

    @classmethod
    def build(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
              min_p: Sequence[float], seed: Sequence[int], step: Sequence[int], vocab: int,
              device: torch.device | str) -> RowSampling:
        """From host values in one host-to-device copy that does not wait for the device
        (the fp32 settings' bits packed into int64 words ahead of the int64 settings, each
        setting's row starting on 16 bytes: Triton compiles a variant per pointer alignment,
        which would otherwise differ between odd and even batch sizes); none when every row
        is greedy, whose settings are constants."""
        sampled = [i for i, t in enumerate(temperature) if t > 0]
        if not sampled:
            return _all_greedy(len(temperature), torch.device(device))
        ranked = [i for i in sampled if top_k[i] > 0 or top_p[i] < 1.0]
        if any(top_k[i] <= 0 for i in ranked):
            candidates = vocab
        else:
            candidates = min(vocab, max((top_k[i] for i in ranked), default=0))
        b = len(temperature)
        fw, iw = -(-b // 4) * 4, -(-b // 2) * 2  # a row's width in 16-byte units
        floats = struct.pack(f"<{3 * fw}f", *_rows((temperature, top_p, min_p), fw))
        words = array("q", floats).tolist()
        flat = to_device([*words, *_rows((top_k, seed, step), iw)], torch.int64, device)
        t, p, m = flat[:len(words)].view(torch.float32).view(3, fw)[:, :b]
        k, s, n = flat[len(words):].view(3, iw)[:, :b]
        return cls(t, k, p, m, s, n, candidates, any(min_p[i] > 0.0 for i in sampled))


def _rows(rows: Sequence[Sequence], width: int) -> list:
    """The rows back to back, each padded with zeros to `width`."""
    return [v for row in rows for v in (*row, *[0] * (width - len(row)))]


@cache
def _all_greedy(rows: int, device: torch.device) -> RowSampling:
    """Greedy settings for `rows` rows, made once (seed and step are unread for greedy rows)."""
    zeros = torch.zeros(rows, device=device)
    ints = torch.zeros(rows, dtype=torch.int64, device=device)
    return RowSampling(zeros, ints, torch.ones(rows, device=device), zeros, ints, ints, 0, False)


def sample_rows_ref(scores: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """One token id per row of scores [B, V] (penalties already applied) -> [B] int64:
    argmax for greedy rows, else argmax of filtered(scores / T) + Gumbel noise."""
    scores = scores.float()
    greedy = rows.temperature <= 0
    temperature = torch.where(greedy, 1.0, rows.temperature)[:, None]
    filtered = filter_logits(scores / temperature, rows.top_k, rows.top_p, rows.min_p)
    uniform = philox_uniform_ref(rows.seed, rows.step, scores.shape[-1])
    keys = filtered - (-uniform.log()).log()
    return torch.where(greedy[:, None], scores, keys).argmax(-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """Draw one token id per row of logits [..., V] -> [...] (int64), one setting for all rows.

    temperature 0 is greedy (argmax); top_k 0, top_p 1 and min_p 0 switch those filters off.
    """
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"invalid sampling parameters: temperature={temperature} "
                         f"(>= 0), top_k={top_k} (>= 0), top_p={top_p} (in (0, 1]), "
                         f"min_p={min_p} (in [0, 1])")
    if temperature == 0:
        return logits.argmax(-1)
    scores = (logits.float() / temperature).reshape(-1, logits.shape[-1])
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        rows = scores.shape[0]
        scores = filter_logits(scores, torch.full((rows,), top_k, device=scores.device),
                               torch.full((rows,), top_p, device=scores.device),
                               torch.full((rows,), min_p, device=scores.device))
    draws = torch.multinomial(scores.softmax(-1), 1, generator=generator)
    return draws.reshape(logits.shape[:-1])


# ---- public ops ----


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalised fp32 logits [B, V] (see `apply_penalties_ref`)."""
    if not use_triton(logits, seen, counts, repetition, frequency, presence):
        return apply_penalties_ref(logits, seen, counts, repetition, frequency, presence)
    return _launch_penalties(logits, seen, counts, repetition, frequency, presence)


def sample_rows(scores: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """One token id per row of scores [B, V] -> [B] int64 on the device (see
    `sample_rows_ref`; the kernel compares raw scores with the threshold, the reference
    scaled ones, which differ only where dividing by T rounds two scores together)."""
    if not use_triton(scores, rows.temperature):
        return sample_rows_ref(scores, rows)
    return _launch_sample(scores, rows)


# ---- launchers ----


def _thresholds(scores: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """fp32 [B]: each row keeps the tokens whose raw score is >= this (-inf: all).

    Rank filters come from the sorted top `rows.candidates` scores by `_kept_prefix`; min-p
    alone needs only the row maximum: score >= max + T * log(min_p).
    """
    greedy = rows.temperature <= 0
    temperature = torch.where(greedy, 1.0, rows.temperature)
    threshold = torch.full_like(temperature, float("-inf"))
    best = None
    if rows.candidates:
        top = scores.topk(rows.candidates, dim=-1, sorted=True).values.float()
        kept = _kept_prefix(top / temperature[:, None], rows.top_k, rows.top_p, rows.min_p)
        ranked = (rows.top_k > 0) | (rows.top_p < 1.0)
        threshold = torch.where(ranked, top.gather(-1, (kept - 1)[:, None])[:, 0], threshold)
        best = top[:, 0]
    if rows.any_min_p:
        best = scores.amax(-1).float() if best is None else best
        threshold = torch.maximum(threshold, best + temperature * rows.min_p.log())
    return torch.where(greedy, float("-inf"), threshold)


def _launch_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
                      repetition: torch.Tensor, frequency: torch.Tensor,
                      presence: torch.Tensor) -> torch.Tensor:
    assert logits.dim() == 2 and logits.shape == seen.shape == counts.shape, \
        f"apply_penalties: logits {tuple(logits.shape)}, seen {tuple(seen.shape)}, " \
        f"counts {tuple(counts.shape)} must be the same [B, V]"
    assert seen.dtype == torch.bool, f"apply_penalties: seen must be bool, got {seen.dtype}"
    for t in (logits, seen, counts):
        assert t.stride(1) == 1, "apply_penalties: need contiguous rows"
    b, v = logits.shape
    out = torch.empty((b, v), dtype=torch.float32, device=logits.device)
    if b == 0 or v == 0:
        return out
    params = [t.float().contiguous() for t in (repetition, frequency, presence)]
    block = min(2048, triton.next_power_of_2(v))
    _penalties_kernel[(b, triton.cdiv(v, block))](
        logits, logits.stride(0), seen.view(torch.uint8), seen.stride(0), counts,
        counts.stride(0), *params, out, v, BLOCK=block, num_warps=4)
    return out


def _launch_sample(scores: torch.Tensor, rows: RowSampling, block: int = 1024,
                   blocks_per_chunk: int = 4) -> torch.Tensor:
    """The kernel path of `sample_rows`; `block` and `blocks_per_chunk` shape the vocabulary
    split (tests shrink them to get several chunks out of a small vocabulary)."""
    assert scores.dim() == 2 and scores.stride(1) == 1, \
        f"sample_rows: need [B, V] with contiguous rows, got {tuple(scores.shape)}"
    b, v = scores.shape
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    filtered = bool(rows.candidates) or rows.any_min_p
    temperature = rows.temperature.float().contiguous()
    threshold = _thresholds(scores, rows) if filtered else temperature  # unread unfiltered
    block = min(block, triton.next_power_of_2(v))
    chunk = block * blocks_per_chunk
    num_chunks = triton.cdiv(v, chunk)
    best_key = torch.empty((b, num_chunks), dtype=torch.float32, device=scores.device)
    best_id = torch.empty((b, num_chunks), dtype=torch.int64, device=scores.device)
    tokens = torch.empty(b, dtype=torch.int64, device=scores.device)
    _sample_kernel[(b, num_chunks)](
        scores, scores.stride(0), v, temperature, threshold, rows.seed.contiguous(),
        rows.step.contiguous(), best_key, best_id, ROW_TICKETS.on(scores.device, b), tokens,
        FILTERED=filtered, CHUNK=chunk, BLOCK=block,
        CHUNKS=triton.next_power_of_2(num_chunks), num_warps=4)
    return tokens


# one counter per row: the sample kernel's last chunk program writes the row's token
ROW_TICKETS = CounterPool("sample_rows tickets", 1 << 12)


# ---- kernels ----

if triton is not None:

    @triton.jit
    def _penalties_kernel(logits, stride_l, seen, stride_s, counts, stride_c, repetition,
                          frequency, presence, out, vocab, BLOCK: tl.constexpr):
        """Row program_id(0), tokens program_id(1) * BLOCK ..: apply_penalties_ref."""
        r = tl.program_id(0).to(tl.int64)
        v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = v < vocab
        x = tl.load(logits + r * stride_l + v, mask=mask, other=0.0).to(tl.float32)
        count = tl.load(counts + r * stride_c + v, mask=mask, other=0).to(tl.float32)
        generated = count > 0
        is_seen = (tl.load(seen + r * stride_s + v, mask=mask, other=0) != 0) | generated
        rep = tl.load(repetition + r)
        x = tl.where(is_seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
        x = x - tl.load(frequency + r) * count - tl.load(presence + r) * generated.to(tl.float32)
        tl.store(out + r * vocab + v, x, mask=mask)

    @triton.jit
    def _philox_uniform(seed, step, token):
        """philox_uniform_ref for int64 scalars seed, step and int32 token ids."""
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = (seed >> 32).to(tl.uint32)
        c0 = token.to(tl.uint32)
        zero = tl.zeros_like(c0)
        c1 = zero + (step & 0xFFFFFFFF).to(tl.uint32)
        c2 = zero + (step >> 32).to(tl.uint32)
        c3 = zero
        for _ in tl.static_range(10):  # PHILOX_ROUNDS
            hi0 = tl.umulhi(c0, 0xD2511F53)
            lo0 = c0 * 0xD2511F53
            hi1 = tl.umulhi(c2, 0xCD9E8D57)
            lo1 = c2 * 0xCD9E8D57
            c0 = hi1 ^ c1 ^ k0
            c1 = lo1
            c2 = hi0 ^ c3 ^ k1
            c3 = lo0
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return ((c0 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23

    @triton.jit
    def _sample_kernel(scores, stride_s, vocab, temperature, threshold, seeds, steps,
                       best_key, best_id, tickets, tokens, FILTERED: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
        """Program (row, chunk): the chunk's best key (score / T + noise over the tokens at
        or above the row's threshold, every token unless FILTERED; the raw score for greedy
        rows) and its lowest token id; the row's last program to finish writes the row's
        token, the lowest id of the best key over its chunks (CHUNKS: a power of two at
        least their number)."""
        r = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        temp = tl.load(temperature + r)
        floor = float("-inf")
        if FILTERED:
            floor = tl.load(threshold + r)
        seed = tl.load(seeds + r)
        step = tl.load(steps + r)
        top = float("-inf")
        top_id = chunk * CHUNK
        for off in tl.static_range(0, CHUNK, BLOCK):
            v = chunk * CHUNK + off + tl.arange(0, BLOCK)
            valid = v < vocab
            s = tl.load(scores + r * stride_s + v, mask=valid, other=float("-inf"))
            s = s.to(tl.float32)
            keep = valid & (s >= floor)
            key = s
            if temp > 0:
                key = tl.math.div_rn(s, temp)
                if tl.max(keep.to(tl.int32), axis=0) > 0:
                    u = _philox_uniform(seed, step, v)
                    key = key - tl.log(-tl.log(u))
            key = tl.where(keep, key, float("-inf"))
            block_top = tl.max(key, axis=0)
            block_id = tl.min(tl.where(key == block_top, v, vocab), axis=0)
            better = block_top > top
            top_id = tl.where(better, block_id, top_id)
            top = tl.where(better, block_top, top)
        chunks = tl.num_programs(1)
        tl.store(best_key + r * chunks + chunk, top)
        tl.store(best_id + r * chunks + chunk, top_id.to(tl.int64))
        tl.debug_barrier()  # the chunk's best is stored before the row counts it
        if tl.atomic_add(tickets + r, 1, sem="acq_rel") == chunks - 1:
            tl.store(tickets + r, 0)
            c = tl.arange(0, CHUNKS)
            keys = tl.load(best_key + r * chunks + c, mask=c < chunks, other=float("-inf"),
                           cache_modifier=".cg")
            ids = tl.load(best_id + r * chunks + c, mask=c < chunks, other=vocab,
                          cache_modifier=".cg")
            best = tl.max(keys, axis=0)
            tl.store(tokens + r, tl.min(tl.where(keys == best, ids, vocab), axis=0))
