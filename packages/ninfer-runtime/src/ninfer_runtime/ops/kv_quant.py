"""INT8 KV quantization: symmetric, one fp16 scale per group of 64 elements along head_dim.

For each (token, head, group) of K or V: scale = absmax / 127 (rounded to fp16), q =
round(x / scale) clamped to [-127, 127] (symmetric, -128 unused), x ~ q * scale. The values
are quantized with the fp16-rounded scale, so the error of every element is at most scale / 2
(fp16 rounding moves x / scale by at most 127 * 2^-11 < 0.5 past 127, so the clamp stays inside
that bound). Dynamic at write time: no calibration. A group is min(64, head_dim) elements, so a
small test model with head_dim 32 has one group per head.

The Triton tile helpers below are the same math for the fused store and attention kernels
(ops.attention); they are defined only where Triton imports. On the GPU the attention kernels
dequantize with `INT8_WORD_PTX` instead: four codes per 32-bit instruction, in fp16. Int8 code
q becomes an fp16 integer exactly: byte q ^ 0x80 = q + 128 as the low byte under 0x64 is the
fp16 1024 + (q + 128) (prmt, two codes per register), less 1152 (one f16x2 subtraction), then
times the group's fp16 scale, rounded once (one f16x2 multiply): q * s in fp16, 11
significant bits where the bf16 reference keeps 8. fp16 covers |q * s| up to 65504; K and V
rows come out of RMSNorm and a projection, orders of magnitude below that.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references need no Triton
    triton = None

KV_GROUP = 64
SCALE_DTYPE = torch.float16
INT8_MAX = 127

# PTX: an instance takes four copies of the 32-bit word that holds four int8 codes ($2 .. $5,
# one read; byte i = code i) and their fp16 scales ($6: codes 0, 1; $7: codes 2, 3) -> $0 =
# fp16x2 of q * s for codes 0, 1 (code 0 in the low half), $1 for 2, 3. The codes stay in
# their word from the load to the PTX: loaded as int8 values, Triton unpacked every word into
# bytes and packed them back for the PTX (4 + 2 PRMTs a word; `dequantize_int8_words`).
INT8_WORD_PTX = "\n".join([
    "{", ".reg .b32 u, lo, hi, bias;",
    "xor.b32 u, $2, 0x80808080;",
    "prmt.b32 lo, u, 0x64646464, 0x4140;",
    "prmt.b32 hi, u, 0x64646464, 0x4342;",
    "mov.b32 bias, 0x64806480;",
    "sub.rn.f16x2 lo, lo, bias;",
    "sub.rn.f16x2 hi, hi, bias;",
    "mul.rn.f16x2 $0, lo, $6;",
    "mul.rn.f16x2 $1, hi, $7;",
    "}"])


def kv_group_size(head_dim: int) -> int:
    """Elements per scale for heads of `head_dim`."""
    group = min(KV_GROUP, head_dim)
    if head_dim % group:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the KV group {KV_GROUP}")
    return group


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp16 scales [..., D // group])."""
    grouped = x.float().unflatten(-1, (-1, group))  # [..., G, group]
    scale = (grouped.abs().amax(-1) / INT8_MAX).to(SCALE_DTYPE)
    # an all-zero group gets scale 0; dividing by 1 there keeps q = 0 instead of NaN
    divisor = torch.where(scale > 0, scale.float(), 1.0)[..., None]
    q = (grouped / divisor).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.flatten(-2), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D] and scales [..., G] -> [..., D] in `dtype` (computed in fp32)."""
    grouped = q.float().unflatten(-1, (scale.shape[-1], -1))
    return (grouped * scale.float()[..., None]).flatten(-2).to(dtype)


if triton is not None:
    _QMAX = tl.constexpr(float(INT8_MAX))

    @triton.jit
    def _round_half_even(x):
        """torch.round for fp32 (ties to even). Triton has no rint the interpreter can run, and
        floor(x + 0.5) is wrong just below .5, so split off the fraction (exact for |x| < 2^23)."""
        r = tl.floor(x)
        frac = x - r
        odd = (r.to(tl.int32) & 1) == 1
        return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def quantize_int8_tile(x):
        """quantize_int8 on a tile: x fp32 [R, G_count, group] -> (int8 of that shape, fp16
        scales [R, G_count]), bit-identical to the torch reference (IEEE divisions, ties to even,
        fp16-rounded scale used as the divisor)."""
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=2), _QMAX).to(tl.float16)
        divisor = tl.where(scale > 0, scale.to(tl.float32), 1.0)
        q = _round_half_even(tl.math.div_rn(x, divisor[:, :, None]))
        q = tl.minimum(tl.maximum(q, -_QMAX), _QMAX)
        return q.to(tl.int8), scale

    _INT8_WORD = tl.constexpr(INT8_WORD_PTX)

    @triton.jit
    def dequantize_int8_words(words, scale, ASM: tl.constexpr):
        """int8 codes as the int32 words that hold four of them, [R, G_count, group // 4]
        (code i of a word in byte i), and their scales [R, G_count] -> [R, G_count,
        group // 4, 4]: fp32 as dequantize_int8, or with ASM (GPU only) fp16 through
        INT8_WORD_PTX."""
        shape: tl.constexpr = (words.shape[0], words.shape[1], words.shape[2], 4)
        # four copies side by side in one thread's registers (tl.join: a broadcast along a
        # new axis spread them over threads, which the PTX's pack then gathered back)
        pair = tl.join(words, words)
        quad = tl.reshape(tl.join(pair, pair), shape)
        s = tl.broadcast_to(scale[:, :, None], words.shape)
        s_pair = tl.join(s, s)
        s_quad = tl.reshape(tl.join(s_pair, s_pair), shape)
        if ASM:
            x = tl.inline_asm_elementwise(_INT8_WORD, "=r,=r,r,r,r,r,r,r", [quad, s_quad],
                                          dtype=tl.float16, is_pure=True, pack=4)
        else:
            byte = tl.arange(0, 4)[None, None, None, :]
            codes = (quad << (24 - 8 * byte)) >> 24  # byte i, sign-extended (arithmetic shift)
            x = codes.to(tl.float32) * s_quad.to(tl.float32)
        return x
