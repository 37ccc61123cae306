"""Episodes of several turns: the model writes, its tool calls run or an environment answers, and the
reply enters its context, until the model stops calling, the environment says done, or a limit cuts it.

`run_episodes` plays P prompts times n episodes on any `Engine` and returns them as one `Rollout` whose
completions are whole transcripts after the prompt: the model's tokens and the replies' tokens in order,
`mask` True only at the model's. What happens between turns (a tool run, an environment's step, the reply's
tokens, the limits) is decided here, once, for every engine; the engine only continues the rows it is given
with the tokens appended (`Turns`). On an engine with `turns` (the native engine: each reply fed into its
row's KV cache by its decode steps, rows at their own pace) that is the engine's; on any other, `ResentTurns`,
the reference: every turn re-sends each row's whole context to `generate`. Both give the same transcripts for the same
sampled tokens.

How a reply becomes tokens: the chat template renders the conversation with the new message(s) and the
generation prompt; the text it adds after the model's own end-of-turn is the reply. The model's tokens are
never re-tokenized, so the trainer scores exactly the tokens that were sampled.

What it deliberately is not: the scoring or the update. Rewards, advantages and the loss read the
`Rollout` as they read single completions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from grpo.agents.environments import Episode
from grpo.agents.tools import Tool, parse_tool_calls, run_tool_call, tool_call_style, tool_schemas
from grpo.data import render_chat
from grpo.rollout.base import Engine, Rollout, Sampling, TurnEnd, pad_rows

Message = dict[str, str]


@dataclasses.dataclass
class _Row:
    """One episode in play: its conversation, its environment, and its completion so far."""

    record: Episode
    environment: Any
    rendered: str  # the chat template's text of the conversation, generation prompt included
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    turn_tokens: list[int] = dataclasses.field(default_factory=list)  # the model's tokens of its last turn
    finished: bool = False
    going: bool = True


def run_episodes(engine: Engine, tokenizer, prompt_messages: Sequence[list[Message]], n: int, sampling: Sampling,
                 *, tools: Sequence[Tool] | None = None, environment: type | None = None, max_turns: int,
                 tool_timeout_s: float, examples: Sequence[dict[str, Any]] | None = None, prefill: str = ""
                 ) -> tuple[Rollout, list[Episode]]:
    """n episodes of each of the P conversations in `prompt_messages`, in group order (row i is prompt i // n).

    `tools`: the functions the model may call (their definitions go into the chat template); a turn without a
    call ends the episode, unless an `environment` plays it. `environment`: a class, one instance per episode,
    `reset(example)` with `examples[p]` (its observation is the prompt's last user message) and
    `step(text)` after each model turn. `max_turns`: model turns at most; an episode that would go on is cut.
    `sampling.max_new_tokens` bounds the whole transcript after the prompt, replies included. `prefill`: text the
    model's first turn opens with, at the end of the prompt (as single-turn prompts end with `<start_working_out>`).
    A turn that ends at a stop string (`sampling.stop_sequences`), not at the model's end-of-turn, ends the
    episode's tool calls: the stop string closes the answer, so its calls are not run.

    Returns the `Rollout` (`finished` False where `max_turns` or the token budget cut the episode) and each
    episode's `Episode` (its conversation, environment rewards, tool calls and errors, whether turns cut it)."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: must be at least 1")
    if environment is not None and (examples is None or len(examples) != len(prompt_messages)):
        raise ValueError("an environment needs one example per prompt (reset(example)); fix: pass examples")
    t0 = time.perf_counter()
    schemas = tool_schemas(tools) if tools else None
    style = tool_call_style(tokenizer.chat_template) if tools else None
    render = _Renderer(tokenizer, schemas, prefill)
    prompts, rows = [], []
    for p, messages in enumerate(prompt_messages):
        group = [_new_row(list(messages), environment, examples[p] if examples is not None else None)
                 for _ in range(n)]
        first = {row.record.messages[-1]["content"] for row in group} if environment is not None else set()
        if len(first) > 1:
            raise ValueError(f"environment {environment.__name__}: reset gave different observations for the "
                             f"same example ({examples[p]!r}); fix: make the observation depend only on the example")
        for row in group:
            row.rendered = render(row.record.messages)
        prompts.append(render.ids(group[0].rendered))
        rows += group

    budget = sampling.max_new_tokens
    # The engine's own way to continue rows in place where it has one; else the whole context re-sent each turn
    opened = (engine.turns(prompts, n, sampling) if callable(getattr(engine, "turns", None))
              else ResentTurns(engine, prompts, n, sampling))
    with opened as turns:
        ended = turns.ended()
        while ended:
            replies = {}
            for end in ended:
                row = rows[end.row]
                _model_turn(row, end, tokenizer)
                reply = _answer(row, tools, style, environment is not None, tool_timeout_s, render, budget,
                                row.record.turns == max_turns) if row.going else None
                if reply is not None:
                    replies[end.row] = reply
            turns.continue_rows(replies)
            ended = turns.ended()

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rollout = Rollout(
        prompt_ids=prompts,
        completion_ids=pad_rows([row.ids for row in rows], pad_id, dtype=torch.long),
        mask=pad_rows([row.mask for row in rows], False, dtype=torch.bool),
        sampler_logp=pad_rows([row.logp for row in rows], 0.0, dtype=torch.float32),
        finished=torch.tensor([row.finished for row in rows], dtype=torch.bool),
        num_generations=n, timings={**turns.timings, "episodes": time.perf_counter() - t0})
    return rollout, [row.record for row in rows]


def _new_row(messages: list[Message], environment: type | None, example: dict[str, Any] | None) -> _Row:
    env = None
    if environment is not None:
        env = environment()
        messages.append({"role": "user", "content": str(env.reset(example))})
    return _Row(Episode(messages), env, "")


def _model_turn(row: _Row, end: TurnEnd, tokenizer) -> None:
    """Row `row`'s tokens of the turn that just ended (already cut to the row's budget)."""
    row.ids += end.ids
    row.mask += [True] * len(end.ids)
    row.logp += end.logp
    row.record.messages.append({"role": "assistant", "content": tokenizer.decode(end.ids, skip_special_tokens=True)})
    row.turn_tokens = end.ids
    if not end.finished:  # the token budget ran out mid-turn
        row.going, row.finished = False, False


def _answer(row: _Row, tools: Sequence[Tool] | None, style: str | None, has_environment: bool,
            timeout_s: float, render: "_Renderer", budget: int, last_turn: bool) -> list[int] | None:
    """After a model turn that stopped: its tool calls run, or the environment steps; the reply's tokens are
    appended and returned, or the episode ends (finished) or is cut (turns or tokens spent): None."""
    text = row.record.messages[-1]["content"]
    replies: list[Message] = []
    ended_turn = render.ends_turn(row.turn_tokens)  # a stop string closed the answer instead: no call runs
    calls = parse_tool_calls(text, style, [fn.__name__ for fn in tools]) if tools and ended_turn else []
    if calls and not last_turn:
        for call in calls:
            content = run_tool_call(call, tools, timeout_s)
            row.record.tool_calls += 1
            row.record.tool_errors += call.error is not None or content.startswith("Error: ")
            replies.append({"role": "tool", "content": content})
    elif not calls and has_environment:
        observation, reward, done = row.environment.step(text)
        row.record.rewards.append(float(reward))
        if done:
            row.going, row.finished = False, True
            return None
        replies.append({"role": "user", "content": str(observation)})
    if not calls and not has_environment:
        row.going, row.finished = False, True
        return None
    if last_turn:  # the episode would go on: the turn limit cuts it
        row.going, row.finished, row.record.cut = False, False, True
        return None
    before = row.rendered
    row.record.messages += replies
    row.rendered = render(row.record.messages)
    reply = render.ids(render.reply(before, row.rendered, row.record.messages[-1 - len(replies)]["content"],
                                    row.turn_tokens))
    if len(row.ids) + len(reply) >= budget:  # no room left for the model to answer: cut
        row.going, row.finished = False, False
        return None
    row.ids += reply
    row.mask += [False] * len(reply)
    row.logp += [0.0] * len(reply)
    return reply


class ResentTurns:
    """The reference way to play turns (`Turns`) on any `Engine`: each turn one `generate` call for every row
    that goes on, its whole context (its prompt and its transcript so far) sent again and prefilled again.

    One call at the largest budget left; each row's tokens are then cut to its own: its tokens up to its limit
    are drawn alike. Each call its own seed, so that a seeded run does not replay the first turn's draws."""

    def __init__(self, engine: Engine, prompts: list[list[int]], n: int, sampling: Sampling):
        self.engine, self.prompts, self.n, self.sampling = engine, prompts, n, sampling
        self.transcripts: list[list[int]] = [[] for _ in range(len(prompts) * n)]
        self.going: list[int] | None = None  # rows continued after their last turn; None before the first
        self.calls = 0
        self.timings: dict[str, float] = {}

    def __enter__(self) -> ResentTurns:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def ended(self) -> list[TurnEnd]:
        going = list(range(len(self.transcripts))) if self.going is None else self.going
        if not going:
            return []
        left = [self.sampling.max_new_tokens - len(self.transcripts[i]) for i in going]
        seed = self.sampling.seed
        sampling = dataclasses.replace(self.sampling, max_new_tokens=max(left),
                                       seed=None if seed is None else seed + self.calls)
        if self.going is None:
            out = self.engine.generate(self.prompts, self.n, sampling)
        else:
            out = self.engine.generate([self.prompts[i // self.n] + self.transcripts[i] for i in going], 1, sampling)
        self.calls += 1
        self.going = []
        ends = []
        for k, (i, room) in enumerate(zip(going, left)):
            ids = out.completion_ids[k][out.mask[k]].tolist()
            logp = out.sampler_logp[k][out.mask[k]].tolist()
            ends.append(TurnEnd(i, ids[:room], logp[:room], bool(out.finished[k]) and len(ids) <= room))
            self.transcripts[i] += ids[:room]
        return ends

    def continue_rows(self, replies: dict[int, list[int]]) -> None:
        for i, reply in sorted(replies.items()):
            self.transcripts[i] += reply
        self.going = sorted(replies)


class _Renderer:
    """The chat template's text of a conversation (with the tools' definitions and the generation prompt, by
    `grpo.data.render_chat` as single-turn prompts are), its tokens, and the text a reply adds after the model's
    turn. The model's first turn opens with `prefill`: the first prompt ends with it, and later renders put it back
    in front of the model's first message, so the text rendered before stays a prefix of the text after."""

    def __init__(self, tokenizer, schemas: list[dict[str, Any]] | None, prefill: str = ""):
        self.tokenizer = tokenizer
        self.schemas = schemas
        self.prefill = prefill

    def __call__(self, messages: list[Message]) -> str:
        first = next((i for i, message in enumerate(messages) if message["role"] == "assistant"), None)
        if first is None:
            return render_chat(self.tokenizer, messages, self.schemas) + self.prefill
        if self.prefill:
            opened = {**messages[first], "content": self.prefill + messages[first]["content"]}
            messages = [*messages[:first], opened, *messages[first + 1:]]
        return render_chat(self.tokenizer, messages, self.schemas)

    def ends_turn(self, model_tokens: list[int]) -> bool:
        """The model closed its turn with a special token (its end-of-turn, or another of its EOS), not with a
        stop string."""
        last = model_tokens[-1:]
        return bool(last) and not self.tokenizer.decode(last, skip_special_tokens=True)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def reply(self, before: str, after: str, content: str, model_tokens: list[int]) -> str:
        """The text `after` adds past the model's turn: `before` is the conversation up to the model's turn
        (generation prompt included), `content` the model's text and `model_tokens` its tokens, whose last may
        be the end-of-turn that the template renders too."""
        if not after.startswith(before):
            raise ValueError("the chat template renders the earlier conversation differently once a message is "
                             "added (it rewrites past turns), so the episode's tokens cannot be continued; fix: "
                             "use a chat template that only appends")
        content = content.strip()  # as a template that trims it renders it
        found = after.find(content, len(before)) if content else -1
        at = found + len(content) if found >= 0 else len(before)
        if self.ends_turn(model_tokens):  # the model wrote its end-of-turn: the template's own is not the reply's
            end = self.tokenizer.decode(model_tokens[-1:])
            found = after.find(end, at)
            # Another of the model's EOS (Qwen's <|endoftext|> for its <|im_end|>) is not in the template's text:
            # the model's token stays, and the template's own close opens the reply.
            at = found + len(end) if found >= 0 else at
        return after[at:]


def environment(completions: list[str], answers: list[str], *, environment_reward: Sequence[float],
                **columns: Any) -> list[float]:
    """The environment's reward of each episode (its rewards per turn summed) as a reward function, so that it
    is a column of its own (`rewards/environment`) beside the others: the trainer passes `environment_reward`."""
    return [float(r) for r in environment_reward]


def tool_use(completions: list[str], answers: list[str], *, tool_calls: Sequence[int], tool_errors: Sequence[int],
             **columns: Any) -> list[float]:
    """1 for an episode with at least one tool call that ran without error, else 0: what pays a model for trying
    its tools before it knows they help (`--reward grpo.agents.episodes:tool_use`; the trainer passes each
    episode's `tool_calls` and `tool_errors` with --tools). It pays for any such call, a needless one too: held-out
    accuracy beside it says whether the calls help. Beside answer rewards under which no answer costs less than a
    wrong one, it pays a model for calling until the turn limit and never answering (docs/learning.md, "Agents")."""
    return [float(calls > errors) for calls, errors in zip(tool_calls, tool_errors)]


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's log of its episodes: model turns, tool calls and tool errors per episode, and the share cut
    by the turn limit. {} without episodes (a single-turn run)."""
    if not episodes:
        return {}
    n = len(episodes)
    return {"episodes/turns": sum(e.turns for e in episodes) / n,
            "episodes/tool_calls": sum(e.tool_calls for e in episodes) / n,
            "episodes/tool_errors": sum(e.tool_errors for e in episodes) / n,
            "episodes/frac_cut_by_max_turns": sum(e.cut for e in episodes) / n}
