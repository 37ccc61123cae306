"""Held-out evaluation: answer accuracy and format compliance, reported separately.

Format earns a large share of the reward (5 of 9.5 points in one reference recipe), so a rising reward
can hide an unchanged accuracy; here the two are measured apart, greedy and as pass@1 over k samples
at the training temperature, with identical prompts and decoding for the base and the trained model.
Accuracy comes twice: strict (the answer in `<SOLUTION>`, what the reward pays for) and lenient (the
final answer wherever the model wrote it, `\\boxed{}` or the last number), so an untrained model's real
ability does not read as zero. Keys: `eval/greedy_accuracy`, `eval/greedy_lenient_accuracy`,
`eval/greedy_format`; sampled: `eval/pass@1`, `eval/pass@1_lenient`, `eval/sampled_format`.
`problem_records` gives one record per held-out problem, so that two adapters can be compared problem by
problem (`grpo.eval.compare`).

What it deliberately is not: loading a model (the trainer evaluates its own policy through its engine;
`grpo.eval.cli` loads one for `python -m grpo.eval`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace

from grpo import rewards as grpo_rewards
from grpo.rollout import Sampling


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
