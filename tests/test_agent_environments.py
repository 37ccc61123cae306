"""grpo.agents.environments and the number-guessing example: environment classes loaded and their shape
checked with one line per fault, the episode record, and the game played."""

from __future__ import annotations

from textwrap import dedent

import pytest

from grpo.agents.environments import Episode, load_environment
from grpo.agents.number_guess import NumberGuess

ENV_FILE = '''
class Echo:
    def reset(self, example):
        self.last = example["prompt"]
        return self.last

    def step(self, action_text):
        return action_text, 1.0, True


class NoStep:
    def reset(self, example):
        return ""


class Neither:
    pass


class StepTakesTwo:
    def reset(self, example):
        return ""

    def step(self, action_text, extra):
        return "", 0.0, True


class NeedsArguments:
    def __init__(self, words):
        self.words = words

    def reset(self, example):
        return ""

    def step(self, action_text):
        return "", 0.0, True


class StepIsData:
    step = 3

    def reset(self, example):
        return ""


def make_env():
    return Echo()
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(dedent(ENV_FILE))
    return path


def one_line_error(spec: str) -> str:
    with pytest.raises(ValueError) as caught:
        load_environment(spec)
    message = str(caught.value)
    assert "\n" not in message and "fix:" in message, message
    return message


def test_load_environment_returns_the_class_and_an_instance_plays_an_episode(env_file):
    cls = load_environment(f"{env_file}:Echo")
    env = cls()
    assert env.reset({"prompt": "hello"}) == "hello"
    assert env.step("guess") == ("guess", 1.0, True)


def test_load_environment_finds_an_installed_module():
    assert load_environment("grpo.agents.number_guess:NumberGuess") is NumberGuess


@pytest.mark.parametrize("spec", ["my_env.py", "my_env.py:", ":Echo"])
def test_a_spec_without_module_and_class_is_one_line(spec):
    assert "expected path/to/file.py:Name" in one_line_error(spec)


def test_a_file_that_does_not_import_is_one_line_naming_the_file_and_the_error(tmp_path):
    broken = tmp_path / "broken_env.py"
    broken.write_text("import a_module_that_is_not_there\n")
    message = one_line_error(f"{broken}:Env")
    assert str(broken) in message and "ModuleNotFoundError" in message


def test_a_class_the_file_lacks_is_one_line(env_file):
    assert "has no 'Wordle'" in one_line_error(f"{env_file}:Wordle")


def test_a_factory_function_is_one_line_asking_for_the_class(env_file):
    assert "'make_env' is a function, not a class" in one_line_error(f"{env_file}:make_env")


@pytest.mark.parametrize("name, missing", [("NoStep", "has no step(action_text);"),
                                           ("Neither", "has no reset(example) nor step(action_text);"),
                                           ("StepIsData", "has no step(action_text);")])
def test_an_environment_missing_reset_or_step_is_one_line_naming_what_is_missing(env_file, name, missing):
    message = one_line_error(f"{env_file}:{name}")
    assert f"{name} {missing}" in message


def test_a_step_taking_other_arguments_is_one_line(env_file):
    message = one_line_error(f"{env_file}:StepTakesTwo")
    assert "StepTakesTwo.step(self, action_text, extra) cannot be called as step(action_text)" in message


def test_an_environment_that_needs_arguments_to_be_made_is_one_line(env_file):
    assert "NeedsArguments(words) needs arguments" in one_line_error(f"{env_file}:NeedsArguments")


# -- the episode record ----------------------------------------------------------------------------------------


def test_an_episode_counts_the_models_turns_and_sums_its_rewards():
    episode = Episode(messages=[{"role": "user", "content": "guess"}])
    assert episode.turns == 0 and episode.reward == 0.0 and not episode.cut
    episode.messages += [{"role": "assistant", "content": "50"}, {"role": "user", "content": "higher"},
                         {"role": "assistant", "content": "75"}, {"role": "tool", "content": "7"}]
    episode.rewards += [0.0, 1.0, -0.25]
    assert episode.turns == 2 and episode.reward == 0.75


def test_episodes_do_not_share_their_lists():
    first, second = Episode(messages=[]), Episode(messages=[])
    first.rewards.append(1.0)
    assert second.rewards == []


# -- the number-guessing game ------------------------------------------------------------------------------------


def test_number_guess_takes_the_examples_answer_and_says_higher_lower_and_correct():
    env = NumberGuess()
    assert "from 1 to 100" in env.reset({"answer": "42"})
    assert env.step("I guess 50") == ("50 is wrong: the number is lower.", 0.0, False)
    assert env.step("Between 1 and 49, say 25") == ("25 is wrong: the number is higher.", 0.0, False)
    assert env.step("42") == ("Correct: the number is 42.", NumberGuess.solved, True)


def test_number_guess_draws_the_number_from_the_seed_the_same_each_time():
    secrets = set()
    for seed in range(20):
        first, again = NumberGuess(), NumberGuess()
        first.reset({"seed": seed})
        again.reset({"seed": seed})
        assert first.secret == again.secret and 1 <= first.secret <= 100
        secrets.add(first.secret)
    assert len(secrets) > 1


def test_number_guess_penalizes_a_reply_without_a_number():
    env = NumberGuess()
    env.reset({"answer": 7})
    assert env.step("hmm, let me think") == ("No number found: reply with a whole number.", NumberGuess.no_guess,
                                             False)


def test_number_guess_ends_after_the_turns_allowed():
    env = NumberGuess()
    env.reset({"answer": 100})
    results = [env.step("1") for _ in range(NumberGuess.max_turns)]
    assert [done for _, _, done in results] == [False] * (NumberGuess.max_turns - 1) + [True]
    assert results[-1] == ("1 is wrong, and that was the last guess: the number was 100.", 0.0, True)


def test_number_guess_refuses_an_answer_outside_its_range_or_not_whole_in_one_line():
    with pytest.raises(ValueError, match=r"the answer 101 is outside \[1, 100\]; fix:"):
        NumberGuess().reset({"answer": 101})
    for answer in ("forty", "4.5", 4.5):
        with pytest.raises(ValueError, match=r"is not a whole number; fix:"):
            NumberGuess().reset({"answer": answer})


def test_number_guess_plays_a_binary_search_to_the_answer_within_the_turns_allowed():
    for secret in (1, 37, 64, 100):
        env = NumberGuess()
        env.reset({"answer": secret})
        low, high, reward, done, turns = 1, 100, 0.0, False, 0
        while not done:
            guess = (low + high) // 2
            observation, reward, done = env.step(f"My guess: {guess}")
            turns += 1
            low, high = (guess + 1, high) if "higher" in observation else (low, guess - 1)
        assert reward == NumberGuess.solved and turns <= NumberGuess.max_turns
