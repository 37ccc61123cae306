"""The sampler's Triton kernels (`grpo.kernels.race_sample`), run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1), against `race_sample_ref`: torch's sampler with the kernels' own draws."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from grpo.kernels import race_sample as rs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_native_engine's helpers


def test_the_reference_draws_what_tl_rand_draws_at_64_bit_offsets():
    import triton
    import triton.language as tl

    @triton.jit
    def rand_kernel(seed_ptr, offset_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, tl.rand(tl.load(seed_ptr), tl.load(offset_ptr + i)))

    offsets = torch.tensor([0, 1, 2, 2**32 - 1, 2**32 + 5, 2**40 + 77, 123456789012, 7], dtype=torch.int64)
    for seed in (0, 7, 0x123456789AB):
        out = torch.empty(len(offsets))
        rand_kernel[(1,)](torch.tensor([seed]), offsets, out, N=len(offsets))
        assert torch.equal(out, torch.from_numpy(rs.philox_uniform_ref(seed, offsets.numpy())))


@pytest.mark.parametrize("rows,vocab,temperature,min_p,step", [(3, 1000, 1.0, 0.1, 0), (4, 700, 0.7, 0.0, 5),
                                                                (2, 1024, 1.3, 0.05, 2)])
def test_race_sample_gives_its_references_tokens_and_log_probs(monkeypatch, rows, vocab, temperature, min_p, step):
    monkeypatch.setattr(rs, "BLOCK", 256)  # several blocks a row, the last one partial where 256 does not divide V
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, 17] = 30.0  # one row whose min_p keeps a single token: the blocks without it draw nothing
    token, logp = rs.race_sample(logits, temperature, min_p, torch.tensor([41 + step]), torch.tensor([step]))
    want_token, want_logp = rs.race_sample_ref(logits, temperature, min_p, 41 + step, step)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
    if min_p > 0:
        assert token[0] == 17
    later = rs.race_sample(logits, temperature, min_p, torch.tensor([41 + step]), torch.tensor([step + 9]))[0]
    assert torch.equal(later, rs.race_sample_ref(logits, temperature, min_p, 41 + step, step + 9)[0])


def test_native_engine_sampling_in_the_kernel_samples_what_its_reference_samples(monkeypatch):
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from grpo.rollout.native import engine as native_engine
    from test_native_engine import PAD, PROMPTS, small_llama

    model = small_llama(seed=1)
    sampling = Sampling(max_new_tokens=4, temperature=1.0, min_p=0.05, seed=3)

    engine = NativeEngine(model, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules",
                          tuning=EngineTuning(sample_kernel=True))

    def rollout():
        return engine.generate(PROMPTS, 2, sampling)

    out = rollout()
    assert engine._state.noise is None  # the kernel draws the race's noise: no (rows, V) buffer for torch's
    steps = []

    def reference(logits, temperature, min_p, seed, step):  # what each step's launches must give
        steps.append(int(step))
        return rs.race_sample_ref(logits, temperature, min_p, int(seed), int(step))

    monkeypatch.setattr(native_engine, "race_sample", reference)
    want = rollout()
    assert steps == [0, 1, 2, 3]  # one draw a step, keyed by the step
    assert torch.equal(out.completion_ids, want.completion_ids)
    torch.testing.assert_close(out.sampler_logp, want.sampler_logp, atol=1e-5, rtol=0)
