"""Shared fixtures: the real Llama 3.2 tokenizer and tiny random Llama models built in the test."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def llama_tokenizer():
    from transformers import AutoTokenizer

    from grpo.assets import llama_tokenizer_dir

    return AutoTokenizer.from_pretrained(llama_tokenizer_dir())


def tiny_llama_config(vocab_size: int = 128256, hidden: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, intermediate: int = 128, max_pos: int = 512, tie: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos, tie_word_embeddings=tie, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009], pad_token_id=128004, rope_theta=500000.0,
    )


def tiny_llama(seed: int = 0, dtype=torch.float32, **kw):
    """A random Llama with Llama 3.2's vocabulary and ids, small enough for CPU tests."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw)).to(dtype)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, llama_tokenizer):
    """A tiny random Llama saved with the real Llama 3.2 tokenizer, loadable by path."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    llama_tokenizer.save_pretrained(path)
    return path
