"""What an episode of a run is and how it opens: `EpisodeSettings` (the tools, the environment, the turn limit,
the tools' time limit and the system prompt, as the run's flags name them), the conversation an example opens
with, the text of its first prompt, and `play_episodes`, which plays examples' episodes through `run_episodes`.
Training (`grpo.groups`) and held-out evaluation (`grpo.eval`) play episodes through it alike.

The first prompt's text (`first_prompt`) is what the prompt-length budget measures and what the engine's
length is sized for, so the tools' definitions and an environment's first observation are in it. It is rendered
by `grpo.data.render_chat`, the call behind single-turn prompts too, so one conversation is one text either way.

A task without an environment is the single-turn task with tools: where its system prompt asks for the answer
format the single-turn prompt opens (`<start_working_out>`, `grpo.answer_format`), its first turn opens with that
tag too, so that the same rewards read it alike. A prompt that asks for no such format opens bare, and so does an
environment's game, which has its own replies.

What it deliberately is not: the turn loop (`grpo.agents.episodes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpo.agents.environments import Episode, load_environment
from grpo.agents.episodes import run_episodes
from grpo.agents.tools import Tool, load_tools, tool_schemas
from grpo.answer_format import REASONING_START
from grpo.data import Example, render_chat, task_messages
from grpo.rollout.base import Engine, Rollout, Sampling


@dataclass(frozen=True)
class EpisodeSettings:
    """How a run's episodes are played: its tools, its environment class, model turns at most, seconds a tool
    call may run, the system prompt every episode opens with and its turn (`grpo.data.task_messages`)."""

    tools: tuple[Tool, ...]
    environment: type | None
    max_turns: int
    tool_timeout_s: float
    system_prompt: str
    system_prompt_turn: str = "system"

    @classmethod
    def load(cls, tools: str | None, environment: str | None, max_turns: int, tool_timeout_s: float,
             system_prompt: str, system_prompt_turn: str = "system") -> EpisodeSettings | None:
        """From the flags' specs (`--tools file.py:f,g`, `--environment file.py:Class`): the tools and the class
        loaded and checked; None for a single-turn run (neither)."""
        if not tools and not environment:
            return None
        return cls(tuple(load_tools(tools)) if tools else (), load_environment(environment) if environment else None,
                   max_turns, tool_timeout_s, system_prompt, system_prompt_turn)

    @property
    def prefill(self) -> str:
        """The text the model's first turn opens with: the answer format's opening tag where the system prompt
        asks for that format and no environment has its own replies (see the module's docstring); else nothing."""
        return REASONING_START if self.environment is None and REASONING_START in self.system_prompt else ""


def opening_messages(example: Example, settings: EpisodeSettings) -> list[dict[str, str]]:
    """The conversation an example opens with: the system prompt, in its turn, and the question (an
    environment's first observation follows, once `run_episodes` has reset it)."""
    return task_messages(example.question, settings.system_prompt, settings.system_prompt_turn)


def example_row(example: Example) -> dict[str, Any]:
    """What an environment's `reset` gets: the example's question, answer and extra columns, as one dict."""
    return {"question": example.question, "answer": example.answer, **example.columns}


def first_prompt(tokenizer, example: Example, settings: EpisodeSettings) -> str:
    """The text of an episode's first prompt, as `run_episodes` renders it: the opening conversation (with an
    environment's first observation, from an instance reset for this), the tools' definitions, the generation
    prompt and the prefill."""
    messages = opening_messages(example, settings)
    if settings.environment is not None:
        messages.append({"role": "user", "content": str(settings.environment().reset(example_row(example)))})
    schemas = tool_schemas(settings.tools) if settings.tools else None
    return render_chat(tokenizer, messages, schemas) + settings.prefill


def play_episodes(engine: Engine, tokenizer, examples: Sequence[Example], n: int, sampling: Sampling,
                  settings: EpisodeSettings) -> tuple[Rollout, list[Episode]]:
    """n episodes of each example, in group order, as `run_episodes` plays them (its Rollout and Episodes)."""
    return run_episodes(engine, tokenizer, [opening_messages(e, settings) for e in examples], n,
                        sampling, tools=settings.tools, environment=settings.environment,
                        max_turns=settings.max_turns, tool_timeout_s=settings.tool_timeout_s,
                        examples=[example_row(e) for e in examples], prefill=settings.prefill)


def success(episode: Episode) -> bool:
    """An environment's episode succeeded: its reward, summed over its turns, is above 0."""
    return episode.reward > 0
