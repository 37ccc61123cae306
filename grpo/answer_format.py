"""The answer format the recipe trains for, stated once: its four tags and the system prompts that
describe it. A completion reads `<start_working_out>...<end_working_out><SOLUTION>...</SOLUTION>`; the
generation prompt ends with the first tag (`grpo.data.chat_prompt`), the rewards check the rest
(`grpo.rewards`), and presets stop at the last (`grpo.config`).

Also the system prompts of the agent presets (`grpo.config.PRESETS`): the format with the calculator tool, and
the number-guessing game's, which has no answer format.

What it deliberately is not: parsing or scoring (`grpo.rewards`) or prompting (`grpo.data`).
"""

REASONING_START = "<start_working_out>"
REASONING_END = "<end_working_out>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"

# The recipe's system prompt: the format in words.
SYSTEM_PROMPT = (
    "You are given a problem. Think about it and show your working out.\n"
    f"Place your working out between {REASONING_START} and {REASONING_END}.\n"
    f"Then give your final answer between {SOLUTION_START} and {SOLUTION_END}."
)

# The recipe's system prompt and the format shown once, with letters for numbers (the quickstart preset's).
# With it, the untrained SmolLM2-135M answers in the exact format in about a fifth of its samples, with its own
# numbers (without it: none of 128; with a numeric example it copies the example).
QUICKSTART_SYSTEM_PROMPT = (
    f"{SYSTEM_PROMPT}\n"
    f'For example, to "What is a plus b?" answer '
    f"{REASONING_START}a + b = c{REASONING_END}{SOLUTION_START}c{SOLUTION_END}"
)

# The calculator preset's instructions (qwen1.5b-gsm8k-calculator), said after the question in the user's turn
# (--system-prompt-turn user): the tool's definition comes from the chat template, under its own system prompt,
# where Qwen2.5-Coder calls it; asked for the working-out format, it works the arithmetic out in words instead
# (docs/learning.md, "Agents"). Only the answer's tags are asked for.
CALCULATOR_SYSTEM_PROMPT = (
    f"Use the calculator tool for the arithmetic. Then give your final answer between {SOLUTION_START} and "
    f"{SOLUTION_END}."
)

# The number-guessing game's system prompt (the qwen1.5b-number-guess preset): no answer format, one guess a turn;
# the environment's first message says the rules.
NUMBER_GUESS_SYSTEM_PROMPT = (
    "You are playing a number guessing game. Reply to each message with your next guess: one whole number and "
    "nothing else. Use what each answer tells you."
)
