"""Packed 4-bit codes -> fp16 tensor-core operands, two codes per 32-bit instruction.

The decode GEMV (`quant_linear`) multiplies on tensor cores in fp16: a weight code becomes an
fp16 operand with integer bit tricks on whole words, and the activations are converted to fp16
and laid out by code position once per call (`activation_kernel`). The weight decoders have
two implementations that produce the same bits:

- `ASM=True` (GPU): inline PTX through `tl.inline_asm_elementwise`, two 32-bit words (adjacent
  K words of one weight row, which is how the tensor-core operand layout pairs registers) in,
  eight fp16x2 registers out, one per code position j: lane 0 from the first word, lane 1 from
  the second.
- `ASM=False` (Triton's interpreter, which cannot run PTX, and a pure-Triton fallback on the
  GPU): the same values one code at a time with plain integer ops and bitcasts.

The PTX is proven without a GPU by `tests/kernels/test_quant_decode.py`, which replays every
instruction below (same constants, documented prmt/lop3 semantics) in torch over all codes.

Byte tricks (PTX `prmt.b32 d, a, b, sel`: output byte i is byte sel[4i+2:4i] of the 8 bytes
{b, a}, or that byte's sign bit replicated when sel bit 4i+3 is set; `lop3` with lut 0xEA is
(a & b) | c):

- nvfp4: an E2M1 code (sign s, magnitude e1 e0 m) placed as the HIGH byte of an fp16 with the
  magnitude in bits 9-11 and s in bit 15 is exactly e2m1 * 2^-14 (code 1 lands on a subnormal,
  which fp16 arithmetic keeps). Per word pair: one prmt gathers byte i of both words into one
  register (`[a.b0, b.b0, a.b1, b.b1]`); three ops turn the four high nibbles into four such
  high bytes at once (`(g & 0x80808080) | ((g >> 3) & 0x0E0E0E0E)`), four the low nibbles; one
  prmt with a zero register spreads two of them into an fp16x2 (`[0, u.b0, 0, u.b1]`). The
  fp8 block scale is converted once per word pair (one prmt copies its byte, then
  `cvt.rn.f16x2.e4m3x2`; both words share a 16-code block) and applied with one
  `mul.f16x2`: the operand is e2m1 * s * 2^-14, exact in fp16 (at most 6 significant bits,
  no smaller than 2^-24, no larger than 6 * 448 * 2^-14).
- groupwise-int: code q OR-ed into the mantissa of 1024.0 (0x6400) is exactly 1024 + q. The
  zero point and scale are applied after the dot, once per 128-code group and output:
  sum((q - z) * s * x) = s * (sum((1024 + q) * x) - (1024 + z) * sum(x)).
- activations (`activation_kernel`, once per call, or the GDN output norm that produced
  them, ops.norm.gated_rms_norm_with_operand; both through `store_operand`): each group of
  a row (one decode K tile: 256 inputs for nvfp4, 128 for groupwise-int) is scaled by a
  power of two that puts its largest |x| in [2^14, 2^15) and rounded once to fp16, whatever
  the magnitude (bf16 spans far more binades than fp16): exact for every bf16 value within
  2^-28 of the group's largest, which is normal in fp16 then; smaller ones lose bits as fp16
  subnormals, far below what the fp32 sum of the row can resolve. Each tile's dot result is
  scaled back by its group's factor.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is used
    triton = None

# fp16 operand offsets the kernels undo in their epilogue
NV_F16_EXP = 14  # nvfp4 fp16 operand = e2m1 * s * 2^-14
INT_F16_BIAS = 1024.0  # groupwise-int fp16 operand = 1024 + q


def _nv_pair_ptx() -> str:
    """PTX: words $8, $9 and their block scale (byte 0 of $10, as a 32-bit register: Triton
    packs two 8-bit operands into one register with two more instructions; $11, the second
    word's copy of it, is unused) -> $0..$7 = fp16x2 of code j."""
    def half(gather: str, lo: int) -> list[str]:
        # codes lo, lo+1, lo+2, lo+3 of both words: u holds the high nibbles (odd codes),
        # v the low nibbles (even codes), as fp16 high bytes
        return [
            f"prmt.b32 g, $8, $9, {gather};",
            "shr.b32 t, g, 3;",
            "and.b32 t, t, 0x0E0E0E0E;",
            "lop3.b32 u, g, 0x80808080, t, 0xEA;",
            "shl.b32 t, g, 1;",
            "and.b32 t, t, 0x0E0E0E0E;",
            "shl.b32 v, g, 4;",
            "lop3.b32 v, v, 0x80808080, t, 0xEA;",
            f"prmt.b32 ${lo}, v, 0, 0x1404;",
            f"prmt.b32 ${lo + 1}, u, 0, 0x1404;",
            f"prmt.b32 ${lo + 2}, v, 0, 0x3424;",
            f"prmt.b32 ${lo + 3}, u, 0, 0x3424;",
        ]
    lines = ["{", ".reg .b32 g, t, u, v, s;", ".reg .b16 sl, sh;",
             "prmt.b32 s, $10, 0, 0x0000;", "mov.b32 {sl, sh}, s;",
             "cvt.rn.f16x2.e4m3x2 s, sl;"]
    lines += half("0x5140", 0) + half("0x7362", 4)
    lines += [f"mul.rn.f16x2 ${j}, ${j}, s;" for j in range(8)]
    return "\n".join([*lines, "}"])


def _int_pair_ptx() -> str:
    """PTX: words $8, $9 -> $0..$7 = fp16x2 (1024 + code j of each word)."""
    lines = ["{", ".reg .b32 g, t;"]
    for gather, lo in (("0x5410", 0), ("0x7632", 4)):
        # g: lane 0 = codes lo..lo+3 of word a, lane 1 = the same codes of word b
        lines.append(f"prmt.b32 g, $8, $9, {gather};")
        for j in range(4):
            src = "g"
            if j:
                lines.append(f"shr.b32 t, g, {4 * j};")
                src = "t"
            lines.append(f"lop3.b32 ${lo + j}, {src}, 0x000F000F, 0x64006400, 0xEA;")
    return "\n".join([*lines, "}"])


NV_PAIR_PTX = _nv_pair_ptx()
INT_PAIR_PTX = _int_pair_ptx()


if triton is not None:
    from ninfer_runtime.ops.activation import silu_mul
    from ninfer_runtime.ops.launch import wait_for_inputs
    from ninfer_runtime.ops.rms_math import normed, residual, rows_inv_rms
    _NV_PTX = tl.constexpr(NV_PAIR_PTX)
    _INT_PTX = tl.constexpr(INT_PAIR_PTX)
    _OUTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r")

    @triton.jit
    def _f16_bits(bits):
        """int32 tensor whose low 16 bits are an fp16 pattern -> that fp16."""
        return bits.to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _nv_code(c, J: tl.constexpr):
        """fp16 e2m1 * 2^-14 of code J of every int32 word (sign to bit 15, magnitude 9-11)."""
        return _f16_bits((((c >> (4 * J + 3)) & 1) << 15) | (((c >> (4 * J)) & 7) << 9))

    @triton.jit
    def _int_code(c, J: tl.constexpr):
        """fp16 1024 + code J of every int32 word."""
        return _f16_bits(((c >> (4 * J)) & 15) | 0x6400)

    @triton.jit
    def nv_operands(words, sbytes, ASM: tl.constexpr):
        """Eight fp16 [BN, BKW] tensors: code j of every uint32 word times its fp8 block scale
        (sbytes: uint8 e4m3 bytes, one per word), = e2m1 * s * 2^-14 exactly."""
        if ASM:
            return tl.inline_asm_elementwise(_NV_PTX, _OUTS + ",r,r,r,r",
                                             [words, sbytes.to(tl.uint32)],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        s = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c = words.to(tl.int32, bitcast=True)
        return (_nv_code(c, 0) * s, _nv_code(c, 1) * s, _nv_code(c, 2) * s, _nv_code(c, 3) * s,
                _nv_code(c, 4) * s, _nv_code(c, 5) * s, _nv_code(c, 6) * s, _nv_code(c, 7) * s)

    @triton.jit
    def int_operands(words, ASM: tl.constexpr):
        """Eight fp16 [BN, BKW] tensors: 1024 + code j of every uint32 word."""
        if ASM:
            return tl.inline_asm_elementwise(_INT_PTX, _OUTS + ",r,r", [words],
                                             dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        c = words.to(tl.int32, bitcast=True)
        return (_int_code(c, 0), _int_code(c, 1), _int_code(c, 2), _int_code(c, 3),
                _int_code(c, 4), _int_code(c, 5), _int_code(c, 6), _int_code(c, 7))

    @triton.jit
    def operand_scale(big):
        """(m, 1 / m) for groups whose largest |x| is `big` (fp32): the power of two m that
        puts it in [2^14, 2^15) (2^126 for zero or below 2^-112), as the module docstring
        says."""
        e = tl.maximum((big.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15)
        return (((268 - e) << 23).to(tl.float32, bitcast=True),  # 2^(141 - e)
                ((e - 14) << 23).to(tl.float32, bitcast=True))

    @triton.jit
    def store_operand(x, rows, row_ok, col0, M, K, xo_ptr, inv_ptr, xsum_ptr,
                      GROUP: tl.constexpr, HAS_SUM: tl.constexpr):
        """Rows `rows` of an [M, K] activation as the decode kernels' operand (the layout and
        scaling `activation_kernel` documents): x [R, C] fp32, its columns col0 .. col0 + C
        (col0 a multiple of GROUP, C of GROUP; those past K hold zeros). Shared by
        `activation_kernel` and the norm kernels that write the operand themselves
        (ops.norm), so both give the same bits."""
        R: tl.constexpr = x.shape[0]
        C: tl.constexpr = x.shape[1]
        G: tl.constexpr = C // GROUP
        cols = col0 + tl.arange(0, C)
        xg = tl.reshape(x, (R, G, GROUP))
        m, inv = operand_scale(tl.max(tl.abs(xg), axis=2))
        group = col0 // GROUP + tl.arange(0, G)
        g_off = group[None, :] * M + rows[:, None]
        g_ok = row_ok[:, None] & (group * GROUP < K)[None, :]
        tl.store(inv_ptr + g_off, inv, mask=g_ok)
        xo = (xg * m[:, :, None]).to(tl.float16)
        if HAS_SUM:  # exact: the same sum whatever tile layout the caller's kernel has
            fixed = (xo.to(tl.float32) * 16777216.0).to(tl.int64)  # 2^24: each an integer
            tl.store(xsum_ptr + g_off, tl.sum(fixed, axis=2).to(tl.float32) * (1.0 / 16777216.0),
                     mask=g_ok)
        xo = tl.reshape(xo, (R, C))
        dst = ((cols % 8)[None, :] * M + rows[:, None]) * (K // 8) + (cols // 8)[None, :]
        tl.store(xo_ptr + dst, xo, mask=row_ok[:, None] & (cols < K)[None, :])

    @triton.jit
    def store_operand_group(x_ptr, rows, row_ok, M, K, tile, tiles, ticket_ptr, xo_ptr, inv_ptr,
                            xsum_ptr, WIDTH: tl.constexpr, GROUP: tl.constexpr,
                            HAS_SUM: tl.constexpr):
        """For the program that has just stored column tile `tile` (WIDTH columns, of `tiles`)
        of rows `rows` of x [M, K]: the last of the tiles of its operand group to get here (the
        group's counter at ticket_ptr) reads the group back from L2, writes its operand
        (`store_operand`) and zeroes the counter for the next launch. Whether this program
        wrote the group."""
        PER: tl.constexpr = GROUP // WIDTH
        g = tile // PER
        tl.debug_barrier()  # every thread's columns are stored before the group counts them
        in_group = tl.minimum(PER, tiles - g * PER)  # the last group may hold fewer tiles
        last = tl.atomic_add(ticket_ptr + g, 1, sem="acq_rel") == in_group - 1
        if last:
            tl.store(ticket_ptr + g, 0)
            ks = g * GROUP + tl.arange(0, GROUP)
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                        mask=row_ok[:, None] & (ks < K)[None, :], other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            store_operand(x, rows, row_ok, g * GROUP, M, K, xo_ptr, inv_ptr, xsum_ptr, GROUP,
                          HAS_SUM)
        return last

    @triton.jit
    def activation_kernel(x_ptr, xo_ptr, inv_ptr, xsum_ptr, h_ptr, nw_ptr, res_ptr, normed_ptr,
                          stride_h, eps, M, K, stride_x, GROUP: tl.constexpr,
                          HAS_SUM: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                          HAS_H: tl.constexpr, NORM_BD: tl.constexpr, GDC: tl.constexpr):
        """Group g = program 1 of row r = program 0 of x [M, K] (bf16 or fp16), inputs
        [g * GROUP, (g + 1) * GROUP), as the decode kernels' fp16 operand, laid out by code
        position: xo [8, M, K/8] with xo[j, r, w] = x[r, 8w + j] * m, where the power of two
        m puts the group's largest |x| in [2^14, 2^15) (an all-zero group, or one below
        2^-112: m = 2^126); inv[g, r] = 1 / m. With HAS_SUM, xsum[g, r] is the group's sum of
        the operand values (groupwise-int's zero-point term). With SWIGLU, x is [gate | up]
        [M, 2K] and the operand is silu_and_mul's output (the down projection's input), which
        then never exists on its own. With NORM, x is the input of the RMSNorm whose output
        the operand is of (ops.norm.DeferredNorm, + h with HAS_H): the program takes its
        row's 1 / rms from the whole row and stores its group of the norm's output and
        residual too, the norm kernel's bits (ops.rms_math).

        A group is one K tile of the decode kernel, which undoes its scale per tile: no
        row-wide reduction, so a row is prepared by K / GROUP programs side by side, and the
        decode K loop only streams the result (no reduction, scaling or reshuffle per
        tile)."""
        wait_for_inputs(GDC)
        row = tl.program_id(0)
        group = tl.program_id(1)
        rows = row + tl.arange(0, 1)
        ks = group * GROUP + tl.arange(0, GROUP)
        src = x_ptr + row.to(tl.int64) * stride_x + ks
        if NORM:
            rstd = rows_inv_rms(x_ptr, stride_x, h_ptr, stride_h, rows, rows < M, K, eps,
                                HAS_H, NORM_BD)
            r = residual(src, h_ptr + row.to(tl.int64) * stride_h + ks, ks < K, HAS_H)
            y = normed(r, rstd, tl.load(nw_ptr + ks, mask=ks < K, other=0.0))
            dst = row.to(tl.int64) * K + ks
            tl.store(normed_ptr + dst, y, mask=ks < K)
            if HAS_H:
                tl.store(res_ptr + dst, r, mask=ks < K)
            x = y.to(tl.float32)
        else:
            x = tl.load(src, mask=ks < K, other=0.0).to(tl.float32)
            if SWIGLU:
                up = tl.load(src + K, mask=ks < K, other=0.0).to(tl.float32)
                x = silu_mul(x, up, x_ptr.dtype.element_ty).to(tl.float32)
        store_operand(x[None, :], rows, rows < M, group * GROUP, M, K, xo_ptr, inv_ptr, xsum_ptr,
                      GROUP, HAS_SUM)
