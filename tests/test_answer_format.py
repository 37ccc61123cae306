"""The answer format, stated once (grpo/answer_format.py): the tags that data and rewards use, and the system
prompts that name them."""

from __future__ import annotations

from grpo import data, rewards
from grpo.answer_format import QUICKSTART_SYSTEM_PROMPT, SYSTEM_PROMPT


def test_data_and_rewards_use_the_one_set_of_tags():
    assert data.REASONING_START == rewards.REASONING_START == "<start_working_out>"
    assert (data.REASONING_END, data.SOLUTION_START, data.SOLUTION_END) == (
        "<end_working_out>", "<SOLUTION>", "</SOLUTION>")


def test_system_prompt_names_every_tag():
    for tag in (data.REASONING_START, data.REASONING_END, data.SOLUTION_START, data.SOLUTION_END):
        assert tag in SYSTEM_PROMPT


def test_the_quickstart_prompt_is_the_recipes_then_the_format_shown_once():
    assert QUICKSTART_SYSTEM_PROMPT.startswith(SYSTEM_PROMPT + "\n")
    example = QUICKSTART_SYSTEM_PROMPT.removeprefix(SYSTEM_PROMPT + "\n")
    assert example.endswith("<start_working_out>a + b = c<end_working_out><SOLUTION>c</SOLUTION>")
