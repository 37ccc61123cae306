"""The decode GEMM kernels on the GPU: correctness, a sweep of tile configs, and cuBLAS side by side.

Llama-3.2-1B decode shapes at 16 rows: q/k/v in one launch (2048 -> 2048 + 512 + 512), o_proj with
the residual (2048 -> 2048), gate/up with the SiLU product (2048 -> 2 x 8192), down_proj with the
residual (8192 -> 2048); bf16 and FP8 block weights; without and with rsLoRA r=32 (float32 adapters,
as peft keeps them). Each timing is a CUDA graph of 16 calls that rotate over copies of the weights
(more bytes than the 60 MB L2), replayed 20 times: the median per call, so launch gaps between
kernels count as they do inside the engine's graph.

    PYTHONPATH=$PWD python3 benchmarks/probes/decode_gemm_tiles.py [--budget-s 300]

Prints the best config per shape and its bandwidth; JSON lines to $OUT/decode_gemm.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from grpo.kernels import decode_gemm as dg
from grpo.kernels.fp8 import fp8_linear, quantize_fp8_block

ROWS = 16
T0 = time.perf_counter()
GROUPS = {  # name: (kind, K, output widths, residual)
    "gate_up": ("gated", 2048, [8192, 8192], False),
    "down": ("proj", 8192, [2048], True),
    "qkv": ("proj", 2048, [2048, 512, 512], False),
    "o": ("proj", 2048, [2048], True),
}


def log(**kw) -> None:
    kw["t"] = round(time.perf_counter() - T0, 1)
    print(json.dumps(kw), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_gemm.jsonl"), "a") as f:
            f.write(json.dumps(kw) + "\n")


def make_projs(k: int, widths: list[int], fp8: bool, rank: int, seed: int) -> list[dg.DecodeProj]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n in widths:
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        if fp8:
            codes, s = quantize_fp8_block(w)
            weight, scale = codes, s
        else:
            weight, scale = w.to(torch.bfloat16), None
        a = b = None
        if rank:
            a = torch.randn(rank, k, device="cuda", generator=g) / k**0.5
            b = torch.randn(n, rank, device="cuda", generator=g) * 0.01
        out.append(dg.DecodeProj(weight, scale, a, b, 64 / rank**0.5 if rank else 1.0))
    return out


def group_bytes(projs: list[dg.DecodeProj]) -> int:
    return sum(p.weight.numel() * p.weight.element_size() for p in projs)


def run_kernels(kind: str, x, projs, res):
    if kind == "gated":
        return dg.project_gated(x, projs[0], projs[1])
    return dg.project(x, projs, residual=res)[0]


def run_modules(kind: str, x, projs, res, fp8_module: bool = False):
    """What the engine does without the kernels: cuBLAS per projection, the LoRA chain as peft runs it."""
    outs = []
    for p in projs:
        if p.scale_inv is None:
            y = F.linear(x, p.weight)
        elif fp8_module:  # FP8Linear's own forward: activations quantized, blockwise _scaled_mm
            y = fp8_linear(x, p.weight, p.scale_inv)
        else:  # cuBLAS on the dequantized weight (a bf16 stand-in)
            y = F.linear(x, dg._dense_ref(p).to(torch.bfloat16))
        if p.lora_a is not None:
            y = (y + F.linear(F.linear(x.float(), p.lora_a), p.lora_b) * p.lora_scale).to(x.dtype)
        outs.append(y)
    if kind == "gated":
        return F.silu(outs[0]) * outs[1]
    return outs[0] + res if res is not None else outs[0]


def time_graph(fn, copies) -> float:
    """Median microseconds per call of fn(copy) over a graph of 16 calls rotating over `copies`."""
    calls = 16
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in copies[:2]:
            fn(c)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def configs(kind: str, fp8: bool, full: bool) -> list[dg.TileConfig]:
    """The sweep: every tile shape (`full`), or the few that won on the H200; projections also split
    over K in 2 and 4 slices (their few tiles leave SMs idle otherwise)."""
    if full:
        out = [dg.TileConfig(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 4))
               if not ((fp8 and bk == 512 and bn == 64) or (bn == 16 and bk == 128))]
        out += [dg.TileConfig(64, 256, 8, 3), dg.TileConfig(128, 128, 8, 3), dg.TileConfig(32, 256, 8, 4),
                dg.TileConfig(16, 256, 4, 6), dg.TileConfig(32, 128, 4, 6), dg.TileConfig(16, 512, 4, 5),
                dg.TileConfig(32, 512, 8, 3), dg.TileConfig(16, 256, 2, 4), dg.TileConfig(16, 512, 2, 4),
                dg.TileConfig(16, 256, 2, 6), dg.TileConfig(16, 1024, 2, 3), dg.TileConfig(32, 256, 2, 4)]
    else:
        out = [dg.TileConfig(bn, bk, 4, 4) for bn, bk in ((16, 256), (16, 512), (32, 128), (32, 256), (32, 512))]
    if kind == "proj":
        out += [dg.TileConfig(bn, bk, 4, st, split) for split in (2, 4)
                for bn, bk, st in ((32, 256, 4), (32, 256, 3), (32, 512, 3), (16, 512, 4), (64, 256, 4), (32, 128, 6))]
    return out


def check_group(name: str, fp8: bool, rank: int) -> None:
    kind, k, widths, residual = GROUPS[name]
    projs = make_projs(k, widths, fp8, rank, seed=1)
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(ROWS, widths[0], device="cuda", dtype=torch.bfloat16) if residual else None
    got = run_kernels(kind, x, projs, res).float()
    ref = (dg.project_gated_ref(x.float(), projs[0], projs[1]) if kind == "gated"
           else dg.project_ref(x.float(), projs, residual=None if res is None else res.float())[0])
    rel = ((got - ref).norm() / ref.norm()).item()
    cfg = dg.tile_config(kind, sum(widths), k, fp8)
    log(kind="check", group=name, fp8=fp8, rank=rank, cfg=cfg.__dict__, rel_err=round(rel, 6), ok=rel < 1e-2)


def compare_rows(name: str, fp8: bool, rows: int) -> None:
    """At `rows` rows: the tuned tiles (fitted to the rows) against the module path (cuBLAS for bf16,
    FP8Linear's blockwise _scaled_mm for FP8), and both with rsLoRA r32, checked."""
    kind, k, widths, residual = GROUPS[name]
    one = group_bytes(make_projs(k, widths, fp8, 0, seed=0))
    n_copies = max(2, -(-(256 << 20) // one))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(rows, widths[0], device="cuda", dtype=torch.bfloat16) if residual else None
    row = dict(kind="rows", group=name, fp8=fp8, rows=rows)
    for rank in (0, 32):
        copies = [make_projs(k, widths, fp8, rank, seed=i) for i in range(n_copies)]
        got = run_kernels(kind, x, copies[0], res).float()
        ref = (dg.project_gated_ref(x.float(), *copies[0][:2]) if kind == "gated"
               else dg.project_ref(x.float(), copies[0], None if res is None else res.float())[0])
        row[f"rel_err_r{rank}"] = round(((got - ref).norm() / ref.norm()).item(), 5)
        row[f"kernels_us_r{rank}"] = round(time_graph(lambda c: run_kernels(kind, x, c, res), copies), 2)
        row[f"modules_us_r{rank}"] = round(time_graph(lambda c: run_modules(kind, x, c, res, fp8_module=fp8),
                                                      copies), 2)
    log(**row)


def compare_unpack(name: str, modes: list[str]) -> None:
    """One group at its tuned tiles: bf16 beside FP8 with each way of unpacking the codes (FP8_UNPACK),
    each FP8 way checked against the reference, also with activations 2^-12 as large (tiny products)."""
    kind, k, widths, residual = GROUPS[name]
    row = dict(kind="unpack", group=name)
    chosen = dg.FP8_UNPACK
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(ROWS, widths[0], device="cuda", dtype=torch.bfloat16) if residual else None
    for fp8 in (False, True):
        one = group_bytes(make_projs(k, widths, fp8, 0, seed=0))
        copies = [make_projs(k, widths, fp8, 0, seed=i) for i in range(max(2, -(-(256 << 20) // one)))]
        for mode in modes if fp8 else ["bf16"]:
            if fp8:
                dg.FP8_UNPACK = mode
                for tag, xs in (("", x), ("_small", x * 2.0**-12)):
                    got = run_kernels(kind, xs, copies[0], None).float()
                    ref = (dg.project_gated_ref(xs.float(), *copies[0][:2]) if kind == "gated"
                           else dg.project_ref(xs.float(), copies[0])[0])
                    row[f"{mode}_rel_err{tag}"] = round(((got - ref).norm() / ref.norm()).item(), 5)
            us = time_graph(lambda c: run_kernels(kind, x, c, res), copies)
            row[f"{mode}_us"] = round(us, 2)
            row[f"{mode}_tbps"] = round(one / us / 1e6, 2)
    dg.FP8_UNPACK = chosen
    log(**row)


def sweep(name: str, fp8: bool, budget_s: float, full: bool) -> dg.TileConfig | None:
    kind, k, widths, residual = GROUPS[name]
    one = group_bytes(make_projs(k, widths, fp8, 0, seed=0))
    n_copies = max(2, -(-(256 << 20) // one))
    copies = [make_projs(k, widths, fp8, 0, seed=i) for i in range(n_copies)]
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(ROWS, widths[0], device="cuda", dtype=torch.bfloat16) if residual else None
    key = (kind, sum(widths), k, fp8)
    best = None
    for cfg in configs(kind, fp8, full):
        if time.perf_counter() - T0 > budget_s:
            log(kind="skipped", group=name, fp8=fp8, reason="budget")
            break
        dg.CONFIG_OVERRIDE[key] = cfg
        try:
            us = time_graph(lambda c: run_kernels(kind, x, c, res), copies)
        except Exception as exc:  # a config the compiler refuses (shared memory) is skipped, not fatal
            log(kind="config_error", group=name, fp8=fp8, cfg=cfg.__dict__, error=repr(exc)[:200])
            continue
        log(kind="config", group=name, fp8=fp8, cfg=cfg.__dict__, us=round(us, 2), tbps=round(one / us / 1e6, 2))
        if best is None or us < best[0]:
            best = (us, cfg)
    dg.CONFIG_OVERRIDE.pop(key, None)
    if best is None:
        return None
    dg.CONFIG_OVERRIDE[key] = best[1]
    cublas = time_graph(lambda c: run_modules(kind, x, c, res), copies) if not fp8 else None
    log(kind="best", group=name, fp8=fp8, cfg=best[1].__dict__, us=round(best[0], 2),
        tbps=round(one / best[0] / 1e6, 2), cublas_us=None if cublas is None else round(cublas, 2), bytes=one)
    # with LoRA r32, kernels (best config) against the module path
    lcopies = [make_projs(k, widths, fp8, 32, seed=i) for i in range(n_copies)]
    lk = time_graph(lambda c: run_kernels(kind, x, c, res), lcopies)
    lm = time_graph(lambda c: run_modules(kind, x, c, res), lcopies)
    log(kind="lora", group=name, fp8=fp8, kernels_us=round(lk, 2), modules_us=round(lm, 2))
    if fp8:  # diagnostic: the same codes read without their scales (what the scale multiply costs)
        bare = [[dg.DecodeProj(p.weight) for p in c] for c in copies]
        dg.CONFIG_OVERRIDE[(kind, sum(widths), k, False)] = best[1]
        log(kind="fp8_without_scales", group=name, us=round(time_graph(lambda c: run_kernels(kind, x, c, res), bare), 2))
        dg.CONFIG_OVERRIDE.pop((kind, sum(widths), k, False))
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this many seconds")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS))
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--pairs", nargs="+", default=None, metavar="GROUP:FORMAT",
                    help="sweep only these, e.g. gate_up:bf16 down:fp8 (default: every group x format)")
    ap.add_argument("--full", action="store_true", help="every tile shape, not only the few that won before")
    ap.add_argument("--engine", action="store_true", help="then time the native engine with the picked configs")
    ap.add_argument("--unpack", nargs="+", default=None, choices=sorted(dg._UNPACK_MODES),
                    help="instead of the sweep: each group in bf16 and in FP8 unpacked each of these ways "
                         "(decode_gemm.FP8_UNPACK); with --engine, the decode step per way too")
    ap.add_argument("--fp8-unpack", default=dg.FP8_UNPACK, choices=sorted(dg._UNPACK_MODES),
                    help="the FP8 unpacking the sweep and the engine runs use")
    ap.add_argument("--engine-rows", type=int, nargs="+", default=None,
                    help="instead of the sweep: the decode step at these row counts, kernels against modules")
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="instead of the sweep: the tuned tiles at these row counts against cuBLAS")
    args = ap.parse_args()
    import triton

    log(kind="env", torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name())
    dg.FP8_UNPACK = args.fp8_unpack
    if args.engine_rows:
        engine_rows(args.engine_rows)
        return
    if args.unpack:
        for name in args.groups:
            compare_unpack(name, args.unpack)
        if args.engine:
            engine_per_unpack(args.unpack)
        return
    if args.rows:
        for rows in args.rows:
            for name in args.groups:
                for fmt in args.formats:
                    compare_rows(name, fmt == "fp8", rows)
        return
    for name in args.groups:
        for fp8 in (False, True):
            for rank in (0, 32):
                check_group(name, fp8, rank)
    pairs = [p.split(":") for p in args.pairs] if args.pairs else [
        (name, fmt) for name in args.groups for fmt in args.formats]
    for name, fmt in pairs:
        sweep(name, fmt == "fp8", args.budget_s, args.full)
    for name, fmt in pairs:  # the picked configs, checked against the reference too
        for rank in (0, 32):
            check_group(name, fmt == "fp8", rank)
    print("\nCONFIG =", {k: v.__dict__ for k, v in dg.CONFIG_OVERRIDE.items()})
    if args.engine:  # the whole decode step with the configs just picked (same process)
        import native_engine as ngc
        from grpo.kernels.fp8 import quantize_linears_

        gemm = dict(compile="default", gemm="kernels")
        model = ngc.build_model()
        ngc.run_engine("bf16 kernels (sweep configs)", model, ngc.weight_bytes(model), engine_kw=gemm)
        fp8 = ngc.build_model()
        quantize_linears_(fp8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        ngc.run_engine("fp8 kernels (sweep configs)", fp8, ngc.weight_bytes(fp8), engine_kw=gemm)
        for label, m in (("bf16+LoRA", model), ("fp8+LoRA", fp8)):
            lora = ngc.add_lora(m)
            ngc.run_engine(f"{label} kernels (sweep configs)", lora, ngc.weight_bytes(lora), engine_kw=gemm)


def _models():
    import native_engine as ngc
    from grpo.kernels.fp8 import quantize_linears_

    fp8 = ngc.build_model()
    quantize_linears_(fp8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return ngc.build_model(), fp8


def engine_per_unpack(modes: list[str]) -> None:
    """The decode step (native engine, kernels, tuned tiles): bf16, then FP8 unpacked each way, then
    both with rsLoRA r32."""
    import native_engine as ngc

    gemm = dict(compile="default", gemm="kernels")
    model, fp8 = _models()
    ngc.run_engine("bf16 kernels", model, ngc.weight_bytes(model), engine_kw=gemm)
    chosen = dg.FP8_UNPACK
    for mode in modes:
        dg.FP8_UNPACK = mode
        ngc.run_engine(f"fp8 kernels ({mode})", fp8, ngc.weight_bytes(fp8), engine_kw=gemm)
    dg.FP8_UNPACK = chosen
    for label, m in (("bf16+LoRA", model), ("fp8+LoRA", fp8)):
        lora = ngc.add_lora(m)
        ngc.run_engine(f"{label} kernels", lora, ngc.weight_bytes(lora), engine_kw=gemm)


def engine_rows(rows_list: list[int]) -> None:
    """The decode step at more rows than 16, kernels (MAX_ROWS lifted) against the module path, bf16 and
    FP8: what decode_gemm.MAX_ROWS is set from."""
    import native_engine as ngc

    saved = dict(dg.MAX_ROWS)
    dg.MAX_ROWS.update({False: dg.KERNEL_ROWS, True: dg.KERNEL_ROWS})
    try:
        for label, m in zip(("bf16", "fp8"), _models()):
            for rows in rows_list:
                for gemm in ("kernels", "modules"):
                    ngc.run_engine(f"{label} {rows} rows {gemm}", m, ngc.weight_bytes(m),
                                   engine_kw=dict(compile="default", gemm=gemm), rows=rows)
    finally:
        dg.MAX_ROWS.update(saved)


if __name__ == "__main__":
    main()
