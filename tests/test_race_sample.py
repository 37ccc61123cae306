"""`grpo.kernels.race_sample`'s draws and its reference on the CPU, and the kernels against it on CUDA (the
kernels themselves under Triton's interpreter: tests/interpreted/test_race_sample_kernel.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo.kernels import race_sample as rs


def test_the_draws_are_exp_1_and_each_row_and_step_draws_anew():
    noise = rs.race_noise_ref(seed=5, step=0, rows=4, vocab=50_000)
    assert noise.dtype == torch.float32 and noise.shape == (4, 50_000) and bool((noise > 0).all())
    draws = np.sort(noise.flatten().numpy().astype(np.float64))
    ecdf = np.arange(1, len(draws) + 1) / len(draws)
    assert np.abs(ecdf - (1 - np.exp(-draws))).max() < 0.005  # Kolmogorov-Smirnov: 0.005 at n = 200,000
    assert abs(draws.mean() - 1) < 0.01 and abs(draws.var() - 1) < 0.03
    rows = noise.numpy()
    assert abs(np.corrcoef(rows[0], rows[1])[0, 1]) < 0.02
    later = rs.race_noise_ref(seed=5, step=1, rows=4, vocab=50_000).numpy()
    assert abs(np.corrcoef(rows[0], later[0])[0, 1]) < 0.02
    assert not np.array_equal(rs.race_noise_ref(seed=6, step=0, rows=1, vocab=100).numpy(), rows[:1, :100])
    assert np.array_equal(rs.race_noise_ref(seed=5, step=0, rows=1, vocab=100).numpy(), rows[:1, :100])


def test_the_reference_samples_each_token_with_its_min_p_probability():
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, -4.0])  # min_p 0.1 drops the last two
    rows, temperature, min_p = 40_000, 0.8, 0.1
    token, logp = rs.race_sample_ref(logits.expand(rows, -1).contiguous(), temperature, min_p, seed=1, step=3)
    probs = torch.softmax(logits / temperature, -1)
    kept = probs >= min_p * probs.max()
    want = torch.where(kept, probs, 0.0) / probs[kept].sum()
    counts = torch.bincount(token, minlength=len(logits)).double()
    assert counts[~kept].sum() == 0
    chi2 = float(((counts - rows * want) ** 2 / (rows * want))[kept].sum())
    assert chi2 < 13.8  # 3 degrees of freedom: p = 0.003
    torch.testing.assert_close(logp, probs.log()[token], atol=1e-6, rtol=0)  # the log-prob before min_p


def test_only_temperature_and_min_p_sampling_takes_the_kernels():
    assert rs.can_sample(1.0, 0, 1.0) and rs.can_sample(0.7, -1, 1.0)
    assert not rs.can_sample(0.0, 0, 1.0)  # greedy: an argmax
    assert not rs.can_sample(1.0, 50, 1.0) and not rs.can_sample(1.0, 0, 0.9)  # a sort


def test_an_engine_asked_for_the_kernels_where_triton_cannot_run_says_so(monkeypatch):
    from grpo.rollout.native import EngineTuning

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="sample_kernel=True needs triton and a CUDA model"):
        EngineTuning(sample_kernel=True).resolved(torch.device("cpu"), llama_mlp=True, rows=4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_sample_what_the_reference_samples_on_cuda():
    # bf16 logits of Llama's vocabulary at 64 rows, the race drawing in the blocks min_p keeps; tl.exp and
    # tl.log are approximate on the GPU, so a near tie may go the other way in a rare row
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 128256, device="cuda", generator=g) * 4).bfloat16()
    for temperature, min_p, step in ((1.0, 0.1, 0), (0.7, 0.0, 11)):
        token, logp = rs.race_sample(logits, temperature, min_p, torch.tensor([9], device="cuda"),
                                     torch.tensor([step], device="cuda"))
        want_token, want_logp = rs.race_sample_ref(logits, temperature, min_p, 9, step)
        assert (token == want_token).float().mean() >= 0.99
        same = token == want_token
        torch.testing.assert_close(logp[same], want_logp[same], atol=1e-4, rtol=0)
        assert math.isfinite(float(logp.sum()))
