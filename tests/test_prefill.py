"""The hf engine's prefill in chunks: a long prompt is read a chunk at a time, so that a second Ctrl-C
(raised by Python between operations) stops a prefill within seconds; the tokens and log-probs are the
ones of a prefill in one piece."""

from __future__ import annotations

import torch

from conftest import tiny_llama
from grpo.rollout import Sampling
from grpo.rollout.hf import HFEngine


def _forward_lengths(model):
    """The sequence length of every forward the model runs, recorded by a hook."""
    seen: list[int] = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1])
                                          if kwargs.get("input_ids") is not None else None, with_kwargs=True)
    return seen


def test_a_long_prompt_is_prefilled_in_chunks_with_the_same_tokens_and_logprobs():
    model = tiny_llama(vocab_size=96, max_pos=256)
    torch.manual_seed(1)
    prompts = [torch.randint(1, 96, (70,)).tolist(), torch.randint(1, 96, (45,)).tolist()]  # padded to 70
    sampling = Sampling(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=5)
    whole = HFEngine(model, pad_id=0, prefill_chunk=1024)
    seen_whole = _forward_lengths(model)
    one_piece = whole.generate(prompts, 2, sampling)
    assert seen_whole[0] == 70
    seen_whole.clear()
    chunked = HFEngine(model, pad_id=0, prefill_chunk=16)
    in_chunks = chunked.generate(prompts, 2, sampling)
    assert max(seen_whole) <= 16 and seen_whole[:5] == [16, 16, 16, 16, 6]  # 70 prompt tokens, then one a step
    assert torch.equal(in_chunks.completion_ids, one_piece.completion_ids)
    torch.testing.assert_close(in_chunks.sampler_logp, one_piece.sampler_logp, rtol=1e-4, atol=1e-4)


def test_a_short_prompt_is_prefilled_in_one_piece():
    model = tiny_llama(vocab_size=96, max_pos=256)
    seen = _forward_lengths(model)
    HFEngine(model, pad_id=0).generate([list(range(1, 41))], 1, Sampling(max_new_tokens=2, temperature=0.0))
    assert seen[0] == 40
