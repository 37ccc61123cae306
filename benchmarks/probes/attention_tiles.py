"""The decode attention kernel's launch choices, swept on the GPU at the sampler's row counts; the sweep that
writes them into a device's table.

Re-tuning a device is one run on it, after `decode_gemm_tiles.py --write-table` (both write the same file,
`grpo/kernels/tuned/<device key>.json`, each its own section):

    PYTHONPATH=$PWD python3 benchmarks/probes/attention_tiles.py --write-table

It sweeps every launch (`configs(full=True)`) at each --rows, checks the kernel against its reference, and
writes the launch closest to each row count's best (`pick`) as the device's `decode_attention` entry.

A decode step's attention as the product runs it (`decode_attention.rope_store_attend`: q and K rotated, the
token's K/V written, then every row's cache read to its own length), on Llama-3.2-1B's attention (32 query
heads over 8 kv heads of 64), each row halfway through the bench's completions (128 + 256 positions in a KV
bucket of 512). Each timing is a CUDA graph of 16 calls over 16 layers' caches (more bytes than the L2
holds at 64 rows and more), as the engine's graph runs them: microseconds a call, and the caches' bytes
read over that time against the copy bandwidth measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/probes/attention_tiles.py [--rows 16 64 256] [--budget-s 240] [--default-only]

Every figure goes to --out as JSON lines (timing.py): one `tiles` line a config, then the best per row count.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from grpo.kernels import tiles as device_tiles
from grpo.kernels.decode_attention import _launch as launch_attention
from grpo.kernels.decode_attention import rope_store_attend_ref
from grpo.kernels.tiles import AttentionTiles
from timing import Recorder, add_out_argument, copy_tbps, graph_us  # beside this file

HEADS, KV_HEADS, DIM, LAYERS = 32, 8, 64, 16
POSITION, BUCKET = 128 + 256, 512  # halfway through 512 new tokens after 128-token prompts; the KV bucket
MAX_SEQ = 640
MAX_ERROR = 2e-2  # bf16 outputs of order one: a few roundings of 2^-8, far below what a wrong launch gives


def problem(rows: int) -> tuple[dict, list[tuple]]:
    """The step's inputs (q, k, v, cos, sin, pos) and one (k_cache, v_cache) view pair a layer."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    angle = torch.rand(rows, DIM // 2, device="cuda", generator=g) * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], 1).to(torch.bfloat16)
    sin = torch.cat([angle.sin(), angle.sin()], 1).to(torch.bfloat16)
    inputs = dict(q=rand(rows, HEADS * DIM), k=rand(rows, KV_HEADS * DIM), v=rand(rows, KV_HEADS * DIM), cos=cos,
                  sin=sin, pos=torch.full((rows,), POSITION, device="cuda", dtype=torch.long))
    caches = [(rand(rows, KV_HEADS, MAX_SEQ, DIM)[:, :, :BUCKET], rand(rows, KV_HEADS, MAX_SEQ, DIM)[:, :, :BUCKET])
              for _ in range(LAYERS)]
    return inputs, caches


def call(inputs: dict, caches: tuple, tiles: AttentionTiles) -> torch.Tensor:
    """`decode_attention.rope_store_attend`'s launches with `tiles` (its shape checks left out: the shapes are
    this probe's own)."""
    rows = inputs["q"].shape[0]
    q3 = inputs["q"].view(rows, HEADS, DIM)
    out = torch.empty_like(q3)
    new_kv = (inputs["k"], inputs["v"], inputs["cos"], inputs["sin"])
    launch_attention(q3, caches[0], caches[1], inputs["pos"], DIM**-0.5, out, new_kv, tiles)
    return out


def max_error(rows: int, tiles: AttentionTiles) -> float:
    """The largest absolute difference of the launch with `tiles` from `rope_store_attend_ref`, at `rows` rows."""
    inputs, caches = problem(rows)
    want = rope_store_attend_ref(**inputs, k_cache=caches[0][0].clone(), v_cache=caches[0][1].clone(),
                                 scale=DIM**-0.5)
    got = call(inputs, caches[0], tiles)
    return float((got.float() - want.float()).abs().max())


def configs(full: bool) -> list[AttentionTiles]:
    """Loop steps, warps and stages at two programs an SM, and the default launch at 1, 4 and 8 programs an SM;
    `full` adds 32-position steps, 2 warps and one stage."""
    blocks, warps, stages = ((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)) if full else ((64, 128), (4, 8), (2, 3, 4))
    out = [AttentionTiles(b, w, s) for b, w, s in itertools.product(blocks, warps, stages)]
    return out + [AttentionTiles(64, 4, 3, programs_per_sm=p) for p in (1, 4, 8)]


def pick(timings: dict[int, dict[AttentionTiles, float]]) -> AttentionTiles | None:
    """The launch for every row count: of those timed at each (rows -> tiles -> microseconds), the one whose
    times, each over its row count's best, add up least (None when none was timed at every row count)."""
    if not timings:
        return None
    best = {rows: min(times.values()) for rows, times in timings.items()}
    everywhere = set.intersection(*(set(times) for times in timings.values()))
    score = {tiles: sum(timings[rows][tiles] / best[rows] for rows in timings) for tiles in everywhere}
    return min(score, key=score.get, default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this many seconds")
    ap.add_argument("--full", action="store_true", help="block 32 too, 2 warps, one stage")
    ap.add_argument("--default-only", action="store_true",
                    help="time the device's launch alone (an A/B of the kernel between two commits)")
    ap.add_argument("--write-table", action="store_true",
                    help="sweep every launch (--full) and write the pick into this GPU's table")
    ap.add_argument("--table", default=None,
                    help="with --write-table: the file to write (default: grpo/kernels/tuned/<this device's key>.json)")
    add_out_argument(ap)
    args = ap.parse_args()
    rec = Recorder("attention_tiles", args.out)
    copy = copy_tbps()
    table = device_tiles.device_table(torch.device("cuda", torch.cuda.current_device()))
    rec.record("env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), copy_tbps=round(copy, 3),
               device_key=table.key)
    budget_s = float("inf") if args.write_table else args.budget_s  # a table is written from a whole sweep
    timings: dict[int, dict[AttentionTiles, float]] = {}
    for rows in args.rows:
        rec.record("check", rows=rows, max_abs_err=max_error(rows, table.attention))
        inputs, caches = problem(rows)
        read = 2 * rows * KV_HEADS * (POSITION + 1) * DIM * 2  # K and V, bf16, every row to its length
        best = None
        for tiles in [table.attention] if args.default_only else configs(args.full or args.write_table):
            if rec.elapsed_s() > budget_s:
                rec.record("skipped", rows=rows, reason="time budget")
                break
            try:
                us = graph_us(lambda c, t=tiles: call(inputs, c, t), caches)
            except Exception as exc:  # a config Triton cannot fit: recorded, the sweep goes on
                rec.record("error", rows=rows, tiles=vars(tiles), error=repr(exc)[:300])
                continue
            row = rec.record("tiles", rows=rows, tiles=vars(tiles), us=round(us, 2),
                             of_copy=round(read / (us * 1e-6) / (copy * 1e12), 3),
                             default=tiles == table.attention)
            timings.setdefault(rows, {})[tiles] = us
            if best is None or row["us"] < best["us"]:
                best = row
        if best is not None:
            rec.record("best", **{k: v for k, v in best.items() if k not in ("kind", "t")})
        del caches
        torch.cuda.empty_cache()
    if args.write_table and (chosen := pick(timings)) is not None:
        errors = [max_error(rows, chosen) for rows in args.rows]
        rec.record("check", tiles=vars(chosen), max_abs_err=max(errors))
        if max(errors) > MAX_ERROR:
            raise SystemExit(f"attention_tiles: {chosen} is {max(errors)} off its reference; no table written")
        path = args.table or device_tiles.TABLES / f"{table.key}.json"
        device_tiles.write_table(path, attention=chosen)
        rec.record("table", path=str(path), attention=vars(chosen))


if __name__ == "__main__":
    main()
