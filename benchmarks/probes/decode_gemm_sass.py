"""The decode GEMM kernels compiled for Hopper (sm_90) on any machine, GPU or not: what the inner loop
executes, per K step, as SASS instruction counts.

Triton compiles without a GPU when given a target, and its wheel carries ptxas and nvdisasm. It shows,
for instance, whether each FP8 code goes through the conversion unit (`--unpack convert`: F2FP then F2F
per element) or only through integer instructions (`--unpack bits`), and how many instructions a warp
issues per weight element for a tile shape, without spending device time (readings: RESULTS.md).
Integer arguments are compiled as multiples of 16, as Triton specializes them at launch for the Llama
shapes (without that the loads are scalar and the code is not what the GPU runs).

    .venv/bin/python benchmarks/probes/decode_gemm_sass.py --kernel gated --fp8 --tile 32 256 4 3
    .venv/bin/python benchmarks/probes/decode_gemm_sass.py --kernel proj --fp8 --unpack convert --split-k 4
    .venv/bin/python benchmarks/probes/decode_gemm_sass.py --kernel attention   # the attention's loop, too
    TRITON_DIR=/path/to/site-packages python benchmarks/probes/decode_gemm_sass.py ...   # another triton

The interpreter's triton (`./dev setup` puts 3.9 in .venv/triton-interpreter) is used when torch's
environment has none (run without TRITON_INTERPRET=1: interpreted kernels cannot be compiled). To see the code
a GPU runs, compile with the triton it runs: `pip install --target DIR triton==<its version>` and TRITON_DIR=DIR.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POINTERS = re.compile(r"(_ptr|^[wsybe][0-2gu]$)")  # x_ptr, w0, s1, y2, b0, e1, wg, su, eu, ...
FLOATS = {"c0", "c1", "c2", "cg", "cu"}  # LoRA scales


def _import_triton():
    """TRITON_DIR's triton if set, else the environment's, else the interpreter's (./dev setup)."""
    if os.environ.get("TRITON_DIR"):
        sys.path.insert(0, os.environ["TRITON_DIR"])
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            sys.path.insert(0, str(ROOT / ".venv" / "triton-interpreter"))
    sys.path.insert(0, str(ROOT))
    import triton

    return triton


def compile_kernel(kind: str, fp8: bool, tile: tuple[int, int, int, int], rows: int = 16, lora: bool = False,
                   unpack: str = "bits", split_k: int = 1, bias: bool = False, pdl: bool = False,
                   chain: bool = False, activations: str = "bf16"):
    """Compile proj_kernel (one projection with a residual) or gated_kernel for sm_90; returns Triton's
    compiled kernel (asm: ttgir, ptx, cubin). `pdl`: as launched beside its lora_down (Tuning.pdl); `chain`: as
    launched dependently on the launch before it (Tuning.chain); `activations`: x's, the outputs' and the
    residual's dtype (fp16 with FP8 weights: the product W x^T, `decode_gemm._w_first`)."""
    _import_triton()
    from grpo.kernels import _decode_gemm_triton as kernels
    from grpo.kernels.decode_gemm import _UNPACK_MODES

    fn = kernels.proj_kernel if kind == "proj" else kernels.gated_kernel
    block_n, block_k, warps, stages = tile
    const = dict(BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=128 if fp8 else block_k, HAS_SCALE=fp8,
                 HAS_LORA=lora, HAS_BIAS=bias, BLOCK_R=32, STAGES=stages, EXACT=False,
                 UNPACK=_UNPACK_MODES[unpack] if fp8 and activations == "bf16" else 0,
                 W_FIRST=fp8 and activations == "fp16", PDL=pdl, CHAIN=chain)
    if kind == "proj":
        const.update(NUM=1, HAS_RES=True, SPLIT_K=split_k)
    names = fn.arg_names
    missing = set(const) - set(names)
    if missing:
        raise ValueError(f"{fn.__name__} has no parameters {sorted(missing)}: update this script's constants")
    weight = "*fp8e4nv" if fp8 else "*bf16"
    sig = {}
    for name in names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("xa_ptr", "part_ptr"):  # LoRA's x A^T partial sums, split-K's partial sums
            sig[name] = "*fp32"
        elif name == "count_ptr":  # split-K's arrival counts
            sig[name] = "*i32"
        elif POINTERS.search(name):  # scales, weights and LoRA B, or activations
            act = f"*{activations}" if name in ("x_ptr", "y_ptr", "res_ptr") or name[0] == "y" else "*bf16"
            sig[name] = "*fp32" if name[0] == "s" else weight if name[0] in "wb" else act  # e: biases
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    divisible = [n for n in names if sig[n].startswith("*") or n in ("stride_xm", "K", "N", "N0", "N1", "N2")]
    return _compile_sm90(fn, sig, const, divisible, {"num_warps": warps})


def _compile_sm90(fn, sig: dict, const: dict, divisible: list[str], options: dict):
    """`fn` compiled for sm_90 with `sig`'s types, `const`'s constexprs, and `divisible`'s arguments specialized
    as multiples of 16 (as a launch specializes them)."""
    triton = _import_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_attention(rope: bool):
    """The decode attention's chunk kernel as the engine launches it for Llama-3.2-1B (32 query heads over 8 kv
    heads of 64, one chunk a row, `AttentionTiles`' defaults, in the chain of dependent launches), compiled for
    sm_90: `rope_store_attend`'s (q and K rotated and the token's K/V written in it, stopped rows skipped) or,
    without `rope`, `decode_attention`'s."""
    _import_triton()
    from grpo.kernels import _decode_attention_triton as kernels
    from grpo.kernels.decode_attention import AttentionTiles

    fn, tiles = kernels.attend_chunk_kernel, AttentionTiles()
    const = dict(G=4, G_PAD=16, D=64, BLOCK_S=tiles.block_s, CHUNK=640, SPLITS=1, EXACT=False, ROPE=rope,
                 LIVE=rope, CHAIN=True)  # the engine's rope launch skips stopped rows' caches
    types = {"acc_ptr": "*fp32", "stat_ptr": "*fp32", "len_ptr": "*i64", "live_ptr": "*i1",
             "scale": "fp32"}  # else bf16 or int32
    sig = {n: "constexpr" if n in const else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    divisible = [n for n in fn.arg_names if sig[n].startswith("*") or n.startswith("s_")]
    return _compile_sm90(fn, sig, const, divisible, {"num_warps": tiles.num_warps, "num_stages": tiles.stages})


def sass_loops(cubin: bytes) -> list[dict]:
    """Each loop of the kernel (a backward branch) with its instruction count and opcode histogram."""
    triton = _import_triton()
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels, instrs = {}, []
    for line in text.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instrs)
            continue
        ins = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if ins:
            instrs.append(ins.group(1).strip())
    loops = []
    for end, ins in enumerate(instrs):
        target = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", ins)
        if target and labels.get(target.group(1), end + 1) < end:
            body = instrs[labels[target.group(1)]: end + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body)
            loops.append(dict(instructions=len(body), ops=dict(ops.most_common())))
    return loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=["proj", "gated", "attention"], default="gated",
                    help="proj: one projection with the residual; gated: gate/up with the SiLU product; attention: "
                         "the decode attention's loop over positions, with the rotaries and K/V write in its launch "
                         "and without (the other flags do not apply)")
    ap.add_argument("--fp8", action="store_true", help="FP8 block weights (default bf16)")
    ap.add_argument("--unpack", choices=["convert", "bits"], default="bits",
                    help="how FP8 codes become bf16 (decode_gemm.Tuning.unpack, set by decode_gemm.tuning(unpack=...))")
    ap.add_argument("--activations", choices=["bf16", "fp16"], default="bf16",
                    help="x's dtype (fp16 with --fp8: the hardware's conversion and W x^T; --unpack then unused)")
    ap.add_argument("--split-k", type=int, default=1, help="K slices of a proj launch (TileConfig.split_k)")
    ap.add_argument("--bias", action="store_true", help="projections with a bias (Qwen2's q/k/v)")
    ap.add_argument("--lora", action="store_true", help="with a LoRA adapter's up-projection at each tile's end")
    ap.add_argument("--pdl", action="store_true",
                    help="with --lora: launched beside its lora_down, waiting for it before the LoRA term")
    ap.add_argument("--chain", action="store_true",
                    help="launched dependently on the launch before it (decode_gemm.Tuning.chain), as the engine does")
    ap.add_argument("--tile", type=int, nargs=4, default=[32, 256, 4, 4],
                    metavar=("BLOCK_N", "BLOCK_K", "WARPS", "STAGES"), help="the TileConfig to compile")
    ap.add_argument("--rows", type=int, default=16, choices=[16, 32, 64], help="the row tile (BLOCK_M)")
    ap.add_argument("--dump", type=Path, default=None, help="also write .ttgir/.ptx/.cubin here")
    ap.add_argument("--json", action="store_true", help="print the loops as one JSON list instead")
    args = ap.parse_args()
    if args.kernel == "attention":
        loops = {way: [loop for loop in sass_loops(compile_attention(way == "rope").asm["cubin"])
                       if loop["instructions"] >= 8] for way in ("rope", "plain")}
        if args.json:
            print(json.dumps(loops))
            return
        for way, found in loops.items():
            for loop in found:
                print(f"attention ({way}): {loop['instructions']} instructions a warp per loop step")
                print("   ", " ".join(f"{op}:{n}" for op, n in list(loop["ops"].items())[:16]))
        return
    compiled = compile_kernel(args.kernel, args.fp8, tuple(args.tile), args.rows, lora=args.lora,
                              unpack=args.unpack, split_k=args.split_k, bias=args.bias, pdl=args.pdl,
                              chain=args.chain, activations=args.activations)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (args.dump / f"{args.kernel}.{ext}").write_text(compiled.asm[ext])
        (args.dump / f"{args.kernel}.cubin").write_bytes(compiled.asm["cubin"])
    if args.json:
        print(json.dumps(sass_loops(compiled.asm["cubin"])))
        return
    block_n, block_k = args.tile[:2]
    weights = ("fp8 (W x^T)" if args.activations == "fp16" else f"fp8 ({args.unpack})") if args.fp8 else "bf16"
    weights += f", {args.activations} activations"
    print(f"{args.kernel} {weights}, split_k {args.split_k}, tile {args.tile}, {args.rows} rows: "
          f"shared memory {compiled.metadata.shared} bytes")
    for loop in sass_loops(compiled.asm["cubin"]):
        if loop["instructions"] < 8:
            continue
        per_element = loop["instructions"] * args.tile[2] / (block_n * block_k)
        print(f"  loop: {loop['instructions']} instructions a warp per K step "
              f"({per_element:.3f} issue slots per weight element)")
        print("   ", " ".join(f"{op}:{n}" for op, n in list(loop["ops"].items())[:16]))


if __name__ == "__main__":
    main()
