"""The first five minutes: the quick-start preset within its CPU budget, flags over presets, a quiet
stderr, a step line that fits 100 columns, and progress reports from generation and evaluation."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_as_main
from grpo.config import PRESET_SUMMARIES, PRESETS, Config, build_parser, list_presets
from grpo.answer_format import SYSTEM_PROMPT
from grpo.quiet import HARMLESS_LOG_RECORDS, HARMLESS_WARNINGS

ROOT = Path(__file__).resolve().parents[1]

# The budget that made the quick start's timings true on 2 shared CPU cores (README, docs/measurements.md):
# a step's cost grows with rows x (prompt + completion) tokens, and a held-out eval adds generation before
# the first step. Grow any of these and the "first numbers within a minute" claim must be measured again.
QUICKSTART_ROWS = 8  # prompts x completions per step
QUICKSTART_COMPLETION_TOKENS = 48
QUICKSTART_STEPS = 16


def _run_cli(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- the quick-start preset ------------------------------------------------------------------------

def test_the_quickstart_preset_is_sized_to_its_cpu_budget():
    cfg = Config(**PRESETS["quickstart"])
    assert cfg.prompts_per_step * cfg.num_generations <= QUICKSTART_ROWS
    assert cfg.max_completion_length <= QUICKSTART_COMPLETION_TOKENS
    assert cfg.max_steps <= QUICKSTART_STEPS
    assert cfg.eval_size == 0  # no held-out generation before the first step
    assert cfg.cpu_threads == 1 and not cfg.gradient_checkpointing
    assert cfg.model == "smollm2-135m-instruct" and cfg.dataset == "arithmetic"  # offline
    assert cfg.stop == ("</SOLUTION>",)  # decoding ends at the answer: a learned format makes steps shorter
    assert cfg.system_prompt.startswith(SYSTEM_PROMPT + "\n")  # the recipe's instructions, then the example
    assert 0 < cfg.save_steps < cfg.max_steps  # a run cut short still leaves a checkpoint


@pytest.mark.slow
def test_one_quickstart_step_runs_offline_and_records_the_preset_it_ran(tmp_path, monkeypatch, capsys):
    from grpo.model.packaged import packaged_model_dir

    try:
        packaged_model_dir("smollm2-135m-instruct")
    except (ValueError, FileNotFoundError) as err:  # no network and no cached package
        pytest.skip(f"SmolLM2 package unavailable: {err}")
    out = tmp_path / "run"
    # one prompt of two completions of up to 16 tokens, not the preset's 2 x 4 of 48: a minute less of CPU; 16
    # problems read, not 500 tokenized
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()  # the preset's --cpu-threads 1 is the process's: given back after
    try:
        code = run_as_main([ROOT / "train.py", "--preset", "quickstart", "--max-steps", "1", "--prompts-per-step",
                            "1", "--num-generations", "2", "--max-completion-length", "16", "--num-train-examples",
                            "16", "--output-dir", out], monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err[-3000:]
    saved = json.loads((out / "config.json").read_text())
    ran = dict(preset="quickstart", max_steps=1, prompts_per_step=1, num_generations=2, max_completion_length=16,
               num_train_examples=16, output_dir=str(out))
    assert saved == json.loads(Config(**{**PRESETS["quickstart"], **ran}).to_json())
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1]
    assert steps[0]["completion_length"] <= saved["max_completion_length"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "metrics.png").is_file()


# --- help and errors (flags over presets: tests/test_train.py) ---------------------------------------

def _shown_values(parser) -> dict[str, str]:
    """What --help says each flag's value is: the "(default: ...)" that ends its help text."""
    return {a.dest: re.search(r"\(default: (.*)\)$", a.help).group(1) for a in parser._actions
            if a.help and "(default: " in a.help}


def test_help_shows_the_values_that_would_run_and_what_each_preset_runs(monkeypatch, capsys):
    plain, quick = _shown_values(build_parser()), _shown_values(build_parser("quickstart"))
    tokens = PRESETS["quickstart"]["max_completion_length"]
    assert plain["max_completion_length"] == "none" and quick["max_completion_length"] == str(tokens)
    assert plain["stop"] == "none" and quick["stop"] == "'</SOLUTION>'"
    assert quick["model"] == "smollm2-135m-instruct" and quick["gradient_checkpointing"] == "false"
    assert plain["learning_rate"] == str(Config().learning_rate)
    text = build_parser().format_help()
    for name in PRESETS:
        assert name in text
    assert set(PRESET_SUMMARIES) == set(PRESETS)
    monkeypatch.setenv("COLUMNS", "200")
    assert run_as_main([ROOT / "train.py", "--preset", "quickstart", "--help"], monkeypatch) == 0
    assert "(default: smollm2-135m-instruct)" in " ".join(capsys.readouterr().out.split())


def test_list_presets_prints_flags_as_typed_not_python_tuples():
    text = list_presets()
    assert "('" not in text and "None" not in text and "True" not in text
    assert "--stop '</SOLUTION>'" in text and "--gradient-checkpointing false" in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_a_flag_error_prints_one_line_and_where_to_look_not_the_usage(monkeypatch, capsys):
    assert run_as_main([ROOT / "train.py", "--num-generations", "x"], monkeypatch) == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "--num-generations" in lines[0] and "--help" in lines[0]
    assert "usage" not in stderr


# --- output: quiet stderr, a step line of at most 100 columns --------------------------------------

def _known_warnings_in(stderr: str) -> list[str]:
    patterns = [message for _, _, message in HARMLESS_WARNINGS] + [message for _, message in HARMLESS_LOG_RECORDS]
    return [p for p in patterns if re.search(p.lstrip("^"), stderr)]


# held-out eval (greedy: the top_k note) and gradient checkpointing (the transformers renames) are on
CLI_RUN = ["--dataset", "arithmetic", "--num-train-examples", "64", "--engine", "hf", "--max-steps", "2",
           "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "8", "--eval-size", "2",
           "--eval-samples", "1", "--log-completions-steps", "0", "--gradient-checkpointing", "true", "--beta",
           "0.04", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def quiet_cli_run(tiny_llama_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """Two steps of train.py on the tiny Llama, without -v, for the tests below (a run pays its imports):
    (the process, its output folder)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    result = _run_cli(["--model", str(tiny_llama_dir), *CLI_RUN, "--output-dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return result, out


@pytest.mark.slow
@pytest.mark.xdist_group("quiet_cli_run")
def test_train_cli_runs_two_steps_offline_and_saves_a_peft_adapter(quiet_cli_run, tiny_llama_dir):
    _, out = quiet_cli_run
    saved = Config.load(out / "config.json")
    assert saved.max_steps == 2 and saved.micro_batch_size == 2 and saved.model == str(tiny_llama_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["kl"] >= 0 for r in steps)
    assert all(0 < r["train/real_token_frac"] <= 1 for r in steps)  # what padding the training forwards ran
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    loaded = PeftModel.from_pretrained(base, out / "adapter")
    assert loaded.peft_config["default"].use_rslora and loaded.peft_config["default"].r == 32


@pytest.mark.xdist_group("quiet_cli_run")
def test_known_warnings_are_hidden_unless_verbose_and_the_step_line_fits_100_columns(quiet_cli_run, tiny_llama_dir,
                                                                                     tmp_path):
    verbose = _run_cli(["--model", str(tiny_llama_dir), *CLI_RUN, "--output-dir", str(tmp_path / "v"), "-v"])
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    shown = _known_warnings_in(verbose.stderr)
    if not shown:
        pytest.skip("none of the known warnings fires with these library versions: nothing to hide")
    quiet, _ = quiet_cli_run
    assert _known_warnings_in(quiet.stderr) == [], quiet.stderr
    step_lines = [line for line in quiet.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/2", "2/2"]
    assert all(len(line) <= 100 and " s  mem " in line and line.endswith(" GiB") for line in step_lines), step_lines


def test_the_step_line_fits_100_columns_at_its_widest():
    from grpo.run.log import step_line

    widest = dict(step=9999, reward=-13.0, reward_std=13.0, accuracy=1.0, format=1.0, kl=9.9999,
                  completion_length=9999.0, peak_mem_gib=139.99)
    for seconds in (0.5, 99.99, 100.0, 9999.0):
        line = step_line({**widest, "step_time": seconds}, max_steps=9999)
        assert len(line) <= 100, line
    line = step_line({**widest, "step": 3, "step_time": 12.3, "peak_mem_gib": 0.63}, max_steps=16)
    assert line.startswith("step  3/16  reward") and "12.30 s" in line and line.endswith("mem 0.63 GiB")


def test_hide_known_warnings_drops_only_the_listed_records():
    import logging
    import warnings

    from grpo.quiet import hide_known_warnings

    logger = logging.getLogger("torchao")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_known_warnings()
        hide_known_warnings()  # a second call adds nothing
        assert sum(type(f).__name__ == "DropMatching" for f in logger.filters) == 1
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                               "modeling_utils.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit("something else is deprecated", FutureWarning, "modeling_utils.py", 1,
                               module="transformers.modeling_utils")
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                               "elsewhere.py", 1, module="elsewhere")
    assert [str(w.message) for w in caught] == ["something else is deprecated",
                                                "`is_gradient_checkpointing` is deprecated and will be removed in v6."]
    assert _shown_after_hiding("torchao", ["Failed to load /x/_C_mxfp8.so: Could not load this library",
                                           "Failed to quantize a tensor"]) == ["Failed to quantize a tensor"]


def test_the_bitsandbytes_kernel_hub_warning_is_hidden_with_the_known_ones():
    warned = ("Failed to load CPU gemm_4bit_forward from kernels-community: no network. Please make sure you already "
              "`pip install kernels` and the kernels >= 0.11.1")  # as bitsandbytes logs it, on AVX512-BF16 CPUs
    shown = _shown_after_hiding("bitsandbytes.backends.cpu.ops", [warned, "Failed to run a 4-bit kernel"])
    assert shown == ["Failed to run a 4-bit kernel"]


def _shown_after_hiding(logger_name: str, messages: list[str]) -> list[str]:
    """The messages that reach a handler of logger `logger_name` once hide_known_warnings() has run."""
    import logging

    from grpo.quiet import hide_known_warnings

    logger = logging.getLogger(logger_name)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        hide_known_warnings()
        for message in messages:
            logger.warning(message)
    finally:
        logger.removeHandler(handler)
        for name, _ in HARMLESS_LOG_RECORDS:  # leave the loggers as the other tests expect them
            named = logging.getLogger(name)
            for f in [f for f in named.filters if type(f).__name__ == "DropMatching"]:
                named.removeFilter(f)
    return [r.getMessage() for r in records]


# --- progress reports ------------------------------------------------------------------------------

def test_the_hf_engine_reports_decode_steps_and_stops_once_every_row_met_a_stop_sequence(tiny_llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from grpo.rollout import Sampling
    from grpo.rollout import hf

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    reports: list[tuple[int, int]] = []
    engine = hf.HFEngine(model, pad_id=128004, progress=lambda done, total: reports.append((done, total)))
    prompts = [[128000, 9906, 1917], [128000, 40, 1093]]
    plain = Sampling(max_new_tokens=12, temperature=1.0, seed=5, stop_token_ids=(128009,))
    first = engine.generate(prompts, 3, plain)
    assert reports[0] == (0, 6 * 12) and reports[-1] == (6 * 12, 6 * 12)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    # Make each row's second token a stop sequence: rows end early, and decoding ends with the last of them.
    stops = tuple({(int(row[1]),) for row in first.completion_ids})
    stopping = Sampling(max_new_tokens=12, temperature=1.0, seed=5, stop_token_ids=(128009,), stop_sequences=stops)
    early = engine.generate(prompts, 3, stopping)
    assert early.finished.all() and early.completion_ids.shape[1] < 12
    monkeypatch.setattr(hf._StopSequences, "__call__", lambda self, input_ids, scores, **kw: torch.zeros(
        input_ids.shape[0], dtype=torch.bool))  # the same call, decoding on to the limit
    full = engine.generate(prompts, 3, stopping)
    assert full.completion_ids.shape[1] == 12
    assert early.completions() == full.completions()  # the same tokens kept
    torch.testing.assert_close(early.sampler_logp, full.sampler_logp[:, :early.sampler_logp.shape[1]])


class _OneTokenEngine:
    """Answers every row with one token, whatever the prompt."""

    def generate(self, prompt_ids, n, sampling):
        from grpo.rollout import Rollout

        rows = len(prompt_ids) * n
        return Rollout(prompt_ids, torch.full((rows, 1), 19), torch.ones((rows, 1), dtype=torch.bool),
                       torch.zeros((rows, 1)), torch.ones(rows, dtype=torch.bool), num_generations=n)


def test_evaluate_reports_prompts_done_over_its_passes(llama_tokenizer):
    from test_eval import _Prompts

    from grpo.eval import accuracy as grpo_eval
    from grpo.rollout import Sampling

    engine = _OneTokenEngine()
    reports: list[tuple[int, int]] = []
    grpo_eval.evaluate(engine, llama_tokenizer, _Prompts(["4", "4", "4"]), Sampling(max_new_tokens=8), k=2, seed=0,
                       max_rows=2, progress=lambda done, total: reports.append((done, total)))
    # greedy: 2 prompts per call, then 1; sampled (k=2): 1 prompt per call
    assert reports == [(0, 6), (2, 6), (3, 6), (4, 6), (5, 6), (6, 6)]
