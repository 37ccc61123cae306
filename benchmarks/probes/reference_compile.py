"""The bench step's reference pass eager and with its decoder under torch.compile: the same inputs, time and values.

The reference pass (`grpo.step.reference_and_old_logprobs`: the adapters off, no grad) runs the decoder op by op
from the host, which issues them slower than the GPU runs them (benchmarks/probes/train_ops.py counts them). This
compiles the decoder alone (`nn.Module.compile` on `policy.get_base_model().model`: the trainer's own
`sequence_logprobs` around it, its fused log-probs eager) and times the trainer's call eager and compiled on the
bench's model (Llama-3.2-1B's shapes, rsLoRA r=32 on the 7 projections; tiny widths on a CPU, plumbing only) and
rows (16 of 128 + 512 tokens, one micro-batch):
- `explain`: the graphs dynamo makes of the decoder and why it breaks them (a break is a return to the host);
- `pass`: median milliseconds eager and compiled (after the first call, whose compile time is `compile_s`),
  the graphs compiled (a new width may compile again), and the log-probs' largest and mean difference from
  eager (the compiled kernels round bf16 intermediates in their own order: not bit for bit), and each one's mean
  distance from a float32 copy's on the first batch.
`--mode reduce-overhead` replays CUDA graphs (one per width); `--vary` gives every pass a new longest row (as a
run's steps do, where the bench's fixed lengths do not), `--bucket` rounds widths up as `--pad-to-multiple-of`.
What it deliberately is not: the trainer's. Nothing in grpo/ compiles the reference pass.

    PYTHONPATH=$PWD python3 benchmarks/probes/reference_compile.py [--mode reduce-overhead] [--vary] [--bucket 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Recorder, add_out_argument, median_ms  # noqa: E402
from train_ops import bench_batch, bench_policy  # noqa: E402


def varied_batch(batch, seed: int, multiple: int):
    """`batch` with every completion cut at a length drawn in its last quarter (as if it stopped there): a new
    longest row, hence a new width, per seed; widths rounded up to `multiple`."""
    gen = torch.Generator().manual_seed(seed)
    T = batch.mask.shape[1]
    kept = torch.randint(3 * T // 4, T + 1, (len(batch),), generator=gen)
    host_mask = torch.arange(T)[None, :] < kept[:, None]
    lengths = tuple(int(s) + int(k) for s, k in zip(batch.start.cpu(), kept))
    return dataclasses.replace(batch, mask=host_mask.to(batch.mask.device), host_mask=host_mask, lengths=lengths,
                               width_multiple=multiple)


def float32_reference(policy, cfg, batch_and_slices) -> torch.Tensor:
    """The reference log-probs of a float32 copy of `policy` (eager): what eager's and the compiled kernels' bf16
    roundings are each measured from."""
    import copy

    from grpo.step import reference_and_old_logprobs

    exact = copy.deepcopy(policy).float()
    logp = reference_and_old_logprobs(SimpleNamespace(cfg=cfg, policy=exact, clock=lambda: 0.0), *batch_and_slices)[0]
    del exact
    return logp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        default="default", help="torch.compile's mode (reduce-overhead: CUDA graphs, one per width)")
    parser.add_argument("--dynamic", choices=["auto", "true", "false"], default="auto",
                        help="torch.compile's dynamic: auto compiles static first and dynamic at a new width; false "
                             "compiles each width anew")
    parser.add_argument("--vary", action="store_true", help="every pass a new longest row (a new width)")
    parser.add_argument("--bucket", type=int, default=1, help="round widths up to a multiple of this (1: none)")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (the bench's 16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes each way (median)")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.bucket < 1 or args.layers < 1 or args.repeats < 1:
        parser.error("--bucket, --layers and --repeats: 1 or more")

    from grpo.batch import micro_batches
    from grpo.model.load import adapters_off, attention_without_cudnn
    from grpo.step import reference_and_old_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = "1b" if device.type == "cuda" else "tiny"
    rec = Recorder("reference_compile", args.out)
    policy, cfg = bench_policy(args.layers, widths, device)
    policy.eval()
    template = bench_batch(policy.config.vocab_size, device)
    setup = SimpleNamespace(cfg=cfg, policy=policy, clock=lambda: 0.0)
    seeds = iter(range(10**6))

    def next_batch():
        batch = varied_batch(template, next(seeds), args.bucket) if args.vary else template
        batch, _, slices = micro_batches(batch, torch.zeros(len(batch), device=device), len(batch), args.bucket)
        return batch, slices

    def reference(batch, slices) -> torch.Tensor:
        return reference_and_old_logprobs(setup, batch, slices)[0]

    decoder = policy.get_base_model().model
    first = next_batch()
    with attention_without_cudnn():
        with torch.no_grad(), adapters_off(policy):  # what the reference pass holds
            explained = torch._dynamo.explain(decoder)(input_ids=first[0].rows(first[1][0]).input_ids,
                                                       use_cache=False)
        rec.record("explain", graphs=explained.graph_count, breaks=explained.graph_break_count,
                   reasons=[str(b.reason)[:300] for b in explained.break_reasons[:8]])
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        batches = [first] + [next_batch() for _ in range(args.repeats)]
        eager_logp = [reference(*b) for b in batches]
        truth = float32_reference(policy, cfg, batches[0])
        passes = iter(batches * 2)
        eager_ms = median_ms(lambda: reference(*next(passes)), warmup=1, iters=args.repeats)

        dynamic = {"auto": None, "true": True, "false": False}[args.dynamic]
        decoder.compile(mode=None if args.mode == "default" else args.mode, dynamic=dynamic)
        t0 = time.perf_counter()
        compiled_logp = [reference(*batches[0])]
        compile_s = time.perf_counter() - t0
        compiled_logp += [reference(*b) for b in batches[1:]]
        passes = iter(batches * 2)
        compiled_ms = median_ms(lambda: reference(*next(passes)), warmup=1, iters=args.repeats)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    diffs = [(c - e)[b.mask].abs() for c, e, (b, _) in zip(compiled_logp, eager_logp, batches)]
    counted = batches[0][0].mask
    off_truth = {name: float((logp[0] - truth)[counted].abs().mean()) for name, logp in
                 (("eager", eager_logp), ("compiled", compiled_logp))}
    rec.record("pass", device=str(device), widths=widths, layers=args.layers, mode=args.mode, dynamic=args.dynamic,
               vary=args.vary, bucket=args.bucket, timer="cuda events" if device.type == "cuda" else "wall clock",
               eager_ms=round(eager_ms, 2), compiled_ms=round(compiled_ms, 2), compile_s=round(compile_s, 1),
               graphs_compiled=graphs, widths_seen=sorted({b.rows(s[0]).input_ids.shape[1] for b, s in batches}),
               logp_max_abs_diff=max(float(d.max()) for d in diffs),
               logp_mean_abs_diff=sum(float(d.mean()) for d in diffs) / len(diffs),
               eager_mean_abs_diff_from_float32=off_truth["eager"],
               compiled_mean_abs_diff_from_float32=off_truth["compiled"])


if __name__ == "__main__":
    main()
