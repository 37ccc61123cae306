"""The training pass on rows of unequal length: one padded forward against length-sorted micro-batches.

A GRPO step's training pass (forward, log-probs, backward over every row) runs each micro-batch as wide as
its longest row (`grpo.batch.Batch.rows`); `--micro-batch-size` cuts the step's rows, sorted by length, into
micro-batches (`grpo.batch.micro_batches`). On the qwen1.5b-gsm8k preset's rows (64 of 90-175 prompt and
102-384 completion tokens) one pass runs 31% padding; four sorted micro-batches, 10%, but each a quarter as
wide in rows. This times that trade on the GPU with the trainer's own pieces: a random model of the
preset's shapes with its rsLoRA (r 32; gradient checkpointing unless --no-checkpointing, as the preset
trains; the adapters multiplied as --lora-compute says), a batch with the lengths of a real step of the preset
(`qwen_step.py`), and for each micro-batch size the forward and backward of
`sequence_logprobs` over all rows: median milliseconds, the share of real tokens among the positions run
(`train/real_token_frac`), and the peak memory above the weights.

A run differs from those repeats in one way a repeat cannot show: no two steps share their micro-batches'
widths: the preset's training pass in micro-batches of 16 took much longer a step in a run of the same flags
than here. `--vary` gives every pass a new step's lengths (the
recorded step's, shuffled and moved by up to 30 tokens), and three variants price what a new width may
cost: `--sdpa torch` torch's own attention backends (cuDNN's first on sm90, which plans every new shape:
what the trainer ran before it left cuDNN out), `--bucket` widths rounded up so that they repeat,
`--trainer` the trainer's own update (`grpo.step.update_policy`: the loss, its statistics read per
micro-batch, the non-finite checks, clipping and the 8-bit AdamW step), `--no-compile-layers` the layers' modules
where the trainer compiles them (on CUDA without checkpointing: `grpo.model.compiled_layers`, widths rounded up to
8 as the trainer rounds them). Measured: benchmarks/RESULTS.md, "The measured defaults".

    PYTHONPATH=$PWD python3 benchmarks/probes/train_pass.py --micro 64 32 16 8
    PYTHONPATH=$PWD python3 benchmarks/probes/train_pass.py --micro 16 --no-checkpointing --lora-compute base \
        --vary [--sdpa torch] [--bucket 64] [--trainer] [--no-compile-layers]
    python benchmarks/probes/train_pass.py --smoke        (a tiny model on the CPU: the plumbing only)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qwen_step import GENERATIONS, QWEN_COMPLETIONS, QWEN_PROMPTS  # noqa: E402  (beside this file)
from timing import Recorder, add_out_argument, median_ms  # noqa: E402  (beside this file)

MAX_PROMPT_LENGTH, MAX_COMPLETION_LENGTH = 288, 384  # the preset's --max-prompt-length, --max-completion-length


def random_model(smoke: bool, device: torch.device, seed: int = 0):
    """A random model of the preset's shapes in bf16 (a tiny float32 Qwen2 with --smoke), frozen."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from native_engine import qwen_1_5b_config  # beside this file

    config = (Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
              if smoke else qwen_1_5b_config())
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if smoke else torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.requires_grad_(False)


def build_policy(smoke: bool, lora_compute: str, checkpointing: bool, device: torch.device,
                 compile_layers: str = "auto"):
    """The preset's policy on a random model of its shapes (a tiny Qwen2 with --smoke)."""
    from grpo.config import Config
    from grpo.model.load import add_lora

    model = random_model(smoke, device)
    cfg = Config(lora_rank=32, lora_alpha=64, lora_compute=lora_compute, gradient_checkpointing=checkpointing,
                 compile_layers=compile_layers, beta=0.0)  # the preset's: no reference model
    policy = add_lora(model, cfg)
    with torch.no_grad():  # B non-zero, as after some training
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    policy.train()
    return policy, model.config.vocab_size, cfg


def step_lengths(seed: int) -> tuple[list[int], list[int]]:
    """Prompt lengths (one per group) and completion lengths of a step: seed 0 the recorded step's,
    another seed the same lengths shuffled and each moved by up to 30 tokens (within the preset's limits),
    so that its micro-batches' widths are new."""
    prompts, completions = QWEN_PROMPTS[::GENERATIONS], list(QWEN_COMPLETIONS)
    if seed == 0:
        return prompts, completions
    gen = torch.Generator().manual_seed(seed)

    def moved(lengths: list[int], longest: int) -> list[int]:
        shuffled = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]
        return [min(longest, max(1, n + int(torch.randint(-30, 31, (), generator=gen)))) for n in shuffled]

    return moved(prompts, MAX_PROMPT_LENGTH), moved(completions, MAX_COMPLETION_LENGTH)


def qwen_batch(vocab: int, device: torch.device, scale: float = 1.0, seed: int = 0):
    """A Batch with a step's lengths (`step_lengths(seed)`, each divided by `scale`), random tokens."""
    from grpo.batch import make_batch
    from grpo.rollout.base import Rollout

    gen = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = step_lengths(seed)
    prompts = [torch.randint(10, vocab, (max(1, int(n / scale)),), generator=gen).tolist() for n in prompt_lengths]
    lengths = [max(1, int(n / scale)) for n in completion_lengths]
    width = max(lengths)
    ids = torch.randint(10, vocab, (len(lengths), width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    rollout = Rollout(prompt_ids=prompts, completion_ids=ids.masked_fill(~mask, 0), mask=mask,
                      sampler_logp=torch.zeros(mask.shape), finished=torch.tensor([n < width for n in lengths]),
                      num_generations=GENERATIONS)
    return make_batch(rollout, 0, device)


def train_pass(policy, batch, slices) -> None:
    """Forward and backward over every micro-batch, each weighted by its share of the tokens (as the step)."""
    from grpo.batch import sequence_logprobs

    tokens = batch.mask.sum()
    for sl in slices:
        mb = batch.rows(sl)
        logp = sequence_logprobs(policy, mb, 1.0)
        (logp.sum() * (mb.mask.sum() / tokens)).backward()
    policy.zero_grad(set_to_none=True)


def trainer_update(policy, cfg, device: torch.device, clock=None):
    """`grpo.step.update_policy` as the trainer calls it with one rank, beta 0 and one pass (no reference
    or old log-probs), on this policy with a fresh optimizer of `cfg`'s kind: fn(batch, adv, slices). `clock`:
    the phases' clock (the trainer's, which waits for the device, unless given)."""
    from types import SimpleNamespace

    from grpo.distributed import World
    from grpo.optim import make_optimizer
    from grpo.run.log import synced_clock
    from grpo.step import InFlight, update_policy

    params = [p for p in policy.parameters() if p.requires_grad]
    # The fields update_policy reads; the others (tokenizer, prompts, rewards, ...) belong to sampling.
    setup = SimpleNamespace(cfg=cfg, world=World(device=device), policy=policy, params=params,
                            optimizer=make_optimizer(cfg, params),
                            engine=SimpleNamespace(needs_importance_correction=False),
                            clock=clock or synced_clock(device), max_completion_length=MAX_COMPLETION_LENGTH)
    return lambda batch, adv, slices: update_policy(setup, batch, slices, adv, None, None, InFlight({}))


def sdpa_backends(name: str):
    """The attention backends of the passes: "product" the trainer's (`grpo.model.load.attention_without_cudnn`),
    "torch" torch's own choice (cuDNN's first on sm90 in torch 2.11, which plans every new shape)."""
    from contextlib import nullcontext

    from grpo.model.load import attention_without_cudnn

    return attention_without_cudnn() if name == "product" else nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--micro", type=int, nargs="+", default=[64, 32, 16, 8],
                        help="micro-batch sizes to time (64: one pass over the step's rows)")
    parser.add_argument("--lora-compute", choices=["base", "float32"], default="base",
                        help="the adapters' matmul dtype (the trainer's default: base)")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep the activations instead of recomputing them in backward (as the preset does)")
    parser.add_argument("--vary", action="store_true",
                        help="every pass on a new step's lengths (as in a run) instead of the recorded step's")
    parser.add_argument("--sdpa", choices=["product", "torch"], default="product",
                        help="attention backends: the trainer's (cuDNN's left out) or torch's own order")
    parser.add_argument("--bucket", type=int, default=1,
                        help="round each micro-batch's width up to a multiple of this many positions, as the "
                             "trainer's --pad-to-multiple-of (1: none)")
    parser.add_argument("--trainer", action="store_true",
                        help="time the trainer's update (grpo.step.update_policy, its optimizer step included) "
                             "instead of the bare forward and backward")
    parser.add_argument("--no-compile-layers", action="store_true",
                        help="the decoder layers' modules instead of the compiled layer (the trainer's "
                             "--compile-layers off)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per size (median)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and short rows on the CPU: plumbing only")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.bucket < 1:
        parser.error(f"--bucket {args.bucket}: a width multiple, 1 or more")

    from grpo.batch import micro_batches, real_token_share
    from grpo.model import compiled_layers

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    rec = Recorder("train_pass", args.out)
    policy, vocab, cfg = build_policy(args.smoke, args.lora_compute, not args.no_checkpointing, device,
                                      "off" if args.no_compile_layers else "auto")
    scale = 16.0 if args.smoke else 1.0
    batch = qwen_batch(vocab, device, scale)
    rec.record("batch", rows=len(batch), real_tokens=sum(batch.lengths), longest=max(batch.lengths),
               mean_length=round(statistics.mean(batch.lengths), 1), device=str(device),
               lora_compute=args.lora_compute, checkpointing=not args.no_checkpointing, vary=args.vary,
               sdpa=args.sdpa, bucket=args.bucket, trainer=args.trainer, compile_layers=not args.no_compile_layers,
               timed=not args.vary)  # with --vary: the template, each timed pass a new step's lengths
    update = trainer_update(policy, cfg, device) if args.trainer else None
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(0)).to(device)
    seeds = iter(range(1, 10**6))
    # as the trainer: widths rounded up to 8 more where the layers are compiled (grpo.step_setup's width_multiple)
    bucket = math.lcm(args.bucket, compiled_layers.width_multiple(policy))
    for micro in args.micro:
        # the timed passes' batches, each cut into its micro-batches (--vary: a new step's lengths each)
        cut = [micro_batches(qwen_batch(vocab, device, scale, next(seeds)) if args.vary else batch, adv, micro,
                             bucket) for _ in range(1 + args.repeats)]
        passes = iter(cut)

        def one_pass() -> None:
            step_batch, step_adv, slices = next(passes)
            if update is not None:
                update(step_batch, step_adv, slices)
            else:
                train_pass(policy, step_batch, slices)

        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        with sdpa_backends(args.sdpa):
            ms = median_ms(one_pass, warmup=1, iters=args.repeats)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device.type == "cuda" else None
        share = statistics.mean(real_token_share(b, slices) for b, _, slices in cut)
        rec.record("pass", micro=micro, passes=len(cut[0][2]), ms=round(ms, 2), real_token_frac=round(share, 3),
                   peak_over_weights_gib=None if peak is None else round(peak, 2))


if __name__ == "__main__":
    main()
