"""Held-out evaluation: accuracy and format measured apart; `python -m grpo.eval` with any adapter."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from grpo import data as grpo_data
from grpo.eval import accuracy, cli
from grpo.rollout import Rollout, Sampling


class ScriptedEngine:
    """Returns fixed completions per prompt: greedy calls get `greedy`, sampled calls `sampled`."""

    def __init__(self, tokenizer, greedy: list[str], sampled: list[str]):
        self.tokenizer, self.greedy, self.sampled = tokenizer, greedy, sampled

    def release_memory(self) -> None:
        pass

    def generate(self, prompt_ids, n, sampling: Sampling) -> Rollout:
        texts = self.greedy if sampling.temperature == 0 else self.sampled
        rows = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), True
        return Rollout(prompt_ids, ids, mask, torch.zeros(ids.shape), torch.ones(len(rows), dtype=torch.bool),
                       num_generations=n)


class _Prompts:
    def __init__(self, answers):
        from grpo.data import Example

        self.prompt_ids = [[1, 2, 3] for _ in answers]
        self.examples = [Example(question="q", answer=a, columns={}) for a in answers]


def test_accuracy_and_format_are_reported_apart(llama_tokenizer):
    good = "2+2<end_working_out><SOLUTION>4</SOLUTION>"
    right_but_unformatted = "the answer is <SOLUTION>4</SOLUTION> and more text"
    wrong_formatted = "2+2<end_working_out><SOLUTION>5</SOLUTION>"
    engine = ScriptedEngine(llama_tokenizer, greedy=[good, right_but_unformatted],
                            sampled=[wrong_formatted, good, right_but_unformatted, right_but_unformatted])
    result = accuracy.evaluate(engine, llama_tokenizer, _Prompts(["4", "4"]), Sampling(max_new_tokens=8),
                                k=2, seed=0)
    assert result["eval/greedy_accuracy"] == 1.0 and result["eval/greedy_format"] == 0.5
    assert result["eval/pass@1"] == 0.75 and result["eval/sampled_format"] == 0.5
    assert result["eval/greedy_lenient_accuracy"] == 1.0 and result["eval/pass@1_lenient"] == 0.75  # as strict here


def test_lenient_accuracy_counts_boxed_and_final_numbers_that_strict_accuracy_does_not(llama_tokenizer):
    boxed = "16 - 3 - 4 = 9, and 9 * 2 = 18. So she makes \\boxed{18} dollars."
    last_number = "She sells 9 eggs at $2, so she makes $18"
    formatted_wrong = "9 * 2<end_working_out><SOLUTION>17</SOLUTION>"
    engine = ScriptedEngine(llama_tokenizer, greedy=[boxed, last_number, formatted_wrong],
                            sampled=[boxed, formatted_wrong, "no idea", last_number, boxed, boxed])
    result = accuracy.evaluate(engine, llama_tokenizer, _Prompts(["18", "18", "18"]), Sampling(max_new_tokens=8),
                                k=2, seed=0)
    assert result["eval/greedy_accuracy"] == 0.0 and result["eval/greedy_lenient_accuracy"] == 2 / 3
    assert result["eval/greedy_format"] == 1 / 3
    assert result["eval/pass@1"] == 0.0 and result["eval/pass@1_lenient"] == 4 / 6
    assert result["eval/sampled_format"] == 1 / 6
    assert list(result) == ["eval/prompts", "eval/greedy_accuracy", "eval/greedy_lenient_accuracy",
                            "eval/greedy_format", "eval/pass@1", "eval/pass@1_lenient", "eval/sampled_format",
                            "eval/samples"]


def test_eval_cli_loads_an_adapter_with_its_own_rank_and_targets(tiny_llama_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    adapted = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    code = cli.main(["--model", str(tiny_llama_dir), "--adapter", str(tmp_path / "adapter"), "--eval-size", "2",
                           "--samples", "1", "--max-completion-length", "4", "--engine", "hf"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/prompts"] == 2.0 and 0.0 <= result["eval/pass@1"] <= 1.0


class PerPromptEngine:
    """Completion text a function of the prompt: right and formatted for even prompt ids; records calls."""

    def __init__(self, tokenizer):
        self.tokenizer, self.rows_per_call = tokenizer, []

    def release_memory(self) -> None:
        pass

    def generate(self, prompt_ids, n, sampling):
        texts = [f"x<end_working_out><SOLUTION>{4 if p[0] % 2 == 0 else 5}</SOLUTION>" for p in prompt_ids
                 for _ in range(n)]
        self.rows_per_call.append(len(texts))
        return ScriptedEngine(self.tokenizer, texts, texts).generate(prompt_ids, n, sampling)


def test_eval_in_chunks_of_max_rows_gives_the_same_result(llama_tokenizer):
    prompts = _Prompts(["4"] * 7)
    prompts.prompt_ids = [[i] for i in range(7)]
    whole, chunked = PerPromptEngine(llama_tokenizer), PerPromptEngine(llama_tokenizer)
    a = accuracy.evaluate(whole, llama_tokenizer, prompts, Sampling(max_new_tokens=8), k=3, seed=0)
    b = accuracy.evaluate(chunked, llama_tokenizer, prompts, Sampling(max_new_tokens=8), k=3, seed=0, max_rows=4)
    assert a == b and a["eval/greedy_accuracy"] == 4 / 7
    assert whole.rows_per_call == [7, 21] and max(chunked.rows_per_call) <= 4 and sum(chunked.rows_per_call) == 28


def test_per_problem_records_hold_each_problems_greedy_grades_and_sampled_counts(llama_tokenizer):
    from grpo.data import Example

    good, boxed = "2+2<end_working_out><SOLUTION>4</SOLUTION>", "so \\boxed{4}"
    engine = ScriptedEngine(llama_tokenizer, greedy=[good, boxed], sampled=[good, boxed, boxed, "5"])
    prompts = _Prompts(["4", "4"])
    prompts.examples = [Example(question="What is 2+2?", answer="4", columns={}),
                        Example(question="And 3+1?", answer="4", columns={})]
    records: list[dict] = []
    result = accuracy.evaluate(engine, llama_tokenizer, prompts, Sampling(max_new_tokens=8), k=2, seed=0,
                                per_problem=records)
    assert [r["id"] for r in records] == [accuracy.problem_id("What is 2+2?"), accuracy.problem_id("And 3+1?")]
    assert records[0]["id"] != records[1]["id"] and len(records[0]["id"]) == 16
    first, second = records
    assert (first["greedy_strict"], first["greedy_lenient"], first["greedy_format"]) == (True, True, True)
    assert (second["greedy_strict"], second["greedy_lenient"], second["greedy_format"]) == (False, True, False)
    assert (first["sampled_strict"], first["sampled_lenient"], first["sampled_format"]) == (1, 2, 1)
    assert (second["sampled_strict"], second["sampled_lenient"], second["sampled_format"]) == (0, 1, 0)
    assert result["eval/greedy_accuracy"] == sum(r["greedy_strict"] for r in records) / 2  # the same grades


def test_eval_cli_writes_one_line_per_held_out_problem(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "evals" / "base.jsonl"
    assert cli.main(["--model", str(tiny_llama_dir), "--eval-size", "3", "--samples", "0",
                           "--max-completion-length", "2", "--engine", "hf", "--batch-rows", "2",
                           "--per-problem", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == result["eval/prompts"] == 3 and len({r["id"] for r in records}) == 3
    assert sum(r["greedy_strict"] for r in records) / 3 == result["eval/greedy_accuracy"]
    with pytest.raises(SystemExit):
        cli.main(["--model", "no/such-model", "--batch-rows", "0"])
    assert "--batch-rows 0" in capsys.readouterr().err


def test_eval_cli_evaluates_without_cudnns_attention_as_the_trainer_does(monkeypatch, capsys):
    # every prompt width of an evaluation is new: cuDNN's attention would plan each (grpo.model.load)
    enabled = []
    monkeypatch.setattr(cli, "evaluate_from_flags",
                        lambda args: enabled.append(torch.backends.cuda.cudnn_sdp_enabled()) or {"eval/prompts": 0})
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        assert cli.main(["--model", "any/model"]) == 0
        assert enabled == [False] and torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    assert json.loads(capsys.readouterr().out) == {"eval/prompts": 0}


def test_eval_cli_refuses_an_empty_stop_string_before_loading_anything(capsys):
    from grpo.eval.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "no/such-model", "--stop", ""])
    assert exit_info.value.code == 2 and "--stop" in capsys.readouterr().err


def test_eval_cli_faults_are_one_line_naming_the_flag_or_path(tiny_llama_dir, tmp_path, capsys):
    from grpo.eval.cli import main

    with pytest.raises(SystemExit) as exit_info:  # refused by the parser, before anything loads
        main(["--model", "no/such-model", "--temperature", "nan"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m grpo.eval: error: --temperature nan") and "--help" in line
    for argv, names in ((["--eval-size", "0"], "--eval-size 0"), (["--samples", "-1"], "--samples -1")):
        with pytest.raises(SystemExit):
            main(["--model", "no/such-model", *argv])
        assert names in capsys.readouterr().err
    assert main(["--model", str(tiny_llama_dir), "--adapter", str(tmp_path / "none"), "--engine", "hf"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"--adapter {tmp_path / 'none'}" in line and "adapter_model.safetensors" in line


def test_eval_cli_builds_its_prompts_with_the_given_system_prompt(tiny_llama_dir, monkeypatch, capsys):
    from grpo import data as grpo_data

    seen = []
    real = grpo_data.build_prompts
    monkeypatch.setattr(grpo_data, "build_prompts", lambda *a, **kw: (seen.append(a[3:] or kw), real(*a, **kw))[1])
    args = ["--model", str(tiny_llama_dir), "--eval-size", "1", "--samples", "0", "--max-completion-length", "2",
            "--engine", "hf"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--system-prompt", "Answer in <SOLUTION> tags."]) == 0
    assert seen == [(grpo_data.SYSTEM_PROMPT,), ("Answer in <SOLUTION> tags.",)]


@pytest.fixture
def run_adapter(tiny_llama_dir, tmp_path):
    """A run's folder: config.json with its own system prompt, and the adapter it trained in adapter/."""
    from grpo.config import Config
    from test_export import load_dense, trained_adapter

    run = tmp_path / "run"
    Config(model=str(tiny_llama_dir), system_prompt="The run's own prompt.", stop=("</SOLUTION>",),
           max_completion_length=3, output_dir=str(run)).save(run)
    trained_adapter(load_dense(tiny_llama_dir), run / "adapter")
    return run


def test_eval_of_a_run_adapter_takes_the_runs_system_prompt_unless_one_is_given(tiny_llama_dir, run_adapter,
                                                                                 monkeypatch, capsys):
    from grpo import data as grpo_data

    seen = []
    real = grpo_data.build_prompts
    monkeypatch.setattr(grpo_data, "build_prompts", lambda *a, **kw: (seen.append(a[3]), real(*a, **kw))[1])
    args = ["--model", str(tiny_llama_dir), "--eval-size", "1", "--samples", "0", "--max-completion-length", "2",
            "--engine", "hf"]
    assert cli.main([*args, "--adapter", str(run_adapter)]) == 0
    said = capsys.readouterr().err
    assert f"the run's settings, from {run_adapter / 'config.json'}: " in said and "--system-prompt" in said
    assert cli.main([*args, "--adapter", str(run_adapter / "adapter"), "--system-prompt", "Mine."]) == 0
    assert seen == ["The run's own prompt.", "Mine."]


def test_a_truncated_adapter_config_is_named_by_eval_and_export_and_export_writes_nothing(tiny_llama_dir, run_adapter,
                                                                                          tmp_path, capsys):
    from grpo.export.merge import main as export_main

    config = run_adapter / "adapter" / "adapter_config.json"
    config.write_text(config.read_text()[:40])
    assert cli.main(["--model", str(tiny_llama_dir), "--adapter", str(run_adapter), "--engine", "hf"]) == 1
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: --adapter {run_adapter}: {config} is not valid JSON (") and "intact copy" in line
    out = tmp_path / "exported"
    assert export_main(["--model", str(tiny_llama_dir), "--adapter", str(run_adapter), "--out", str(out)]) == 1
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert f"{config} is not valid JSON" in line and not out.exists()


class RecordedProgress:
    """Stands in for grpo.run.log.ProgressBar: records what the evaluation tells it."""

    made: list[RecordedProgress] = []

    def __init__(self, console, total, completed, unit="steps"):
        self.total, self.unit, self.calls = total, unit, []
        RecordedProgress.made.append(self)

    def start(self):
        self.calls.append(("start",))

    def stop(self):
        self.calls.append(("stop",))

    def update(self, completed):
        self.calls.append(("update", completed))

    def evaluation(self, done, total):
        self.calls.append(("evaluation", done, total))

    def generation(self, done, total):
        self.calls.append(("generation", done, total))


def test_eval_cli_shows_prompts_and_tokens_done_on_the_trainers_progress_bar(tiny_llama_dir, monkeypatch, capsys):
    RecordedProgress.made = []
    monkeypatch.setattr(cli, "ProgressBar", RecordedProgress)
    assert cli.main(["--model", str(tiny_llama_dir), "--eval-size", "3", "--samples", "1",
                     "--max-completion-length", "2", "--engine", "hf", "--batch-rows", "2"]) == 0
    [bar] = RecordedProgress.made
    assert bar.total == 1 and bar.unit == "models" and bar.calls[0] == ("start",) and bar.calls[-2:] == [("update", 1), ("stop",)]
    prompts = [c[1:] for c in bar.calls if c[0] == "evaluation"]
    assert prompts[0] == (0, 6) and prompts[-1] == (6, 6) and len(prompts) > 2  # greedy, then sampled, in chunks
    assert any(c[0] == "generation" and c[1] > 0 for c in bar.calls)  # the engine's tokens, as it generates


def test_ctrl_c_during_an_evaluation_is_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "evaluate_from_flags", interrupted)
    assert cli.main(["--model", "any/model"]) == 130
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert line.startswith("interrupted") and "nothing written" in line and captured.out == ""


def test_eval_help_shows_every_default_and_the_sizes_on_a_cpu_and_a_gpu():
    parser = cli.build_parser()
    takes_a_value = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
                     and a.nargs != 0 and a.dest != "model"]
    assert len(takes_a_value) >= 15
    assert [a.option_strings[0] for a in takes_a_value if "(default: " not in a.help] == []
    helps = {a.dest: " ".join(a.help.split()) for a in takes_a_value}
    assert "(default: 64 on a GPU, 16 on a CPU)" in helps["eval_size"]
    assert "(default: 4 on a GPU, 1 on a CPU)" in helps["samples"]
    for dest in ("max_completion_length", "stop", "system_prompt", "system_prompt_turn"):
        assert "the run's when --adapter is in a run's folder" in helps[dest]
    text = " ".join(parser.format_help().split())
    assert "(default: 64 on a GPU, 16 on a CPU)" in text and "(default: 3407)" in text


def test_unset_flags_take_the_runs_stop_and_length_and_the_devices_size(tmp_path, capsys):
    from grpo.config import Config

    run = tmp_path / "run"
    Config(model="m", system_prompt="Own.", system_prompt_turn="user", stop=("</SOLUTION>",),
           max_completion_length=48, output_dir=str(run)).save(run)
    (run / "checkpoint-4").mkdir()
    found = cli.run_config(run / "checkpoint-4")
    assert found is not None and found[0] == run / "config.json"
    unset = cli.build_parser().parse_args(["--model", "m"])
    on_cpu = cli.with_run_defaults(unset, found, torch.device("cpu"))
    assert (on_cpu.stop, on_cpu.max_completion_length, on_cpu.system_prompt) == (["</SOLUTION>"], 48, "Own.")
    assert (on_cpu.eval_size, on_cpu.samples, on_cpu.system_prompt_turn) == (16, 1, "user")
    err = capsys.readouterr().err
    assert f"the run's settings, from {run / 'config.json'}: --stop '</SOLUTION>', --max-completion-length 48" in err
    assert "--system-prompt-turn user" in err
    assert unset.stop is None and unset.eval_size is None  # the flags as parsed are left as they were
    on_gpu = cli.with_run_defaults(unset, None, torch.device("cuda"))
    assert (on_gpu.stop, on_gpu.max_completion_length, on_gpu.eval_size, on_gpu.samples) == ([], 256, 64, 4)
    assert (on_gpu.system_prompt, on_gpu.system_prompt_turn) == (cli.SYSTEM_PROMPT, "system")
    given = cli.build_parser().parse_args(["--model", "m", "--stop", "--max-completion-length", "9",
                                          "--eval-size", "2", "--samples", "0"])
    mine = cli.with_run_defaults(given, found, torch.device("cpu"))
    assert (mine.stop, mine.max_completion_length, mine.eval_size, mine.samples) == ([], 9, 2, 0)
    Config(model="m", max_seq_length=512, max_prompt_length=200, output_dir=str(run)).save(run)
    assert cli.with_run_defaults(unset, cli.run_config(run), torch.device("cpu")).max_completion_length == 312


def test_eval_of_a_run_adapter_samples_with_the_runs_stop_and_length(tiny_llama_dir, run_adapter, monkeypatch,
                                                                    capsys):
    seen = []
    real = cli.evaluate
    monkeypatch.setattr(cli, "evaluate", lambda *a, **kw: (seen.append(a[3]), real(*a, **kw))[1])
    assert cli.main(["--model", str(tiny_llama_dir), "--adapter", str(run_adapter), "--eval-size", "1",
                     "--samples", "0", "--engine", "hf"]) == 0
    [sampling] = seen
    tokenizer = cli.load_tokenizer(tiny_llama_dir)
    assert sampling.max_new_tokens == 3
    assert sampling.stop_sequences == cli.stop_string_sequences(tokenizer, ["</SOLUTION>"]) != ()


def test_compare_base_evaluates_the_base_like_the_adapter_and_prints_the_difference(tiny_llama_dir, run_adapter,
                                                                                    tmp_path, monkeypatch, capsys):
    seen = []
    real = cli.evaluate
    def with_lora(engine):
        return any("lora_" in name for name, _ in engine.model.named_modules())

    monkeypatch.setattr(cli, "evaluate", lambda *a, **kw: (seen.append((with_lora(a[0]), a[2], a[3])),
                                                           real(*a, **kw))[1])
    flags = ["--model", str(tiny_llama_dir), "--eval-size", "3", "--samples", "1", "--engine", "hf"]
    out = tmp_path / "evals" / "trained.jsonl"
    assert cli.main([*flags, "--adapter", str(run_adapter), "--compare-base", "--per-problem", str(out)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    (base_lora, base_prompts, base_sampling), (lora, prompts, sampling) = seen
    assert base_prompts is prompts and base_sampling == sampling and sampling.max_new_tokens == 3  # the run's
    assert (base_lora, lora) == (False, True)  # the base first, then the adapter
    assert result["adapter_minus_base"] == {k: result["adapter"][k] - result["base"][k] for k in
                                            result["adapter"] if k not in ("eval/prompts", "eval/samples")}
    assert [row["key"] for row in result["per_problem"]] == ["greedy_strict", "greedy_lenient", "greedy_format"]
    assert all(row["problems"] == 3 and 0 < row["p_value"] <= 1 for row in result["per_problem"])
    assert "adapter-base" in captured.err and "McNemar exact p" in captured.err
    base_file = tmp_path / "evals" / "trained.base.jsonl"
    assert len(out.read_text().splitlines()) == len(base_file.read_text().splitlines()) == 3
    # the base's figures are those of the base evaluated alone under the run's prompt, stop and length
    assert cli.main([*flags, "--system-prompt", "The run's own prompt.", "--stop", "</SOLUTION>",
                     "--max-completion-length", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result["base"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", "no/such-model", "--compare-base"])
    assert exit_info.value.code == 2 and "--compare-base" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Episodes: a run with tools or an environment is evaluated on the episodes it trains on
# --------------------------------------------------------------------------------------------------
def test_eval_of_episodes_reports_tool_use_calls_and_turns_beside_accuracy(llama_tokenizer):
    from grpo.agents.calculator import calculator
    from grpo.agents.settings import EpisodeSettings
    from test_agent_episodes import EOT, TEMPLATE, Scripted

    tok = llama_tokenizer
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    try:
        def ids(text):
            return tok.encode(text, add_special_tokens=False) + [EOT]

        call = ids('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
        engine = Scripted([[call, ids("<end_working_out><SOLUTION>3</SOLUTION>")],  # turn 1 of both problems
                           [ids("<end_working_out><SOLUTION>42</SOLUTION>")]])  # turn 2 of the first
        examples = [grpo_data.Example("What is 6 times 7?", "42"), grpo_data.Example("And 1 plus 1?", "2")]
        agent = EpisodeSettings((calculator,), None, max_turns=3, tool_timeout_s=5.0, system_prompt="Solve.")
        prompt_set = grpo_data.build_prompts(tok, examples, 10_000)
        records = []
        result = accuracy.evaluate(engine, tok, prompt_set, Sampling(max_new_tokens=64, stop_token_ids=(EOT,)), k=0,
                                   seed=0, per_problem=records, episodes=agent)
    finally:
        tok.chat_template = saved
    assert result["eval/greedy_accuracy"] == 0.5 and result["eval/greedy_format"] == 1.0  # the transcript is read
    assert (result["eval/greedy_tool_use"], result["eval/greedy_tool_calls"], result["eval/greedy_tool_errors"],
            result["eval/greedy_turns"]) == (0.5, 0.5, 0.0, 1.5)
    assert "eval/greedy_success" not in result  # no environment
    assert [(r["greedy_tool_use"], r["greedy_tool_calls"], r["greedy_turns"]) for r in records] == \
        [(True, 1, 2), (False, 0, 1)]


def test_compare_base_plays_the_same_games_for_the_base_and_the_runs_adapter(tmp_path, monkeypatch, capsys):
    from grpo.config import Config
    from test_agent_episodes import TEMPLATE
    from test_export import load_dense, trained_adapter
    from transformers import AutoTokenizer

    from conftest import tiny_llama
    from grpo.assets import llama_tokenizer_dir

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(llama_tokenizer_dir())
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model_dir)
    run = tmp_path / "run"
    Config(model=str(model_dir), dataset="number-guess", reward_preset="none", system_prompt="Guess.",
           environment="grpo.agents.number_guess:NumberGuess", max_turns=2, max_completion_length=10,
           output_dir=str(run)).save(run)
    trained_adapter(load_dense(model_dir), run / "adapter")
    seen = []
    real = cli.evaluate
    monkeypatch.setattr(cli, "evaluate", lambda *a, **kw: (seen.append((a[2], a[3], kw["episodes"])),
                                                           real(*a, **kw))[1])
    out = tmp_path / "games.jsonl"
    assert cli.main(["--model", str(model_dir), "--adapter", str(run), "--compare-base", "--dataset", "number-guess",
                     "--eval-size", "3", "--samples", "1", "--engine", "hf", "--per-problem", str(out)]) == 0
    captured = capsys.readouterr()
    assert "--environment grpo.agents.number_guess:NumberGuess" in captured.err  # taken from the run
    result = json.loads(captured.out.strip().splitlines()[-1])
    (base_prompts, base_sampling, base_games), (prompts, sampling, games) = seen
    assert base_prompts is prompts and base_sampling == sampling and base_games is games
    assert games.environment.__name__ == "NumberGuess" and games.max_turns == 2 and games.tools == ()
    for name in ("base", "adapter"):
        assert {"eval/greedy_success", "eval/greedy_turns", "eval/sampled_success"} <= set(result[name])
        assert 1 <= result[name]["eval/greedy_turns"] <= 2
    assert [row["key"] for row in result["per_problem"]][-1] == "greedy_success"
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(set(ids)) == 3  # one question, three secrets: three problems
