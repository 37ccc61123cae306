"""grpo.agents.settings: an episode opens as the single-turn prompt does (the same render, Llama 3's date, the
answer format's opening tag without an environment), and the prompt budget measures it with the tools'
definitions and the environment's first observation; the agent presets run end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from grpo import data as grpo_data
from grpo.agents.calculator import calculator
from grpo.agents.number_guess import NumberGuess
from grpo.agents.settings import EpisodeSettings, first_prompt, play_episodes
from grpo.agents.tools import tool_schemas
from grpo.answer_format import CALCULATOR_SYSTEM_PROMPT, REASONING_START, SYSTEM_PROMPT
from grpo.config import PRESETS, Config, parse_args
from grpo.rewards import reward_functions
from grpo.rollout.base import Sampling
from grpo.trainer import load_prompt_sets, train
from test_agent_episodes import EOT, Scripted, tool_llama_dir  # noqa: F401  (the fixture, used by name)

QUESTION = grpo_data.Example("What is 6 times 7?", "42")
# Llama 3.1's way with the date: today's unless the caller gives `date_string`.
DATED_TEMPLATE = (
    "{{ bos_token }}{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}\n\n"
    "{% if tools %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n{% endif %}'
    "{{ messages[0].content }}<|eot_id|>"
    "{% for message in messages[1:] %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture
def dated_tokenizer(llama_tokenizer):
    saved = llama_tokenizer.chat_template
    llama_tokenizer.chat_template = DATED_TEMPLATE
    yield llama_tokenizer
    llama_tokenizer.chat_template = saved


def settings(tools=(calculator,), environment=None) -> EpisodeSettings:
    return EpisodeSettings(tuple(tools), environment, max_turns=3, tool_timeout_s=5.0, system_prompt=SYSTEM_PROMPT)


def test_an_episodes_first_prompt_is_the_single_turn_prompt_with_the_tools_and_llamas_fixed_date(dated_tokenizer):
    tok = dated_tokenizer
    text = first_prompt(tok, QUESTION, settings())
    assert text == grpo_data.chat_prompt(tok, QUESTION.question, SYSTEM_PROMPT, tool_schemas([calculator]))
    assert "Today Date: 26 Jul 2024" in text and '"name": "calculator"' in text and text.endswith(REASONING_START)
    engine = Scripted([[[EOT]]])
    rollout, _ = play_episodes(engine, tok, [QUESTION], 1, Sampling(max_new_tokens=8, stop_token_ids=(EOT,)),
                               settings())
    assert rollout.prompt_ids == [tok.encode(text, add_special_tokens=False)]  # what the engine was given


def test_instructions_in_the_users_turn_follow_the_question_and_ask_for_no_opening_tag(dated_tokenizer):
    tok = dated_tokenizer
    agent = EpisodeSettings((calculator,), None, max_turns=3, tool_timeout_s=5.0,
                            system_prompt=CALCULATOR_SYSTEM_PROMPT, system_prompt_turn="user")
    asked = [{"role": "user", "content": f"{QUESTION.question}\n\n{CALCULATOR_SYSTEM_PROMPT}"}]
    assert agent.prefill == "" and settings().prefill == REASONING_START  # the recipe's prompt asks for the tag
    assert first_prompt(tok, QUESTION, agent) == grpo_data.render_chat(tok, asked, tool_schemas([calculator]))
    single = grpo_data.build_prompts(tok, [QUESTION], system_prompt=CALCULATOR_SYSTEM_PROMPT, system_prompt_turn="user")
    assert single.prompts == [grpo_data.render_chat(tok, asked) + REASONING_START]
    with pytest.raises(ValueError, match="system prompt turn 'assistant'"):
        grpo_data.task_messages("q", "s", "assistant")


def test_an_environments_first_prompt_holds_its_first_observation_and_opens_bare(dated_tokenizer):
    llama_tokenizer = dated_tokenizer
    game = grpo_data.Example(grpo_data.NUMBER_GUESS_QUESTION, "42")
    text = first_prompt(llama_tokenizer, game, settings(tools=(), environment=NumberGuess))
    assert NumberGuess().reset({"answer": 42}) in text and not text.endswith(REASONING_START)
    engine = Scripted([[[EOT]]])
    rollout, _ = play_episodes(engine, llama_tokenizer, [game], 1, Sampling(max_new_tokens=8, stop_token_ids=(EOT,)),
                               settings(tools=(), environment=NumberGuess))
    assert rollout.prompt_ids == [llama_tokenizer.encode(text, add_special_tokens=False)]


def test_the_prompt_budget_measures_a_prompt_with_its_tools_definitions(dated_tokenizer):
    llama_tokenizer = dated_tokenizer
    cfg = Config(model="m", dataset="arithmetic", num_train_examples=8, max_prompt_length=400, max_seq_length=1024,
                 max_completion_length=64, eval_size=4, tools="grpo.agents.calculator:calculator")
    agent = EpisodeSettings.load(cfg.tools, None, cfg.max_turns, cfg.tool_timeout, SYSTEM_PROMPT)
    single, _, _ = load_prompt_sets(cfg, llama_tokenizer)
    prompts, held_out, _ = load_prompt_sets(cfg, llama_tokenizer, episodes=agent)
    for prompt_set in (prompts, held_out):
        assert [len(ids) for ids in prompt_set.prompt_ids] == [
            len(llama_tokenizer.encode(first_prompt(llama_tokenizer, e, agent), add_special_tokens=False))
            for e in prompt_set.examples]
    longest_alone = max(len(ids) for ids in single.prompt_ids)
    assert min(len(ids) for ids in prompts.prompt_ids) > longest_alone  # the definitions count
    tight = Config(**{**cfg.__dict__, "max_prompt_length": longest_alone})
    assert len(load_prompt_sets(tight, llama_tokenizer)[0]) == 8  # all fit without the tools' definitions
    with pytest.raises(ValueError, match="every prompt is longer"):
        load_prompt_sets(tight, llama_tokenizer, episodes=agent)


def test_the_agent_presets_name_their_tool_or_environment_and_no_answer_format_for_the_game():
    calculator_run = parse_args(["--preset", "qwen1.5b-gsm8k-calculator"])
    single = parse_args(["--preset", "qwen1.5b-gsm8k"])
    assert calculator_run.tools == "grpo.agents.calculator:calculator" and calculator_run.environment is None
    for same in ("model", "dataset", "stop", "learning_rate", "num_generations", "prompts_per_step"):
        assert getattr(calculator_run, same) == getattr(single, same), same
    assert calculator_run.reward[-1] == "grpo.agents.episodes:tool_use" and not any(
        "format" in spec for spec in calculator_run.reward)  # the format's are not asked
    assert calculator_run.system_prompt_turn == "user" and REASONING_START not in calculator_run.system_prompt
    game = parse_args(["--preset", "qwen1.5b-number-guess"])
    assert game.environment == "grpo.agents.number_guess:NumberGuess" and game.reward_preset == "none"
    assert game.max_turns == NumberGuess.max_turns and game.dataset == "number-guess"
    for cfg in (calculator_run, game):
        assert (cfg.max_steps, cfg.eval_steps) == (60, 0) and cfg.eval_size > 0 and cfg.save_steps > 0


@pytest.mark.parametrize("calls, errors", [(0, 0), (1, 0), (4, 1)])
def test_the_calculator_preset_pays_an_answer_over_none_at_the_same_calls(calls, errors):
    # Under answer points where no answer cost nothing and a wrong one cost, tool_use made calling the tool until
    # the turn limit, never answering, the best a model could do without knowing the answers.
    cfg = parse_args(["--preset", "qwen1.5b-gsm8k-calculator"])
    funcs = reward_functions(cfg.reward_preset, cfg.reward)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "10 + 5"}}</tool_call>'
    episodes = {"right": "<SOLUTION>15</SOLUTION>", "wrong": "<SOLUTION>7</SOLUTION>", "none": call}

    paid = {name: sum(f([text], ["15"], tool_calls=[calls], tool_errors=[errors])[0] for f in funcs)
            for name, text in episodes.items()}
    assert paid["right"] > paid["wrong"] > paid["none"]


def test_no_reward_preset_without_a_reward_or_an_environment_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--reward-preset", "none"])
    assert "--reward-preset none with neither --reward nor --environment" in capsys.readouterr().err


@pytest.mark.parametrize("preset, figures", [
    ("qwen1.5b-number-guess", ("eval/greedy_success", "eval/greedy_turns", "eval/sampled_success")),
    ("qwen1.5b-gsm8k-calculator", ("eval/greedy_accuracy", "eval/greedy_tool_use", "eval/greedy_tool_calls",
                                   "eval/greedy_tool_errors")),
])
def test_an_agent_preset_trains_and_evaluates_before_and_after_on_a_tiny_model(preset, figures, tool_llama_dir,
                                                                               tmp_path):
    out = tmp_path / "run"
    values = {**PRESETS[preset], "model": str(tool_llama_dir), "engine": "hf", "max_steps": 1, "eval_size": 2,
              "eval_samples": 1, "num_generations": 2, "prompts_per_step": 2, "micro_batch_size": None,
              "max_completion_length": 12, "max_turns": 2, "num_train_examples": 6, "save_steps": 0,
              "optim": "adamw_torch", "output_dir": str(out), "log_completions_steps": 0}
    train(Config(**values))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/prompts" in r]
    assert [r["step"] for r in evals] == [0, 1] and all(r["eval/prompts"] == 2 for r in evals)
    for record in evals:
        assert all(0 <= record[key] for key in figures), record
    assert (out / "adapter").is_dir() and (out / "metrics.png").is_file()
