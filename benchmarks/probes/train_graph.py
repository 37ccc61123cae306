"""The bench step's training micro-batch replayed from one CUDA graph against run eagerly: what the host costs it.

Whether the host or the GPU sets the training pass's pace: a CUDA graph replays a captured pass's kernels with one
launch, at the GPU's pace, as the engine's decode steps are replayed, so a replay much shorter than the eager pass
says the host bounds it (and what graphs in the trainer would save). One training micro-batch at the bench's shape
(16 rows of 128 + 512 tokens; Llama-3.2-1B shapes, random weights, rsLoRA r=32 alpha=64 on the 7 projections,
gradient checkpointing) through the trainer's own pieces (`grpo.model.load.add_lora`,
`grpo.batch.sequence_logprobs`, `grpo.loss.clipped_surrogate` with beta 0.04 against a reference's log-probs), its
gradients zeroed, its loss's backward: eagerly, then captured once and replayed. For each way: the pass's time
between CUDA events (median; eager: what the host takes to issue it where it is the slower), the peak memory above
what the set-up holds (weights, adapters, gradients, batch), and the replay's gradients against the eager ones. A
capture that fails is recorded with its error: what the trainer would change first.

What the capture needs that the trainer does not do today: the counted tokens' positions made before it (the
trainer finds them on the host, `Batch.counted`, and copies them in; a graph replays no host copy), and the
checkpoint's RNG state left alone (`preserve_rng_state=False`: no dropout, nothing random to replay).

    PYTHONPATH=$PWD python3 benchmarks/probes/train_graph.py --out DIR [--dtype bf16|fp8] [--repeats 7]
    python benchmarks/probes/train_graph.py --smoke        (a tiny model on the CPU: the eager pass's plumbing only)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_setup
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_setup as bs  # noqa: E402
from timing import Recorder, add_out_argument, median_ms  # noqa: E402  (beside this file)


def bench_policy(smoke: bool, fp8: bool, device: torch.device):
    """(policy, cfg): the bench model (a tiny one with --smoke) with the recipe's rsLoRA, B non-zero, checkpointed
    without the RNG state, in training mode."""
    from transformers import AutoModelForCausalLM

    from grpo.config import LORA_TARGETS, Config
    from grpo.kernels.fp8 import quantize_linears_
    from grpo.model.load import add_lora

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if smoke else torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(bs.model_config("tiny" if smoke else "1b"))
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    if fp8:
        quantize_linears_(model, LORA_TARGETS)  # the 7 projections, as an FP8-Block checkpoint holds them
    cfg = Config(lora_rank=32, lora_alpha=64, use_rslora=True, lora_targets=LORA_TARGETS, gradient_checkpointing=True,
                 beta=0.04, load_in_fp8=fp8)
    policy = add_lora(model, cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "preserve_rng_state": False})
    with torch.no_grad():  # B non-zero, as after some training
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return policy.train(), cfg


def bench_batch(shape: bs.Shape, vocab: int, device: torch.device):
    """A Batch of the shape's rows at their full lengths (as the bench forces them), random tokens."""
    from grpo.batch import make_batch
    from grpo.rollout.base import Rollout

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (shape.prompt_len,), generator=gen).tolist() for _ in range(shape.prompts)]
    ids = torch.randint(10, vocab, (shape.rows, shape.completion_len), generator=gen)
    mask = torch.ones_like(ids, dtype=torch.bool)
    rollout = Rollout(prompt_ids=prompts, completion_ids=ids, mask=mask, sampler_logp=torch.zeros(mask.shape),
                      finished=torch.zeros(shape.rows, dtype=torch.bool), num_generations=shape.generations)
    return make_batch(rollout, 0, device)


@contextlib.contextmanager
def counted_made_before(batch):
    """Within the block, `Batch.counted` returns the batch's counted positions made once, on the device."""
    from grpo.batch import Batch

    at = batch.counted()
    real = Batch.counted
    Batch.counted = lambda self: at
    try:
        yield
    finally:
        Batch.counted = real


def one_pass(policy, cfg, batch, adv: torch.Tensor, ref_logp: torch.Tensor, params: list) -> torch.Tensor:
    """Gradients zeroed, then the loss's forward and backward, as a pass of the trainer's update makes them. The
    gradients stay allocated (a graph writes into its captured tensors), zeroed in one multi-tensor launch where the
    trainer's set_to_none launches nothing: a launch a param would overstate the eager pass's host time."""
    from grpo.batch import sequence_logprobs
    from grpo.loss import clipped_surrogate
    from grpo.step import surrogate_options

    torch._foreach_zero_([p.grad for p in params])
    logp = sequence_logprobs(policy, batch, 1.0)
    loss, _ = clipped_surrogate(logp, logp.detach(), adv, batch.mask, ref_logp=ref_logp,
                                **surrogate_options(cfg, batch.completion_ids.shape[1]))
    loss.backward()
    return loss.detach()


def capture(fn):
    """fn captured in a CUDA graph after three warm-up calls on a side stream (as torch's whole-network capture):
    (the graph, fn's output as the graph leaves it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                        help="base weights: bf16, or FP8 blocks (quantized on load, multiplied as --fp8-gemm auto)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes a way (median)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and short rows on the CPU: plumbing only")
    add_out_argument(parser)
    args = parser.parse_args()

    from grpo.batch import sequence_logprobs
    from grpo.model.load import adapters_off, attention_without_cudnn

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    rec = Recorder("train_graph", args.out)
    shape = bs.SMOKE_BENCH if not cuda else bs.BENCH
    policy, cfg = bench_policy(not cuda, args.dtype == "fp8", device)
    batch = bench_batch(shape, policy.config.vocab_size, device)
    params = [p for p in policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad(), adapters_off(policy):  # the reference pass's log-probs, as the step's
        ref_logp = sequence_logprobs(policy, batch, 1.0)
    weights = torch.cuda.memory_allocated() if cuda else 0
    rec.record("set_up", rows=len(batch), width=batch.input_ids.shape[1], dtype=args.dtype, device=str(device),
               gpu=torch.cuda.get_device_name() if cuda else None, torch=torch.__version__,
               trainable=sum(p.numel() for p in params))

    def run() -> torch.Tensor:
        return one_pass(policy, cfg, batch, adv, ref_logp, params)

    with attention_without_cudnn(), counted_made_before(batch):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        eager_ms = median_ms(run, warmup=2, iters=args.repeats)
        eager_loss = run()
        eager_grads = [p.grad.clone() for p in params]
        peak = round((torch.cuda.max_memory_allocated() - weights) / 2**30, 3) if cuda else None
        rec.record("eager", ms=round(eager_ms, 2), loss=float(eager_loss), peak_over_set_up_gib=peak)
        if not cuda:
            rec.say("no CUDA: the eager pass only")
            return
        try:
            torch.cuda.reset_peak_memory_stats()
            graph, graph_loss = capture(run)
            graph.replay()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - weights) / 2**30
            worst = max(((g - p.grad).norm() / g.norm().clamp(min=1e-30)).item() for g, p in zip(eager_grads, params))
            graph_ms = median_ms(graph.replay, warmup=1, iters=args.repeats)
            rec.record("graph", ms=round(graph_ms, 2), loss=float(graph_loss), peak_over_set_up_gib=round(peak, 3),
                       worst_grad_rel_diff=worst, eager_over_graph=round(eager_ms / graph_ms, 2))
        except Exception as exc:  # what stops the capture is the finding: recorded, with where it came from
            rec.record("graph_error", error=repr(exc)[:500], where=traceback.format_exc()[-2500:])


if __name__ == "__main__":
    main()
