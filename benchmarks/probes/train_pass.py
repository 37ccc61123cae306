"""The training pass on rows of unequal length: one padded forward against length-sorted micro-batches.

A GRPO step's training pass (forward, log-probs, backward over every row) runs each micro-batch as wide as
its longest row (`grpo.batch.Batch.rows`); `--micro-batch-size` cuts the step's rows, sorted by length, into
micro-batches (`grpo.batch.micro_batches`). On the qwen1.5b-gsm8k preset's rows (64 of 90-175 prompt and
102-384 completion tokens) one pass runs 31% padding; four sorted micro-batches, 10%, but each a quarter as
wide in rows. This times that trade on the GPU with the trainer's own pieces: a random model of the
preset's shapes with the preset's rsLoRA (r 32, gradient checkpointing unless --no-checkpointing), a batch
with the lengths of a real step of the preset (`QWEN_PROMPTS`, `QWEN_COMPLETIONS`: batch 0 of
learning_faults.py's gap run), and for each micro-batch size the forward and backward of
`sequence_logprobs` over all rows: median milliseconds, the share of real tokens among the positions run
(`train/real_token_frac`), and the peak memory above the weights.

    PYTHONPATH=$PWD python3 benchmarks/probes/train_pass.py --micro 64 32 16 8
    python benchmarks/probes/train_pass.py --smoke        (a tiny model on the CPU: the plumbing only)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import Recorder, add_out_argument, median_ms  # noqa: E402  (beside this file)

# One step of the qwen1.5b-gsm8k preset (8 prompts x 8 completions): each row's prompt and completion tokens.
QWEN_PROMPTS = [90] * 8 + [121] * 8 + [99] * 8 + [175] * 8 + [168] * 8 + [124] * 8 + [129] * 8 + [122] * 8
QWEN_COMPLETIONS = [160, 179, 209, 150, 146, 111, 210, 153, 168, 233, 245, 354, 245, 201, 209, 197, 159, 146, 348,
                    146, 111, 145, 129, 108, 372, 364, 217, 200, 264, 384, 301, 196, 290, 384, 342, 356, 384, 384,
                    246, 208, 240, 367, 260, 384, 226, 197, 266, 184, 241, 260, 228, 221, 149, 235, 287, 232, 384,
                    384, 353, 384, 384, 352, 384, 384]
GENERATIONS = 8


def build_policy(smoke: bool, lora_compute: str, checkpointing: bool, device: torch.device):
    """The preset's policy on a random model of its shapes (a tiny Qwen2 with --smoke)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo.config import Config
    from grpo.model import add_lora
    from native_engine import qwen_1_5b_config  # beside this file

    config = (Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
              if smoke else qwen_1_5b_config())
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.requires_grad_(False)
    cfg = Config(lora_rank=32, lora_alpha=64, lora_compute=lora_compute, gradient_checkpointing=checkpointing)
    policy = add_lora(model, cfg)
    with torch.no_grad():  # B non-zero, as after some training
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    policy.train()
    return policy, config.vocab_size


def qwen_batch(vocab: int, device: torch.device, scale: float = 1.0):
    """A Batch with the preset step's lengths (each divided by `scale`), random tokens."""
    from grpo.batch import make_batch
    from grpo.rollout.base import Rollout

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (max(1, int(n / scale)),), generator=gen).tolist()
               for n in QWEN_PROMPTS[::GENERATIONS]]
    lengths = [max(1, int(n / scale)) for n in QWEN_COMPLETIONS]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--micro", type=int, nargs="+", default=[64, 32, 16, 8],
                        help="micro-batch sizes to time (64: one pass over the step's rows)")
    parser.add_argument("--lora-compute", choices=["float32", "base"], default="float32",
                        help="the adapters' matmul dtype (the preset's: float32)")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep the activations instead of recomputing them in backward (the preset recomputes)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per size (median)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and short rows on the CPU: plumbing only")
    add_out_argument(parser)
    args = parser.parse_args()

    from grpo.batch import micro_batches, real_token_share

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    rec = Recorder("train_pass", args.out)
    policy, vocab = build_policy(args.smoke, args.lora_compute, not args.no_checkpointing, device)
    batch = qwen_batch(vocab, device, scale=16.0 if args.smoke else 1.0)
    rec.record("batch", rows=len(batch), real_tokens=sum(batch.lengths), longest=max(batch.lengths),
               mean_length=round(statistics.mean(batch.lengths), 1), device=str(device),
               lora_compute=args.lora_compute, checkpointing=not args.no_checkpointing)
    adv = torch.zeros(len(batch), device=device)
    for micro in args.micro:
        sorted_batch, _, slices = micro_batches(batch, adv, micro)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        ms = median_ms(lambda: train_pass(policy, sorted_batch, slices), warmup=1, iters=args.repeats)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device.type == "cuda" else None
        rec.record("pass", micro=micro, passes=len(slices), ms=round(ms, 2),
                   real_token_frac=round(real_token_share(sorted_batch, slices), 3),
                   peak_over_weights_gib=None if peak is None else round(peak, 2))


if __name__ == "__main__":
    main()
