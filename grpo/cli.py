"""The command line as people already know it, the same for train.py, grpo.eval and grpo.export.

    parser = OneLineParser(prog="python -m grpo.eval", description="...")
    add_bool_flag(parser, "--load-in-fp8", help="...")

- No prefix matching (`allow_abbrev=False`): `--lr 1e-4` is not taken for `--lr-scheduler`.
- Every `--kebab-case` flag also answers to its snake_case spelling (`--learning_rate`, as TRL and the
  HF scripts write them), without a second line in --help.
- An unknown flag gets the nearest known one (TRL's names for ours where they differ, else the closest
  spelling), in the one-line error.
- A boolean flag takes `--flag`, `--no-flag` and `--flag true|false` (also yes/no, on/off, 1/0).
- Errors are one line with a pointer to --help, not the whole usage.
- `make_console()`: rich's Console, which wraps long lines only on a terminal.

What it deliberately is not: the flags themselves (train.py's come from `grpo.config.Config`, the others'
from their modules), or a parser of its own: it is argparse.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from rich.console import Console

# TRL's (and transformers' TrainingArguments') names for what our flags do, where the names differ.
TRL_NAMES = {
    "--per-device-train-batch-size": "--micro-batch-size (completions per forward/backward pass; a step trains on "
                                     "--prompts-per-step x --num-generations completions)",
    "--gradient-accumulation-steps": "--prompts-per-step (a step's completions; --micro-batch-size splits them)",
    "--lr": "--learning-rate",
    "--lr-scheduler-type": "--lr-scheduler",
    "--num-train-epochs": "--max-steps",
    "--model-name-or-path": "--model",
    "--lora-r": "--lora-rank",
    "--lora-target-modules": "--lora-targets",
    "--use-vllm": "--engine vllm",
    "--bf16": "--dtype bf16",
}
CONVENTIONS = ("Every flag also takes its snake_case spelling (--learning_rate);\n"
               "a true/false flag takes --flag, --no-flag or --flag true|false.")


class OneLineParser(argparse.ArgumentParser):
    """argparse without prefix matching, with snake_case spellings, a suggestion for an unknown flag, and
    errors in one line with a pointer to --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.epilog = f"{self.epilog}\n\n{CONVENTIONS}" if self.epilog else CONVENTIONS

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._kebab_case(args), namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self._unknown(unknown))
        return parsed

    def _kebab_case(self, args: list[str]) -> list[str]:
        """`--learning_rate` -> `--learning-rate` (and `--x_y=v`) wherever the kebab-case flag exists."""
        spelled = []
        for i, arg in enumerate(args):
            if arg == "--":  # what follows is not a flag
                return spelled + args[i:]
            name, eq, value = arg.partition("=")
            kebab = name.replace("_", "-")
            if name.startswith("--") and kebab != name and kebab in self._option_string_actions:
                arg = kebab + eq + value
            spelled.append(arg)
        return spelled

    def _unknown(self, unknown: list[str]) -> str:
        flags = [arg.partition("=")[0] for arg in unknown if arg.startswith("-")]
        if not flags:
            return f"unrecognized arguments: {' '.join(unknown)}"
        name = flags[0]
        kebab = "--" + name.lstrip("-").replace("_", "-")
        known = [option for option in self._option_string_actions if option.startswith("--")]
        if kebab in TRL_NAMES and TRL_NAMES[kebab].split()[0] in known:
            return f"unrecognized flag {name}: here it is {TRL_NAMES[kebab]}"
        nearest = nearest_flags(kebab, known)
        if nearest:
            either = nearest[0] if len(nearest) == 1 else f"{', '.join(nearest[:-1])} or {nearest[-1]}"
            return f"unrecognized flag {name}: did you mean {either}?"
        return f"unrecognized arguments: {' '.join(unknown)}"


def nearest_flags(flag: str, known: list[str], most: int = 3) -> list[str]:
    """The known flags `flag` most likely meant: those it begins (`--learn` -> `--learning-rate`; the shortest
    first, at most `most`), else the closest spelling (`--max-step` -> `--max-steps`), else none."""
    started = sorted((k for k in known if k.startswith(flag) and len(flag) > 3), key=len)  # not a bare "--x"
    if started:
        return started[:most]
    return difflib.get_close_matches(flag, known, n=1, cutoff=0.6)


def make_console(**kwargs) -> Console:
    """A rich Console that wraps only on a terminal: printed to a file or a pipe, a long line (a path, a
    command to copy) stays one line instead of breaking at rich's 80 columns."""
    out = Console(**kwargs)
    out.soft_wrap = not out.is_terminal
    return out


def parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_bool_flag(container, option: str, *, help: str, default=False, dest: str | None = None) -> None:
    """`--flag` (true), `--flag true|false` and `--no-flag` (false, not listed in --help) on `container`, a
    parser or an argument group."""
    dest = dest or option[2:].replace("-", "_")
    container.add_argument(option, nargs="?", const=True, type=parse_bool, default=default, dest=dest,
                           metavar="{true,false}", help=help)
    container.add_argument(f"--no-{option[2:]}", action="store_const", const=False, dest=dest,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def print_to_a_pipe(text: str) -> None:
    """print(text), quietly cut short when the reader has gone (`train.py --list-presets | head`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush cannot fail
