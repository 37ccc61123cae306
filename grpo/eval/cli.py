"""`python -m grpo.eval --model M [--adapter A]`: held-out accuracy of a checkpoint, with or without an adapter,
measured as the trainer measures it (`grpo.eval.accuracy`). `--per-problem FILE.jsonl` also writes one line per
held-out problem, for `python -m grpo.eval.compare A.jsonl B.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from peft import PeftModel
from rich.console import Console

from grpo import data as grpo_data
from grpo.answer_format import SYSTEM_PROMPT
from grpo.cli import OneLineParser, add_bool_flag
from grpo.config import Config
from grpo.eval.accuracy import evaluate
from grpo.export.merge import find_adapter
from grpo.model.load import attention_without_cudnn, default_device, load_base_model, load_tokenizer
from grpo.quiet import add_verbose_flag
from grpo.rollout import Sampling, build_engine
from grpo.rollout.stops import stop_string_sequences, stop_token_ids
from grpo.run.durable import write_atomically
from grpo.run.failures import adapter_load_error, report


def build_parser():
    """The command line of `python -m grpo.eval`."""

    parser = OneLineParser(prog="python -m grpo.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Base model: local folder, hub id or smollm2-135m-instruct.")
    parser.add_argument("--adapter", default=None, help="A PEFT adapter folder to apply (default: the base model).")
    parser.add_argument("--dataset", default="arithmetic", help="Dataset whose held-out split is used.")
    parser.add_argument("--eval-size", type=int, default=64, help="Held-out prompts.")
    parser.add_argument("--samples", type=int, default=4, help="Samples per prompt for pass@1 (0: greedy only).")
    parser.add_argument("--max-completion-length", type=int, default=256, help="Completion tokens at most.")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature for pass@1.")
    parser.add_argument("--min-p", type=float, default=0.1, help="min-p for pass@1 sampling.")
    parser.add_argument("--engine", default="auto", choices=["auto", "native", "hf"], help="Sampler.")
    parser.add_argument("--seed", type=int, default=3407, help="Seed of the sampled decoding.")
    parser.add_argument("--max-prompt-length", type=int, default=1024,
                        help="Held-out prompts longer than this are dropped (the default keeps all of arithmetic's).")
    parser.add_argument("--stop", nargs="*", default=[], help="Stop strings, as train.py's --stop (the "
                        "smollm2-arithmetic preset trains with --stop '</SOLUTION>'; pass the same to compare).")
    add_bool_flag(parser, "--load-in-fp8", help="Quantize a bf16 base to FP8 blocks at load.")
    parser.add_argument("--batch-rows", type=int, default=None, help="Completions per engine call (default: all "
                        "at once). The trainer's eval uses P*G (64 in the qwen1.5b-gsm8k preset); pass the same to "
                        "reproduce its figures, since batching moves bf16 greedy decoding slightly on a GPU.")
    parser.add_argument("--per-problem", default=None, metavar="FILE.jsonl", help="Also write one JSON line per "
                        "held-out problem (id, greedy strict/lenient/format, sampled counts), for "
                        "`python -m grpo.eval.compare`.")
    parser.add_argument("--system-prompt", default=None, help="The system prompt of every held-out prompt, as "
                        "train.py's --system-prompt (default: the recipe's; pass the run's own to compare).")
    add_bool_flag(parser, "--debug", help="On an error, show the traceback (also GRPO_DEBUG=1).")
    add_verbose_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo.eval`: flags checked before anything loads; any error is one line (status 1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(not text for text in args.stop):
        parser.error("--stop: an empty stop string would end every completion at once; remove it")
    problem = eval_flag_problem(args)
    if problem:
        parser.error(problem)
    try:
        with attention_without_cudnn():  # as the trainer's evaluations run: every prompt width is new
            result = evaluate_from_flags(args)
    except Exception as err:
        return report(err, args.debug, adapter_load_error(err, args.adapter, args.model))
    json.dump(result, sys.stdout)
    print()
    return 0


def eval_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a numeric flag of `python -m grpo.eval`, naming it; None when nothing."""
    at_least = {"--eval-size": (args.eval_size, 1), "--samples": (args.samples, 0), "--seed": (args.seed, 0),
                "--max-completion-length": (args.max_completion_length, 1),
                "--max-prompt-length": (args.max_prompt_length, 1)}
    if args.batch_rows is not None:
        at_least["--batch-rows"] = (args.batch_rows, 1)
    for name, (value, low) in at_least.items():
        if value < low:
            return f"{name} {value}: must be {low} or more"
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature {args.temperature}: must be a finite number, 0 or more"
    if not (math.isfinite(args.min_p) and 0 <= args.min_p < 1):
        return f"--min-p {args.min_p}: must be in [0, 1)"
    return None


def run_system_prompt(adapter: Path) -> str | None:
    """The system prompt the adapter was trained with, when it comes from a run's folder (its config.json
    beside the adapter or the checkpoint), said on stderr; None when there is no run's config."""
    for path in (adapter / "config.json", adapter.parent / "config.json"):
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(values, dict) and "num_generations" in values and "system_prompt" in values:  # a run's Config
            prompt = values["system_prompt"]
            if prompt is not None:
                print(f"--system-prompt: the run's, from {path}", file=sys.stderr)
            return prompt
    return None


def evaluate_from_flags(args: argparse.Namespace) -> dict[str, float]:
    adapter = find_adapter(args.adapter) if args.adapter else None  # before the model loads
    cfg = Config(model=args.model, dataset=args.dataset, load_in_fp8=args.load_in_fp8, gradient_checkpointing=False)
    base, model_dir = load_base_model(cfg, default_device())
    tokenizer = load_tokenizer(model_dir)
    policy = base
    if adapter is not None:  # with its own saved settings (rank, targets), whatever they are
        policy = PeftModel.from_pretrained(base, adapter)
    examples = grpo_data.load_examples(args.dataset, split="test", seed=args.seed)[:args.eval_size]
    system_prompt = args.system_prompt
    if system_prompt is None and adapter is not None:
        system_prompt = run_system_prompt(adapter)
    system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
    prompt_set = grpo_data.build_prompts(tokenizer, examples, args.max_prompt_length, system_prompt)
    engine = build_engine(args.engine, policy, pad_id=tokenizer.pad_token_id,
                          max_seq_len=max(len(p) for p in prompt_set.prompt_ids) + args.max_completion_length,
                          max_batch=max(1, args.eval_size * max(1, args.samples)))
    sampling = Sampling(max_new_tokens=args.max_completion_length, temperature=args.temperature, min_p=args.min_p,
                        stop_token_ids=stop_token_ids(tokenizer, base.generation_config),
                        stop_sequences=stop_string_sequences(tokenizer, args.stop))
    per_problem: list[dict] | None = [] if args.per_problem else None
    result = evaluate(engine, tokenizer, prompt_set, sampling, k=args.samples, seed=args.seed,
                      max_rows=args.batch_rows, per_problem=per_problem)
    if per_problem is not None:
        write_jsonl(args.per_problem, per_problem)
    Console(stderr=True).print(result)
    return result


def write_jsonl(path: str, records: list[dict]) -> None:
    """`records` as JSON lines in `path` (its folder created), written aside and renamed: never half-written."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(Path(path), "".join(json.dumps(r) + "\n" for r in records).encode())
