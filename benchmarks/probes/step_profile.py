"""Where the bench step's time goes on the GPU and on the host: one steady step under torch's profiler, by phase.

Issue 31 wants the bench step (16 rows of 128 + 512 tokens) at or below 1.0 s (benchmarks/RESULTS.md), and its
phases move by several percent between machine starts, which says the host sets part of the pace.
This runs `grpo.trainer.train` at the bench config as the suite does (`bench_setup.step_config`) and profiles
one loop iteration after the warm-up: from one `grpo_step`'s start to the next's, so the trainer's bookkeeping
between steps is in it. Each phase is a profiler range (the functions `grpo.step` and `grpo.groups` call, wrapped
here): sample (the engine's generate), score, reference, the update's forwards (`sequence_logprobs`) and the
rest of the update (backward, clipping, optimizer), and what is left of the iteration. For each: its wall time,
the GPU's busy time for it (the union of the intervals of the kernels launched inside its ranges), the top kernels
and the top host ops by their own time, and the GPU's idle time between those kernels by the length of each wait,
with the kernels the long waits held back (`idle_gaps`). A phase holds its inner phases, in its GPU time as in its
wall time: the update's figures hold its forwards'. The Chrome trace goes beside the results, gzipped.

    PYTHONPATH=$PWD python3 benchmarks/probes/step_profile.py --out DIR [--dtype bf16] [--no-fold] [--peft-forward]
        [--no-norm-kernel]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_setup
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup as bs  # noqa: E402
from timing import Recorder, add_out_argument, covered_us  # noqa: E402

# (module, function) -> the phase it is: each call runs inside a profiler range of that name
PHASES = {("grpo.groups", "sample"): "sample", ("grpo.groups", "score"): "score",
          ("grpo.step", "reference_and_old_logprobs"): "reference",
          ("grpo.step", "sequence_logprobs"): "update/forward", ("grpo.step", "update_policy"): "update"}


@contextlib.contextmanager
def phase_ranges():
    """Wraps each function of PHASES in a profiler range named after its phase, for as long as this lasts."""
    import importlib

    saved = []
    for (module_name, fn_name), phase in PHASES.items():
        module = importlib.import_module(module_name)
        fn = getattr(module, fn_name)

        def ranged(*args, _fn=fn, _phase=phase, **kwargs):
            with torch.profiler.record_function(f"phase:{_phase}"):
                return _fn(*args, **kwargs)

        setattr(module, fn_name, functools.wraps(fn)(ranged))
        saved.append((module, fn_name, fn))
    try:
        yield
    finally:
        for module, fn_name, fn in saved:
            setattr(module, fn_name, fn)


def profile_iteration(cfg, at_step: int, trace_path: Path) -> None:
    """Runs `cfg`, profiling from step `at_step`'s start (1-based) to the next step's, and saves the trace."""
    import grpo.trainer as trainer

    inner = trainer.grpo_step
    seen = {"n": 0}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])

    def step(setup, index, in_flight):
        seen["n"] += 1
        if seen["n"] == at_step:
            torch.cuda.synchronize()
            prof.start()
        elif seen["n"] == at_step + 1:
            torch.cuda.synchronize()
            prof.stop()
            prof.export_chrome_trace(str(trace_path))
        return inner(setup, index, in_flight)

    trainer.grpo_step = step
    try:
        with phase_ranges(), bs.fixed_lengths():
            trainer.train(cfg)
    finally:
        trainer.grpo_step = inner


def summarize(trace: dict, top: int = 12) -> list[dict]:
    """Per phase (and the whole iteration): wall, GPU busy, top kernels and host ops by their own time.
    A kernel belongs to each phase whose host range holds its launch (by its correlation id; graph replays' kernels
    to the range of the replay's launch), a host op to each range holding its start: an outer phase holds its inner
    ones, as its wall time does. Kernels and ops outside every range are 'other'."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("phase:")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)

    def holding(ts: float) -> list[str]:
        """The phases whose ranges hold host time ts (['other'] outside all)."""
        return [r["name"][6:] for r in ranges if r["ts"] <= ts <= r["ts"] + r["dur"]] or ["other"]

    by_phase: dict[str, list] = defaultdict(list)  # the kernels launched inside each phase's ranges
    for k in kernels:
        launch = launches.get(k.get("args", {}).get("correlation"))
        for phase in holding(launch["ts"]) if launch else ["unlaunched"]:
            by_phase[phase].append(k)
    ops_by_phase: dict[str, list] = defaultdict(list)
    for op in ops:
        for phase in holding(op["ts"]):
            ops_by_phase[phase].append(op)
    wall = defaultdict(float)
    for r in ranges:
        wall[r["name"][6:]] += r["dur"]
    out = [{"phase": "iteration", "wall_ms": (end - start) / 1e3,
            "gpu_busy_ms": covered_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels]) / 1e3,
            "kernels": len(kernels)}]
    for phase in sorted(set(by_phase) | set(wall) | set(ops_by_phase)):
        ks = by_phase.get(phase, [])
        kernel_ms = defaultdict(float)
        for k in ks:
            kernel_ms[k["name"][:90]] += k["dur"] / 1e3
        op_ms = defaultdict(float)
        for op in self_times(ops_by_phase.get(phase, [])):
            op_ms[op[0]] += op[1] / 1e3
        out.append({"phase": phase, "wall_ms": wall.get(phase, 0.0) / 1e3,
                    "gpu_busy_ms": covered_us([(k["ts"], k["ts"] + k["dur"]) for k in ks]) / 1e3,
                    "kernels": len(ks),
                    "top_kernels_ms": sorted(kernel_ms.items(), key=lambda kv: -kv[1])[:top],
                    "top_host_ops_self_ms": sorted(op_ms.items(), key=lambda kv: -kv[1])[:top],
                    **idle_gaps(ks)})
    return out


GAP_SIZES_US = ((20, "<20us"), (100, "20-100us"), (float("inf"), ">=100us"))


def idle_gaps(kernels: list[dict], top: int = 6) -> dict:
    """Where a phase's GPU waited between its first kernel and its last: the idle time by the size of each wait
    (many short ones: the host issues ops slower than the GPU runs them; long ones: a stall, a Python stretch or a
    wait for the host), and the kernels that waits of 100 us or more held back, by their total wait."""
    by_size = {name: 0.0 for _, name in GAP_SIZES_US}
    after_long: dict[str, float] = defaultdict(float)
    reached = None
    for k in sorted(kernels, key=lambda e: e["ts"]):
        if reached is not None and k["ts"] > reached:
            gap = k["ts"] - reached
            by_size[next(name for bound, name in GAP_SIZES_US if gap < bound)] += gap / 1e3
            if gap >= 100:
                after_long[k["name"][:90]] += gap / 1e3
        end = k["ts"] + k["dur"]
        reached = end if reached is None else max(reached, end)
    return {"gpu_idle_ms_by_wait": by_size,
            "after_long_waits_ms": sorted(after_long.items(), key=lambda kv: -kv[1])[:top]}


def self_times(ops: list[dict]) -> list[tuple[str, float]]:
    """(name, self time in us) of host ops: each op's duration less its direct children's (same thread)."""
    by_thread: dict[int, list] = defaultdict(list)
    for op in ops:
        by_thread[op.get("tid", 0)].append(op)
    result = []
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, children's time]
        for op in thread_ops:
            while stack and op["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                done = stack.pop()
                result.append((done[0]["name"], done[0]["dur"] - done[1]))
            if stack:
                stack[-1][1] += op["dur"]
            stack.append([op, 0.0])
        result.extend((e["name"], e["dur"] - c) for e, c in stack)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--fold", action=argparse.BooleanOptionalAction, default=True,
                        help="the adapters folded in decode, as the trainer does by default (--engine-fold-adapter)")
    parser.add_argument("--peft-forward", action="store_true",
                        help="peft's own LoRA forward in the training pass (without grpo.model.lora_addmm)")
    parser.add_argument("--norm-kernel", action=argparse.BooleanOptionalAction, default=True,
                        help="the RMSNorms as grpo.kernels.rmsnorm's one launch each way, as the trainer runs them "
                             "(--no-norm-kernel: torch's ops, lean_activations.install's norm_kernel=False)")
    parser.add_argument("--fp8-gemm", choices=["auto", "dense", "fp8"], default="auto",
                        help="with --dtype fp8, the trainer's --fp8-gemm: how the FP8 layers multiply outside decode")
    parser.add_argument("--steps", type=int, default=7, help="steps a run; the fourth is profiled")
    add_out_argument(parser)
    args = parser.parse_args()
    rec = Recorder("step_profile", args.out)
    if args.peft_forward:
        import grpo.model.lora_addmm

        grpo.model.lora_addmm.install = lambda model: 0
    if not args.norm_kernel:
        import grpo.model.lean_activations

        grpo.model.lean_activations.install = functools.partial(grpo.model.lean_activations.install, norm_kernel=False)
    root = Path(tempfile.mkdtemp(prefix="step-profile-"))
    model_dir = bs.build_model_dir(root / "model", size="1b", device="cuda")
    from transformers import AutoTokenizer

    prompts = bs.write_prompts(root / "prompts.jsonl", AutoTokenizer.from_pretrained(model_dir), bs.BENCH.prompt_len)
    cfg = bs.step_config(model_dir, prompts, bs.BENCH, fp8=args.dtype == "fp8", steps=args.steps,
                         output_dir=root / "run", cuda=True, engine_fold_adapter=args.fold, fp8_gemm=args.fp8_gemm)
    trace_path = root / "trace.json"
    profile_iteration(cfg, at_step=4, trace_path=trace_path)
    records = bs.read_metrics(cfg.output_dir)
    rec.record("steps", dtype=args.dtype, fold=args.fold, peft_forward=args.peft_forward,
               norm_kernel=args.norm_kernel, fp8_gemm=args.fp8_gemm,
               step_s=[round(r["step_time"], 4) for r in records], profiled=records[3] if len(records) > 3 else None)
    summary = summarize(json.loads(trace_path.read_text()))
    for row in summary:
        rec.record("phase", dtype=args.dtype, fold=args.fold, peft_forward=args.peft_forward,
                   norm_kernel=args.norm_kernel, fp8_gemm=args.fp8_gemm, **row)
        idle = "  ".join(f"{size} {ms:.1f}" for size, ms in row.get("gpu_idle_ms_by_wait", {}).items())
        rec.say(f"{row['phase']:16s} wall {row['wall_ms']:8.1f} ms  GPU busy {row['gpu_busy_ms']:8.1f} ms  "
                f"{row['kernels']} kernels{'  idle ms by wait: ' + idle if idle else ''}")
    name = (f"trace-{args.dtype}{'' if args.fp8_gemm == 'auto' else '-' + args.fp8_gemm}"
            f"{'' if args.fold else '-unfolded'}{'-peft' if args.peft_forward else ''}"
            f"{'' if args.norm_kernel else '-no-norm-kernel'}.json.gz")
    with open(trace_path, "rb") as src, gzip.open(Path(rec.path).parent / name, "wb") as dst:
        shutil.copyfileobj(src, dst)


if __name__ == "__main__":
    main()
