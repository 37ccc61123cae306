"""grpo.agents.episodes: episodes of several turns played on an engine, as one Rollout whose mask covers
exactly the model's tokens, whose replies are the chat template's own text, and whose cut episodes say so."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import tiny_llama
from grpo.agents.calculator import calculator
from grpo.agents.episodes import run_episodes, tool_use
from grpo.agents.number_guess import NumberGuess
from grpo.agents.tools import tool_schemas
from grpo.batch import make_batch, sequence_logprobs
from grpo.config import Config, parse_args
from grpo.rollout.base import Rollout, Sampling, pad_rows
from grpo.rollout.hf import HFEngine
from grpo.trainer import train

# Qwen2.5's tool format (<tool_call> blocks, a `tool` role answered in <tool_response>) on Llama 3's special
# tokens, so the real Llama tokenizer reads it. The newline after <|eot_id|> is text the model never writes:
# it belongs to the reply.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n<tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|eot_id|>\n'
    "{% endif %}"
    "{% for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{% if message.role == 'tool' %}<tool_response>{{ message.content }}</tool_response>"
    "{% else %}{{ message.content }}{% endif %}<|eot_id|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
EOT = 128009
PAD = 128004
PROMPT = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture
def tokenizer(llama_tokenizer):
    tok = llama_tokenizer
    saved = tok.chat_template
    tok.chat_template = TEMPLATE
    yield tok
    tok.chat_template = saved


def reply_text(message: str, role: str = "tool") -> str:
    body = f"<tool_response>{message}</tool_response>" if role == "tool" else message
    return (f"\n<|start_header_id|>{role}<|end_header_id|>\n\n{body}<|eot_id|>\n"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")


class Scripted:
    """An engine that answers each call with chosen completions (one list of token ids per row), stopping a row
    where it ends with a stop id or stop sequence and cutting it at the budget; it records what it was asked."""

    needs_importance_correction = False

    def __init__(self, calls: list[list[list[int]]]):
        self.calls = list(calls)
        self.asked: list[tuple[list[list[int]], int, Sampling]] = []

    def generate(self, prompt_ids, n, sampling):
        self.asked.append(([list(p) for p in prompt_ids], n, sampling))
        rows = [row[:sampling.max_new_tokens] for row in self.calls.pop(0)]
        assert len(rows) == len(prompt_ids) * n
        finished = [bool(row) and (row[-1] in sampling.stop_token_ids
                                   or any(tuple(row[-len(seq):]) == seq for seq in sampling.stop_sequences))
                    for row in rows]
        ids = pad_rows(rows, 0, dtype=torch.long)
        mask = pad_rows([[True] * len(r) for r in rows], False, dtype=torch.bool)
        logp = pad_rows([[-0.25 - 0.01 * t for t in range(len(r))] for r in rows], 0.0, dtype=torch.float32)
        return Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=ids, mask=mask, sampler_logp=logp,
                       finished=torch.tensor(finished), num_generations=n)

    def release_memory(self):
        pass

    def standby_bytes(self):
        return None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def sampling(budget: int = 200) -> Sampling:
    return Sampling(max_new_tokens=budget, stop_token_ids=(EOT,))


def test_a_tool_call_and_its_answer_make_one_transcript_with_the_mask_over_the_models_tokens(tokenizer):
    call = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>') + [EOT]
    answer = encode(tokenizer, "It is 5.") + [EOT]
    direct = encode(tokenizer, "5") + [EOT]
    engine = Scripted([[call, direct], [answer]])
    rollout, episodes = run_episodes(engine, tokenizer, [PROMPT], 2, sampling(), tools=[calculator], max_turns=3,
                                     tool_timeout_s=5.0)
    reply = encode(tokenizer, reply_text("5"))
    prompt = encode(tokenizer, tokenizer.apply_chat_template(PROMPT, tools=tool_schemas([calculator]), tokenize=False,
                                                             add_generation_prompt=True))
    assert rollout.prompt_ids == [prompt]
    assert rollout.completions() == [call + reply + answer, direct]
    assert rollout.mask[0, :len(call) + len(reply) + len(answer)].tolist() == \
        [True] * len(call) + [False] * len(reply) + [True] * len(answer)
    assert rollout.mask[1].sum() == len(direct) and rollout.finished.tolist() == [True, True]
    model_logp = [-0.25 - 0.01 * t for t in range(len(call))] + [-0.25 - 0.01 * t for t in range(len(answer))]
    assert rollout.sampler_logp[0][rollout.mask[0]].tolist() == pytest.approx(model_logp)
    assert (rollout.sampler_logp[0][~rollout.mask[0]] == 0).all()
    # turn 2 continued only the row still going, from its whole context, with the budget it had left
    contexts, n, asked = engine.asked[1]
    assert contexts == [prompt + call + reply] and n == 1
    assert asked.max_new_tokens == 200 - len(call) - len(reply)
    assert [(e.turns, e.tool_calls, e.tool_errors, e.cut) for e in episodes] == [(2, 1, 0, False), (1, 0, 0, False)]
    assert episodes[0].messages[2] == {"role": "tool", "content": "5"}


def boom(x: int) -> int:
    """Fail.

    Args:
        x: anything.
    """
    raise RuntimeError("the tool broke")


def test_a_tool_that_raises_becomes_an_error_message_in_the_conversation(tokenizer):
    call = encode(tokenizer, '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>') + [EOT]
    answer = encode(tokenizer, "Sorry.") + [EOT]
    rollout, episodes = run_episodes(Scripted([[call], [answer]]), tokenizer, [PROMPT], 1, sampling(), tools=[boom],
                                     max_turns=2, tool_timeout_s=5.0)
    message = "Error: tool 'boom' raised RuntimeError: the tool broke"
    assert episodes[0].messages[2] == {"role": "tool", "content": message}
    assert rollout.completions()[0] == call + encode(tokenizer, reply_text(message)) + answer
    assert (episodes[0].tool_calls, episodes[0].tool_errors) == (1, 1) and rollout.finished.tolist() == [True]


def test_an_episode_cut_by_the_turn_limit_or_the_token_budget_is_not_finished(tokenizer):
    call = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>') + [EOT]
    rollout, episodes = run_episodes(Scripted([[call]]), tokenizer, [PROMPT], 1, sampling(), tools=[calculator],
                                     max_turns=1, tool_timeout_s=5.0)
    assert rollout.completions() == [call] and rollout.finished.tolist() == [False]
    assert episodes[0].cut and episodes[0].tool_calls == 0  # the call that would go on was not run

    reply = encode(tokenizer, reply_text("1"))
    budget = len(call) + len(reply) + 3
    long_answer = encode(tokenizer, "one two three four five six") + [EOT]
    rollout, episodes = run_episodes(Scripted([[call], [long_answer]]), tokenizer, [PROMPT], 1, sampling(budget),
                                     tools=[calculator], max_turns=4, tool_timeout_s=5.0)
    assert rollout.completions() == [call + reply + long_answer[:3]]  # every token after the prompt counts
    assert rollout.finished.tolist() == [False] and not episodes[0].cut

    rollout, _ = run_episodes(Scripted([[call]]), tokenizer, [PROMPT], 1, sampling(len(call) + len(reply)),
                              tools=[calculator], max_turns=4, tool_timeout_s=5.0)
    assert rollout.completions() == [call] and rollout.finished.tolist() == [False]  # no room left to answer


def test_a_turn_that_stops_at_a_stop_string_ends_the_episode_without_running_its_calls(tokenizer):
    from grpo.rollout.stops import stop_string_sequences

    answer = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
                               " so <SOLUTION>5</SOLUTION>")
    stop = stop_string_sequences(tokenizer, ["</SOLUTION>"])
    assert any(tuple(answer[-len(seq):]) == seq for seq in stop)  # the scripted turn ends at the stop string
    engine = Scripted([[answer]])
    rollout, episodes = run_episodes(engine, tokenizer, [PROMPT], 1, dataclasses.replace(sampling(), stop_sequences=stop),
                                     tools=[calculator], max_turns=3, tool_timeout_s=5.0)
    assert len(engine.asked) == 1 and rollout.completions() == [answer]  # no second turn
    assert rollout.finished.tolist() == [True] and episodes[0].tool_calls == 0 and not episodes[0].cut


def test_a_call_closed_by_another_eos_than_the_templates_runs_and_the_template_closes_the_turn(tokenizer):
    end_of_text = 128001  # one of Llama's EOS, which the template never writes (as Qwen's <|endoftext|>)
    call = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    answer = encode(tokenizer, "5") + [EOT]
    stops = dataclasses.replace(sampling(), stop_token_ids=(EOT, end_of_text))
    rollout, episodes = run_episodes(Scripted([[call + [end_of_text]], [answer]]), tokenizer, [PROMPT], 1, stops,
                                     tools=[calculator], max_turns=3, tool_timeout_s=5.0)
    assert episodes[0].tool_calls == 1 and episodes[0].messages[2] == {"role": "tool", "content": "5"}
    reply = encode(tokenizer, "<|eot_id|>" + reply_text("5"))  # the template's own end-of-turn opens the reply
    assert rollout.completions() == [call + [end_of_text] + reply + answer]
    assert rollout.mask[0].tolist()[:len(call) + 1 + len(reply)] == [True] * (len(call) + 1) + [False] * len(reply)


def test_tool_use_pays_an_episode_with_a_call_that_ran():
    rewards = tool_use(["a", "b", "c", "d"], ["1"] * 4, tool_calls=[0, 1, 2, 2], tool_errors=[0, 1, 1, 0])
    assert rewards == [0.0, 0.0, 1.0, 1.0]


def test_a_prefilled_first_turn_keeps_the_transcript_a_continuation_of_the_prompt(tokenizer):
    from grpo.rewards import has_exact_format, is_correct

    prefill = "<start_working_out>"
    call = encode(tokenizer, ' 2+3: <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
                             "</tool_call>") + [EOT]
    answer = encode(tokenizer, "So it is 5.<end_working_out><SOLUTION>5</SOLUTION>") + [EOT]
    engine = Scripted([[call], [answer]])
    rollout, episodes = run_episodes(engine, tokenizer, [PROMPT], 1, sampling(), tools=[calculator], max_turns=3,
                                     tool_timeout_s=5.0, prefill=prefill)
    schemas = tool_schemas([calculator])
    opened = tokenizer.apply_chat_template(PROMPT, tools=schemas, tokenize=False, add_generation_prompt=True,
                                           date_string="26 Jul 2024") + prefill
    assert rollout.prompt_ids == [encode(tokenizer, opened)]
    reply = encode(tokenizer, reply_text("5"))
    assert engine.asked[1][0] == [encode(tokenizer, opened) + call + reply]
    # the conversation keeps what the model wrote; its renders put the prefill back in front (else turn 2's context
    # above would not continue the prompt: the template's text would not start with the text before)
    assert episodes[0].messages[1]["content"] == tokenizer.decode(call, skip_special_tokens=True)
    transcript = tokenizer.decode(rollout.completions()[0], skip_special_tokens=True)
    assert has_exact_format(transcript) and is_correct(transcript, "5")  # read as a single-turn completion is


def test_the_number_guessing_environment_ends_the_episode_on_the_right_guess(tokenizer):
    guesses = [[encode(tokenizer, "50") + [EOT]], [encode(tokenizer, "I guess 42") + [EOT]]]
    rollout, episodes = run_episodes(Scripted(guesses), tokenizer, [[]], 1, sampling(), environment=NumberGuess,
                                     max_turns=5, tool_timeout_s=5.0, examples=[{"answer": 42}])
    episode = episodes[0]
    assert episode.messages[0]["content"].startswith("I am thinking of a whole number from 1 to 100")
    assert episode.rewards == [0.0, 1.0] and episode.reward == 1.0 and episode.turns == 2
    assert rollout.finished.tolist() == [True] and not episode.cut
    observation = encode(tokenizer, reply_text("50 is wrong: the number is lower.", role="user"))
    assert rollout.completions()[0] == guesses[0][0] + observation + guesses[1][0]


def test_an_environment_whose_first_observation_differs_within_a_group_is_refused(tokenizer):
    class Moody(NumberGuess):
        count = 0

        def reset(self, example):
            Moody.count += 1
            return f"observation {Moody.count}"

    with pytest.raises(ValueError, match="reset gave different observations for the same example"):
        run_episodes(Scripted([]), tokenizer, [[]], 2, sampling(), environment=Moody, max_turns=2,
                     tool_timeout_s=1.0, examples=[{}])


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(tokenizer):
    tokenizer.chat_template = TEMPLATE.replace("{% for message in messages %}", "{% for message in messages[-2:] %}")
    call = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>') + [EOT]
    with pytest.raises(ValueError, match="renders the earlier conversation differently"):
        run_episodes(Scripted([[call]]), tokenizer, [PROMPT], 1, sampling(), tools=[calculator], max_turns=2,
                     tool_timeout_s=5.0)


class StopAfter:
    """The hf engine with each turn stopped after `k` tokens, as if the model had ended its turn there: a random
    model rarely writes its end-of-turn token. The template's end-of-turn then belongs to the reply."""

    needs_importance_correction = False

    def __init__(self, engine: HFEngine, k: int):
        self.engine, self.k = engine, k

    def generate(self, prompt_ids, n, sampling):
        out = self.engine.generate(prompt_ids, n, dataclasses.replace(sampling, max_new_tokens=min(self.k, sampling.max_new_tokens)))
        out.finished = out.mask.sum(1) == self.k
        return out


def test_hf_episodes_record_the_samplers_logprobs_that_the_trainer_computes_on_the_whole_transcript(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(seed=3)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False)).eval()
    engine = StopAfter(HFEngine(policy, pad_id=PAD), k=4)
    rollout, episodes = run_episodes(engine, tokenizer, [[], []], 2, Sampling(max_new_tokens=80, seed=0),
                                     environment=NumberGuess, max_turns=3, tool_timeout_s=1.0,
                                     examples=[{"answer": 7}, {"answer": 93}])
    assert [e.turns for e in episodes] == [3, 3, 3, 3] and all(e.cut for e in episodes)
    assert (rollout.mask.sum(1) == 12).all() and not rollout.finished.any()
    for row, episode in zip(rollout.completions(), episodes):
        observation = episode.messages[2]["content"]
        assert observation in tokenizer.decode(row)  # the environment's reply sits between the model's turns
    batch = make_batch(rollout, PAD, torch.device("cpu"))
    with torch.no_grad():
        trainer_logp = sequence_logprobs(policy, batch, temperature=1.0)
    torch.testing.assert_close(trainer_logp, rollout.sampler_logp, atol=2e-4, rtol=0)


# --------------------------------------------------------------------------------------------------
# Training on episodes: train() with --tools and with --environment
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_llama_dir(tmp_path_factory, llama_tokenizer):
    """A tiny random Llama whose tokenizer carries the test's chat template with tools."""
    path = tmp_path_factory.mktemp("tool-llama")
    tiny_llama().save_pretrained(path)
    saved = llama_tokenizer.chat_template
    llama_tokenizer.chat_template = TEMPLATE
    llama_tokenizer.save_pretrained(path)
    llama_tokenizer.chat_template = saved
    return path


class CallsFirst:
    """The trainer's engine, with every episode's first turn a scripted calculator call (a random model never
    writes one); the turns after it are the model's own."""

    needs_importance_correction = False

    def __init__(self, engine, call: list[int]):
        self.engine, self.call = engine, call

    def generate(self, prompt_ids, n, sampling):
        if n == 1:  # an episode's later turn: its whole context, one row each
            return self.engine.generate(prompt_ids, n, sampling)
        rows = len(prompt_ids) * n
        ids = torch.tensor([self.call] * rows)
        return Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=ids,
                       mask=torch.ones(ids.shape, dtype=torch.bool), sampler_logp=torch.full(ids.shape, -1.0),
                       finished=torch.ones(rows, dtype=torch.bool), num_generations=n)

    def release_memory(self):
        self.engine.release_memory()

    def standby_bytes(self):
        return self.engine.standby_bytes()


def read_metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_the_calculator_trains_on_episodes_and_no_tool_token_reaches_the_loss(
        tool_llama_dir, tmp_path, monkeypatch, llama_tokenizer):
    import grpo.batch
    import grpo.groups
    import grpo.trainer

    call = encode(llama_tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    real_build = grpo.trainer.build_engine
    monkeypatch.setattr(grpo.trainer, "build_engine", lambda *a, **k: CallsFirst(real_build(*a, **k), call + [EOT]))
    rollouts, targets = [], []
    real_episodes, real_logprobs = grpo.groups.play_episodes, grpo.batch.token_logprobs

    def recording_episodes(*args, **kwargs):
        rollout, episodes = real_episodes(*args, **kwargs)
        rollouts.append(rollout)
        return rollout, episodes

    def recording_logprobs(h, weight, ids, temperature):
        targets.append(ids.clone())
        return real_logprobs(h, weight, ids, temperature)

    monkeypatch.setattr(grpo.groups, "play_episodes", recording_episodes)
    monkeypatch.setattr(grpo.batch, "token_logprobs", recording_logprobs)
    out = tmp_path / "run"
    train(Config(model=str(tool_llama_dir), dataset="arithmetic", num_train_examples=16, engine="hf", max_steps=2,
                 prompts_per_step=2, num_generations=2, max_completion_length=120, max_seq_length=1024,
                 learning_rate=1e-3, warmup_ratio=0.0, save_steps=0, eval_steps=0, log_completions_steps=0,
                 output_dir=str(out), seed=3,
                 reward=("test_train:text_signal", "grpo.agents.episodes:tool_use"),
                 tools="grpo.agents.calculator:calculator", max_turns=2))
    records = read_metrics(out)
    assert len(records) == 2
    for record in records:
        assert record["episodes/tool_calls"] == 1.0 and record["episodes/tool_errors"] == 0.0
        assert record["rewards/tool_use"] == 1.0  # every episode's call ran: the trainer passed the columns
        assert record["episodes/turns"] == 2.0 and "episodes/frac_cut_by_max_turns" in record
    header = llama_tokenizer.convert_tokens_to_ids("<|start_header_id|>")  # in every reply, never the model's
    for rollout in rollouts:
        for row, mask in zip(rollout.completions(), rollout.mask):
            assert row[:len(call) + 1] == call + [EOT] and header in row
            assert not mask[row.index(header)]
            assert "<tool_response>42</tool_response>" in llama_tokenizer.decode(row)
    assert targets and all(header not in ids.tolist() for ids in targets)


@pytest.mark.parametrize("engine", ["hf", pytest.param("native", marks=pytest.mark.slow)])
def test_a_run_with_the_number_guessing_environment_logs_its_reward_and_episodes(tool_llama_dir, tmp_path, engine):
    # the environment's first observation makes each episode's prompt longer than the dataset's: the native
    # engine's cache holds --max-seq-length for episodes, not the dataset's longest prompt and the budget
    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"question": "Guess my number.", "answer": str(a)}) + "\n"
                            for a in (7, 31, 64, 90)))
    out = tmp_path / "run"
    train(Config(model=str(tool_llama_dir), dataset=str(data), engine=engine, max_steps=1, prompts_per_step=2,
                 num_generations=2, max_completion_length=60, max_seq_length=1024, learning_rate=1e-3,
                 warmup_ratio=0.0, save_steps=0, eval_steps=0, log_completions_steps=0, output_dir=str(out), seed=3,
                 environment="grpo.agents.number_guess:NumberGuess", max_turns=3))
    (record,) = read_metrics(out)
    assert "rewards/environment" in record and record["rewards/environment"] <= 1.0
    assert 1.0 <= record["episodes/turns"] <= 3.0 and record["episodes/tool_calls"] == 0.0


@pytest.mark.parametrize("flags, message", [
    (["--tools", "grpo.agents.calculator:nothing"], "has no 'nothing'"),
    (["--environment", "grpo.agents.calculator:calculator"], "not a class"),
    (["--max-turns", "0"], "--max-turns 0: must be 1 or more"),
    (["--tool-timeout", "0"], "--tool-timeout 0.0: must be above 0"),
    (["--reward", "grpo.agents.episodes:tool_use"], "reads each episode's tool_calls and tool_errors, which only runs "
                                                    "with --tools or --environment have; fix: add --tools"),
])
def test_bad_agent_flags_are_one_line_before_any_model_loads(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "no/such-model", *flags])
    assert message in capsys.readouterr().err


def test_the_tool_reward_with_tools_parses():
    cfg = parse_args(["--model", "m", "--reward", "grpo.agents.episodes:tool_use", "--tools",
                      "grpo.agents.calculator:calculator"])
    assert cfg.reward == ("grpo.agents.episodes:tool_use",)
