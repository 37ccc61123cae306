"""Held-out evaluation: answer accuracy and format compliance, reported separately.

Format earns a large share of the reward (5 of 9.5 points in one reference recipe), so a rising reward
can hide an unchanged accuracy; here the two are measured apart, greedy and as pass@1 over k samples
at the training temperature, with identical prompts and decoding for the base and the trained model.
Accuracy comes twice: strict (the answer in `<SOLUTION>`, what the reward pays for) and lenient (the
final answer wherever the model wrote it, `\\boxed{}` or the last number), so an untrained model's real
ability does not read as zero. Keys: `eval/greedy_accuracy`, `eval/greedy_lenient_accuracy`,
`eval/greedy_format`; sampled: `eval/pass@1`, `eval/pass@1_lenient`, `eval/sampled_format`.
Also `python -m grpo.eval --model M [--adapter A]` for a one-off measurement; `--per-problem FILE.jsonl` also
writes one line per held-out problem (`problem_records`), so that two adapters can be compared problem by
problem (`python -m grpo.compare_evals A.jsonl B.jsonl`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from grpo import data as grpo_data
from grpo import rewards as grpo_rewards
from grpo.answer_format import SYSTEM_PROMPT
from grpo.cli import OneLineParser, add_bool_flag
from grpo.config import Config
from grpo.export.merge import find_adapter
from grpo.model.load import attention_without_cudnn, default_device, load_base_model, load_tokenizer
from grpo.quiet import add_verbose_flag, hide_known_warnings
from grpo.rollout import Sampling, build_engine
from grpo.rollout.stops import stop_string_sequences, stop_token_ids
from grpo.run.durable import write_atomically
from grpo.run.failures import adapter_load_error, report


def evaluate(engine, tokenizer, prompt_set, sampling: Sampling, *, k: int, seed: int,
             max_rows: int | None = None, progress: Callable[[int, int], None] | None = None,
             per_problem: list[dict] | None = None) -> dict[str, float]:
    """Greedy strict and lenient accuracy and format, and the same over `k` samples per held-out prompt
    (pass@1: the fraction of samples that are right).

    Generates at most `max_rows` completions per engine call, so the engine's buffers stay sized for
    training batches rather than for the whole held-out set. `progress(done, total)` hears of each
    call: prompts done, counting each prompt once per pass (greedy, then sampled when k > 0).
    `per_problem`, when given, receives `problem_records`: one dict per held-out prompt, in order.
    """
    prompt_ids = prompt_set.prompt_ids
    answers = [ex.answer for ex in prompt_set.examples]
    result: dict[str, float] = {"eval/prompts": float(len(prompt_ids))}
    passes = _Passes(progress, len(prompt_ids) * (2 if k > 0 else 1))
    greedy = replace(sampling, temperature=0.0, seed=seed)
    texts = _generate_texts(engine, tokenizer, prompt_ids, 1, greedy, max_rows, passes)
    greedy_grades = _grades(texts, answers)
    result["eval/greedy_accuracy"], result["eval/greedy_lenient_accuracy"], result["eval/greedy_format"] = \
        _means(greedy_grades)
    sampled_grades = None
    if k > 0:
        texts = _generate_texts(engine, tokenizer, prompt_ids, k, replace(sampling, seed=seed + 1), max_rows, passes)
        sampled_grades = _grades(texts, [a for a in answers for _ in range(k)])
        result["eval/pass@1"], result["eval/pass@1_lenient"], result["eval/sampled_format"] = _means(sampled_grades)
        result["eval/samples"] = float(k)
    if per_problem is not None:
        per_problem.extend(problem_records(prompt_set.examples, greedy_grades, sampled_grades, k))
    return result


def problem_id(question: str) -> str:
    """A held-out problem's id: the first 16 hex digits of its question's sha256, the same whatever the
    order, the model or the run."""
    return hashlib.sha256(question.encode()).hexdigest()[:16]


def problem_records(examples, greedy: list[tuple[bool, bool, bool]], sampled: list[tuple[bool, bool, bool]] | None,
                    k: int) -> list[dict]:
    """One record per problem: its id, greedy strict/lenient correctness and exact format, and with k
    samples per problem how many of them were right (strict, lenient) and in format."""
    records = []
    for i, (example, (strict, lenient, formatted)) in enumerate(zip(examples, greedy, strict=True)):
        record = {"id": problem_id(example.question), "answer": example.answer, "greedy_strict": strict,
                  "greedy_lenient": lenient, "greedy_format": formatted}
        if sampled is not None:
            mine = sampled[i * k:(i + 1) * k]
            record.update(samples=k, sampled_strict=sum(g[0] for g in mine), sampled_lenient=sum(g[1] for g in mine),
                          sampled_format=sum(g[2] for g in mine))
        records.append(record)
    return records


class _Passes:
    """Counts the prompts done over an evaluation's passes and tells `progress`, if there is one."""

    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress = progress
        self.total = total
        self.done = 0
        self.advance(0)

    def advance(self, prompts: int) -> None:
        self.done += prompts
        if self.progress is not None:
            self.progress(self.done, self.total)


def _generate_texts(engine, tokenizer, prompt_ids, n: int, sampling: Sampling, max_rows: int | None,
                    passes: _Passes) -> list[str]:
    per_call = len(prompt_ids) if max_rows is None else max(1, max_rows // n)
    completions = []
    for start in range(0, len(prompt_ids), per_call):  # each chunk its own seed: reproducible, not repeated
        chunk = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 7 * start)
        completions += engine.generate(prompt_ids[start:start + per_call], n, chunk).completions()
        passes.advance(len(prompt_ids[start:start + per_call]))
    return tokenizer.batch_decode(completions, skip_special_tokens=True)


def _grades(texts: list[str], answers: list[str]) -> list[tuple[bool, bool, bool]]:
    """(strict correct, lenient correct, exact format) of each completion against its answer."""
    return [(bool(grpo_rewards.is_correct(t, a)), bool(grpo_rewards.is_correct_lenient(t, a)),
             bool(grpo_rewards.has_exact_format(t))) for t, a in zip(texts, answers, strict=True)]


def _means(grades: list[tuple[bool, bool, bool]]) -> tuple[float, float, float]:
    """(strict accuracy, lenient accuracy, format compliance) of graded completions."""
    n = max(1, len(grades))
    return tuple(sum(g[j] for g in grades) / n for j in range(3))


def log_eval(console, log, step: int, result: dict[str, float]) -> None:
    log.write({"step": step, **result})
    parts = [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in result.items() if k not in ("eval/prompts", "eval/samples")]
    console.print(f"[bold cyan]eval[/] step {step}: " + " | ".join(parts))


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
                        "`python -m grpo.compare_evals`.")
    parser.add_argument("--system-prompt", default=None, help="The system prompt of every held-out prompt, as "
                        "train.py's --system-prompt (default: the recipe's; pass the run's own to compare).")
    add_bool_flag(parser, "--debug", help="On an error, show the traceback (also GRPO_DEBUG=1).")
    add_verbose_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo.eval`: flags checked before anything loads; any error is one line (status 1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:  # before the libraries that warn are imported
        hide_known_warnings()
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
        from peft import PeftModel  # imported where used: it logs at import (grpo.quiet)

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


if __name__ == "__main__":
    raise SystemExit(main())
