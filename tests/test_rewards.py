"""The four-tier reward of both presets on tricky completions, the parsers, score() and load_reward."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from grpo import rewards
from grpo.rewards import (
    PRESETS, extract_solution, grade, has_exact_format, is_correct, is_correct_lenient, last_boxed, load_reward,
    parse_number, reward_functions, score,
)

W = "I work it out step by step.<end_working_out>"  # reasoning after the prompt's <start_working_out>

# (id, completion, answer, dapo [format_exact, tags, answer, number], gsm8k [format_exact, tags, answer, number])
CASES = [
    ("perfect", W + "<SOLUTION>4</SOLUTION>", "4", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("negative_answer", W + "<SOLUTION>-7</SOLUTION>", "-7", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("unicode_minus", W + "<SOLUTION>\u22127</SOLUTION>", "-7", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("negative_sign_matters", W + "<SOLUTION>7</SOLUTION>", "-7", [3, 1.5, -2.5, -1.5], [3, 2, -1.5, -0.5]),
    ("thousands_separator", W + "<SOLUTION>1,234</SOLUTION>", "1234", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("decimal_trailing_zero", W + "<SOLUTION>3.50</SOLUTION>", "3.5", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("fraction_for_decimal", W + "<SOLUTION>3/4</SOLUTION>", "0.75", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("latex_fraction_answer", W + "<SOLUTION>0.75</SOLUTION>", "\\frac{3}{4}", [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("padded_whitespace", W + "<SOLUTION> 42 </SOLUTION>", "42", [3, 1.5, 3.5, 3.5], [3, 2, 1.5, 1.5]),
    ("final_number_of_several", W + "<SOLUTION>3 + 4 = 7</SOLUTION>", "7", [3, 1.5, 3.5, 3.5], [3, 2, 1.5, 1.5]),
    ("earlier_number_is_not_the_answer", W + "<SOLUTION>7, no: 9</SOLUTION>", "7",
     [3, 1.5, -2.5, -1.5], [3, 2, -1.5, -0.5]),
    ("negative_with_words", W + "<SOLUTION>x = -5 meters</SOLUTION>", "-5", [3, 1.5, 3.5, 3.5], [3, 2, 1.5, 1.5]),
    ("currency_and_thousands", W + "<SOLUTION>$1,234.50</SOLUTION>", "1234.5", [3, 1.5, 3.5, 3.5], [3, 2, 1.5, 1.5]),
    ("within_10_percent", W + "<SOLUTION>110</SOLUTION>", "100", [3, 1.5, 2, -1.5], [3, 2, 1, -0.5]),
    ("within_20_percent", W + "<SOLUTION>85</SOLUTION>", "100", [3, 1.5, 1.5, -1.5], [3, 2, 0.5, -0.5]),
    ("negative_within_10_percent", W + "<SOLUTION>-95</SOLUTION>", "-100", [3, 1.5, 2, -1.5], [3, 2, 1, -0.5]),
    ("opposite_sign_is_wrong", W + "<SOLUTION>95</SOLUTION>", "-100", [3, 1.5, -2.5, -1.5], [3, 2, -1.5, -0.5]),
    ("zero_answer_wrong_guess", W + "<SOLUTION>1</SOLUTION>", "0", [3, 1.5, -2.5, -1.5], [3, 2, -1.5, -0.5]),
    ("unparsable_guess", W + "<SOLUTION>forty-two</SOLUTION>", "42", [3, 1.5, -4.5, -2.5], [3, 2, -1.5, 0]),
    ("symbolic_answer_equal", W + "<SOLUTION>\\sqrt{2}</SOLUTION>", "\\sqrt{2}", [3, 1.5, 5, 0], [3, 2, 3, 0]),
    ("symbolic_answer_different", W + "<SOLUTION>\\sqrt{3}</SOLUTION>", "\\sqrt{2}",
     [3, 1.5, -4.5, 0], [3, 2, -1.5, 0]),
    ("no_tags_at_all", "The answer is 42.", "42", [0, -3, -2, -2.5], [0, -2.5, 0, 0]),
    ("empty_completion", "", "42", [0, -3, -2, -2.5], [0, -2.5, 0, 0]),
    ("unclosed_solution", W + "<SOLUTION>42", "42", [0, 0, -2, 3.5], [0, 0.5, 0, 1.5]),
    ("blank_solution", W + "<SOLUTION>  </SOLUTION>", "42", [0, 1.5, -2, -2.5], [0, 2, 0, 0]),
    ("missing_end_working_out", "I think.<SOLUTION>42</SOLUTION>", "42", [0, 0, 5, 3.5], [0, 0.5, 3, 1.5]),
    ("repeated_solution_last_wins", W + "<SOLUTION>41</SOLUTION> wait <SOLUTION>42</SOLUTION>", "42",
     [0, -1.5, 5, 3.5], [0, -1, 3, 1.5]),
    ("echoed_opening_tag", "<start_working_out>" + W + "<SOLUTION>4</SOLUTION>", "4",
     [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("opening_tag_again_midway", "hm <start_working_out>" + W + "<SOLUTION>4</SOLUTION>", "4",
     [0, 1.5, 5, 3.5], [0, 0.5, 3, 1.5]),
    ("text_after_solution_on_next_line", W + "<SOLUTION>4</SOLUTION>\nAlso 5", "4",
     [0, 1.5, 5, 3.5], [0, 2, 3, 1.5]),
    ("end_of_turn_token_after_solution", W + "<SOLUTION>4</SOLUTION>\n<|eot_id|>", "4",
     [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("words_between_reasoning_and_solution", W + "\nSo:\n<SOLUTION>4</SOLUTION>", "4",
     [3, 1.5, 5, 3.5], [3, 2, 3, 1.5]),
    ("solution_before_reasoning_end", "x<SOLUTION>4</SOLUTION><end_working_out>", "4",
     [0, 1.5, 5, 3.5], [0, 2, 3, 1.5]),
]


@pytest.mark.parametrize("preset", ["dapo", "gsm8k"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_reward_function_scores_tricky_completions_as_tabled(case, preset):
    _, completion, answer, dapo, gsm8k = case
    expected = dapo if preset == "dapo" else gsm8k
    got = [fn([completion], [answer])[0] for fn in PRESETS[preset]]
    assert got == pytest.approx(expected), dict(zip([f.__name__ for f in PRESETS[preset]], got))


def test_presets_reach_the_reference_maxima_and_format_share():
    perfect = CASES[0][1]
    dapo = [fn([perfect], ["4"])[0] for fn in PRESETS["dapo"]]
    gsm8k = [fn([perfect], ["4"])[0] for fn in PRESETS["gsm8k"]]
    assert sum(dapo) == 13.0
    assert sum(gsm8k) == 9.5 and gsm8k[0] + gsm8k[1] == 5.0


def test_reward_functions_have_distinct_names_within_a_preset():
    for name, funcs in PRESETS.items():
        names = [f.__name__ for f in funcs]
        assert len(set(names)) == len(names) == (0 if name == "none" else 4)


@pytest.mark.parametrize("text, expected", [
    ("42", 42.0), ("-42", -42.0), ("\u221242", -42.0), ("x = -5", -5.0), ("(-7)", -7.0),
    ("10-3", 3.0), ("1,234", 1234.0), ("1,234,567.5", 1234567.5), ("$1,234.50", 1234.5), ("3.50", 3.5),
    (".5", 0.5), ("3/4", 0.75), ("-3/4", -0.75), ("\\frac{3}{4}", 0.75), ("-\\dfrac{1}{8}", -0.125),
    ("The answer is 5.", 5.0), ("first 3 then 8", 8.0), ("2.5e3", 2500.0), ("50%", 50.0), ("1,2", 2.0),
    ("abc", None), ("", None), ("1/0", None), ("1e400", math.inf), ("-" + "9" * 400, -math.inf),
    ("-$5", -5.0), ("-\\$1,200.", -1200.0), ("$-5", -5.0), ("costs $18.", 18.0), ("10-$3", 3.0),
])
def test_parse_number_reads_the_final_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("a<SOLUTION>4</SOLUTION>", "4"),
    ("<SOLUTION> 4 </SOLUTION>", " 4 "),
    ("<SOLUTION>1</SOLUTION><SOLUTION>2</SOLUTION>", "2"),
    ("<SOLUTION>1</SOLUTION><SOLUTION>2", "1"),  # the last *complete* block
    ("<SOLUTION>42", None), ("42</SOLUTION>", None), ("<SOLUTION> \n</SOLUTION>", None), ("", None),
])
def test_extract_solution_takes_the_last_complete_block(text, expected):
    assert extract_solution(text) == expected


@pytest.mark.parametrize("completion, answer, tier", [
    ("<SOLUTION>4</SOLUTION>", "4", "exact"), ("<SOLUTION>4.0</SOLUTION>", "4", "exact"),
    ("<SOLUTION>4 </SOLUTION>", "4", "padded"), ("<SOLUTION>x=4</SOLUTION>", "4", "padded"),
    ("<SOLUTION>4.3</SOLUTION>", "4", "within_10"), ("<SOLUTION>4.8</SOLUTION>", "4", "within_20"),
    ("<SOLUTION>4.81</SOLUTION>", "4", "wrong"), ("<SOLUTION>four</SOLUTION>", "4", "unparsable"),
    ("<SOLUTION>4</SOLUTION>", "four", "unparsable"), ("4", "4", "no_match"),
])
def test_grade_orders_the_answer_tiers(completion, answer, tier):
    assert grade(completion, answer) == tier


def test_is_correct_and_has_exact_format_are_independent():
    right_sloppy = "<SOLUTION>12</SOLUTION> trailing words"
    wrong_tidy = W + "<SOLUTION>13</SOLUTION>"
    assert is_correct(right_sloppy, "12") and not has_exact_format(right_sloppy)
    assert not is_correct(wrong_tidy, "12") and has_exact_format(wrong_tidy)
    assert is_correct(W + "<SOLUTION>The answer is 12.</SOLUTION>", "12")


def test_exact_format_check_is_fast_on_adversarial_text():
    import time

    text = ("<end_working_out><SOLUTION>" * 2000) + "x" * 5000
    start = time.perf_counter()
    assert not has_exact_format(text)
    for fn in PRESETS["dapo"]:
        fn([text], ["1"])
    assert time.perf_counter() - start < 1.0


# --- score ---------------------------------------------------------------------------------------

def test_score_returns_one_float32_column_per_function_matching_direct_calls():
    completions = [c[1] for c in CASES]
    answers = [c[2] for c in CASES]
    rewards_, names = score(completions, answers, PRESETS["gsm8k"])
    assert rewards_.dtype == torch.float32 and rewards_.shape == (len(CASES), 4)
    assert names == ["format_exact", "format_tags_gsm8k", "answer_gsm8k", "number_gsm8k"]
    expected = torch.tensor([c[4] for c in CASES], dtype=torch.float32)
    torch.testing.assert_close(rewards_, expected, rtol=0, atol=0)


def test_score_passes_columns_and_maps_none_to_nan():
    def level_bonus(completions, answers, level):
        return [None if lv is None else float(lv) for lv in level]

    rewards_, names = score(["a", "b", "c"], ["1", "2", "3"], [level_bonus], columns={"level": [1, None, 3]})
    assert names == ["level_bonus"]
    assert rewards_[0, 0] == 1.0 and math.isnan(rewards_[1, 0]) and rewards_[2, 0] == 3.0


def test_score_gives_duplicate_names_unique_log_keys():
    def same(completions, answers, **columns):
        return [0.0] * len(completions)

    _, names = score(["a"], ["1"], [same, same])
    assert names == ["same", "same_1"]


def test_score_names_the_function_and_the_completion_that_raised():
    def fragile(completions, answers, **columns):
        return [float(len(c)) if "boom" not in c else 1 / 0 for c in completions]

    long_bad = "boom" + "z" * 1000
    with pytest.raises(RuntimeError) as info:
        score(["fine", "also fine", long_bad], ["1", "2", "3"], [fragile])
    message = str(info.value)
    assert "fragile" in message and "ZeroDivisionError" in message and "completion 2" in message
    assert "'boomzzz" in message and len(message) < 600  # the completion is shown, truncated
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_score_reports_a_batch_only_failure_without_blaming_a_completion():
    def batch_only(completions, answers, **columns):
        if len(completions) > 1:
            raise ValueError("needs one at a time")
        return [0.0]

    with pytest.raises(RuntimeError, match="batch_only raised ValueError: needs one at a time on the batch"):
        score(["a", "b"], ["1", "2"], [batch_only])


@pytest.mark.parametrize("returned, match", [
    ([1.0], "returned 1 values for 2 completions"),
    (None, "returned 0 values for 2 completions"),
    ([1.0, "2"], r"returned '2' \(a str\) for completion 1"),
])
def test_score_rejects_malformed_return_values(returned, match):
    def bad(completions, answers, **columns):
        return returned

    with pytest.raises(RuntimeError, match=match):
        score(["a", "b"], ["1", "2"], [bad])


def test_score_accepts_ints_bools_tensor_scalars_and_none_as_nan():
    def mixed(completions, answers, **columns):
        return [1, True, torch.tensor(2.5), None]

    rewards_, _ = score(list("abcd"), list("1234"), [mixed])
    assert rewards_[:3, 0].tolist() == [1.0, 1.0, 2.5] and math.isnan(rewards_[3, 0])


def test_score_rejects_mismatched_answers_and_columns():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        score(["a", "b"], ["1"], PRESETS["dapo"])
    with pytest.raises(ValueError, match="column 'level' has 1 values for 2 completions"):
        score(["a", "b"], ["1", "2"], PRESETS["dapo"], columns={"level": [1]})


# --- load_reward ----------------------------------------------------------------------------------

def test_load_reward_from_module_and_from_file(tmp_path, monkeypatch):
    source = "def brevity(completions, answers, **columns):\n    return [-len(c) / 100 for c in completions]\n"
    (tmp_path / "my_reward_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_reward_mod", raising=False)
    from_module = load_reward("my_reward_mod:brevity")
    from_file = load_reward(f"{tmp_path / 'my_reward_mod.py'}:brevity")
    assert from_module(["ab"], ["1"]) == from_file(["ab"], ["1"]) == [-0.02]
    funcs = reward_functions("dapo", [f"{tmp_path / 'my_reward_mod.py'}:brevity"])
    assert [f.__name__ for f in funcs][-1] == "brevity" and len(funcs) == 5


@pytest.mark.parametrize("spec, match", [
    ("no_colon_here", "expected module:function"),
    ("grpo_no_such_module_xyz:f", "cannot import 'grpo_no_such_module_xyz' .*ModuleNotFoundError"),
    ("/no/such/file.py:f", "cannot import '/no/such/file.py' .*FileNotFoundError"),
    ("grpo.rewards:no_such_function", "has no attribute 'no_such_function'"),
    ("grpo.rewards:REASONING_START", "is a str, not a function"),
])
def test_load_reward_errors_name_the_spec_and_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        load_reward(spec)


def test_load_reward_reports_an_import_time_error_in_user_code(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('oops at import')\n")
    with pytest.raises(ValueError, match="RuntimeError: oops at import"):
        load_reward(f"{tmp_path / 'broken.py'}:f")


def test_reward_functions_rejects_an_unknown_preset():
    with pytest.raises(ValueError, match="--reward-preset 'nope' is unknown; choose one of dapo, gsm8k"):
        reward_functions("nope")


def test_score_refuses_an_infinite_reward_and_names_the_function():
    def blows_up(completions, answers, **columns):
        return [float("-inf")] * len(completions)

    with pytest.raises(rewards.RewardError, match="blows_up returned -inf for completion 0"):
        rewards.score(["a"], ["1"], [blows_up])


# --- lenient accuracy (eval only) -------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{18}.", "18"), ("\\boxed{1} then \\boxed{2}", "2"), ("\\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{3} and \\boxed{4", None), ("no box", None), ("\\boxed{}", ""),
])
def test_last_boxed_takes_the_last_complete_box_with_nested_braces(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("completion, answer, lenient", [
    ("16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is $\\boxed{18}$.", "18", True),  # the untrained model's way
    ("Janet makes \\boxed{\\$18} a day. (She keeps 3 eggs.)", "18", True),  # the box, not the last number
    ("\\boxed{17} ... no wait, 18", "18", False),  # the box is the final answer, even before other numbers
    ("She makes $18 every day.", "18", True),  # no tag, no box: the last number
    ("The balance is -$1,200.", "-1200", True), ("The balance is $1,200.", "-1200", False),
    ("It costs 1,234,567 dollars", "1234567", True), ("So 18.00", "18", True), ("So 19", "18", False),
    ("\\boxed{\\frac{3}{4}}", "0.75", True), ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),
    (W + "<SOLUTION>17</SOLUTION> but really \\boxed{18}", "18", False),  # a complete <SOLUTION> decides
    (W + "<SOLUTION>The answer is 18.</SOLUTION>", "18", True),
    (W + "<SOLUTION>18", "18", True),  # an unclosed block: its last number
    ("no numbers at all", "18", False), ("", "0", False), ("18", "eighteen", False),
])
def test_lenient_accuracy_finds_the_final_answer_wherever_it_was_written(completion, answer, lenient):
    assert is_correct_lenient(completion, answer) is lenient


def test_lenient_is_never_below_strict_and_equals_it_when_a_solution_block_exists():
    completions = [c for _, c, *_ in CASES] + ["\\boxed{4}", "4", "x<SOLUTION>4</SOLUTION>\\boxed{5}"]
    for completion in completions:
        for answer in ("4", "-7", "42", "1234", "0.75"):
            strict, lenient = is_correct(completion, answer), is_correct_lenient(completion, answer)
            assert lenient or not strict, (completion, answer)
            if extract_solution(completion) is not None:
                assert lenient == strict, (completion, answer)


def test_a_reward_that_applies_to_no_completion_is_no_python_warning_and_a_batch_no_reward_applies_to_stops():
    import warnings

    from grpo.rewards import RewardError, score

    def never(completions, answers, **columns):
        return [float("nan")] * len(completions)

    def length(completions, answers, **columns):
        return [float(len(text)) for text in completions]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step line says it (grpo.groups.Scores.applies_to_none), not Python
        rewards, names = score(["a", "bb"], ["1", "2"], [never, length])
    assert rewards[:, 1].tolist() == [1.0, 2.0] and names == ["never", "length"]
    with pytest.raises(RewardError, match=r"^no reward applies to any of the 2 completions: never returned None or "
                                          r"NaN for every one; fix: return a float"):
        score(["a", "bb"], ["1", "2"], [never])


def test_a_module_in_the_current_folder_loads_and_a_file_loads_once(tmp_path, monkeypatch):
    (tmp_path / "raise_reward.py").write_text("CALLS = []\nCALLS.append(1)\n"
                                              "def boom(completions, answers, **columns):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "raise_reward", raising=False)
    assert load_reward("raise_reward:boom")(["x"], ["1"]) == [1.0]
    first = load_reward(f"{tmp_path / 'raise_reward.py'}:boom")
    again = load_reward("raise_reward.py:boom")  # the same file, relative: not run a second time
    assert first is again and sys.modules[first.__module__].CALLS == [1]
