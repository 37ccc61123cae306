"""Generation beside training on one GPU: does the next step's decode hide in this step's training pass?

The decode is bound by memory and the training pass by compute (and partly by the host), so on one GPU the two
might share the step's time: step n+1's completions sampled from the policy before step n's update (one step off
the policy) while step n trains. This times the two apart and together, with the trainer's own pieces on the
qwen1.5b-gsm8k preset's shapes (random weights): the sampler (`NativeEngine`, the trainer's tuning) on a model of
its own without adapters, as a folded copy of the policy would be, 8 prompts x 8 completions of 384 tokens
(ignoring EOS: the preset's longest rows reach its 384); the update (`grpo.step.update_policy` as in
`train_pass.py --trainer`: micro-batches of 16, layers kept and compiled, new widths each pass). Together: the
generate in a thread on a stream of its own (`--priority high`: a high-priority stream), the update in this
thread on the default stream, each waiting only for its own stream. Median seconds of each alone, of the two one
after the other, and of the two together (the wall time until both are done); the ratio together / apart is
what an overlapped step could save at best. Measured: benchmarks/RESULTS.md, "The measured defaults"
(`--sample-ahead`).

`--profile` runs one more together under torch's profiler, writes its trace beside the records and, per CUDA stream,
what its kernels show: the time they covered, from the stream's first kernel to its last, and the gaps between
them (how long the stream sat without a kernel: a decode the host queues too slowly shows gaps; one that waits for
the training's kernels to leave the SMs shows long kernels and few gaps).

    PYTHONPATH=$PWD python3 benchmarks/probes/overlap.py [--priority high] [--stop] [--repeats 3] [--profile]
    python benchmarks/probes/overlap.py --smoke        (a tiny model on the CPU: the plumbing only)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import Recorder, add_out_argument, covered_us  # noqa: E402  (beside this file)

import train_pass  # noqa: E402  (beside this file)
from qwen_step import GENERATIONS, QWEN_PROMPTS  # noqa: E402  (beside this file)


def stream_clock(device: torch.device):
    """A clock that waits for this thread's stream only (the trainer's synced_clock waits for the device)."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()
    return now


def build_sampler(smoke: bool, device: torch.device):
    """The engine on a random model of the preset's shapes without adapters (a folded copy's decode)."""
    from grpo.rollout.native import NativeEngine

    model = train_pass.random_model(smoke, device, seed=1).eval()
    new = 8 if smoke else train_pass.MAX_COMPLETION_LENGTH
    engine = NativeEngine(model, max_seq_len=train_pass.MAX_PROMPT_LENGTH + new, max_batch=64, pad_id=0)
    return engine, model.config.vocab_size, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--priority", choices=["normal", "high"], default="normal",
                        help="the sampler's stream priority when the two run together")
    parser.add_argument("--stop", action="store_true",
                        help="a stop token (never sampled here): the decode looks every 16 steps whether all rows "
                             "stopped, as the preset's does, instead of queuing all its steps at once")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    parser.add_argument("--profile", action="store_true",
                        help="one more together under torch's profiler: its trace, and each stream's kernels' "
                             "busy time and gaps")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: plumbing only")
    add_out_argument(parser)
    args = parser.parse_args()

    from grpo.batch import micro_batches
    from grpo.model import compiled_layers
    from grpo.rollout.base import Sampling

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    rec = Recorder("overlap", args.out)
    policy, vocab, cfg = train_pass.build_policy(args.smoke, "base", False, device)
    clock = stream_clock(device)
    update = train_pass.trainer_update(policy, cfg, device, clock)
    engine, sampler_vocab, new = build_sampler(args.smoke, device)
    scale = 16.0 if args.smoke else 1.0
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, sampler_vocab, (max(1, int(n / scale)),), generator=gen).tolist()
               for n in QWEN_PROMPTS[::GENERATIONS]]
    stops = dict(stop_token_ids=(sampler_vocab - 1,), ignore_eos=False) if args.stop else dict(ignore_eos=True)
    sampling = Sampling(max_new_tokens=new, temperature=1.0, min_p=0.1, seed=0, **stops)

    adv = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(device)
    width = compiled_layers.width_multiple(policy)
    seeds = iter(range(1, 10**6))

    def train() -> float:
        step_batch, step_adv, slices = micro_batches(train_pass.qwen_batch(vocab, device, scale, next(seeds)), adv,
                                                     16, width)
        t = clock()
        update(step_batch, step_adv, slices)
        return clock() - t

    def sample() -> float:
        t = clock()
        engine.generate(prompts, GENERATIONS, sampling)
        return clock() - t

    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device, priority=-1 if args.priority == "high" else 0) if cuda else None
    done: dict = {}

    def sample_on_side() -> None:
        with torch.cuda.stream(side) if cuda else nullcontext():
            done["sample"] = sample()

    def together() -> float:
        t = clock()
        thread = threading.Thread(target=sample_on_side)
        thread.start()
        done["train"] = train()
        thread.join()
        return clock() - t

    rec.record("setup", device=str(device), priority=args.priority, stop=args.stop, rows=64, new_tokens=new,
               compiled_layers=width > 1)
    sample_on_side(), train(), train()  # compiles, captures (on the side stream, as together), warms
    runs = {"sample": [], "train": [], "apart": [], "together": [], "sample_in_together": [], "train_in_together": []}
    for _ in range(args.repeats):
        s, tr = sample(), train()
        runs["sample"].append(s)
        runs["train"].append(tr)
        runs["apart"].append(s + tr)
        runs["together"].append(together())
        runs["sample_in_together"].append(done["sample"])
        runs["train_in_together"].append(done["train"])
        rec.record("run", **{k: round(v[-1], 4) for k, v in runs.items()})
    medians = {k: round(statistics.median(v), 4) for k, v in runs.items()}
    rec.record("median", **medians, together_over_apart=round(medians["together"] / medians["apart"], 3),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
    if args.profile:
        trace = rec.path.with_suffix(".trace.json")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]) as prof:
            wall = together()
        prof.export_chrome_trace(str(trace))
        for stream, row in stream_kernels(json.loads(trace.read_text())).items():
            rec.record("stream", stream=stream, together_s=round(wall, 4), **row)


def stream_kernels(trace: dict, gap_us: float = 20.0) -> dict[int, dict]:
    """Per CUDA stream of a chrome trace: kernels, the microseconds they covered, the span from the first kernel's
    start to the last's end, the gaps between kernels longer than `gap_us` (their count and total), and its most
    frequent kernel's name (which stream is the decode's)."""
    spans: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, collections.Counter] = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") == "kernel" and "dur" in event:
            stream = int(event.get("args", {}).get("stream", -1))
            spans.setdefault(stream, []).append((float(event["ts"]), float(event["ts"]) + float(event["dur"])))
            names.setdefault(stream, collections.Counter())[str(event.get("name", ""))[:60]] += 1
    out = {}
    for stream, kernels in sorted(spans.items()):
        kernels.sort()
        gaps, reached = [], kernels[0][1]
        for start, end in kernels[1:]:
            if start - reached > gap_us:
                gaps.append(start - reached)
            reached = max(reached, end)
        span = reached - kernels[0][0]
        out[stream] = dict(kernels=len(kernels), busy_us=round(covered_us(kernels)), span_us=round(span),
                           gaps=len(gaps), gap_us=round(sum(gaps)), most=names[stream].most_common(1)[0][0])
    return out


if __name__ == "__main__":
    main()
