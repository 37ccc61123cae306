"""The decode GEMM kernels on the GPU: the sweep that writes a device's tile table, and the comparisons behind
the kernels' defaults.

Re-tuning a device (a GPU whose table `grpo/kernels/tuned/<device key>.json` is missing, or after a kernel
change) is one run on it:

    PYTHONPATH=$PWD python3 benchmarks/probes/decode_gemm_tiles.py --write-table

It sweeps every tile config (`configs`) over each launch the product makes (`PRODUCT_SWEEPS`: Llama-3.2-1B's
projection groups in bf16 and FP8 at 16 and 64 rows, on fp16 activations at 16, the packaged Qwen2.5-Coder-1.5B's
in bf16 at 64), checks each group's fastest config against its float32 reference with and without rsLoRA, and writes
the checked picks into the device's table (`grpo.kernels.tiles.write_table`: the entries it sweeps replaced, the
others kept); commit the file. `--table PATH` writes elsewhere; `--formats` sweeps only those.

The groups: q/k/v in one launch (2048 -> 2048 + 512 + 512), o_proj with the residual (2048 -> 2048), gate/up
with the SiLU product (2048 -> 2 x 8192), down_proj with the residual (8192 -> 2048); `qwen_*` the packaged
Qwen2.5-Coder-1.5B's (hidden 1536, MLP 8960). Each timing is a CUDA graph of 16 calls that rotate over copies
of the weights (more bytes than the L2 holds), replayed 20 times: the median per call, so launch gaps between
kernels count as they do inside the engine's graph.

Without --write-table: a sweep of the --groups and --formats at --sweep-rows within --budget-s, each best
config against cuBLAS, printed as CONFIG (nothing written); `--engine` then times the native engine's decode
step with the picks. `--unpack`, `--rows`, `--lora-down` and `--engine-rows` run the comparisons behind the
kernels' defaults instead (see --help). Every figure goes to --out as JSON lines (timing.py).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from grpo.config import LORA_TARGETS
from grpo.kernels import decode_gemm as dg
from grpo.kernels import tiles
from grpo.kernels.fp8 import dequantize_fp8_block, fp8_linear, quantize_fp8_block, quantize_linears_
from timing import Recorder, add_out_argument, graph_us  # beside this file

ROWS = 16
LLAMA_GROUPS = {  # name: (kind, K, output widths, residual)
    "gate_up": ("gated", 2048, [8192, 8192], False),
    "down": ("proj", 8192, [2048], True),
    "qkv": ("proj", 2048, [2048, 512, 512], False),
    "o": ("proj", 2048, [2048], True),
}
QWEN_GROUPS = {  # the packaged Qwen2.5-Coder-1.5B's (hidden 1536, MLP 8960, 2 kv heads of 128)
    "qwen_gate_up": ("gated", 1536, [8960, 8960], False),
    "qwen_down": ("proj", 8960, [1536], True),
    "qwen_qkv": ("proj", 1536, [1536, 256, 256], False),
    "qwen_o": ("proj", 1536, [1536], True),
}
GROUPS = LLAMA_GROUPS | QWEN_GROUPS
# What --write-table sweeps: (rows, group, format) for each launch the product makes. 16 rows: the training
# step's decode; 64: the sampler's wider batches (launches of 33-64 rows read those tiles first); FP8 on fp16
# activations at 16 rows (wider launches read those); the packaged Qwen runs in bf16 at its preset's 64 rows.
PRODUCT_SWEEPS = ([(rows, name, fmt) for rows in (16, 64) for name in LLAMA_GROUPS for fmt in ("bf16", "fp8")]
                  + [(16, name, "fp8-fp16") for name in LLAMA_GROUPS] + [(64, name, "bf16") for name in QWEN_GROUPS])
# A format: the weights' (FP8 or not) and the activations' dtype. fp8-fp16: FP8 weights multiplied W x^T on fp16
# activations (decode_gemm._w_first; the native engine's EngineTuning.fp8_activations).
FORMATS = {"bf16": (False, torch.bfloat16), "fp8": (True, torch.bfloat16), "fp8-fp16": (True, torch.float16)}


def tile_key(name: str, fmt: str) -> tiles.GemmKey:
    """The group's key in `dg.tuning(tiles=...)` and the device's table in a format of FORMATS."""
    kind, k, widths, _ = GROUPS[name]
    fp8, act = FORMATS[fmt]
    return tiles.GemmKey(kind, sum(widths), k, fp8, "fp16" if act == torch.float16 else "bf16")


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
            y = F.linear(x, dequantize_fp8_block(p.weight, p.scale_inv))
        if p.lora_a is not None:
            y = (y + F.linear(F.linear(x.float(), p.lora_a), p.lora_b) * p.lora_scale).to(x.dtype)
        outs.append(y)
    if kind == "gated":
        return F.silu(outs[0]) * outs[1]
    return outs[0] + res if res is not None else outs[0]


def configs(kind: str, fmt: str) -> list[dg.TileConfig]:
    """The sweep: tile shapes of 16-64 outputs (128 with 8 warps) and K steps of 128-1024, 2-6 stages, each one
    the kernels take for the format; projections also split over K in 2 and 4 slices (their few tiles leave
    SMs idle otherwise). fp8-fp16 (W x^T): `w_first_configs`."""
    fp8 = FORMATS[fmt][0]
    if fmt == "fp8-fp16":
        return w_first_configs(kind)
    out = [dg.TileConfig(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 4))
           if not ((fp8 and bk == 512 and bn == 64) or (bn == 16 and bk == 128))]
    out += [dg.TileConfig(64, 256, 8, 3), dg.TileConfig(128, 128, 8, 3), dg.TileConfig(32, 256, 8, 4),
            dg.TileConfig(16, 256, 4, 6), dg.TileConfig(32, 128, 4, 6), dg.TileConfig(16, 512, 4, 5),
            dg.TileConfig(32, 512, 8, 3), dg.TileConfig(16, 256, 2, 4), dg.TileConfig(16, 512, 2, 4),
            dg.TileConfig(16, 256, 2, 6), dg.TileConfig(16, 1024, 2, 3), dg.TileConfig(32, 256, 2, 4)]
    out = [cfg for cfg in out if tiles.tile_problem(kind, fp8, cfg) is None]
    if kind == "proj":
        out += [dg.TileConfig(bn, bk, 4, st, split) for split in (2, 4)
                for bn, bk, st in ((32, 256, 4), (32, 256, 3), (32, 512, 3), (16, 512, 4), (64, 256, 4), (32, 128, 6))]
    return out


def check_group(rec: Recorder, name: str, fmt: str, rank: int, rows: int = ROWS) -> bool:
    """The group's launch with the tiles in force against its float32 reference: whether it is within 1e-2."""
    kind, k, widths, residual = GROUPS[name]
    fp8, act = FORMATS[fmt]
    projs = make_projs(k, widths, fp8, rank, seed=1)
    x = torch.randn(rows, k, device="cuda", dtype=act)
    res = torch.randn(rows, widths[0], device="cuda", dtype=act) if residual else None
    got = run_kernels(kind, x, projs, res).float()
    ref = (dg.project_gated_ref(x.float(), projs[0], projs[1]) if kind == "gated"
           else dg.project_ref(x.float(), projs, residual=None if res is None else res.float())[0])
    rel = ((got - ref).norm() / ref.norm()).item()
    cfg = dg.tile_config(tile_key(name, fmt), rows, x.device)
    rec.record("check", group=name, format=fmt, rank=rank, rows=rows, cfg=cfg.__dict__, rel_err=round(rel, 6),
               ok=rel < 1e-2)
    return rel < 1e-2


def compare_rows(rec: Recorder, name: str, fp8: bool, rows: int) -> None:
    """At `rows` rows: the device's tiles (fitted to the rows) against the module path (cuBLAS for bf16,
    FP8Linear's blockwise _scaled_mm for FP8), and both with rsLoRA r32, checked; the kernels with rsLoRA also
    launched after their lora_down (`dg.tuning(pdl=False)`) and beside it (pdl=True, the default)."""
    kind, k, widths, residual = GROUPS[name]
    one = group_bytes(make_projs(k, widths, fp8, 0, seed=0))
    n_copies = max(2, -(-(256 << 20) // one))
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(rows, widths[0], device="cuda", dtype=torch.bfloat16) if residual else None
    row = dict(kind="rows", group=name, fp8=fp8, rows=rows)
    for rank in (0, 32):
        copies = [make_projs(k, widths, fp8, rank, seed=i) for i in range(n_copies)]
        with dg.tuning(pdl=False):
            got = run_kernels(kind, x, copies[0], res).float()
            ref = (dg.project_gated_ref(x.float(), *copies[0][:2]) if kind == "gated"
                   else dg.project_ref(x.float(), copies[0], None if res is None else res.float())[0])
            row[f"rel_err_r{rank}"] = round(((got - ref).norm() / ref.norm()).item(), 5)
            row[f"kernels_us_r{rank}"] = round(graph_us(lambda c: run_kernels(kind, x, c, res), copies), 2)
        row[f"modules_us_r{rank}"] = round(graph_us(lambda c: run_modules(kind, x, c, res, fp8_module=fp8),
                                                    copies), 2)
    try:
        with dg.tuning(pdl=True):  # the adapter's launch beside its lora_down (Tuning.pdl), checked and timed
            got = run_kernels(kind, x, copies[0], res).float()
            row["rel_err_r32_pdl"] = round(((got - ref).norm() / ref.norm()).item(), 5)
            row["kernels_us_r32_pdl"] = round(graph_us(lambda c: run_kernels(kind, x, c, res), copies), 2)
    except Exception as exc:  # its first run on a GPU: a failure is recorded, the plain figures still kept
        row["pdl_error"] = repr(exc)[:300]
    rec.record(**row)


def compare_unpack(rec: Recorder, name: str, modes: list[str]) -> None:
    """One group at the device's tiles: bf16 beside FP8 with each way of unpacking the codes (`dg.Tuning.unpack`),
    each FP8 way checked against the reference, also with activations 2^-12 as large (tiny products)."""
    kind, k, widths, residual = GROUPS[name]
    row = dict(kind="unpack", group=name)
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(ROWS, widths[0], device="cuda", dtype=torch.bfloat16) if residual else None
    for fp8 in (False, True):
        one = group_bytes(make_projs(k, widths, fp8, 0, seed=0))
        copies = [make_projs(k, widths, fp8, 0, seed=i) for i in range(max(2, -(-(256 << 20) // one)))]
        for mode in modes if fp8 else ["bf16"]:
            with dg.tuning(unpack=mode if fp8 else None):
                if fp8:
                    for tag, xs in (("", x), ("_small", x * 2.0**-12)):
                        got = run_kernels(kind, xs, copies[0], None).float()
                        ref = (dg.project_gated_ref(xs.float(), *copies[0][:2]) if kind == "gated"
                               else dg.project_ref(xs.float(), copies[0])[0])
                        row[f"{mode}_rel_err{tag}"] = round(((got - ref).norm() / ref.norm()).item(), 5)
                us = graph_us(lambda c: run_kernels(kind, x, c, res), copies)
            row[f"{mode}_us"] = round(us, 2)
            row[f"{mode}_tbps"] = round(one / us / 1e6, 2)
    rec.record(**row)


def w_first_configs(kind: str) -> list[dg.TileConfig]:
    """Tiles for W x^T (FP8 weights, fp16 activations: `dg._w_first`): 16-32 weight rows a warp, so that no two
    warps convert the same codes; projections also split over K."""
    if kind == "gated":
        base = [(64, 256, 2, 3), (64, 128, 2, 4), (64, 256, 2, 4), (32, 256, 2, 4), (32, 256, 1, 4),
                (16, 256, 1, 4), (64, 256, 4, 3), (128, 256, 4, 3), (128, 128, 4, 4), (32, 256, 4, 3)]
        return [dg.TileConfig(*t) for t in base]
    base = [(64, 256, 2, 3), (64, 128, 2, 4), (32, 256, 2, 4), (32, 256, 1, 4), (128, 256, 4, 3), (32, 256, 4, 3)]
    return [dg.TileConfig(*t, split_k=s) for t in base for s in (4, 2, 1)]


def compare_fp16_activations(rec: Recorder, name: str, budget_s: float) -> None:
    """One FP8 group: bf16 activations at the device's tiles (the product, codes unpacked by bit moves) against
    fp16 activations (W x^T, the hardware's E4M3 -> f16 conversion) over `w_first_configs`, each checked against
    its float32 reference; the fastest fp16 one recorded as `best_fp16`."""
    kind, k, widths, residual = GROUPS[name]
    one = group_bytes(make_projs(k, widths, True, 0, seed=0))
    copies = [make_projs(k, widths, True, 0, seed=i) for i in range(max(2, -(-(256 << 20) // one)))]
    x32 = torch.randn(ROWS, k, device="cuda")
    res32 = torch.randn(ROWS, widths[0], device="cuda") if residual else None
    best = None
    for act in (torch.bfloat16, torch.float16):
        x, res = x32.to(act), None if res32 is None else res32.to(act)
        ref = (dg.project_gated_ref(x.float(), *copies[0][:2]) if kind == "gated"
               else dg.project_ref(x.float(), copies[0], None if res is None else res.float())[0])
        for cfg in [None] if act == torch.bfloat16 else w_first_configs(kind):
            if rec.elapsed_s() > budget_s:
                return
            try:
                with dg.tuning(tiles={} if cfg is None else {tile_key(name, "fp8-fp16"): cfg}):
                    got = run_kernels(kind, x, copies[0], res).float()
                    us = graph_us(lambda c: run_kernels(kind, x, c, res), copies)
            except Exception as exc:  # a config the compiler refuses (shared memory) is skipped, not fatal
                rec.record("config_error", group=name, cfg=cfg.__dict__, error=repr(exc)[:200])
                continue
            row = dict(group=name, activations=str(act).split(".")[-1], cfg=None if cfg is None else cfg.__dict__,
                       us=round(us, 2), tbps=round(one / us / 1e6, 2),
                       rel_err=round(((got - ref).norm() / ref.norm()).item(), 5))
            rec.record("fp16_activations", **row)
            if cfg is not None and (best is None or us < best["us"]):
                best = row
    if best is not None:
        rec.record("best_fp16", **best)


def compare_lora_down(rec: Recorder, name: str, rows: int) -> None:
    """The adapters' down-projection of one group alone (`dg.lora_down`, rsLoRA r32, float32 A as peft keeps
    it), at the product's split of K (`dg.lora_split`) and over other splits and K steps, each checked
    against x A^T in float32: what the split-K launch costs before the projection can add its LoRA term."""
    kind, k, widths, _ = GROUPS[name]
    rank = 32
    one = len(widths) * rank * k * 4
    copies = [[torch.randn(rank, k, device="cuda") / k**0.5 for _ in widths]
              for _ in range(max(2, -(-(256 << 20) // one)))]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = torch.stack([x.float() @ a.T for a in copies[0]])
    splits = sorted({dg.lora_split(k), *[s for s in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s * 64 <= k]})
    for split, block_k in itertools.product(splits, (64, 128)):
        per = -(-(-(-k // split)) // block_k) * block_k  # a slice's columns, whole K steps (as the kernel has it)
        slices = -(-k // per)  # the programs (per adapter) with work; the other split - slices add zeros
        product = split == dg.lora_split(k) and block_k == 64
        if slices < split and not product:
            continue
        got = dg.lora_down(x, copies[0], rank, split=split, block_k=block_k)[:, :rows]
        us = graph_us(lambda c: dg.lora_down(x, c, rank, split=split, block_k=block_k), copies)
        rec.record("lora_down", group=name, rows=rows, adapters=len(widths), k=k, split=split, slices=slices,
                   block_k=block_k, product=product, us=round(us, 2),
                   rel_err=round(((got - ref).norm() / ref.norm()).item(), 6))


def sweep(rec: Recorder, name: str, fmt: str, budget_s: float, rows: int = ROWS) -> dg.TileConfig | None:
    """Time each config of the sweep on one group and format at `rows` rows; the fastest is timed against
    cuBLAS (bf16) and with rsLoRA, and returned (None when none ran). Each config is in force only while it is
    timed."""
    kind, k, widths, residual = GROUPS[name]
    fp8, act = FORMATS[fmt]
    one = group_bytes(make_projs(k, widths, fp8, 0, seed=0))
    n_copies = max(2, -(-(256 << 20) // one))
    copies = [make_projs(k, widths, fp8, 0, seed=i) for i in range(n_copies)]
    x = torch.randn(rows, k, device="cuda", dtype=act)
    res = torch.randn(rows, widths[0], device="cuda", dtype=act) if residual else None
    key = tile_key(name, fmt)
    best = None
    for cfg in configs(kind, fmt):
        if rec.elapsed_s() > budget_s:
            rec.record("skipped", group=name, format=fmt, reason="budget")
            break
        try:
            with dg.tuning(tiles={key: cfg}):
                us = graph_us(lambda c: run_kernels(kind, x, c, res), copies)
        except Exception as exc:  # a config the compiler refuses (shared memory) is skipped, not fatal
            rec.record("config_error", group=name, format=fmt, cfg=cfg.__dict__, error=repr(exc)[:200])
            continue
        rec.record("config", group=name, format=fmt, rows=rows, cfg=cfg.__dict__, us=round(us, 2),
                   tbps=round(one / us / 1e6, 2))
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is None:
        return None
    best_us, best_cfg = best
    cublas = graph_us(lambda c: run_modules(kind, x, c, res), copies) if fmt == "bf16" else None
    rec.record("best", group=name, format=fmt, rows=rows, cfg=best_cfg.__dict__, us=round(best_us, 2),
        tbps=round(one / best_us / 1e6, 2), cublas_us=None if cublas is None else round(cublas, 2), bytes=one)
    # with LoRA r32, kernels (best config) against the module path
    lcopies = [make_projs(k, widths, fp8, 32, seed=i) for i in range(n_copies)]
    with dg.tuning(tiles={key: best_cfg}):
        lk = graph_us(lambda c: run_kernels(kind, x, c, res), lcopies)
    lm = graph_us(lambda c: run_modules(kind, x.bfloat16(), c, None if res is None else res.bfloat16()), lcopies)
    rec.record("lora", group=name, format=fmt, kernels_us=round(lk, 2), modules_us=round(lm, 2))
    return best_cfg


def build_models():
    """The bf16 Llama-3.2-1B-shaped model and an FP8 copy of it (native_engine.py builds both)."""
    import native_engine as ngc

    fp8 = ngc.build_model()
    quantize_linears_(fp8, LORA_TARGETS)
    return ngc.build_model(), fp8


def engine_with_configs(rec: Recorder) -> None:
    """The whole decode step with the tiles in force (the caller's `dg.tuning` block holds the sweep's
    picks): bf16, FP8, and both with rsLoRA r32."""
    import native_engine as ngc

    gemm = dict(compile="default", gemm="kernels")
    model, fp8 = build_models()
    ngc.run_engine(rec, "bf16 kernels (sweep configs)", model, ngc.weight_bytes(model), engine_kw=gemm)
    ngc.run_engine(rec, "fp8 kernels (sweep configs)", fp8, ngc.weight_bytes(fp8), engine_kw=gemm)
    for label, m in (("bf16+LoRA", model), ("fp8+LoRA", fp8)):
        lora = ngc.add_lora(m)
        ngc.run_engine(rec, f"{label} kernels (sweep configs)", lora, ngc.weight_bytes(lora), engine_kw=gemm)


def engine_per_unpack(rec: Recorder, modes: list[str]) -> None:
    """The decode step (native engine, kernels, the device's tiles): bf16, then FP8 unpacked each way, then
    both with rsLoRA r32."""
    import native_engine as ngc

    gemm = dict(compile="default", gemm="kernels")
    model, fp8 = build_models()
    ngc.run_engine(rec, "bf16 kernels", model, ngc.weight_bytes(model), engine_kw=gemm)
    for mode in modes:
        with dg.tuning(unpack=mode):  # the graphs captured inside keep this unpacking
            ngc.run_engine(rec, f"fp8 kernels ({mode})", fp8, ngc.weight_bytes(fp8), engine_kw=gemm)
    for label, m in (("bf16+LoRA", model), ("fp8+LoRA", fp8)):
        lora = ngc.add_lora(m)
        ngc.run_engine(rec, f"{label} kernels", lora, ngc.weight_bytes(lora), engine_kw=gemm)


def engine_rows(rec: Recorder, rows_list: list[int]) -> None:
    """The decode step at more rows than 16, kernels (at every row count they take, whatever the engine's
    default `EngineTuning.kernel_rows`) against the module path, bf16 and FP8: what that default is set from."""
    import native_engine as ngc

    for label, m in zip(("bf16", "fp8"), build_models()):
        for rows in rows_list:
            for gemm in ("kernels", "modules"):
                kw = dict(compile="default", gemm=gemm, kernel_rows=dg.MAX_ROWS)
                ngc.run_engine(rec, f"{label} {rows} rows {gemm}", m, ngc.weight_bytes(m), engine_kw=kw, rows=rows)


def sweep_into_table(rec: Recorder, path, formats=tuple(FORMATS)) -> None:
    """--write-table: each launch of PRODUCT_SWEEPS in `formats` swept, its fastest config checked with and without
    rsLoRA, and the checked picks written into the table at `path` (the other entries kept)."""
    picked: dict[int, dict[tuple, dg.TileConfig]] = {}  # rows -> tile_key -> the sweep's fastest config
    for rows, name, fmt in PRODUCT_SWEEPS:
        if fmt not in formats:
            continue
        cfg = sweep(rec, name, fmt, float("inf"), rows)  # no budget: a table is written from a whole sweep
        if cfg is None:
            continue
        with dg.tuning(tiles={tile_key(name, fmt): cfg}):
            if all([check_group(rec, name, fmt, rank, rows) for rank in (0, 32)]):
                picked.setdefault(rows, {})[tile_key(name, fmt)] = cfg
    tiles.write_table(path, gemm=picked)
    rec.record("table", path=str(path), entries={rows: len(section) for rows, section in picked.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-table", action="store_true",
                    help="sweep every launch the product makes on this GPU and write the picks into its tile table")
    ap.add_argument("--table", default=None,
                    help="with --write-table: the file to write (default: grpo/kernels/tuned/<this device's key>.json)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this many seconds")
    ap.add_argument("--groups", nargs="+", default=list(LLAMA_GROUPS), choices=list(GROUPS),
                    help="the projection groups (default: Llama-3.2-1B's; qwen_*: the packaged Qwen2.5-Coder-1.5B's)")
    ap.add_argument("--sweep-rows", type=int, default=ROWS, choices=[16, 32, 64],
                    help="rows of the checks and the sweep (the sampler's wider batches: 64)")
    ap.add_argument("--formats", nargs="+", default=None, choices=list(FORMATS),
                    help="weights and activations: bf16, fp8 (on bf16 activations), fp8-fp16 (on fp16 ones, W x^T); "
                         "default: bf16 and fp8, with --write-table all three (its other entries are kept)")
    ap.add_argument("--pairs", nargs="+", default=None, metavar="GROUP:FORMAT",
                    help="sweep only these, e.g. gate_up:bf16 down:fp8 (default: every group x format)")
    ap.add_argument("--engine", action="store_true", help="then time the native engine with the picked configs")
    ap.add_argument("--unpack", nargs="+", default=None, choices=sorted(dg._UNPACK_MODES),
                    help="instead of the sweep: each group in bf16 and in FP8 unpacked each of these ways "
                         "(decode_gemm.tuning(unpack=...)); with --engine, the decode step per way too")
    ap.add_argument("--fp16-activations", action="store_true",
                    help="instead of the sweep: each group's FP8 launch with bf16 activations (the product) "
                         "against fp16 ones (W x^T) over a few tiles, within --budget-s")
    ap.add_argument("--engine-rows", type=int, nargs="+", default=None,
                    help="instead of the sweep: the decode step at these row counts, kernels against modules")
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="instead of the sweep: the device's tiles at these row counts against cuBLAS")
    ap.add_argument("--lora-down", action="store_true",
                    help="instead of the sweep: each group's LoRA down-projection alone over splits of K, at "
                         "the --rows (default: --sweep-rows)")
    add_out_argument(ap)
    args = ap.parse_args()
    if args.formats is None:
        args.formats = list(FORMATS) if args.write_table else ["bf16", "fp8"]
    if args.rows and "fp8-fp16" in args.formats:
        ap.error("--rows compares the kernels with the modules on bf16 activations: --formats bf16 fp8")
    import triton

    rec = Recorder("decode_gemm_tiles", args.out)
    device = torch.device("cuda", torch.cuda.current_device())
    key = tiles.device_table(device).key
    rec.record("env", torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
               device_key=key)
    if args.write_table:
        sweep_into_table(rec, args.table or tiles.TABLES / f"{key}.json", args.formats)
        return
    run(rec, args)


def run(rec: Recorder, args: argparse.Namespace) -> None:
    """The comparison the flags ask for, else the checks, the sweep, and the picked tiles checked again
    (and with --engine, the decode step with them)."""
    if args.engine_rows:
        engine_rows(rec, args.engine_rows)
        return
    if args.fp16_activations:
        for name in args.groups:
            compare_fp16_activations(rec, name, args.budget_s)
        return
    if args.unpack:
        for name in args.groups:
            compare_unpack(rec, name, args.unpack)
        if args.engine:
            engine_per_unpack(rec, args.unpack)
        return
    if args.lora_down:
        for rows in args.rows or [args.sweep_rows]:
            for name in args.groups:
                compare_lora_down(rec, name, rows)
        return
    if args.rows:
        for rows in args.rows:
            for name in args.groups:
                for fmt in args.formats:
                    compare_rows(rec, name, fmt == "fp8", rows)
        return
    for name in args.groups:
        for fmt in FORMATS:
            for rank in (0, 32):
                check_group(rec, name, fmt, rank, args.sweep_rows)
    pairs = [p.split(":") for p in args.pairs] if args.pairs else [
        (name, fmt) for name in args.groups for fmt in args.formats]
    picked: dict[tuple, dg.TileConfig] = {}  # tile_key -> the sweep's fastest config
    for name, fmt in pairs:
        cfg = sweep(rec, name, fmt, args.budget_s, args.sweep_rows)
        if cfg is not None:
            picked[tile_key(name, fmt)] = cfg
    with dg.tuning(tiles=picked):
        for name, fmt in pairs:  # the picked configs, checked against the reference too
            for rank in (0, 32):
                check_group(rec, name, fmt, rank, args.sweep_rows)
        print("\nCONFIG =", {k: v.__dict__ for k, v in picked.items()})
        if args.engine:
            engine_with_configs(rec)


if __name__ == "__main__":
    main()
