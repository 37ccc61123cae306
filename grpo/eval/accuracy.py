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

A run with tools or an environment is measured on episodes (`grpo.agents.settings.play_episodes`), played
as training plays them: accuracy and format read the whole transcript, and each pass also reports its episodes:
`eval/greedy_turns` (model turns per episode); with tools `eval/greedy_tool_use` (the share of episodes with at
least one call), `eval/greedy_tool_calls` and `eval/greedy_tool_errors` (per episode); with an environment
`eval/greedy_success` (the share whose reward, summed over turns, is above 0). The sampled pass the same with
`eval/sampled_` in front.

What it deliberately is not: loading a model (the trainer evaluates its own policy through its engine;
`grpo.eval.cli` loads one for `python -m grpo.eval`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from grpo import rewards as grpo_rewards
from grpo.agents.environments import Episode
from grpo.agents.settings import EpisodeSettings, play_episodes, success
from grpo.rollout import Sampling


def evaluate(engine, tokenizer, prompt_set, sampling: Sampling, *, k: int, seed: int,
             max_rows: int | None = None, progress: Callable[[int, int], None] | None = None,
             per_problem: list[dict] | None = None, episodes: EpisodeSettings | None = None) -> dict[str, float]:
    """Greedy strict and lenient accuracy and format, and the same over `k` samples per held-out prompt
    (pass@1: the fraction of samples that are right).

    Generates at most `max_rows` completions per engine call, so the engine's buffers stay sized for
    training batches rather than for the whole held-out set. `progress(done, total)` hears of each
    call: prompts done, counting each prompt once per pass (greedy, then sampled when k > 0).
    `per_problem`, when given, receives `problem_records`: one dict per held-out prompt, in order.
    `episodes`: the run's tools or environment (see the module's docstring); None for single completions.
    """
    prompt_ids = prompt_set.prompt_ids
    answers = [ex.answer for ex in prompt_set.examples]
    result: dict[str, float] = {"eval/prompts": float(len(prompt_ids))}
    passes = _Passes(progress, len(prompt_ids) * (2 if k > 0 else 1))
    greedy = replace(sampling, temperature=0.0, seed=seed)
    played = _Played(engine, tokenizer, prompt_set, max_rows, passes, episodes)
    texts, greedy_episodes = played(1, greedy)
    greedy_grades = _grades(texts, answers)
    result["eval/greedy_accuracy"], result["eval/greedy_lenient_accuracy"], result["eval/greedy_format"] = \
        _means(greedy_grades)
    result.update(episode_figures(greedy_episodes, episodes, "eval/greedy_"))
    sampled_grades = None
    if k > 0:
        texts, sampled_episodes = played(k, replace(sampling, seed=seed + 1))
        sampled_grades = _grades(texts, [a for a in answers for _ in range(k)])
        result["eval/pass@1"], result["eval/pass@1_lenient"], result["eval/sampled_format"] = _means(sampled_grades)
        result.update(episode_figures(sampled_episodes, episodes, "eval/sampled_"))
        result["eval/samples"] = float(k)
    if per_problem is not None:
        per_problem.extend(problem_records(prompt_set.examples, greedy_grades, sampled_grades, k, greedy_episodes,
                                           episodes))
    return result


def episode_figures(played: list[Episode], episodes: EpisodeSettings | None, prefix: str) -> dict[str, float]:
    """A pass's episodes in figures (the module's docstring names them), each key `prefix` + its name; {} for a
    pass of single completions."""
    if episodes is None or not played:
        return {}
    n = len(played)
    figures = {"turns": sum(e.turns for e in played) / n}
    if episodes.tools:
        figures.update(tool_use=sum(e.tool_calls > 0 for e in played) / n,
                       tool_calls=sum(e.tool_calls for e in played) / n,
                       tool_errors=sum(e.tool_errors for e in played) / n)
    if episodes.environment is not None:
        figures["success"] = sum(map(success, played)) / n
    return {prefix + name: value for name, value in figures.items()}


def problem_id(question: str, answer: str | None = None) -> str:
    """A held-out problem's id: the first 16 hex digits of its question's sha256 (with its answer, for a
    question that several problems share), the same whatever the order, the model or the run."""
    text = question if answer is None else f"{question}\n{answer}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def problem_records(examples, greedy: list[tuple[bool, bool, bool]], sampled: list[tuple[bool, bool, bool]] | None,
                    k: int, greedy_episodes: list[Episode] | None = None,
                    episodes: EpisodeSettings | None = None) -> list[dict]:
    """One record per problem: its id, greedy strict/lenient correctness and exact format, and with k
    samples per problem how many of them were right (strict, lenient) and in format. With `episodes`, the
    greedy episode's too: its tool calls and whether it called one (tools), whether it succeeded (an
    environment). Problems that share a question (one game, several secrets) are told apart by their answer."""
    questions = Counter(example.question for example in examples)
    records = []
    for i, (example, (strict, lenient, formatted)) in enumerate(zip(examples, greedy, strict=True)):
        shared = questions[example.question] > 1
        record = {"id": problem_id(example.question, example.answer if shared else None), "answer": example.answer,
                  "greedy_strict": strict, "greedy_lenient": lenient, "greedy_format": formatted}
        if episodes is not None and greedy_episodes:
            episode = greedy_episodes[i]
            record["greedy_turns"] = episode.turns
            if episodes.tools:
                record.update(greedy_tool_use=episode.tool_calls > 0, greedy_tool_calls=episode.tool_calls)
            if episodes.environment is not None:
                record["greedy_success"] = success(episode)
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


class _Played:
    """One pass over the held-out prompts, `n` completions (or episodes) of each: `(texts, episodes)`, the
    episodes [] for single completions. At most `max_rows` completions per engine call, each call its own seed."""

    def __init__(self, engine, tokenizer, prompt_set, max_rows: int | None, passes: _Passes,
                 episodes: EpisodeSettings | None):
        self.engine, self.tokenizer, self.prompt_set = engine, tokenizer, prompt_set
        self.max_rows, self.passes, self.episodes = max_rows, passes, episodes

    def __call__(self, n: int, sampling: Sampling) -> tuple[list[str], list[Episode]]:
        prompt_ids, examples = self.prompt_set.prompt_ids, self.prompt_set.examples
        per_call = len(prompt_ids) if self.max_rows is None else max(1, self.max_rows // n)
        completions, played = [], []
        for start in range(0, len(prompt_ids), per_call):  # each chunk its own seed: reproducible, not repeated
            chunk = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 7 * start)
            if self.episodes is None:
                rollout = self.engine.generate(prompt_ids[start:start + per_call], n, chunk)
            else:
                rollout, chunk_episodes = play_episodes(self.engine, self.tokenizer, examples[start:start + per_call],
                                                        n, chunk, self.episodes)
                played += chunk_episodes
            completions += rollout.completions()
            self.passes.advance(len(prompt_ids[start:start + per_call]))
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True), played


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
