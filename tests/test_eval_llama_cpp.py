"""grpo.eval.llama_cpp without llama.cpp: the requests it sends and how it cuts the rows that come back.
(The server itself is exercised by `./dev test-gguf`.)"""

import re
import tempfile
from pathlib import Path

import pytest
import torch

from grpo.eval import cli as eval_cli
from grpo.eval.llama_cpp import (LLAMA_CPP_VERSION, LlamaCppEngine, LlamaServer, default_bin_dir, find_tool,
                                 request_body)
from grpo.rollout.base import Sampling


class FakeServer:
    """Answers each request with the next of `replies` for its prompt (by its first token), recording the bodies."""

    slots = 3

    def __init__(self, replies: dict[int, list[dict]]):
        self.replies = {k: list(v) for k, v in replies.items()}
        self.bodies: list[dict] = []

    def complete(self, body: dict) -> dict:
        self.bodies.append(body)
        return self.replies[body["prompt"][0]].pop(0)


def test_request_turns_off_every_sampler_of_llama_cpp_that_ours_lacks():
    body = request_body([5, 6], Sampling(max_new_tokens=7, temperature=0.0, min_p=0.1), seed=11)
    assert body["prompt"] == [5, 6] and body["n_predict"] == 7 and body["seed"] == 11
    assert body["temperature"] == 0.0 and body["return_tokens"] is True
    # llama.cpp's own defaults (top-k 40, top-p 0.95, min-p 0.05) would change the distribution sampled
    assert body["top_k"] == 0 and body["top_p"] == 1.0 and body["min_p"] == 0.1
    assert body["repeat_penalty"] == 1.0 and body["dry_multiplier"] == 0.0 and body["xtc_probability"] == 0.0
    assert body["mirostat"] == 0 and body["typical_p"] == 1.0
    assert body["ignore_eos"] is False  # llama.cpp forbids end tokens it is told to ignore
    # our filters' order: llama.cpp's own applies the temperature last, after min_p and top-p have cut
    assert body["samplers"] == ["temperature", "min_p", "top_k", "top_p"]


def test_rows_are_cut_at_our_stops_and_keep_group_order():
    stop_seq = (8, 9)
    server = FakeServer({
        1: [{"tokens": [4, 8, 9, 4, 4], "stop_type": "limit"},  # stop sequence inside: cut after it
            {"tokens": [4, 2], "stop_type": "eos"}],            # the end token (2): kept, finished
        3: [{"tokens": [4, 4, 4, 4, 4, 4], "stop_type": "limit"},  # cut by the budget
            {"tokens": [7], "stop_type": "eos"}],               # llama.cpp stopped at one of its own end tokens
    })
    engine = LlamaCppEngine(server, pad_id=0, seed=100)
    sampling = Sampling(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,), stop_sequences=(stop_seq,))
    out = engine.generate([[1, 1], [3]], 2, sampling)
    assert out.completions() == [[4, 8, 9], [4, 2], [4, 4, 4, 4, 4], [7]]
    assert out.finished.tolist() == [True, True, False, True]
    assert out.mask.sum(1).tolist() == [3, 2, 5, 1]
    assert torch.equal(out.sampler_logp, torch.zeros_like(out.sampler_logp))
    # each row its own seed, from the engine's when the sampling has none
    assert sorted(b["seed"] for b in server.bodies) == [100, 101, 102, 103]


def test_missing_tools_and_files_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/llama-cpp.sh"):
        find_tool("llama-server", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LlamaServer(tmp_path / "none.gguf", bin_dir=tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--gguf-lora", "a.gguf"], "go with --gguf"),
    (["--gguf", "m.gguf", "--adapter", "run"], "one or the other"),
])
def test_gguf_flags_that_do_not_go_together(argv, message):
    args = eval_cli.build_parser().parse_args(["--model", "m", *argv])
    assert message in eval_cli.eval_flag_problem(args)


def test_gguf_is_not_for_episodes():
    args = eval_cli.build_parser().parse_args(["--model", "m", "--gguf", "m.gguf", "--tools", "t.py:f"])
    assert "--tools and --environment" in eval_cli.eval_flag_problem(args)


def test_the_tools_are_looked_for_where_the_build_script_puts_them(monkeypatch, tmp_path):
    script = (Path(__file__).resolve().parents[1] / "scripts" / "llama-cpp.sh").read_text()
    assert re.search(r"^version=(\S+)", script, re.MULTILINE).group(1) == LLAMA_CPP_VERSION
    assert "llama-server" in re.search(r'^tools="([^"]*)"', script, re.MULTILINE).group(1).split()
    for name in ("GRPO_LLAMA_CPP_BIN", "LLAMA_CPP_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    assert default_bin_dir() == tmp_path / "cache" / f"llama.cpp-{LLAMA_CPP_VERSION}" / "bin"
    monkeypatch.setenv("LLAMA_CPP_HOME", str(tmp_path / "home"))
    assert default_bin_dir() == tmp_path / "home" / "bin"
    monkeypatch.setenv("GRPO_LLAMA_CPP_BIN", str(tmp_path / "bin"))
    assert default_bin_dir() == tmp_path / "bin"


def test_a_server_that_fails_to_start_is_one_line_quoting_its_error_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its log, kept for the error, goes here
    fake = tmp_path / "llama-server"  # prints a log as llama.cpp's does, then exits as it does on a bad file
    fake.write_text("#!/bin/sh\necho '0.00.001.000 I srv  main: loading'\n"
                    "echo \"0.00.004.833 E gguf_init_from_reader: invalid magic characters: 'JUNK', expected 'GGUF'\"\n"
                    "echo '0.00.004.857 E srv    load_model: failed to load model'\nexit 1\n")
    fake.chmod(0o755)
    (tmp_path / "m.gguf").write_bytes(b"JUNK")
    with pytest.raises(RuntimeError) as err:
        with LlamaServer(tmp_path / "m.gguf", bin_dir=tmp_path):
            pass
    message = str(err.value)
    assert "\n" not in message and "exited with status 1" in message and str(tmp_path / "m.gguf") in message
    assert "gguf_init_from_reader: invalid magic characters" in message
    assert "load_model: failed to load model" in message and "loading" not in message
