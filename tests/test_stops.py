"""Stop strings: text -> token-id stop sequences, and the trainer's --stop."""

from __future__ import annotations

import pytest

from grpo.config import parse_args
from grpo.rollout.stops import first_stop_index, stop_string_sequences, stop_token_ids


@pytest.mark.parametrize("text", ["<SOLUTION>4</SOLUTION>", "<SOLUTION> 42 </SOLUTION>", "x\n</SOLUTION>",
                                  "<SOLUTION></SOLUTION>", "= -7.5</SOLUTION>"])
def test_a_completion_that_ends_with_the_stop_string_stops_on_its_last_token(llama_tokenizer, text):
    sequences = stop_string_sequences(llama_tokenizer, ["</SOLUTION>"])
    ids = llama_tokenizer(text + " and more", add_special_tokens=False)["input_ids"]
    end = first_stop_index(ids, (), sequences)
    assert end is not None
    assert llama_tokenizer.decode(ids[:end + 1]) == text


@pytest.mark.parametrize("after", ["\n", "\n\n", ".", ")", ","])
def test_a_stop_string_merged_with_the_next_character_still_stops_right_there(llama_tokenizer, after):
    # Llama's BPE writes "</SOLUTION>\n" as ... "OLUTION", ">\n": the stop must fire on that token.
    sequences = stop_string_sequences(llama_tokenizer, ["</SOLUTION>"])
    ids = llama_tokenizer("<SOLUTION>4</SOLUTION>" + after + "next line", add_special_tokens=False)["input_ids"]
    end = first_stop_index(ids, (), sequences)
    assert end is not None
    assert llama_tokenizer.decode(ids[:end + 1]) == "<SOLUTION>4</SOLUTION>" + after


def test_text_without_the_whole_stop_string_does_not_stop(llama_tokenizer):
    sequences = stop_string_sequences(llama_tokenizer, ["</SOLUTION>"])
    for text in ["<SOLUTION>4</SOLUTION", "<SOLUTION>4</SOL>", "4 SOLUTION>"]:
        ids = llama_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert first_stop_index(ids, (), sequences) is None, text


def test_several_strings_each_get_their_spellings(llama_tokenizer):
    one = stop_string_sequences(llama_tokenizer, ["</SOLUTION>"])
    both = stop_string_sequences(llama_tokenizer, ["</SOLUTION>", "\n\nQuestion:"])
    assert set(one) < set(both)
    assert all(seq for seq in both)


def test_an_empty_stop_string_is_refused(llama_tokenizer):
    with pytest.raises(ValueError, match="empty"):
        stop_string_sequences(llama_tokenizer, [""])


def test_the_stop_flag_sets_clears_and_refuses_empty_strings(capsys):
    assert parse_args(["--preset", "smollm2-arithmetic"]).stop == ("</SOLUTION>",)
    assert parse_args(["--preset", "smollm2-arithmetic", "--stop"]).stop == ()
    assert parse_args(["--stop", "a", "bc"]).stop == ("a", "bc")
    with pytest.raises(SystemExit):
        parse_args(["--stop", ""])
    assert "--stop ''" in capsys.readouterr().err


def test_stop_token_ids_join_the_tokenizers_eos_and_every_eos_of_the_generation_config():
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(eos_token_id=128009)
    assert stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=[128008, 128001, 128009])) == (128001, 128008, 128009)
    assert stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=128001)) == (128001, 128009)
    assert stop_token_ids(tokenizer, SimpleNamespace()) == (128009,)
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=None)) == ()
