"""The command line people already know (grpo.cli), the same in train.py, grpo.eval and grpo.export: boolean
flags bare, --no- and true/false; no prefix matching; TRL's snake_case spellings; the nearest flag for an
unknown one."""

from __future__ import annotations

import io
import sys

import pytest

from grpo.eval import cli as grpo_eval
from grpo.export import merge as grpo_export
from grpo.cli import make_console
from grpo.config import build_parser, parse_args

EVAL = ["--model", "m"]
EXPORT = ["--model", "m", "--adapter", "a", "--out", "o"]


def _error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    return lines[0]


@pytest.mark.parametrize("given, value", [(["--FLAG"], True), (["--no-FLAG"], False), (["--FLAG", "false"], False),
                                          (["--FLAG", "true"], True), (["--FLAG=no"], False), ([], None)])
def test_a_boolean_flag_takes_the_bare_the_no_and_the_true_false_form_in_every_command(given, value):
    argv = [arg.replace("FLAG", "load-in-fp8") for arg in given]
    assert parse_args(argv).load_in_fp8 is (False if value is None else value)
    assert grpo_eval.build_parser().parse_args(EVAL + argv).load_in_fp8 is bool(value)
    assert grpo_export.build_parser().parse_args(EXPORT + argv).load_in_fp8 is bool(value)
    dynamic = [arg.replace("FLAG", "dynamic-sampling") for arg in given]
    assert parse_args(dynamic).dynamic_sampling is bool(value)


def test_a_boolean_flag_followed_by_another_flag_is_true_and_a_bad_value_is_one_line(capsys):
    cfg = parse_args(["--dynamic-sampling", "--seed", "5", "--no-gradient-checkpointing"])
    assert cfg.dynamic_sampling is True and cfg.seed == 5 and cfg.gradient_checkpointing is False
    assert "expected true or false, got 'maybe'" in _error(parse_args, ["--dynamic-sampling", "maybe"], capsys)


def test_no_flag_is_taken_for_an_abbreviation_of_another(capsys):
    line = _error(parse_args, ["--lr", "1e-4"], capsys)  # was: --lr-scheduler, "invalid choice: '1e-4'"
    assert line == "train.py: error: unrecognized flag --lr: here it is --learning-rate (see train.py --help)"
    assert "did you mean --max-steps?" in _error(parse_args, ["--max-step", "3"], capsys)
    assert "did you mean --samples?" in _error(grpo_eval.build_parser().parse_args, EVAL + ["--sample", "2"], capsys)


def test_the_snake_case_spelling_of_every_flag_works_and_stays_out_of_help(capsys, tmp_path, monkeypatch):
    cfg = parse_args(["--learning_rate", "1e-4", "--num_generations", "8", "--max_completion_length=64",
                      "--no_dynamic_sampling", "--use_rslora", "false", "--lora_targets", "q_proj", "v_proj"])
    assert (cfg.learning_rate, cfg.num_generations, cfg.max_completion_length) == (1e-4, 8, 64)
    assert cfg.dynamic_sampling is False and cfg.use_rslora is False and cfg.lora_targets == ("q_proj", "v_proj")
    assert grpo_eval.build_parser().parse_args(EVAL + ["--eval_size", "3", "--load_in_fp8"]).eval_size == 3
    assert grpo_export.build_parser().parse_args(EXPORT + ["--load_in_fp8"]).load_in_fp8 is True
    text = build_parser().format_help()
    assert "--learning-rate" in text and "--learning_rate " not in text and "--no-dynamic-sampling" not in text
    for other in (grpo_eval.build_parser(), grpo_export.build_parser()):  # every help renders (a bare % did not)
        assert "--load-in-fp8" in other.format_help()
    # a value is never rewritten, only a flag
    (tmp_path / "my_rewards.py").write_text("def snake_case(completions, answers, **columns):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--system-prompt", "keep_this_text", "--reward", "my_rewards.py:snake_case"]).reward == (
        "my_rewards.py:snake_case",)


def test_trl_names_that_differ_and_near_misses_get_the_flag_to_use(capsys):
    line = _error(parse_args, ["--per_device_train_batch_size", "8"], capsys)
    assert "unrecognized flag --per_device_train_batch_size: here it is --micro-batch-size" in line
    assert "did you mean --learning-rate?" in _error(parse_args, ["--learnin_rate", "1e-4"], capsys)
    assert "unrecognized arguments: --zzz" in _error(parse_args, ["--zzz"], capsys)


def test_a_reward_of_the_current_folder_is_found_and_a_missing_one_is_one_line_before_any_model(
        capsys, tmp_path, monkeypatch):
    """`--reward module:function` imports module from the folder the command runs in, and a reward that cannot be
    imported or found stops the command line itself (before the model loads), in one line."""
    (tmp_path / "raise_reward_cli.py").write_text("def boom(completions, answers, **columns):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "raise_reward_cli", raising=False)
    assert parse_args(["--reward", "raise_reward_cli:boom"]).reward == ("raise_reward_cli:boom",)
    line = _error(parse_args, ["--reward", "raise_reward_cli:bam"], capsys)
    assert "--reward 'raise_reward_cli:bam': module 'raise_reward_cli' has no attribute 'bam'" in line
    line = _error(parse_args, ["--reward", "no_such_reward_module_here:f"], capsys)
    assert "cannot import 'no_such_reward_module_here'" in line and "fix: run from the folder that holds it" in line


def test_the_nearest_flag_prefers_the_real_flags_an_unknown_one_begins(capsys):
    """`--learn` is the start of --learning-rate, though --reward is the closer spelling."""
    assert "did you mean --learning-rate?" in _error(parse_args, ["--learn", "1e-4"], capsys)
    line = _error(parse_args, ["--lora", "8"], capsys)
    assert "did you mean --lora-rank, --lora-alpha or --lora-" in line, line  # the shortest few it begins


def test_a_console_that_is_not_a_terminal_never_wraps_a_long_line():
    text = io.StringIO()
    path = "/a/long/folder/" + "x" * 120 + "/models/smollm2-135m-instruct-bf16"
    make_console(file=text).print(f"converted smollm2-135m-instruct to bf16 in {path} (once: later runs read it there)")
    assert text.getvalue().count("\n") == 1 and path in text.getvalue()
    terminal = io.StringIO()
    make_console(file=terminal, force_terminal=True, width=80).print("word " * 40)
    assert terminal.getvalue().count("\n") > 1  # a terminal still wraps at its width
