"""Shared fixtures: the real Llama 3.2 tokenizer (parsed once a process) and tiny random models built in the test."""

from __future__ import annotations

import gc
import os
import runpy
import shutil
import sys

import pytest
import torch

# Triton-interpreter tests run in their own process (tests/test_decode_gemm.py), with TRITON_INTERPRET=1
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_patch  # noqa: F401  (beside this file: the language patched once a launch, no dead checks)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tokenizer_once  # noqa: E402,F401  (beside this file: each tokenizer.json content parsed once a process)


@pytest.fixture(scope="session")
def llama_tokenizer():
    from transformers import AutoTokenizer

    from grpo.assets import llama_tokenizer_dir

    return AutoTokenizer.from_pretrained(llama_tokenizer_dir())


def tiny_llama_config(vocab_size: int = 128256, hidden: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, intermediate: int = 128, max_pos: int = 512, tie: bool = True,
                      initializer_range: float = 0.02):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos, tie_word_embeddings=tie, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], rope_theta=500000.0,
        pad_token_id=128004 if vocab_size > 128004 else None, initializer_range=initializer_range,
    )


def tiny_llama(seed: int = 0, dtype=torch.float32, **kw):
    """A random Llama with Llama 3.2's vocabulary and ids, small enough for CPU tests."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw)).to(dtype)
    model.eval()
    return model


FAMILY_DIMS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_hidden_layers=2, vocab_size=200, max_position_embeddings=256, pad_token_id=0)


def tiny_family_model(family: str, **config):
    """A random two-layer model of `family` (llama, mistral, qwen2, qwen3) at FAMILY_DIMS: Qwen2's q/k/v have
    biases, Qwen3's heads their norms; no sliding window unless `config` sets one (it overrides the dims too)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    window = {} if family == "llama" else {"sliding_window": None}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_class(**{**FAMILY_DIMS, **window, **config}))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama saved with the real Llama 3.2 tokenizer, loadable by path."""
    from grpo.assets import llama_tokenizer_dir

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    # the tokenizer's files as the package ships them: transformers' save_pretrained leaves the added tokens out of
    # tokenizer_config.json, and each load then reads them from the 9 MB tokenizer.json (0.2-0.3 s a load)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_tokenizer_dir() / name, path / name)
    return path


CHAR_SPECIALS = ["<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                 "<|end_header_id|>"]


def char_tokenizer():
    """A character-level tokenizer built in the test: every printable ASCII character is one token.

    Small vocabularies make learning visible in a few CPU steps; the Llama-3 special tokens keep the
    chat-template fallback working.
    """
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS + ["<unk>"] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": CHAR_SPECIALS[4:]})
    return tok


@pytest.fixture(scope="session")
def aligned_char_llama_dir(tmp_path_factory):
    """A tiny Llama over the character tokenizer whose rank-32 adapters each hold whole 256-element blocks of at
    least 4096 elements: a run on it takes the flat optimizer buffer (grpo.flat_params)."""
    tok = char_tokenizer()
    path = tmp_path_factory.mktemp("aligned-char-llama")
    model = tiny_llama(vocab_size=128, hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, max_pos=1024)
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, \
            tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def char_llama_dir(tmp_path_factory):
    """A tiny random Llama over the character tokenizer (vocab 128), saved with it."""
    tok = char_tokenizer()
    path = tmp_path_factory.mktemp("char-llama")
    # Embeddings wide enough (init std 0.2) that the frozen tied head can express a clear preference.
    model = tiny_llama(vocab_size=128, hidden=64, layers=2, max_pos=1024, initializer_range=0.2)
    model.config.bos_token_id = tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")  # not module: its tests are in two modules, kept on one worker by their xdist group
def two_rank_run(char_llama_dir, aligned_char_llama_dir, tmp_path_factory):
    """The runs on two gloo ranks that tests/test_distributed.py and tests/test_dynamic_sampling.py compare with one
    process, from one torchrun launch (test_distributed.launch_two_rank_suite): the folder they went into."""
    from test_distributed import launch_two_rank_suite

    return launch_two_rank_suite(char_llama_dir, aligned_char_llama_dir, tmp_path_factory.mktemp("two-ranks"))


def pytest_configure(config):
    """Python's full collections walk every object of the process; torch's and transformers' imports hold over a
    million, so one costs a quarter of a second, and at the default thresholds the suite ran one every second or
    two (a sixth of its CPU time). Rarer here: garbage in cycles waits longer, and a test that needs it gone calls
    gc.collect() itself, which collects as ever."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1000)


def run_as_main(command: list, monkeypatch) -> int:
    """`python COMMAND` in this process, COMMAND a script's path and its arguments or `-m MODULE` and its: the exit
    status. What it prints is capsys's; a new interpreter would pay seconds of imports before its first line."""
    command = [str(arg) for arg in command]
    module = command[1] if command[0] == "-m" else None
    monkeypatch.setattr(sys, "argv", command[1:] if module else command)  # run_module puts its path first
    with pytest.raises(SystemExit) as ended:
        if module is None:
            runpy.run_path(command[0], run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    return ended.value.code


def pytest_collection_modifyitems(items):
    """The tests marked slow first, the rest in their order: the two workers then end together, where a long test
    that one of them took last kept the other idle (xdist hands out tests, and groups, in this order)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
