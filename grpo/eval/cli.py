"""`python -m grpo.eval --model M [--adapter A [--compare-base]]`: held-out accuracy of a checkpoint.

With or without an adapter, measured as the trainer measures it (`grpo.eval.accuracy`): a progress bar on stderr,
then the figures on stderr and as one JSON line on stdout.

An adapter from a run's folder is measured under the run's own settings (its system prompt, stop strings,
completion length, and its tools or environment, whose episodes are then played as training plays them) unless a
flag says otherwise. `--compare-base` measures the base model under exactly those
settings first, then the adapter, and prints the difference per metric and problem by problem (McNemar's exact
test, `grpo.eval.compare`). `--per-problem FILE.jsonl` also writes one line per held-out problem, for
`python -m grpo.eval.compare A.jsonl B.jsonl`. `--gguf FILE [--gguf-lora ADAPTER.gguf]` measures an exported
GGUF file in llama.cpp's own server instead (`grpo.eval.llama_cpp`), with --model's tokenizer and prompts.

What it deliberately is not: training's evaluation (the trainer calls `grpo.eval.accuracy` on its own policy).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import GenerationConfig

from grpo import data as grpo_data
from grpo.agents.settings import EpisodeSettings, first_prompt
from grpo.answer_format import SYSTEM_PROMPT
from grpo.cli import OneLineParser, add_bool_flag, make_console
from grpo.config import Config, format_value
from grpo.eval.accuracy import evaluate
from grpo.eval.compare import EPISODE_KEYS, KEYS, compare, format_row
from grpo.eval.llama_cpp import LlamaCppEngine, LlamaServer
from grpo.export.merge import find_adapter
from grpo.model.load import (attention_without_cudnn, default_device, load_base_model, load_tokenizer,
                             resolve_model_dir)
from grpo.quiet import add_verbose_flag
from grpo.rollout import Sampling, build_engine
from grpo.rollout.stops import stop_string_sequences, stop_token_ids
from grpo.run.durable import write_atomically
from grpo.run.failures import adapter_load_error, report
from grpo.run.log import ProgressBar, json_line

# A CPU measures fewer problems with fewer samples: a less precise figure for a shorter wait
# (benchmarks/RESULTS.md, "The measured defaults").
SIZE_DEFAULTS = {"cpu": {"eval_size": 16, "samples": 1}, "gpu": {"eval_size": 64, "samples": 4}}
MAX_COMPLETION_LENGTH = 256  # without a run's own
RUN_DEFAULT = "the run's when --adapter is in a run's folder, else"


def build_parser():
    """The command line of `python -m grpo.eval`; a flag left unset (None) takes the run's or the device's value
    (`with_run_defaults`)."""
    cpu, gpu = SIZE_DEFAULTS["cpu"], SIZE_DEFAULTS["gpu"]
    parser = OneLineParser(prog="python -m grpo.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Base model: local folder, hub id or smollm2-135m-instruct "
                        "(required).")
    parser.add_argument("--adapter", default=None, help="A PEFT adapter folder to apply, or a run's folder (its "
                        "adapter/) (default: none, the base model alone).")
    add_bool_flag(parser, "--compare-base", help="Evaluate the base model first, under the adapter's prompt, stop "
                  "strings and length, then the adapter, and print the difference per metric and per problem "
                  "(needs --adapter) (default: false).")
    parser.add_argument("--gguf", default=None, metavar="FILE.gguf", help="Evaluate this GGUF file in llama.cpp's "
                        "llama-server instead of --model's weights (--model still gives the tokenizer and prompts) "
                        "(default: none).")
    parser.add_argument("--gguf-lora", default=None, metavar="ADAPTER.gguf", help="With --gguf: a LoRA GGUF "
                        "(`python -m grpo.export --gguf-lora`) that llama.cpp applies on top (default: none).")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR", help="With --gguf: the folder of llama.cpp's "
                        "tools (default: $GRPO_LLAMA_CPP_BIN, else what scripts/llama-cpp.sh built in the cache).")
    parser.add_argument("--dataset", default="arithmetic", help="Dataset whose held-out split is used "
                        "(default: arithmetic).")
    parser.add_argument("--eval-size", type=int, default=None, help="Held-out prompts "
                        f"(default: {gpu['eval_size']} on a GPU, {cpu['eval_size']} on a CPU).")
    parser.add_argument("--samples", type=int, default=None, help="Samples per prompt for pass@1, 0: greedy only "
                        f"(default: {gpu['samples']} on a GPU, {cpu['samples']} on a CPU).")
    parser.add_argument("--max-completion-length", type=int, default=None, help="Completion tokens at most "
                        f"(default: {RUN_DEFAULT} {MAX_COMPLETION_LENGTH}).")
    parser.add_argument("--stop", nargs="*", default=None, help="Stop strings, as train.py's --stop "
                        f"(default: {RUN_DEFAULT} none).")
    parser.add_argument("--system-prompt", default=None, help="The system prompt of every held-out prompt, as "
                        f"train.py's --system-prompt (default: {RUN_DEFAULT} the recipe's).")
    parser.add_argument("--system-prompt-turn", default=None, choices=["system", "user"], help="Where the system "
                        f"prompt goes, as train.py's --system-prompt-turn (default: {RUN_DEFAULT} system).")
    parser.add_argument("--tools", default=None, metavar="FILE.py:f,g", help="Tools the model may call, as "
                        "train.py's --tools: each held-out problem is then an episode (none: single completions) "
                        f"(default: {RUN_DEFAULT} none).")
    parser.add_argument("--environment", default=None, metavar="FILE.py:Class", help="An environment class, as "
                        "train.py's --environment: each held-out problem is then an episode of it (none: no "
                        f"environment) (default: {RUN_DEFAULT} none).")
    parser.add_argument("--max-turns", type=int, default=None, help="With tools or an environment: model turns per "
                        f"episode at most (default: {RUN_DEFAULT} {Config.max_turns}).")
    parser.add_argument("--tool-timeout", type=float, default=None, help="With tools: seconds a tool call may run "
                        f"(default: {RUN_DEFAULT} {Config.tool_timeout:g}).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature for pass@1 "
                        "(default: 1.0).")
    parser.add_argument("--min-p", type=float, default=0.1, help="min-p for pass@1 sampling (default: 0.1).")
    parser.add_argument("--engine", default="auto", choices=["auto", "native", "hf"], help="Sampler "
                        "(default: auto).")
    parser.add_argument("--seed", type=int, default=3407, help="Seed of the sampled decoding (default: 3407).")
    parser.add_argument("--max-prompt-length", type=int, default=1024, help="Held-out prompts longer than this are "
                        "dropped (default: 1024, which keeps all of arithmetic's).")
    add_bool_flag(parser, "--load-in-fp8", help="Quantize a bf16 base to FP8 blocks at load (default: false).")
    parser.add_argument("--batch-rows", type=int, default=None, help="Completions per engine call. The trainer's "
                        "eval uses P*G (64 in the qwen1.5b-gsm8k preset); pass the same to reproduce its figures, "
                        "since batching moves bf16 greedy decoding slightly on a GPU (default: all at once).")
    parser.add_argument("--per-problem", default=None, metavar="FILE.jsonl", help="Also write one JSON line per "
                        "held-out problem (id, greedy strict/lenient/format, sampled counts), for "
                        "`python -m grpo.eval.compare`; with --compare-base the base model's go to "
                        "FILE.base.jsonl (default: none).")
    add_bool_flag(parser, "--debug", help="On an error, show the traceback (also GRPO_DEBUG=1) (default: false).")
    add_verbose_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo.eval`: flags checked before anything loads; any error is one line (status 1); Ctrl-C is one
    line (status 130)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = eval_flag_problem(args)
    if problem:
        parser.error(problem)
    try:
        with attention_without_cudnn():  # as the trainer's evaluations run: every prompt width is new
            result = evaluate_from_flags(args)
    except KeyboardInterrupt as stop:  # grpo.run.signals.Stopped carries its signal; a plain one is Ctrl-C's
        print("interrupted: the evaluation stopped before its end; nothing written", file=sys.stderr)
        return 128 + getattr(stop, "signum", signal.SIGINT)
    except Exception as err:
        return report(err, args.debug, adapter_load_error(err, args.adapter, args.model))
    json.dump(result, sys.stdout)
    print()
    return 0


def eval_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a flag of `python -m grpo.eval` as given, naming it; None when nothing."""
    if args.compare_base and args.adapter is None:
        return "--compare-base: compares the base model with an adapter; pass --adapter ADAPTER_OR_RUN_FOLDER"
    if args.gguf is None and (args.gguf_lora is not None or args.llama_cpp is not None):
        return "--gguf-lora and --llama-cpp go with --gguf FILE.gguf (the file llama.cpp evaluates)"
    if args.gguf is not None and (args.adapter is not None or args.compare_base):
        return ("--gguf evaluates a GGUF file in llama.cpp; --adapter and --compare-base evaluate --model's "
                "weights: use one or the other (a trained adapter goes in as --gguf-lora)")
    if args.gguf is not None and (args.tools or args.environment):
        return "--gguf evaluates single completions; --tools and --environment episodes run on --model's weights"
    if args.stop is not None and any(not text for text in args.stop):
        return "--stop: an empty stop string would end every completion at once; remove it"
    at_least = {"--eval-size": (args.eval_size, 1), "--samples": (args.samples, 0), "--seed": (args.seed, 0),
                "--max-completion-length": (args.max_completion_length, 1),
                "--max-prompt-length": (args.max_prompt_length, 1), "--batch-rows": (args.batch_rows, 1),
                "--max-turns": (args.max_turns, 1)}
    for name, (value, low) in at_least.items():
        if value is not None and value < low:
            return f"{name} {value}: must be {low} or more"
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature {args.temperature}: must be a finite number, 0 or more"
    if not (math.isfinite(args.min_p) and 0 <= args.min_p < 1):
        return f"--min-p {args.min_p}: must be in [0, 1)"
    if args.tool_timeout is not None and not (math.isfinite(args.tool_timeout) and args.tool_timeout > 0):
        return f"--tool-timeout {args.tool_timeout}: must be above 0 seconds"
    return None


def run_config(adapter: Path) -> tuple[Path, dict] | None:
    """The config.json of the run an adapter comes from (beside the adapter, or beside its checkpoint-N or
    adapter/ folder) and its path; None when there is no run's config."""
    for path in (adapter / "config.json", adapter.parent / "config.json"):
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(values, dict) and "num_generations" in values and "system_prompt" in values:  # a run's Config
            return path, values
    return None


def run_completion_length(values: dict) -> int | None:
    """A run's completion budget: its --max-completion-length, or what its prompt budget left of its sequence."""
    if isinstance(values.get("max_completion_length"), int):
        return values["max_completion_length"]
    seq, prompt = values.get("max_seq_length"), values.get("max_prompt_length")
    if isinstance(seq, int) and isinstance(prompt, int) and seq > prompt:
        return seq - prompt
    return None  # a percentile of the run's prompts: not known here


def with_run_defaults(args: argparse.Namespace, run: tuple[Path, dict] | None,
                      device: torch.device) -> argparse.Namespace:
    """`args` (not changed) with each flag left unset given the run's value where `run` (`run_config`) has one,
    else the device's or the plain default; says on stderr which values came from the run."""
    values, taken = dict(vars(args)), []
    settings = run[1] if run is not None else {}
    if args.stop is None:
        values["stop"] = list(settings.get("stop") or [])
        if run is not None:
            taken.append(f"--stop {format_value(values['stop']) or 'none'}")
    if args.max_completion_length is None:
        length = run_completion_length(settings)
        values["max_completion_length"] = length or MAX_COMPLETION_LENGTH
        if length is not None:
            taken.append(f"--max-completion-length {length}")
    if args.system_prompt is None:
        values["system_prompt"] = settings.get("system_prompt") or SYSTEM_PROMPT
        if settings.get("system_prompt") is not None:
            taken.append("--system-prompt (its own)")
    if args.system_prompt_turn is None:
        values["system_prompt_turn"] = settings.get("system_prompt_turn") or "system"
        if settings.get("system_prompt_turn") not in (None, "system"):
            taken.append(f"--system-prompt-turn {values['system_prompt_turn']}")
    for name, plain in (("tools", None), ("environment", None), ("max_turns", Config.max_turns),
                        ("tool_timeout", Config.tool_timeout)):
        if values[name] is None:
            from_run = settings.get(name)
            values[name] = plain if from_run is None else from_run
            if from_run is not None and name in ("tools", "environment"):
                taken.append(f"--{name} {format_value(from_run)}")
    for name in ("tools", "environment"):
        if isinstance(values[name], str) and values[name].lower() == "none":
            values[name] = None
    sized = SIZE_DEFAULTS["gpu" if device.type == "cuda" else "cpu"]
    for name, value in sized.items():
        values[name] = value if values[name] is None else values[name]
    if taken:
        print(f"the run's settings, from {run[0]}: {', '.join(taken)}", file=sys.stderr)
    return argparse.Namespace(**values)


def evaluate_from_flags(args: argparse.Namespace) -> dict:
    """The evaluation the flags ask for, its progress shown on stderr: the result of one model, or with
    --compare-base both and their differences (`comparison`)."""
    adapter = find_adapter(args.adapter) if args.adapter else None  # before the model loads
    device = default_device()
    args = with_run_defaults(args, run_config(adapter) if adapter is not None else None, device)
    if args.gguf is not None:
        return evaluate_gguf(args, device)
    cfg = Config(model=args.model, dataset=args.dataset, load_in_fp8=args.load_in_fp8, gradient_checkpointing=False)
    base, model_dir = load_base_model(cfg, device)
    tokenizer = load_tokenizer(model_dir)
    episodes = EpisodeSettings.load(args.tools, args.environment, args.max_turns, args.tool_timeout,
                                    args.system_prompt, args.system_prompt_turn)
    examples = grpo_data.load_examples(args.dataset, split="test", seed=args.seed)[:args.eval_size]
    prompt_text = None if episodes is None else (lambda example: first_prompt(tokenizer, example, episodes))
    prompt_set = grpo_data.build_prompts(tokenizer, examples, args.max_prompt_length, args.system_prompt,
                                         prompt_text=prompt_text, system_prompt_turn=args.system_prompt_turn)
    sampling = Sampling(max_new_tokens=args.max_completion_length, temperature=args.temperature, min_p=args.min_p,
                        stop_token_ids=stop_token_ids(tokenizer, base.generation_config),
                        stop_sequences=stop_string_sequences(tokenizer, args.stop))
    names = ["base", "adapter"] if args.compare_base else ["base" if adapter is None else "adapter"]
    results, records = evaluate_models(names, base, adapter, tokenizer, prompt_set, sampling, args, episodes)
    if args.per_problem:
        write_jsonl(args.per_problem, records[names[-1]])
        if args.compare_base:
            write_jsonl(base_records_path(args.per_problem), records["base"])
    if not args.compare_base:
        make_console(stderr=True).print(results[names[0]])
        return results[names[0]]
    result = comparison(results["base"], results["adapter"], records["base"], records["adapter"])
    print_comparison(result, args.adapter)
    return result


def evaluate_gguf(args: argparse.Namespace, device: torch.device) -> dict:
    """`--gguf`: the file (and `--gguf-lora`) in llama.cpp's server, with --model's tokenizer, prompts and stop ids;
    as many requests in flight as a batch of the trainer's evaluation (`--batch-rows`, else 64)."""
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    examples = grpo_data.load_examples(args.dataset, split="test", seed=args.seed)[:args.eval_size]
    prompt_set = grpo_data.build_prompts(tokenizer, examples, args.max_prompt_length, args.system_prompt,
                                         system_prompt_turn=args.system_prompt_turn)
    generation_config = GenerationConfig.from_pretrained(model_dir) \
        if (model_dir / "generation_config.json").is_file() else None
    sampling = Sampling(max_new_tokens=args.max_completion_length, temperature=args.temperature, min_p=args.min_p,
                        stop_token_ids=stop_token_ids(tokenizer, generation_config),
                        stop_sequences=stop_string_sequences(tokenizer, args.stop))
    slots = min(args.batch_rows or 64, len(prompt_set.prompt_ids) * max(1, args.samples))
    longest = max(len(p) for p in prompt_set.prompt_ids) + args.max_completion_length
    progress = ProgressBar(make_console(stderr=True), 1, 0, unit="models")
    records: list[dict] = []
    with LlamaServer(args.gguf, lora=args.gguf_lora, slots=slots, ctx_per_slot=-(-longest // 256) * 256,
                     gpu_layers=999 if device.type == "cuda" else 0, bin_dir=args.llama_cpp) as server:
        engine = LlamaCppEngine(server, pad_id=tokenizer.pad_token_id, seed=args.seed)
        progress.start()
        try:
            result = evaluate(engine, tokenizer, prompt_set, sampling, k=args.samples, seed=args.seed,
                              max_rows=args.batch_rows, progress=progress.evaluation, per_problem=records)
            progress.update(1)
        finally:
            progress.stop()
    if args.per_problem:
        write_jsonl(args.per_problem, records)
    make_console(stderr=True).print(result)
    return result


def evaluate_models(names: list[str], base, adapter: Path | None, tokenizer, prompt_set, sampling: Sampling,
                    args: argparse.Namespace, episodes: EpisodeSettings | None = None
                    ) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Each of `names` ("base", "adapter": the base first, since the adapter is applied to it in place) evaluated
    under the same prompts and sampling (and with `episodes`, the same episodes' settings, environments reset from
    the same examples), with the trainer's progress bar on stderr; (results, per-problem records) by name."""
    progress = ProgressBar(make_console(stderr=True), len(names), 0, unit="models")
    results: dict[str, dict] = {}
    records: dict[str, list[dict]] = {name: [] for name in names}
    progress.start()
    try:
        for done, name in enumerate(names, start=1):
            policy = base if name == "base" else PeftModel.from_pretrained(base, adapter)
            results[name] = evaluate_policy(policy, tokenizer, prompt_set, sampling, args, progress, records[name],
                                            episodes)
            progress.update(done)
    finally:
        progress.stop()
    return results, records


def evaluate_policy(policy, tokenizer, prompt_set, sampling: Sampling, args: argparse.Namespace,
                    progress: ProgressBar, records: list[dict], episodes: EpisodeSettings | None = None
                    ) -> dict[str, float]:
    """One model's held-out result through an engine of its own; its per-problem records appended to `records`."""
    engine = build_engine(args.engine, policy, pad_id=tokenizer.pad_token_id,
                          max_seq_len=max(len(p) for p in prompt_set.prompt_ids) + args.max_completion_length,
                          max_batch=max(1, args.eval_size * max(1, args.samples)))
    engine.progress = progress.generation  # tokens generated, shown while the engine samples (if it says)
    result = evaluate(engine, tokenizer, prompt_set, sampling, k=args.samples, seed=args.seed,
                      max_rows=args.batch_rows, progress=progress.evaluation, per_problem=records, episodes=episodes)
    engine.release_memory()
    return result


def comparison(base: dict[str, float], adapter: dict[str, float], base_records: list[dict],
               adapter_records: list[dict]) -> dict:
    """Both results, the adapter's minus the base's per metric, and per greedy key (with episodes, their tool use
    or success too) the problem-by-problem comparison (A the adapter, B the base: `grpo.eval.compare.compare`)."""
    by_id = [{r["id"]: r for r in records} for records in (adapter_records, base_records)]
    keys = [*KEYS, *(key for key in EPISODE_KEYS if adapter_records and key in adapter_records[0])]
    difference = {k: adapter[k] - base[k] for k in adapter if k not in ("eval/prompts", "eval/samples")}
    return {"base": base, "adapter": adapter, "adapter_minus_base": difference,
            "per_problem": [compare(by_id[0], by_id[1], key) for key in keys]}


def print_comparison(result: dict, adapter: str) -> None:
    """The comparison on stderr: a line per metric, then a line per greedy key, problem by problem."""
    lines = [f"{'metric':<26}{'base':>8}{'adapter':>9}{'adapter-base':>14}"]
    for key, diff in result["adapter_minus_base"].items():
        lines.append(f"{key.removeprefix('eval/'):<26}{result['base'][key]:>8.3f}{result['adapter'][key]:>9.3f}"
                     f"{diff:>+14.3f}")
    lines.append(f"problem by problem, A = --adapter {adapter}, B = the base model:")
    lines += [format_row(row) for row in result["per_problem"]]
    print("\n".join(lines), file=sys.stderr)


def base_records_path(path: str) -> Path:
    """Where --compare-base writes the base model's per-problem records: FILE.jsonl -> FILE.base.jsonl."""
    path = Path(path)
    return path.with_name(f"{path.stem}.base{path.suffix}")


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """`records` as JSON lines in `path` (its folder created), written aside and renamed: never half-written."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(Path(path), "".join(json_line(r) for r in records).encode())
