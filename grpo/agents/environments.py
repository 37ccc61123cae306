"""Environments: a class whose instance plays one episode, in TRL's environment shape.

    env = Env()                                    # one instance per episode, made with no arguments
    observation = env.reset(example)               # the dataset row -> the first message to the model
    observation, reward, done = env.step(text)     # the model's reply -> the next message, a reward, the end

This module loads such a class from `path/to/file.py:Name` (or `module:Name`) and checks its shape, and holds
`Episode`, the record of one episode. What it deliberately is not: the loop that plays episodes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from grpo.user_code import import_user_module, split_spec

# each method, and the arguments the loop calls it with
_METHODS = {"reset": "reset(example)", "step": "step(action_text)"}


def load_environment(spec: str) -> type:
    """`path/to/file.py:Name` or `module:Name` -> the class, checked to have `reset(example)` and
    `step(action_text)` and to be made with no arguments. A module is found as `--reward` finds one."""
    form = "path/to/file.py:Name (or module:Name)"
    module_name, name = split_spec(spec, "environment", form, "my_env.py:Wordle")
    name = name.strip()
    module = import_user_module(spec, "environment", module_name, form)
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"environment {spec!r}: {module_name!r} has no {name!r}; fix: name a class it defines")
    if not isinstance(cls, type):
        raise ValueError(f"environment {spec!r}: {name!r} is a {type(cls).__name__}, not a class; fix: name a "
                         "class with reset(example) and step(action_text)")
    _check_shape(spec, cls)
    return cls


def _check_shape(spec: str, cls: type) -> None:
    missing = [call for method, call in _METHODS.items() if not callable(getattr(cls, method, None))]
    if missing:
        raise ValueError(f"environment {spec!r}: {cls.__name__} has no {' nor '.join(missing)}; fix: define "
                         "reset(self, example) -> observation and step(self, action_text) -> "
                         "(observation, reward, done)")
    for method, call in _METHODS.items():
        function = inspect.getattr_static(cls, method)
        if inspect.isfunction(function) and not _accepts(function, None, None):  # self and one argument
            raise ValueError(f"environment {spec!r}: {cls.__name__}.{method}{inspect.signature(function)} "
                             f"cannot be called as {call}; fix: take exactly that one argument")
    if not _accepts(cls):
        raise ValueError(f"environment {spec!r}: {cls.__name__}{inspect.signature(cls)} needs arguments; fix: "
                         "give them defaults, since one instance is made per episode with none")


def _accepts(function: Any, *args: Any) -> bool:
    try:
        inspect.signature(function).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): nothing to check
        return True
    return True


@dataclass
class Episode:
    """What one episode leaves: the conversation, the environment's reward per turn, the tool calls made and
    how many failed, and whether the turn limit cut it before the environment said done. The loop that
    plays the episode fills it."""

    messages: list[dict[str, str]]
    rewards: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    cut: bool = False

    @property
    def turns(self) -> int:
        """The model's turns: its messages in the conversation."""
        return sum(message["role"] == "assistant" for message in self.messages)

    @property
    def reward(self) -> float:
        """The environment's reward for the whole episode: its rewards per turn summed."""
        return float(sum(self.rewards))
