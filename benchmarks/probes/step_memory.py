"""What the bench step's peak memory is made of: the live allocations at the peak, by the code that made them.

Issue 31 wants the bf16 peak of the bench step (16 rows of 128 + 512 tokens) below TRL's 4.54 GiB; ours was
4.89 GiB (2026-12-04). This runs `grpo.trainer.train` at the bench config as the suite does
(`bench_setup.step_config`) and records the CUDA allocator's history during one steady step (torch's
`_record_memory_history`, Python stacks). Replaying that step's allocations and frees finds the moment of its
peak and what was alive then: the blocks already held when the step began (weights, the adapters, the
optimizer's state, the engine's buffers), and those the step made, grouped by the innermost frame in grpo/
(file, line and function), with the frame outside grpo/ that made each. Then each `--chunk-mib` runs the same
steps with the log-prob kernel's chunk budget (`grpo.kernels.logprobs._CHUNK_BUDGET`) set to it: peak and step
time, to price the one candidate named so far.

    PYTHONPATH=$PWD python3 benchmarks/probes/step_memory.py --out DIR [--dtype bf16] [--chunk-mib 128 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_setup
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup as bs  # noqa: E402
from timing import Recorder, add_out_argument  # noqa: E402

GiB = 2**30


def grpo_frame(frames: list[dict]) -> tuple[str, str]:
    """(the innermost frame in grpo/, the innermost frame outside it) of an allocation's Python stack."""
    ours = next((f for f in frames if "/grpo/" in f["filename"]), None)
    other = next((f for f in frames if "/grpo/" not in f["filename"]), None)

    def name(f):
        return "-" if f is None else f"{f['filename'].rsplit('/', 2)[-2:][-1]}:{f['line']} {f['name']}"

    return name(ours), name(other)


def live_at_peak(held: dict[int, int], trace: list[dict]) -> tuple[int, dict[int, tuple[int, list]]]:
    """Replays `trace` (the allocator's entries of one step) over the blocks `held` when it began (address ->
    bytes). Returns the peak of allocated bytes and the live blocks then (address -> (bytes, frames); frames
    are [] for blocks held before the step)."""
    live = {addr: (size, []) for addr, size in held.items()}
    total = sum(held.values())
    peak, at_peak = total, dict(live)
    for entry in trace:
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            live[addr] = (entry["size"], entry.get("frames", []))
            total += entry["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    return peak, at_peak


def held_blocks() -> dict[int, int]:
    """The allocated blocks now (address -> bytes), from the allocator's segments."""
    held = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                held[addr] = block["size"]
            addr += block["size"]
    return held


def summarize(peak: int, live: dict[int, tuple[int, list]], top: int = 25) -> dict:
    groups: dict[str, int] = defaultdict(int)
    for size, frames in live.values():
        key = "held before the step" if not frames else " <- ".join(grpo_frame(frames))
        groups[key] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    biggest = sorted(((size, frames) for size, frames in live.values() if frames), key=lambda sf: -sf[0])[:top]
    return {"peak_gib": peak / GiB,
            "groups": [{"where": k, "gib": v / GiB} for k, v in ranked[:top]],
            "blocks": [{"mib": s / 2**20, "stack": [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                                                    for f in frames if "/grpo/" in f["filename"]][:6]
                        or [grpo_frame(frames)[1]]} for s, frames in biggest]}


def run_steps(cfg, record_step: int | None) -> dict:
    """Runs `cfg`; with `record_step`, records the allocator's history during that step (1-based)."""
    import grpo.trainer as trainer

    inner = trainer.grpo_step
    seen = {"n": 0, "result": None}

    def step(setup, index, in_flight):
        seen["n"] += 1
        if seen["n"] != record_step:
            return inner(setup, index, in_flight)
        torch.cuda.synchronize()
        held = held_blocks()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        try:
            return inner(setup, index, in_flight)
        finally:
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, live = live_at_peak(held, trace)
            seen["result"] = summarize(peak, live)
            seen["result"]["held_before_gib"] = sum(held.values()) / GiB
            seen["result"]["entries"] = len(trace)

    trainer.grpo_step = step
    try:
        trainer.train(cfg)
    finally:
        trainer.grpo_step = inner
    records = bs.read_metrics(cfg.output_dir)
    steady = records[2:] if len(records) > 2 else records
    return {"step_s": statistics.median(r["step_time"] for r in steady),
            "peak_gib": [round(r["peak_mem_gib"], 3) for r in records],
            "records": steady[-1], "replay": seen["result"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--steps", type=int, default=4, help="steps a run (the history is recorded in the third)")
    parser.add_argument("--chunk-mib", type=int, nargs="*", default=[128],
                        help="the log-prob kernel's chunk budgets to run the steps at besides 512 (MiB)")
    add_out_argument(parser)
    args = parser.parse_args()
    rec = Recorder("step_memory", args.out)
    import grpo.kernels.logprobs as logprobs

    root = Path(tempfile.mkdtemp(prefix="step-memory-"))
    model_dir = bs.build_model_dir(root / "model", size="1b", device="cuda")
    from transformers import AutoTokenizer

    prompts = bs.write_prompts(root / "prompts.jsonl", AutoTokenizer.from_pretrained(model_dir), bs.BENCH.prompt_len)
    for mib in [logprobs._CHUNK_BUDGET // 2**20, *args.chunk_mib]:
        logprobs._CHUNK_BUDGET = mib * 2**20
        cfg = bs.step_config(model_dir, prompts, bs.BENCH, fp8=args.dtype == "fp8", steps=args.steps,
                             output_dir=root / f"run-{mib}", cuda=True)
        bs.free_memory()
        out = run_steps(cfg, record_step=3 if mib == 512 else None)
        rec.record("run", dtype=args.dtype, chunk_mib=mib, step_s=out["step_s"], peak_gib=out["peak_gib"],
                   last=out["records"])
        rec.say(f"chunk {mib} MiB: step {out['step_s']:.3f} s, peaks {out['peak_gib']}")
        if out["replay"] is not None:
            r = out["replay"]
            rec.record("peak", dtype=args.dtype, **r)
            rec.say(f"replayed peak {r['peak_gib']:.3f} GiB ({r['entries']} entries; held before the step "
                    f"{r['held_before_gib']:.3f} GiB)")
            for g in r["groups"]:
                rec.say(f"  {g['gib']:7.3f} GiB  {g['where']}")


if __name__ == "__main__":
    main()
