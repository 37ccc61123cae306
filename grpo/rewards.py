"""The four-tier reward of the two reference recipes, the answer parser under it, and the reward API.

A reward function is `f(completions: list[str], answers: list[str], **columns) -> list[float]`: one
float per completion (None or NaN where it does not apply); in training `columns` hold the dataset's
extra fields and `completion_ids`, each completion's token ids (TRL's name). `score` calls a list of them
and keeps one column per function, so each is logged on its own. `PRESETS` holds the two reference recipes:

| tier | what it checks | dapo (recipe A) | gsm8k (recipe B) |
|---|---|---|---|
| format_exact | the whole response has the exact format | +3 | +3 |
| format_tags | each tag appears exactly once: +0.5, else -1 | 3 tags (max +1.5) | 4 tags (max +2) |
| answer | the `<SOLUTION>` block against the reference answer | +5 / +3.5 / +2 / +1.5 / -2.5 / -4.5 / -2 | +3 / +1.5 / +1 / +0.5 / -1.5 / -1.5 / 0 |
| number | the final number after `<SOLUTION>`, leniently | +3.5 / -1.5 / -2.5 | +1.5 / -0.5 / 0 |

The answer tiers, in order: exact (the block holds exactly the answer; a bare number in any notation
counts: "3.50" for "3.5", "1,234" for "1234"), right but padded (whitespace, words or units around the
right final number), within 10%, within 20%, wrong, unparsable (no number to compare), no `<SOLUTION>`
block. Maxima: 13 (dapo), 9.5 (gsm8k, of which 5 is format).

The completion is the generated text only; the prompt already ended with `<start_working_out>`, so
the checks read the *response* `<start_working_out>` + completion. A completion that repeats the
opening tag at its very start (some templates and engines echo it) is accepted as if it had not:
the echo is dropped, never counted twice.

Faults of the reference verifiers that are fixed here, not copied: the exact-format regex used
`re.MULTILINE` with `$`, so text after `</SOLUTION>` on a later line passed; the number regex dropped a
leading minus and took the first number after `<SOLUTION>` instead of the final one; "1,234" and
"3.50" did not compare to 1234 and 3.5; a zero reference answer raised in the ratio. The answer tier
reads the `<SOLUTION>` block whether or not the rest of the format is exact (format has its own two
rewards), so accuracy and format compliance stay separate (`is_correct`, `has_exact_format`). Eval also
reports a lenient accuracy (`is_correct_lenient`): the final answer wherever the model wrote it (the
`<SOLUTION>` block, else the last `\\boxed{}`, else the last number), so that a model that knows the math
but not yet the tags does not read as zero. It is measured, never rewarded.

Deliberately not here: symbolic equivalence of expressions (sqrt, pi, intervals). Add it as an extra
function, e.g. with math-verify, through `--reward module:function`.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Callable, Sequence

import torch

from grpo.answer_format import REASONING_END, REASONING_START, SOLUTION_END, SOLUTION_START
from grpo.user_code import import_user_module, split_spec

RewardFn = Callable[..., list]

# --- parsing ---------------------------------------------------------------------------------

# A plain number: thousands groups ("1,234,567") or digits, optional decimals; or ".5". An exponent of
# at most 3 digits (a model writing 1e999999999 must not make us build that integer).
_NUM = r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3}(?![0-9]))?"
# A minus counts as a sign unless it follows a word character or a closing bracket ("10-3" is 3).
_SIGN = r"(?<![\w)\]}])[-\u2212]"
_TOKEN = re.compile(
    rf"(?P<sign>{_SIGN})?(?:\\?\$\s*)?"  # a currency sign may stand between the minus and the number: -$5
    rf"(?:\\[dt]?frac\{{\s*(?P<fnum>{_NUM})\s*\}}\{{\s*(?P<fden>{_NUM})\s*\}}"  # \frac{3}{4}
    rf"|(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?)"  # 42, -1,234.5, 3/4
)
# The same, as the whole string (no surrounding text or whitespace): an answer that *is* a number.
_BARE = re.compile(
    rf"[-\u2212]?(?:\\[dt]?frac\{{\s*{_NUM}\s*\}}\{{\s*{_NUM}\s*\}}|(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?)"
)


def _to_fraction(num: str, den: str | None) -> Fraction | None:
    try:
        value = Fraction(num.replace(",", ""))
        divisor = Fraction(den.replace(",", "")) if den is not None else Fraction(1)
    except ValueError:  # e.g. more digits than Python converts (sys.get_int_max_str_digits)
        return None
    return None if divisor == 0 else value / divisor


def _final_number(text: str) -> Fraction | None:
    """The last number in `text`, exactly (as a Fraction), or None."""
    value = None
    for m in _TOKEN.finditer(text):
        num, den = (m["fnum"], m["fden"]) if m["fnum"] is not None else (m["num"], m["den"])
        found = _to_fraction(num, den)
        if found is not None:
            value = -found if m["sign"] else found
    return value


def _bare_number(text: str) -> Fraction | None:
    """The value of `text` if the whole of it is one number ("-1,234.50", "3/4"), else None."""
    return _final_number(text) if _BARE.fullmatch(text) else None


def parse_number(text: str) -> float | None:
    """The final number in `text` as a float: keeps a leading minus, reads "1,234", "3.5", "3/4" and
    "\\frac{3}{4}"; None when there is none. Overflowing values come back as +-inf."""
    value = _final_number(text)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def extract_solution(text: str) -> str | None:
    """The text inside the last complete `<SOLUTION>...</SOLUTION>` block, unstripped; None when there
    is no such block or it is blank."""
    end = text.rfind(SOLUTION_END)
    if end < 0:
        return None
    start = text.rfind(SOLUTION_START, 0, end)
    if start < 0:
        return None
    inner = text[start + len(SOLUTION_START):end]
    return inner if inner.strip() else None


def _number_after_solution(text: str) -> Fraction | None:
    """Lenient: the final number after the last `<SOLUTION>`, up to `</SOLUTION>` if it is closed."""
    start = text.rfind(SOLUTION_START)
    if start < 0:
        return None
    rest = text[start + len(SOLUTION_START):]
    end = rest.find(SOLUTION_END)
    return _final_number(rest if end < 0 else rest[:end])


def _response(completion: str) -> str:
    """What the model said after the prompt's `<start_working_out>`, with that tag put back in front.
    An echoed opening tag at the very start is dropped first so that it is not counted twice."""
    body = completion.lstrip()
    if body.startswith(REASONING_START):
        body = body[len(REASONING_START):]
    return REASONING_START + body


# Anything between the tags is allowed; after `</SOLUTION>` only whitespace and end-of-turn tokens
# that a decoder may leave in the text (<|eot_id|>, <|im_end|>, </s>, ...).
_EXACT = re.compile(
    re.escape(REASONING_START) + r".*?" + re.escape(REASONING_END) + r".*?"
    + re.escape(SOLUTION_START) + r"(?P<solution>.*?)" + re.escape(SOLUTION_END)
    + r"(?:\s|<\|[^<>|\s]{1,40}\|>|</s>)*",
    flags=re.DOTALL,
)
_TAGS = (REASONING_START, REASONING_END, SOLUTION_START, SOLUTION_END)


def has_exact_format(completion: str) -> bool:
    """True when the response is `<start_working_out>...<end_working_out>...<SOLUTION>x</SOLUTION>`
    with each tag exactly once, a non-blank solution and nothing but whitespace or end-of-turn tokens
    after it. `completion` is the generated text after the prompt's `<start_working_out>`."""
    response = _response(completion)
    if any(response.count(tag) != 1 for tag in _TAGS):
        return False  # checked first: with each tag once, the regex below cannot backtrack badly
    m = _EXACT.fullmatch(response)
    return m is not None and m["solution"].strip() != ""


def grade(completion: str, answer: str) -> str:
    """The answer tier of one completion: "exact", "padded" (right number with whitespace or words
    around it), "within_10", "within_20", "wrong", "unparsable" or "no_match" (no `<SOLUTION>` block)."""
    guess = extract_solution(completion)
    if guess is None:
        return "no_match"
    target = _bare_number(answer.strip())
    if guess == answer or (target is not None and _bare_number(guess) == target):
        return "exact"
    if guess.strip() == answer.strip():
        return "padded"
    value = _final_number(guess)
    if target is None or value is None:
        return "unparsable"
    if value == target:
        return "padded"
    error = abs(value - target)  # relative error; the reference's ratio, without dividing by zero
    if error <= abs(target) / 10:
        return "within_10"
    if error <= abs(target) / 5:
        return "within_20"
    return "wrong"


def is_correct(completion: str, answer: str) -> bool:
    """Answer accuracy for eval: the `<SOLUTION>` block holds the reference answer (exactly, or as its
    final number), whatever the rest of the format."""
    return grade(completion, answer) in ("exact", "padded")


_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in `text` (nested braces allowed: `\\boxed{\\frac{1}{2}}`),
    or None when there is none or the last one is never closed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    for end in range(start + len(_BOXED), len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED):end]
    return None


def is_correct_lenient(completion: str, answer: str) -> bool:
    """Lenient accuracy for eval: the model's final answer, wherever it wrote it, is the reference answer.

    The final answer is the `<SOLUTION>` block when there is a complete one (judged as `is_correct`, so
    lenient is never below strict), else the last `\\boxed{...}`, else the last number in the completion,
    read by the reward's parser (a leading minus, thousands separators, `$`, a trailing full stop).
    """
    if extract_solution(completion) is not None:
        return is_correct(completion, answer)
    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip() == answer.strip():
        return True  # a non-numeric answer written exactly as the reference
    target = _bare_number(answer.strip())
    return target is not None and _final_number(completion if boxed is None else boxed) == target


# --- the reward functions ----------------------------------------------------------------------

# Points per answer tier: recipe A (dapo) and recipe B (gsm8k).
_ANSWER_POINTS = {
    "dapo": dict(exact=5.0, padded=3.5, within_10=2.0, within_20=1.5, wrong=-2.5, unparsable=-4.5,
                 no_match=-2.0),
    "gsm8k": dict(exact=3.0, padded=1.5, within_10=1.0, within_20=0.5, wrong=-1.5, unparsable=-1.5,
                  no_match=0.0),
}
# Number fallback: (equal, different, no number after <SOLUTION>); 0 when the answer is not a number.
_NUMBER_POINTS = {"dapo": (3.5, -1.5, -2.5), "gsm8k": (1.5, -0.5, 0.0)}


def format_exact(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """+3 when the response has the exact format (both recipes)."""
    return [3.0 if has_exact_format(c) else 0.0 for c in completions]


def _tag_points(completion: str, tags: Sequence[str]) -> float:
    response = _response(completion)
    return sum(0.5 if response.count(tag) == 1 else -1.0 for tag in tags)


def format_tags_dapo(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """+0.5 per tag seen exactly once, else -1; the prompt's `<start_working_out>` is not scored."""
    return [_tag_points(c, _TAGS[1:]) for c in completions]


def format_tags_gsm8k(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """+0.5 per tag seen exactly once, else -1, for all four tags (the prompt's opening tag counts)."""
    return [_tag_points(c, _TAGS) for c in completions]


def answer_dapo(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """+5 exact, +3.5 padded, +2 within 10%, +1.5 within 20%, -2.5 wrong, -4.5 unparsable, -2 none."""
    return [_ANSWER_POINTS["dapo"][grade(c, a)] for c, a in zip(completions, answers, strict=True)]


def answer_gsm8k(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """+3 exact, +1.5 padded, +1 within 10%, +0.5 within 20%, -1.5 wrong or unparsable, 0 none."""
    return [_ANSWER_POINTS["gsm8k"][grade(c, a)] for c, a in zip(completions, answers, strict=True)]


def _number_points(completion: str, answer: str, points: tuple[float, float, float]) -> float:
    equal, different, missing = points
    target = _bare_number(answer.strip())
    if target is None:
        return 0.0  # nothing to compare against
    value = _number_after_solution(completion)
    if value is None:
        return missing
    return equal if value == target else different


def number_dapo(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """Final number after `<SOLUTION>`: +3.5 equal, -1.5 different, -2.5 none."""
    return [_number_points(c, a, _NUMBER_POINTS["dapo"]) for c, a in zip(completions, answers, strict=True)]


def number_gsm8k(completions: list[str], answers: list[str], **columns: Any) -> list[float]:
    """Final number after `<SOLUTION>`: +1.5 equal, -0.5 different, 0 none."""
    return [_number_points(c, a, _NUMBER_POINTS["gsm8k"]) for c, a in zip(completions, answers, strict=True)]


def soft_overlong_penalty(length: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13) of a completion of `length`
    tokens: 0 up to max_length - cache, then (max_length - cache - length) / cache, falling linearly to -1 at
    max_length, and -1 beyond."""
    start = max_length - cache
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / cache
    return -1.0


def overlong_penalty(max_length: int, cache: int) -> RewardFn:
    """--overlong-penalty as a reward function named `overlong` (logged as rewards/overlong): the soft overlong
    punishment of each completion's length in tokens, read from the `completion_ids` column the scorer passes
    (TRL's name for it)."""
    if not 1 <= cache <= max_length:
        raise ValueError(f"--overlong-penalty {max_length},{cache}: CACHE must be between 1 and LEN "
                         f"({max_length}); fix: lower CACHE or raise LEN")

    def overlong(completions: list[str], answers: list[str], *, completion_ids: Sequence[Sequence[int]],
                 **columns: Any) -> list[float]:
        return [soft_overlong_penalty(len(ids), max_length, cache) for ids in completion_ids]

    return overlong


PRESETS: dict[str, list[RewardFn]] = {
    "dapo": [format_exact, format_tags_dapo, answer_dapo, number_dapo],
    "gsm8k": [format_exact, format_tags_gsm8k, answer_gsm8k, number_gsm8k],
    # No answer format to pay for: the run's rewards are its --reward functions and its environment's.
    "none": [],
}


def reward_functions(preset: str, extra: Sequence[str] = ()) -> list[RewardFn]:
    """The preset's functions followed by each `module:function` in `extra`."""
    if preset not in PRESETS:
        raise ValueError(f"--reward-preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}")
    return [*PRESETS[preset], *(load_reward(spec) for spec in extra)]


def load_reward(spec: str) -> RewardFn:
    """`package.module:function` or `path/to/file.py:function` -> the function. A module is looked for where
    Python looks, then in the current folder (as `python -m` finds it, but after what is installed)."""
    form = "module:function (or path/to/file.py:function)"
    module_name, attr = split_spec(spec, "--reward", form, "my_rewards.py:short")
    module = import_user_module(spec, "--reward", module_name, form)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"--reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _as_float(value: Any) -> float | None:
    """A reward value as a float (None -> NaN: "does not apply"); None when it is not a number."""
    if value is None:
        return math.nan
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)  # int, float, bool, numpy scalars, one-element tensors
    except (TypeError, ValueError, RuntimeError):
        return None


class RewardError(RuntimeError):
    """A reward function failed or returned something other than one float per completion."""


def score(completions: Sequence[str], answers: Sequence[str], funcs: Sequence[RewardFn],
          columns: dict[str, Sequence[Any]] | None = None) -> tuple[torch.Tensor, list[str]]:
    """Call every reward function on the batch -> (rewards (N, R) float32, names (R,)).

    `columns` are extra per-completion fields (length N each), passed as keyword arguments. A function
    that raises is called again on one completion at a time to find the one that breaks it; the
    RewardError names the function and shows that completion.
    """
    completions, answers = list(completions), list(answers)
    n = len(completions)
    if len(answers) != n:
        raise ValueError(f"score: {n} completions but {len(answers)} answers; give one answer per completion")
    columns = {k: list(v) for k, v in (columns or {}).items()}
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"score: column {key!r} has {len(values)} values for {n} completions; "
                             "repeat each prompt's value once per completion")
    names: list[str] = []
    rewards = torch.empty(n, len(funcs), dtype=torch.float32)  # (N, R)
    for j, fn in enumerate(funcs):
        name = _name(fn)
        names.append(name if name not in names else f"{name}_{j}")  # log keys must be unique
        try:
            values = fn(completions, answers, **columns)
        except Exception as err:
            raise _locate_failure(fn, completions, answers, columns, err) from err
        values = list(values) if values is not None else []
        if len(values) != n:
            raise RewardError(f"reward function {name} returned {len(values)} values for {n} completions; "
                               "it must return one float per completion")
        for i, value in enumerate(values):
            as_float = _as_float(value)
            if as_float is None:
                raise RewardError(f"reward function {name} returned {value!r} (a {type(value).__name__}) for "
                                   f"completion {i}; it must return floats (or None where it does not apply)")
            if math.isinf(as_float):
                raise RewardError(f"reward function {name} returned {as_float} for completion {i}; rewards must be "
                                  "finite (None where a function does not apply)")
            rewards[i, j] = as_float
    _refuse_a_batch_no_reward_applies_to(rewards, names)
    return rewards, names


def _refuse_a_batch_no_reward_applies_to(rewards: torch.Tensor, names: list[str]) -> None:
    """Every group would tie and teach nothing. (One function that applies to no completion of a step is
    the step line's to say: `grpo.groups.Scores.applies_to_none`.)"""
    n = rewards.shape[0]
    if n and bool(rewards.isnan().all()):
        raise RewardError(f"no reward applies to any of the {n} completions: {', '.join(names)} returned None or NaN "
                          "for every one; fix: return a float where a reward applies (None or NaN means it does not)")


def _locate_failure(fn: RewardFn, completions: list[str], answers: list[str],
                    columns: dict[str, list[Any]], err: Exception) -> RewardError:
    name = _name(fn)
    for i, (completion, answer) in enumerate(zip(completions, answers)):
        try:
            fn([completion], [answer], **{k: [v[i]] for k, v in columns.items()})
        except Exception as single_err:
            shown = repr(completion)
            shown = shown if len(shown) <= 300 else shown[:200] + " ... " + shown[-80:]
            return RewardError(f"reward function {name} raised {type(single_err).__name__}: {single_err} "
                                f"on completion {i} {shown} (answer {answer!r})")
    return RewardError(f"reward function {name} raised {type(err).__name__}: {err} on the batch of "
                        f"{len(completions)} completions (no single completion reproduces it)")
