"""The TRL peer of the side by side (benchmarks/probes/trl_same_recipe.py) on a CPU: our Config mapped onto TRL
1.16's GRPOConfig value by value, what cannot be mapped refused, our prompts reaching TRL as our ids in our
order, the metrics in our keys, and the smoke run stopping on its time budget and resuming to the end; the
calculator preset's tools and turn limit given to TRL, its episodes scored as ours, and an environment refused."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from grpo.config import parse_args
from grpo.loss import Cispo

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "probes"))
    return importlib.import_module("trl_same_recipe")


@pytest.fixture
def bench_modules_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def test_the_qwen_preset_maps_onto_grpo_config_value_by_value(probe):
    cfg = parse_args(["--preset", "qwen1.5b-gsm8k", "--max-steps", "60"])
    v = probe.grpo_config_values(cfg, output_dir="out", cuda=True, vllm_share=0.3)
    # 8 prompts x 8 completions, one generation batch of 64 per optimizer step, trained 16 rows at a time
    assert (v["num_generations"], v["per_device_train_batch_size"], v["gradient_accumulation_steps"]) == (8, 16, 4)
    assert (v["max_steps"], v["learning_rate"], v["seed"], v["shuffle_dataset"]) == (60, 1e-5, 3407, False)
    assert (v["max_completion_length"], v["vllm_max_model_length"]) == (384, 672)
    assert (v["temperature"], v["min_p"], v["top_p"], v["top_k"]) == (1.0, 0.1, 1.0, 0)
    assert (v["beta"], v["epsilon"], v["epsilon_high"], v["loss_type"], v["scale_rewards"]) == (0.0, 0.2, None, "grpo",
                                                                                              "group")
    assert v["generation_kwargs"] == {"stop": ["</SOLUTION>"], "include_stop_str_in_output": True}
    assert (v["use_vllm"], v["vllm_mode"], v["vllm_gpu_memory_utilization"], v["bf16"]) == (True, "colocate", 0.3, True)
    assert (v["vllm_importance_sampling_mode"], v["vllm_importance_sampling_clip_max"]) == ("token_truncate", 2.0)
    assert not v["gradient_checkpointing"] and v["optim"] == "adamw_8bit"  # the preset keeps activations
    whole = probe.grpo_config_values(dataclasses.replace(cfg, micro_batch_size=None, loss_norm="token",
                                                         is_correction="none", gradient_checkpointing=True,
                                                         sample_ahead=False),
                                     output_dir="out", cuda=False, vllm_share=None)
    assert (whole["per_device_train_batch_size"], whole["gradient_accumulation_steps"]) == (64, 1)
    assert (whole["loss_type"], whole["use_vllm"], whole["use_cpu"], whole["gradient_checkpointing"]) == (
        "dapo", False, True, True)
    assert "vllm_importance_sampling_mode" not in whole


def test_grpo_config_of_trl_1_16_accepts_every_mapped_value(probe, tmp_path):
    trl = pytest.importorskip("trl")
    cfg = parse_args(["--preset", "qwen1.5b-gsm8k"])
    values = probe.grpo_config_values(cfg, output_dir=str(tmp_path), cuda=False, vllm_share=0.3)
    args = trl.GRPOConfig(**values)  # an unknown or misspelled field raises here
    assert (args.loss_type, args.num_generations, args.generation_batch_size) == ("grpo", 8, 64)
    assert (args.vllm_mode, args.vllm_importance_sampling_mode) == ("colocate", "token_truncate")


def test_what_trl_cannot_be_told_is_refused_in_one_line_naming_the_flag(probe):
    cfg = parse_args(["--preset", "qwen1.5b-gsm8k"])
    for change, flag in ((dict(dynamic_sampling=True, sample_ahead=False), "--dynamic-sampling"),
                         (dict(policy_term=Cispo()), "--loss-type"), (dict(kl_estimator="k1"), "--kl-estimator"),
                         (dict(micro_batch_size=24), "--micro-batch-size")):
        with pytest.raises(ValueError) as err:
            probe.grpo_config_values(dataclasses.replace(cfg, **change), output_dir="o", cuda=True, vllm_share=0.3)
        assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_prompts_reach_trl_as_our_ids_in_the_order_given(bench_modules_path, llama_tokenizer):
    import bench_setup

    from grpo.data import Example, build_prompts

    examples = [Example(question=f"What is {a} plus 2?", answer=str(a + 2), columns={}) for a in range(3)]
    prompts = build_prompts(llama_tokenizer, examples, 512)
    rows = bench_setup.trl_prompt_rows(llama_tokenizer, prompts, [2, 0, 2])
    assert [r["answer"] for r in rows] == ["4", "2", "4"]
    assert [llama_tokenizer(r["prompt"])["input_ids"] for r in rows] == [prompts.prompt_ids[i] for i in (2, 0, 2)]
    prompts.prompt_ids[1] = prompts.prompt_ids[1][1:]  # ids TRL would not see
    with pytest.raises(RuntimeError, match="prompt 1: TRL would see other token ids"):
        bench_setup.trl_prompt_rows(llama_tokenizer, prompts)


def test_metrics_records_use_our_keys_where_trl_means_the_same(probe):
    logs = {"reward": 1.5, "reward_std": 2.0, "rewards/format_exact/mean": 3.0, "rewards/format_exact/std": 0.0,
            "completions/mean_length": 200.0, "completions/clipped_ratio": 0.25, "learning_rate": 1e-5,
            "frac_reward_zero_std": 0.125, "accuracy": 0.5, "format": 0.75, "step_time": 9.0,
            "sampling/sampling_logp_difference/max": 3.0}
    record = probe.our_record(7, logs, {"step": 7, "step_time": 4.5, "peak_mem_gib": 20.0})
    assert record["step"] == 7 and record["reward"] == 1.5 and record["rewards/format_exact"] == 3.0
    assert (record["completion_length"], record["frac_finished"], record["lr"]) == (200.0, 0.75, 1e-5)
    assert (record["frac_zero_std"], record["accuracy"], record["format"]) == (0.125, 0.5, 0.75)
    assert record["step_time"] == 4.5 and record["trl/step_time"] == 9.0  # our synchronized clock, TRL's beside it
    assert "gap/logp_abs_max" not in record and record["trl/sampling/sampling_logp_difference/max"] == 3.0
    # With stop strings TRL counts every row they ended as clipped: no frac_finished then, its own key stays
    stopped = probe.our_record(7, logs, {}, stop_strings=True)
    assert "frac_finished" not in stopped and stopped["trl/completions/clipped_ratio"] == 0.25


@pytest.mark.slow
def test_smoke_run_stops_on_its_time_budget_and_resumes_to_the_end(probe, tmp_path, capsys):
    pytest.importorskip("trl")
    out = tmp_path / "trl"
    recipe = ["--", "--preset", "qwen1.5b-gsm8k", "--output-dir", str(out), "--cpu-threads", "1"]
    assert probe.main(["--smoke", "--time-budget-s", "0", *recipe]) == 0
    assert "stopped after step 1 of 2" in capsys.readouterr().out
    assert (out / "checkpoint-1" / "adapter_model.safetensors").is_file() and not (out / "adapter").exists()
    assert probe.main(["--smoke", *recipe]) == 1  # a fresh run refuses the folder of another
    assert "--resume latest" in capsys.readouterr().err
    assert probe.main(["--smoke", *recipe, "--resume", "latest"]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"reward", "rewards/format_exact", "rewards/answer_gsm8k", "accuracy", "format", "step_time"} <= set(r)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["max_steps"], saved["num_generations"], saved["reward_preset"]) == (2, 2, "gsm8k")


def test_the_calculator_preset_gives_trl_its_turn_limit_and_llama_3s_date(probe):
    trl = pytest.importorskip("trl")
    cfg = parse_args(["--preset", "qwen1.5b-gsm8k-calculator"])
    values = probe.grpo_config_values(cfg, output_dir="out", cuda=False, vllm_share=0.3)  # bf16 needs a GPU
    # 5 model turns: the first generation and 4 tool rounds (our last turn runs no call)
    assert values["max_tool_calling_iterations"] == cfg.max_turns - 1 == 4
    assert values["chat_template_kwargs"] == {"date_string": "26 Jul 2024"}
    assert trl.GRPOConfig(**values).max_tool_calling_iterations == 4
    single = probe.grpo_config_values(parse_args(["--preset", "qwen1.5b-gsm8k"]), output_dir="o", cuda=True,
                                      vllm_share=0.3)
    assert "max_tool_calling_iterations" not in single and "chat_template_kwargs" not in single


def test_an_environment_is_refused_in_one_line_before_the_model_loads(probe, tmp_path, capsys):
    recipe = ["--", "--preset", "qwen1.5b-number-guess", "--output-dir", str(tmp_path / "trl")]
    assert probe.main(recipe) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--environment grpo.agents.number_guess:NumberGuess" in err
    assert "tool calls" in err and not (tmp_path / "trl").exists()


def test_an_episodes_reward_reads_its_transcript_decoded_as_our_trainer_decodes_it(probe, llama_tokenizer):
    from grpo import rewards

    cfg = parse_args(["--preset", "qwen1.5b-gsm8k-calculator"])
    answer_fn = next(f for f in probe.trl_reward_functions(cfg, llama_tokenizer) if f.__name__ == "answer_dapo")
    ours = rewards.answer_dapo
    transcripts = ["<tool_call>6*7</tool_call><|eot_id|>42<|eot_id|>then <SOLUTION>42</SOLUTION>",
                   "<SOLUTION>41</SOLUTION>"]
    ids = [llama_tokenizer(t, add_special_tokens=False)["input_ids"] for t in transcripts]
    # TRL hands a tools run's completions over as messages, the right answer here in the wrong row's: the ids
    # are what is scored, as ours scores an episode
    messages = [[{"role": "assistant", "content": "<SOLUTION>41</SOLUTION>"}],
                [{"role": "assistant", "content": "<SOLUTION>42</SOLUTION>"}]]
    logged = {}
    scores = answer_fn(messages, ["42", "42"], completion_ids=ids, log_metric=lambda k, v: logged.update({k: v}))
    texts = llama_tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert scores == [float(v) for v in ours(texts, ["42", "42"])] and scores[0] > scores[1]
    assert logged["accuracy"] == 0.5


@pytest.mark.slow
def test_smoke_run_of_the_calculator_preset_trains_with_trls_tools_and_logs_their_metrics(probe, tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "trl"
    assert probe.main(["--smoke", "--", "--preset", "qwen1.5b-gsm8k-calculator", "--output-dir", str(out),
                       "--cpu-threads", "1"]) == 0
    args = json.loads((out / "trl_args.json").read_text())
    assert args["max_tool_calling_iterations"] == 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # TRL's tool metrics, in our keys beside its own
        assert r["episodes/tool_calls"] == r["trl/tools/call_frequency"] >= 0
        assert {"episodes/tool_errors", "trl/tools/failure_frequency", "rewards/answer_dapo", "step_time"} <= set(r)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_trl_tool_messages_become_the_tool_columns_our_rewards_read(probe):
    conversations = [
        [{"role": "assistant", "content": "no call"}],
        [{"role": "assistant", "content": "<tool_call>..."}, {"role": "tool", "name": "calculator", "content": "42"},
         {"role": "assistant", "content": "<tool_call>..."},
         {"role": "tool", "name": "calculator", "content": str({"error": "bad expression"})}],
    ]
    columns = probe.tool_columns(conversations)
    assert columns == {"tool_calls": [0, 2], "tool_errors": [0, 1]}


def test_a_converted_templates_tool_calls_are_parsed_by_the_family_our_parser_reads(probe, llama_tokenizer,
                                                                                     monkeypatch):
    pytest.importorskip("trl")
    import copy

    import trl.trainer.grpo_trainer as trl_grpo

    monkeypatch.setattr(trl_grpo, "parse_response", trl_grpo.parse_response)  # put back after the test

    # TRL knows a chat template by its exact text; a converted model's differs (whitespace), so the probe sets the
    # parser of the family that `tool_call_style` reads
    tokenizer = copy.deepcopy(llama_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                               "{% if tools %}Call a tool in <tool_call></tool_call> tags.{% endif %}")
    tokenizer.response_template = None
    probe.read_calls_as_ours(tokenizer, ["calculator"])
    import inspect

    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
    newer = "prefix" in inspect.signature(tokenizer.parse_response).parameters  # newer transformers ask for it
    parsed = tokenizer.parse_response(reply, **({"prefix": "<|im_start|>assistant\n"} if newer else {}))
    assert parsed["tool_calls"] == [{"type": "function",
                                     "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]
    tokenizer.response_template = kept = {"fields": {}}  # a template the tokenizer ships is left alone
    probe.read_calls_as_ours(tokenizer, ["calculator"])
    assert tokenizer.response_template is kept


def test_trls_trainer_reads_the_calls_ours_reads_code_blocks_included(probe, llama_tokenizer, monkeypatch):
    pytest.importorskip("trl")
    import copy

    import trl.trainer.grpo_trainer as trl_grpo

    monkeypatch.setattr(trl_grpo, "parse_response", trl_grpo.parse_response)  # put back after the test
    tokenizer = copy.deepcopy(llama_tokenizer)
    tokenizer.chat_template = "{% if tools %}Call a tool in <tool_call></tool_call> tags.{% endif %}"
    probe.read_calls_as_ours(tokenizer, ["calculator"])
    parse = trl_grpo.parse_response

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    block = '```json\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n```'
    assert parse(tokenizer, ids(block))["tool_calls"] == [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]
    assert "tool_calls" not in parse(tokenizer, ids("The answer is <SOLUTION>5</SOLUTION>"))
    (unread,) = parse(tokenizer, ids('<tool_call>{"name": </tool_call>'))["tool_calls"]
    assert unread["function"]["name"] == "unreadable call"  # TRL answers it with an error, as ours does


def test_a_step_that_leaves_a_trained_weight_not_finite_stops_the_peer_naming_it(probe, tmp_path, capsys):
    import torch
    from transformers import TrainerControl, TrainerState

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    model[0].weight.data[0, 0] = float("nan")  # a frozen weight is not the run's to judge
    recorder = probe.run_recorder(tmp_path / "metrics.jsonl", clock=type("Clock", (), {"records": []})(),
                                  started=0.0, budget_s=None)
    state, control = TrainerState(global_step=1, max_steps=10), TrainerControl()
    recorder.on_step_end(None, state, control, model=model)
    assert not control.should_training_stop
    model[1].bias.data[1] = float("inf")
    recorder.on_step_end(None, state, control, model=model)
    assert control.should_training_stop
    assert "step 1 left 1.bias not finite" in capsys.readouterr().out
