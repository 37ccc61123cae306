"""The built-in example environment: guess a whole number, told after each guess whether it is higher or lower.

It has the shape every environment has (see `grpo.agents.environments`): one instance per episode,
`reset(example)` starts it and `step(action_text)` answers one turn. It serves the tests and the docs, and
a stateful game the model can learn.
"""

from __future__ import annotations

import random
import re
from typing import Any

_INTEGER = re.compile(r"-?\d+")


class NumberGuess:
    """Guess a number in [low, high] within `max_turns` guesses. The number is the example's `answer` when
    it has one, else drawn from its `seed`. Reward: `solved` on the right guess, `no_guess` for a reply with
    no number in it, 0 otherwise."""

    low, high, max_turns = 1, 100, 7  # 7 guesses: enough for a binary search over 100 numbers
    solved, no_guess = 1.0, -0.1

    def reset(self, example: dict[str, Any]) -> str:
        answer = example.get("answer")
        if answer is None:  # no seed either: a number of the system's randomness
            self.secret = random.Random(example.get("seed")).randint(self.low, self.high)
        elif isinstance(answer, int) or (isinstance(answer, str) and _INTEGER.fullmatch(answer.strip())):
            self.secret = int(answer)
        else:
            raise ValueError(f"number guess example {example!r}: the answer {answer!r} is not a whole number; "
                             f"fix: give one from {self.low} to {self.high}, or a seed")
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"number guess example {example!r}: the answer {self.secret} is outside "
                             f"[{self.low}, {self.high}]; fix: give an answer inside it, or a seed")
        self.turns = 0
        return (f"I am thinking of a whole number from {self.low} to {self.high}. You have {self.max_turns} "
                "guesses; after each I say higher or lower. Reply with your guess.")

    def step(self, action_text: str) -> tuple[str, float, bool]:
        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        numbers = _INTEGER.findall(action_text)
        if not numbers:
            return "No number found: reply with a whole number.", self.no_guess, out_of_turns
        guess = int(numbers[-1])  # the last number: "between 1 and 100 I guess 50" guesses 50
        if guess == self.secret:
            return f"Correct: the number is {self.secret}.", self.solved, True
        direction = "higher" if guess < self.secret else "lower"
        if out_of_turns:
            return f"{guess} is wrong, and that was the last guess: the number was {self.secret}.", 0.0, True
        return f"{guess} is wrong: the number is {direction}.", 0.0, False
