"""The kernels' inline PTX, executed by a small emulator over every input it can see.

`quant_decode`'s PTX strings (the decode GEMV) and `kv_quant.INT8_WORD_PTX` (INT8 KV in
attention) run on the GPU only; here each instruction they use is replayed
in torch with the semantics the PTX ISA documents (prmt's byte select and sign replicate,
lop3's truth table, cvt / mul rounding to nearest even), vectorized over all inputs: every
pair of code bytes with every fp8 block scale, every int4 code. The
results must be the exact fp16 operands the kernel's epilogue assumes.
"""

from __future__ import annotations

import re

import pytest
import torch

from ninfer_runtime.ops import quant_decode as qd
from ninfer_runtime.quant.nvfp4 import e2m1_table

MASK = 0xFFFFFFFF


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """prmt.b32 (default mode): byte i = byte sel[4i+2:4i] of {b, a}, or its sign replicated
    when sel bit 4i+3 is set."""
    both = (b << 32) | a
    out = torch.zeros_like(a)
    for i in range(4):
        nibble = (sel >> (4 * i)) & 0xF
        byte = (both >> (8 * (nibble & 7))) & 0xFF
        byte = torch.where((nibble & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lut: int) -> torch.Tensor:
    """lop3.b32: each result bit is lut[(a << 2) | (b << 1) | c] of the operands' bits."""
    out = torch.zeros_like(a)
    for idx in range(8):
        if lut >> idx & 1:
            term = torch.full_like(a, MASK)
            for operand, bit in ((a, 4), (b, 2), (c, 1)):
                term &= operand if idx & bit else ~operand & MASK
            out |= term
    return out


def _halves(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low = (r & 0xFFFF).to(torch.int16).view(torch.float16)
    high = ((r >> 16) & 0xFFFF).to(torch.int16).view(torch.float16)
    return low, high


def _pack(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    bits = [h.view(torch.int16).to(torch.int64) & 0xFFFF for h in (low, high)]
    return bits[0] | (bits[1] << 16)


def _f32(r: torch.Tensor) -> torch.Tensor:
    return r.to(torch.int32).view(torch.float32)


def _bits32(f: torch.Tensor) -> torch.Tensor:
    return f.view(torch.int32).to(torch.int64) & MASK


def run_ptx(ptx: str, operands: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Execute `ptx` (the instruction subset the kernels use) on int64 tensors holding 32-bit
    registers; operands maps $n to its value. Returns every register after the last line."""
    regs: dict[str, torch.Tensor] = {f"${n}": v & MASK for n, v in operands.items()}
    like = next(iter(regs.values()))

    def val(token: str) -> torch.Tensor:
        token = token.strip()
        if token in regs:
            return regs[token]
        if token.startswith("0f"):
            return torch.full_like(like, int(token[2:], 16))
        return torch.full_like(like, int(token, 0) & MASK)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dst, *args = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            out = _prmt(*(val(t) for t in args))
        elif op == "lop3.b32":
            out = _lop3(val(args[0]), val(args[1]), val(args[2]), int(args[3], 0))
        elif op == "and.b32":
            out = val(args[0]) & val(args[1])
        elif op == "shr.b32":
            out = val(args[0]) >> int(args[1])
        elif op == "shl.b32":
            out = (val(args[0]) << int(args[1])) & MASK
        elif op == "cvt.rn.f16x2.e4m3x2":  # two e4m3 bytes -> fp16x2, byte 0 -> low half
            e4m3 = [((val(args[0]) >> s) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn)
                    for s in (0, 8)]
            out = _pack(*(e.half() for e in e4m3))
        elif op in ("mul.rn.f16x2", "sub.rn.f16x2"):
            (a0, a1), (b0, b1) = _halves(val(args[0])), _halves(val(args[1]))
            out = _pack(a0 * b0, a1 * b1) if op[0] == "m" else _pack(a0 - b0, a1 - b1)
        elif op == "xor.b32":
            out = val(args[0]) ^ val(args[1])
        elif op == "mov.b32":
            out = val(args[0])
        elif op == "mul.f32":
            out = _bits32(_f32(val(args[0])) * _f32(val(args[1])))
        elif op == "cvt.rn.f16x2.f32":  # d = {hi: cvt(a), lo: cvt(b)}
            out = _pack(_f32(val(args[1])).half(), _f32(val(args[0])).half())
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it")
        regs[dst] = out & MASK
    return regs


def _words(values: torch.Tensor) -> torch.Tensor:
    """int64 of the uint32 words"""
    return values.to(torch.int64) & MASK


@pytest.fixture(scope="module")
def byte_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two words per case: every byte value at every position of each word, paired with
    random bytes of the other word, the remaining bytes random."""
    gen = torch.Generator().manual_seed(0)
    first = torch.arange(256, dtype=torch.int64).repeat(16)
    second = torch.randint(0, 256, first.shape, generator=gen, dtype=torch.int64)
    noise = torch.randint(0, 2**32, (2, first.numel()), generator=gen, dtype=torch.int64)
    a = torch.cat([(noise[0] & ~(0xFF << 8 * p) & MASK) | (first << 8 * p) for p in range(4)]
                  + [(noise[0] & ~(0xFF << 8 * p) & MASK) | (second << 8 * p) for p in range(4)])
    b = torch.cat([(noise[1] & ~(0xFF << 8 * p) & MASK) | (second << 8 * p) for p in range(4)]
                  + [(noise[1] & ~(0xFF << 8 * p) & MASK) | (first << 8 * p) for p in range(4)])
    return _words(a), _words(b)


def _codes(word: torch.Tensor, j: int) -> torch.Tensor:
    return (word >> (4 * j)) & 0xF


def test_nvfp4_pair_is_e2m1_times_scale(byte_pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Every code in every nibble of both words, scales cycling over every finite e4m3 (0
    included, and both zero codes): lane 0 = code j of word a, lane 1 = code j of word b,
    both e2m1 * s * 2^-14 exactly."""
    a, b = byte_pairs
    table = e2m1_table(torch.device("cpu")).double()
    sbyte = torch.arange(a.numel(), dtype=torch.int64) % 0x7F
    scale = sbyte.to(torch.uint8).view(torch.float8_e4m3fn).double()
    # the scale is byte 0 of $10 and of $11; the bytes above it are ignored
    noisy = sbyte | (0xAB << 8) | (0xCD << 24)
    regs = run_ptx(qd.NV_PAIR_PTX, {8: a, 9: b, 10: noisy, 11: noisy})
    for j in range(8):
        low, high = _halves(regs[f"${j}"])
        for lane, word in ((low, a), (high, b)):
            expect = table[_codes(word, j)] * scale * 2.0**-qd.NV_F16_EXP
            assert torch.equal(lane.double(), expect), j
            # exact in fp16: the kernel's operand loses nothing
            assert torch.equal(expect.half().double(), expect)


def test_int4_pair_is_1024_plus_code(byte_pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = byte_pairs
    regs = run_ptx(qd.INT_PAIR_PTX, {8: a, 9: b})
    for j in range(8):
        low, high = _halves(regs[f"${j}"])
        assert torch.equal(low.double(), qd.INT_F16_BIAS + _codes(a, j).double()), j
        assert torch.equal(high.double(), qd.INT_F16_BIAS + _codes(b, j).double()), j


def test_emulator_prmt_and_lop3_semantics() -> None:
    """The emulator against hand-worked cases from the PTX ISA's prmt and lop3 sections."""
    t = torch.tensor
    a, b = t([0x33221100]), t([0x77665544])
    assert _prmt(a, b, t([0x3210])).item() == 0x33221100
    assert _prmt(a, b, t([0x5140])).item() == 0x55114400
    assert _prmt(t([0x00008000]), b, t([0x9999])).item() == 0xFFFFFFFF  # sign of byte 1
    assert _prmt(a, t([0]), t([0x1404])).item() == 0x11000000
    x, y, z = t([0xF0]), t([0xCC]), t([0xAA])
    assert _lop3(x, y, z, 0xEA).item() == (0xF0 & 0xCC) | 0xAA
    assert _lop3(x, y, z, 0x96).item() == 0xF0 ^ 0xCC ^ 0xAA


def test_int8_word_is_code_times_scale() -> None:
    """kv_quant.INT8_WORD_PTX over every int8 code at every byte position, with fp16 scales
    from tiny to large: lane values are q * s rounded once to fp16, code i of the input word in
    output i (codes 0, 1 in $0's low and high halves, 2, 3 in $1's)."""
    from ninfer_runtime.ops.kv_quant import INT8_WORD_PTX

    gen = torch.Generator().manual_seed(0)
    codes = torch.arange(-128, 128, dtype=torch.int64).repeat(16)
    others = torch.randint(-128, 128, (3, codes.numel()), generator=gen, dtype=torch.int64)
    scales = torch.cat([torch.rand(codes.numel() // 2, generator=gen) * 2.0**-10,
                        torch.rand(codes.numel() // 2, generator=gen) * 4.0]).half()
    for position in range(4):
        quad = [others[i - (i > position)] if i != position else codes for i in range(4)]
        word = sum((q & 0xFF) << (8 * i) for i, q in enumerate(quad))
        s = [scales.roll(i) for i in range(4)]
        # the word's four copies in $2 .. $5 (the PTX reads $2), the scales in $6, $7
        regs = run_ptx(INT8_WORD_PTX, {**dict.fromkeys(range(2, 6), word),
                                       6: _pack(s[0], s[1]), 7: _pack(s[2], s[3])})
        lanes = [*_halves(regs["$0"]), *_halves(regs["$1"])]
        for i in range(4):
            expect = (quad[i].double() * s[i].double()).half()
            assert torch.equal(lanes[i], expect), (position, i)
