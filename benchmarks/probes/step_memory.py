"""What the bench step's peak memory is made of: the live allocations at the peak, by the code that made them.

Issue 31 wants the bf16 peak of the bench step (16 rows of 128 + 512 tokens) below TRL's (benchmarks/RESULTS.md).
This runs `grpo.trainer.train` at the bench config as the suite does
(`bench_setup.step_config`) and records the CUDA allocator's history from the run's start to the end of its
third step (torch's `_record_memory_history`, Python stacks; `--stacks all`: C++ too). Replaying it finds the
moment of that step's peak and what was alive then, grouped by the innermost frame in grpo/ (file, line and
function) with the frame outside grpo/ that made each. Autograd's backward runs without Python frames: what it
allocates is one group, or with `--stacks all` one group per autograd node (MmBackward0, ...).
Then the same steps with transformers' own MLP and norms (`--no-lean-activations`), with the engine released
before each training pass (`--engine-standby release`: where the peak goes without the KV cache), each replayed
too, and with each `--chunk-mib` as the log-prob kernel's chunk budget (`grpo.kernels.logprobs._CHUNK_BUDGET`):
peak and step time.

    PYTHONPATH=$PWD python3 benchmarks/probes/step_memory.py --out DIR [--dtype bf16] [--chunk-mib 128] [--stacks all]
"""

from __future__ import annotations

import argparse
import re
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
# the runs besides the product's: (the Config fields they change, what they show)
VARIANTS = {"eager-layers": ({"lean_activations": False}, "transformers' own MLP and norms (--no-lean-activations)"),
            "release": ({"engine_standby": "release"}, "the engine's KV cache and graphs dropped before the training "
                        "pass (--engine-standby release)")}


def grpo_frame(frames: list[dict]) -> tuple[str, str]:
    """(the innermost frame in grpo/, the innermost frame outside it) of an allocation's Python stack."""
    frames = python_frames(frames)
    ours = next((f for f in frames if "/grpo/" in f["filename"]), None)
    other = next((f for f in frames if "/grpo/" not in f["filename"]), None)

    def name(f):
        return "-" if f is None else f"{f['filename'].rsplit('/', 2)[-2:][-1]}:{f['line']} {f['name']}"

    return name(ours), name(other)


def python_frames(frames: list[dict]) -> list[dict]:
    """The Python frames of a stack recorded with C++ frames too (Python's: a .py file, or <string>, <eval...>)."""
    return [f for f in frames if f["filename"].endswith(".py") or f["filename"].startswith("<")]


_AUTOGRAD_NODE = re.compile(r"\w+Backward\d*")  # in a C++ frame's name: torch::autograd::generated::MmBackward0::apply


def where(frames: list[dict] | None) -> str:
    """An allocation's group: its innermost frame in grpo/ and the innermost outside; without Python frames
    (autograd's backward) the innermost autograd node among its C++ frames, where they were recorded."""
    if frames is None:
        return "held before the history began"
    if python_frames(frames):
        return " <- ".join(grpo_frame(frames))
    node = next((m.group(0) for f in frames if (m := _AUTOGRAD_NODE.search(f["name"]))), None)
    return f"autograd's backward: {node}" if node else "no Python frame (autograd's backward)"


def live_at_peak(held: dict[int, int], trace: list[dict], start: int = 0) -> tuple[int, dict[int, tuple[int, list]]]:
    """Replays `trace` (the allocator's entries since `held`, address -> bytes, was read) and finds the peak of
    allocated bytes from entry `start` on (the step's first). Returns that peak and the live blocks then
    (address -> (bytes, frames); frames are None for blocks held before the trace began, [] for those made
    where no Python frame ran: autograd's backward)."""
    live = {addr: (size, None) for addr, size in held.items()}
    total = sum(held.values())
    peak, at_peak = -1, {}
    for i, entry in enumerate(trace):
        if i == start:
            peak, at_peak = total, dict(live)
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            live[addr] = (entry["size"], entry.get("frames", []))
            total += entry["size"]
            if i >= start and total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_requested" and addr in live:  # where torch's allocated bytes go down
            total -= live.pop(addr)[0]
    if peak < 0:  # nothing from `start` on
        peak, at_peak = total, dict(live)
    return peak, at_peak


def held_blocks() -> dict[int, int]:
    """The allocated blocks now (address -> bytes), from the allocator's segments."""
    held = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                held[addr] = block.get("requested_size", block["size"])  # as the trace's allocations count
            addr += block["size"]
    return held


def summarize(peak: int, live: dict[int, tuple[int, list]], top: int = 25) -> dict:
    groups: dict[str, int] = defaultdict(int)
    for size, frames in live.values():
        groups[where(frames)] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    biggest = sorted(((size, frames) for size, frames in live.values() if frames is not None),
                     key=lambda sf: -sf[0])[:top]
    return {"peak_gib": peak / GiB,
            "groups": [{"where": k, "gib": v / GiB} for k, v in ranked[:top]],
            "blocks": [{"mib": s / 2**20, "stack": [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                                                    for f in python_frames(frames) if "/grpo/" in f["filename"]][:6]
                        or [where(frames)]} for s, frames in biggest]}


def run_steps(cfg, record_step: int, stacks: str = "python") -> dict:
    """Runs `cfg`, recording the allocator's history from the run's start (so that what step `record_step`,
    1-based, finds held names the code that made it: the weights, the optimizer, the engine) to that step's
    end, and replays it to that step's peak."""
    import grpo.trainer as trainer

    inner = trainer.grpo_step
    seen = {"n": 0, "result": None}
    history = 4_000_000

    def step(setup, index, in_flight):
        seen["n"] += 1
        if seen["n"] != record_step:
            return inner(setup, index, in_flight)
        torch.cuda.synchronize()
        start = len(torch.cuda.memory._snapshot()["device_traces"][0])
        try:
            return inner(setup, index, in_flight)
        finally:
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            if len(trace) >= history:  # the ring buffer dropped the oldest entries: the replay would be wrong
                raise RuntimeError(f"{len(trace)} allocator entries: raise `history`")
            peak, live = live_at_peak(held, trace, start)
            seen["result"] = summarize(peak, live)
            seen["result"]["entries"] = len(trace) - start

    held = held_blocks()
    torch.cuda.memory._record_memory_history(max_entries=history, stacks=stacks)
    trainer.grpo_step = step
    try:
        with bs.fixed_lengths():
            trainer.train(cfg)
    finally:
        trainer.grpo_step = inner
        torch.cuda.memory._record_memory_history(enabled=None)
    records = bs.read_metrics(cfg.output_dir)
    steady = records[record_step:] or records  # after the recorded step: recording slows those up to it
    return {"step_s": statistics.median(r["step_time"] for r in steady),
            "peak_gib": [round(r["peak_mem_gib"], 3) for r in records],
            "records": steady[-1], "replay": seen["result"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps a run (the history is recorded from its start to the third's end and replayed "
                             "to the third's peak; the step time is the median of those after it)")
    parser.add_argument("--variants", nargs="*", default=["eager-layers", "release"], choices=list(VARIANTS),
                        help="runs besides the product's, each replayed too: " + "; ".join(
                            f"{k}: {v[1]}" for k, v in VARIANTS.items()))
    parser.add_argument("--chunk-mib", type=int, nargs="*", default=[],
                        help="the log-prob kernel's chunk budgets to run the steps at besides 512 (MiB)")
    parser.add_argument("--stacks", choices=["python", "all"], default="python",
                        help="the stacks recorded: all adds C++ frames, which name the autograd node of what autograd's "
                             "backward allocates (slower to record and to read)")
    add_out_argument(parser)
    args = parser.parse_args()
    rec = Recorder("step_memory", args.out)
    import grpo.kernels.logprobs as logprobs

    root = Path(tempfile.mkdtemp(prefix="step-memory-"))
    model_dir = bs.build_model_dir(root / "model", size="1b", device="cuda")
    from transformers import AutoTokenizer

    prompts = bs.write_prompts(root / "prompts.jsonl", AutoTokenizer.from_pretrained(model_dir), bs.BENCH.prompt_len)
    default = logprobs._CHUNK_BUDGET // 2**20
    runs = [("product", {}, default), *((name, VARIANTS[name][0], default) for name in args.variants),
            *((f"chunk {mib} MiB", {}, mib) for mib in args.chunk_mib)]
    for i, (name, overrides, mib) in enumerate(runs):
        logprobs._CHUNK_BUDGET = mib * 2**20
        cfg = bs.step_config(model_dir, prompts, bs.BENCH, fp8=args.dtype == "fp8", steps=args.steps,
                             output_dir=root / f"run-{i}", cuda=True, **overrides)
        bs.free_memory()
        held = torch.cuda.memory_allocated() / GiB  # what earlier runs left: their peaks include it
        out = run_steps(cfg, record_step=3, stacks=args.stacks)
        rec.record("run", name=name, dtype=args.dtype, chunk_mib=mib, step_s=out["step_s"], peak_gib=out["peak_gib"],
                   held_before_gib=held, last=out["records"])
        rec.say(f"{name}: step {out['step_s']:.3f} s, peaks {out['peak_gib']} GiB ({held:.3f} held before the run)")
        if out["replay"] is not None:
            r = out["replay"]
            rec.record("peak", name=name, dtype=args.dtype, **r)
            rec.say(f"replayed peak {r['peak_gib']:.3f} GiB (the step's {r['entries']} allocator entries)")
            for g in r["groups"]:
                rec.say(f"  {g['gib']:7.3f} GiB  {g['where']}")


if __name__ == "__main__":
    main()
