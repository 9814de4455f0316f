"""SASS instructions per weight of the quantized-linear kernels' inner loops, without a GPU.

Compiles each kernel variant of `ninfer_runtime.ops.quant_linear` for sm_90 (Triton's own
ptxas), disassembles it with the cuobjdump that ships with Triton, finds the K loop (the
backward branch with the largest body) and prints its instruction count per weight and per
thread, its top opcodes, the registers, the programs an SM holds (registers and shared memory
allow) and the local-memory (spill) use of every config; SASS_ROWS sets the decode's
activation rows (default 1, a one-token step), SASS_EVEN_N=0 masks the weight rows in the K
loop (a weight whose rows do not fill whole tiles).

    .venv/bin/python scripts/sass_report.py              # every decode config
    .venv/bin/python scripts/sass_report.py --asm off    # the pure-Triton decode, for contrast
    SASS_CAPS=1,2 .venv/bin/python scripts/sass_report.py  # each config capped at 1, 2 more an SM
    .venv/bin/python scripts/sass_report.py --gemm       # the prefill GEMM too
    .venv/bin/python scripts/sass_report.py --moe        # the MoE prompt GEMMs (64-row blocks)
    .venv/bin/python scripts/sass_report.py --attention  # paged INT8 attention's KV loop

With the GPU machine's Triton (3.6) instead of the venv's, as the device compiles (the
counts differ: 3.6 builds the 8-row decode on mma.sync, 3.9 on wgmma):

    .venv/bin/python -m pip install -q --target /tmp/t36 --no-deps \
        /opt/pypi/files/triton-3.6.0-cp311-*.whl
    PYTHONPATH=/tmp/t36 .venv/bin/python scripts/sass_report.py

The budget an H200 gives an nvfp4 GEMV at 4.24 TB/s is ~4.4 instructions per weight at full
issue rate (132 SMs x 4 schedulers x 1.98 GHz x 32 lanes / 7.5e12 weights/s).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the report compiles for the GPU")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ninfer_runtime.ops import attention, moe  # noqa: E402
from ninfer_runtime.ops import quant_linear as ql  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DEVICE_TRITON = "3.6"  # the H200 image's (../shared/device/README.md)
TOP_OPCODES = int(os.environ.get("SASS_TOP", "8"))
ROWS = int(os.environ.get("SASS_ROWS", "1"))  # decode activation rows (the row tile follows)
PREFETCH = os.environ.get("NINFER_L2_PREFETCH", "0") == "1"  # the decode's L2 prefetch
# whole row tiles, as every real projection has (SASS_EVEN_N=0: rows masked in the K loop)
EVEN_N = os.environ.get("SASS_EVEN_N", "1") == "1"
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ARGS = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "g_ptr", "out_ptr", "M", "N", "K", "stride_x",
        "stride_w", "stride_sn", "stride_sg")
# (scale, zero, global scale) pointer types per scheme, as the launcher passes them
PARTS = {"nvfp4": ("*fp8e4nv", "*fp8e4nv", "*fp32"), "groupwise-int": ("*bf16", "*u8", "*bf16")}
# the scale stride the launcher's specialization makes 1: nvfp4's scales are row-major, a linear
# layer's groupwise-int ones group-major (`quant_linear.group_major`; SASS_INT_SCALES=row: the
# artifact's row-major layout)
UNIT_STRIDES = {"nvfp4": {"stride_sg": 1},
                "groupwise-int": {"stride_sg" if os.environ.get("SASS_INT_SCALES") == "row"
                                  else "stride_sn": 1}}
SCHEME_IDS = {"nvfp4": (ql._NVFP4_ID, 2), "groupwise-int": (ql._INT_ID, 16)}


@dataclass(frozen=True)
class Loop:
    instructions: int
    opcodes: collections.Counter


def sass(cubin: bytes, tmp: Path) -> tuple[str, str]:
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    dump = subprocess.run([BIN / "cuobjdump", "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True,
                           text=True, check=True).stdout
    return dump, usage.strip().splitlines()[-1]


def loops(dump: str) -> list[Loop]:
    """Every backward branch's body (a loop), the largest first."""
    code = [(int(a, 16), t.strip()) for a, t in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump)]
    index = {a: i for i, (a, _) in enumerate(code)}
    found = []
    for i, (addr, text) in enumerate(code):
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for _, t in code[index[int(target.group(1), 16)]:i + 1]]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                      for t in body)
            found.append(Loop(len(body), ops))
    return sorted(found, key=lambda loop: -loop.instructions)


def main_loop(dump: str) -> Loop:
    """The backward branch with the largest body: the kernel's K loop."""
    return (loops(dump) or [Loop(0, collections.Counter())])[0]


def compile_variant(fn, signature: dict[str, str], constexprs: dict, warps: int, stages: int,
                    maxnreg: int | None = None):
    for name in constexprs:
        signature[name] = "constexpr"
    # what Triton's launcher specializes for real shapes: 16-byte aligned pointers, strides,
    # sizes and split lengths divisible by 16
    divisible = [i for i, (name, ty) in enumerate(signature.items()) if ty != "constexpr"
                 and (ty.startswith("*") or name.startswith("stride")
                      or name in ("N", "K", "split_len", "m_bucket"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=options)


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    """Resident programs per sm_90 SM: 64K registers (allocated per warp in units of 256),
    227 KB of shared memory (1 KB reserved per program), 64 warps."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 232448 // (smem + 1024), 64 // warps)


def report(label: str, kernel, weights_per_thread: int, tmp: Path) -> None:
    dump, usage = sass(kernel.asm["cubin"], tmp)
    loop = main_loop(dump)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    spills = loop.opcodes["LDL"] + loop.opcodes["STL"]
    resident = programs_per_sm(regs, kernel.metadata.shared, kernel.metadata.num_warps)
    top = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(TOP_OPCODES))
    print(f"{label:<58} {loop.instructions / weights_per_thread:6.2f} {loop.instructions:6d} "
          f"{weights_per_thread:5d} {regs:>4} {resident:>4} {stack:>5} {spills:>6}  {top}")


DECODE_ARGS = ("xo_ptr", "inv_ptr", "xsum_ptr", "w_ptr", "s_ptr", "z_ptr", "g_ptr", "part_ptr",
               "counter_ptr", "out_ptr", "hidden_ptr", "hxo_ptr", "hinv_ptr", "hxsum_ptr",
               "ticket_ptr", "M", "N", "K", "stride_w", "stride_sn", "stride_sg", "split_len",
               "splits")


def configs(scheme_id: int) -> list:
    """The tuner's decode configs, or with SASS_DOTS=1,2,... each of them at those dot
    counts, with SASS_CAPS=1,2,... each uncapped one also capped at that many more programs
    an SM (to compare before changing DECODE_CONFIGS)."""
    found = ql.DECODE_CONFIGS[scheme_id]
    if dots := os.environ.get("SASS_DOTS"):
        found = [dataclasses.replace(c, dots=int(d)) for c in found for d in dots.split(",")]
    if caps := os.environ.get("SASS_CAPS"):
        found = [variant for c in found for variant in (c, *(
            dataclasses.replace(c, per_sm=c.per_sm + int(more), capped=True)
            for more in caps.split(",") if not c.capped))]
    return found


def decode_variants(asm: bool, tmp: Path) -> None:
    for scheme in ("nvfp4", "groupwise-int"):
        sid, wps = SCHEME_IDS[scheme]
        for cfg in configs(sid):
            bn, bk = cfg.bn, cfg.bk
            sig = dict(zip(DECODE_ARGS, ("*fp16", "*fp32", "*fp32", "*i32", *PARTS[scheme],
                                         "*fp32", "*i32", "*bf16", "*bf16", "*fp16", "*fp32",
                                         "*fp32", "*i32", *["i32"] * 8), strict=True))
            cst = {"SCHEME": sid, "WPS": wps, "BM": ql.decode_rows(ROWS), "ASM": asm,
                   "EVEN_K": True, "EVEN_N": EVEN_N, "BN": bn, "BK": bk, "DOTS": cfg.dots,
                   "HAND_ON": False, "OUT_GROUP": bn, "OUT_SUMS": False, "PREFETCH": PREFETCH,
                   "GDC": True, **UNIT_STRIDES[scheme]}
            k = compile_variant(ql._decode_kernel, sig, cst, cfg.warps, cfg.stages, cfg.maxnreg)
            label = (f"decode {scheme} BN={bn} BK={bk} w={cfg.warps} s={cfg.stages} d={cfg.dots}"
                     + (f" cap={cfg.maxnreg}" if cfg.capped else ""))
            report(label, k, bn * bk // (32 * cfg.warps), tmp)


def gemm_kernel(scheme: str, operand: bool, cfg):
    """The prefill GEMM for sm_90 with config `cfg`: on fp16 operands, or decoding its tiles
    to bf16."""
    sid, wps = SCHEME_IDS[scheme]
    kw = cfg.kwargs
    sig = dict(zip(ARGS, ("*bf16", "*i32", *PARTS[scheme], "*bf16", *["i32"] * 7),
                   strict=True))
    sig.update(m_bucket="i32", xo_ptr="*fp16", inv_ptr="*fp32")
    cst = {"SCHEME": sid, "WPS": wps, "PRECISION": "tf32", "EVEN_K": True, "OPERAND": operand,
           "ASM": True, "BM": kw["BM"], "BN": kw["BN"], "BK": kw["BK"],
           "GROUP_M": kw["GROUP_M"], **UNIT_STRIDES[scheme]}
    return compile_variant(ql._gemm_kernel, sig, cst, cfg.num_warps, cfg.num_stages)


def gemm_variants(tmp: Path) -> None:
    """The prefill GEMM's loop per config: nvfp4 on fp16 operands (the GPU's path for half
    activations, "f16"), nvfp4's and groupwise-int's bf16 tile decode."""
    for scheme, operand in (("nvfp4", True), ("nvfp4", False), ("groupwise-int", False)):
        for cfg in ql._gemm.configs:
            kw = cfg.kwargs
            k = gemm_kernel(scheme, operand, cfg)
            # the dequantize cost per weight is shared by BM rows of MMA work
            label = (f"gemm {scheme}{' f16' if operand else ''} BM={kw['BM']} BN={kw['BN']} "
                     f"BK={kw['BK']} w={cfg.num_warps} s={cfg.num_stages}")
            report(label, k, kw["BN"] * kw["BK"] // (32 * cfg.num_warps), tmp)


MOE_ARGS = ("a", "stride_am", "w", "scale", "aux", "stride_we", "stride_wn", "stride_se",
            "stride_sn", "stride_ae", "stride_an", "out", "stride_om", "sorted_slots",
            "block_expert", "N", "K", "num_pairs", "top_k")
# (weight, scale, aux) pointer types of the grouped GEMM per scheme, as _launch_grouped passes
MOE_PARTS = {"nvfp4": ("*i32", "*fp8e4nv", "*fp32"), "groupwise-int": ("*i32", "*bf16", "*u8")}


def moe_kernel(scheme: str, swiglu: bool, cfg, block_m: int = 64):
    """The MoE grouped GEMM for sm_90 (gate|up with swiglu, else down) with config `cfg`."""
    mid = moe.NVFP4 if scheme == "nvfp4" else moe.INT4
    layout = ql.LAYOUTS[scheme]
    kw = cfg.kwargs
    sig = dict(zip(MOE_ARGS, ("*bf16", "i32", *MOE_PARTS[scheme], *["i32"] * 6, "*bf16", "i32",
                              "*i64", "*i64", *["i32"] * 4), strict=True))
    cst = {"SCHEME": mid, "QSCHEME": layout.scheme, "WPS": layout.words_per_scale,
           "SWIGLU": swiglu, "BLOCK_M": block_m, "BLOCK_N": kw["BLOCK_N"],
           "BLOCK_K": kw["BLOCK_K"], "EVEN_K": True, "DOT_PRECISION": "tf32"}
    # the JITFunction under the autotuner and the EVEN_K heuristic
    return compile_variant(moe._grouped_gemm_kernel.fn.fn, sig, cst, cfg.num_warps,
                           cfg.num_stages)


def moe_variants(tmp: Path, block_m: int = 64) -> None:
    """The grouped GEMM's loop per config: the tile decode of nvfp4 and groupwise-int."""
    for scheme in ("nvfp4", "groupwise-int"):
        for swiglu in (True, False):
            for cfg in moe._gemm_configs():
                kw = cfg.kwargs
                k = moe_kernel(scheme, swiglu, cfg, block_m)
                label = (f"moe {scheme} {'gate|up' if swiglu else 'down'} BM={block_m} "
                         f"BN={kw['BLOCK_N']} BK={kw['BLOCK_K']} w={cfg.num_warps} "
                         f"s={cfg.num_stages}")
                tiles = 2 if swiglu else 1
                report(label, k, tiles * kw["BLOCK_N"] * kw["BLOCK_K"] // (32 * cfg.num_warps),
                       tmp)


# (label, BLOCK_M, GROUP_HEADS, NUM_SPLITS): a 35B prompt tile (8 q heads a kv head), the 27B's
# (6, padded to 8 rows a token) and their decode tiles at 8K context
ATTENTION_TILES = (("prompt 35B", 128, 8, 1), ("prompt 27B", 128, 6, 1),
                   ("decode 35B", 8, 8, 64), ("decode 27B", 8, 6, 64))


def attention_kernel(block_m: int, heads: int, splits: int, cfg):
    """The paged attention kernel for sm_90 over an INT8 cache (head_dim 256, 64-token pages),
    causal, dequantized with the inline PTX as the launcher has it, with config `cfg`."""
    fn = attention._paged_attention_kernel.fn  # the JITFunction under the autotuner
    pointers = {"q": "*bf16", "k_cache": "*i8", "v_cache": "*i8", "k_scale": "*fp16",
                "v_scale": "*fp16", "page_tables": "*i64", "cu_seqlens": "*i64",
                "context_lens": "*i64", "qk_scale": "fp32", "out": "*bf16", "gate": "*bf16",
                "part_out": "*fp32", "part_lse": "*fp32"}
    kw = cfg.kwargs
    sig = {a: pointers.get(a, "i32") for a in fn.arg_names if a.upper() != a}
    cst = {"GROUP_HEADS": heads, "BLOCK_M": block_m, "BLOCK_N": kw["BLOCK_N"], "HEAD_DIM": 256,
           "GROUP": 64, "PAGE_SIZE": 64, "NUM_SPLITS": splits, "QUANT": True, "HAS_GATE": True,
           "CAUSAL": True, "HAS_WINDOW": False, "DOT_PRECISION": "tf32", "ASM": True,
           "PREFETCH": kw["PREFETCH"], "GDC": True}
    return compile_variant(fn, sig, cst, cfg.num_warps, cfg.num_stages)


def align_kernel(place: bool):
    """The MoE align's place (else count) kernel for sm_90 at the 35B's prompt chunks (257
    stacked experts padded to 512, 64-row blocks), as `moe._launch_align` launches it."""
    sig = {"flat_ids": "*i64", "sorted_slots": "*i64", "block_expert": "*i64",
           "span_counts": "*i32", "cursors": "*i32", "n": "i32", "num_blocks": "i32",
           "spans": "i32"}
    cst = {"SPAN": moe.ALIGN_SPAN, "EXPERTS": 512, "CHUNK": 32}
    if place:
        return compile_variant(moe._align_place_kernel, sig,
                               cst | {"BLOCK_M": 64, "SPAN_TILE": moe._ALIGN_SPAN_TILE}, 4, 1)
    count = {name: sig[name] for name in ("flat_ids", "span_counts", "sorted_slots", "n")}
    return compile_variant(moe._align_count_kernel, count | {"rows": "i32"},
                           cst | {"FILL": moe._ALIGN_FILL}, 4, 1)


def attention_variants(tmp: Path) -> None:
    """The paged attention kernel's KV loop per tile shape and tuner candidate that its
    pruning keeps for the tile; "per weight" is per K/V element a thread decodes in an
    iteration."""
    for label, block_m, heads, splits in ATTENTION_TILES:
        for cfg in attention._prune_configs(attention._configs(), {}, BLOCK_M=block_m):
            kw = cfg.kwargs
            k = attention_kernel(block_m, heads, splits, cfg)
            prefetch = {0: "", 1: " prefetch", 2: " prefetch 2"}[kw["PREFETCH"]]
            report(f"attention {label} BM={block_m} BN={kw['BLOCK_N']} w={cfg.num_warps} "
                   f"s={cfg.num_stages}{prefetch}", k,
                   2 * kw["BLOCK_N"] * 256 // (32 * cfg.num_warps), tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--asm", choices=("on", "off"), default="on",
                        help="decode with the inline PTX (GPU default) or the pure-Triton twin")
    parser.add_argument("--gemm", action="store_true", help="also the prefill GEMM")
    parser.add_argument("--moe", action="store_true", help="also the MoE prompt GEMMs")
    parser.add_argument("--attention", action="store_true",
                        help="also the paged attention's KV loop")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode GEMV")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, target sm_90; per weight = loop instructions / "
          "weights per thread per iteration")
    if not triton.__version__.startswith(DEVICE_TRITON):
        # 3.9 builds the 8-row decode on wgmma where the H200's 3.6 builds mma.sync: other
        # instruction counts and registers than the GPU runs (docs/perf.md, tenth run)
        print(f"WARNING: the H200 image compiles with Triton {DEVICE_TRITON}; see the "
              "docstring for running this on it")
    print(f"{'variant':<58} {'/wt':>6} {'loop':>6} {'wt/th':>5} {'reg':>4} {'p/SM':>4} "
          f"{'stack':>5} {'LDL+STL':>6}  top opcodes")
    # a directory of this process's own: two reports at once (two trees side by side) wrote
    # each other's cubins into a shared one and printed the other's registers
    with tempfile.TemporaryDirectory(prefix="ninfer_sass_report") as name:
        tmp = Path(name)
        if not args.no_decode:
            decode_variants(args.asm == "on", tmp)
        if args.gemm:
            gemm_variants(tmp)
        if args.moe:
            moe_variants(tmp)
        if args.attention:
            attention_variants(tmp)


if __name__ == "__main__":
    main()
