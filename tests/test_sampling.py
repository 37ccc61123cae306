"""grpo.rollout.sampling: vLLM's filter semantics on hand-made logits, and sampled frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.rollout.base import Sampling
from grpo.rollout.sampling import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_p,
    filter_logits,
    row_chunks,
    sample_next,
    sample_with_noise,
)


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper quantile of chi-square with df degrees of freedom (Wilson-Hilferty); z=3.09 is p=0.001."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against expected probabilities, pooling bins with E < 5."""
    total = counts.sum().item()
    expected = probs.double() * total
    order = torch.argsort(expected, descending=True)
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for i in order.tolist():
        if expected[i] >= 5:
            obs.append(counts[i].item())
            exp.append(expected[i].item())
        else:
            pool_o += counts[i].item()
            pool_e += expected[i].item()
    if pool_e > 0:
        if pool_e >= 5 or not exp:
            obs.append(pool_o)
            exp.append(pool_e)
        else:  # too small to stand alone: fold into the smallest bin
            obs[-1] += pool_o
            exp[-1] += pool_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(exp) - 1


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """The distribution vLLM samples from, written plainly in float64 for one row (V,)."""
    z = logits.double() / temperature
    p = torch.softmax(z, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if 0 < top_k < len(z):
        kth = torch.sort(z[keep], descending=True).values[min(top_k, int(keep.sum())) - 1]
        keep &= z >= kth
    if top_p < 1:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        before = 0.0
        for i in torch.argsort(q, descending=True).tolist():
            if not keep[i]:
                continue
            if before >= top_p:
                keep[i] = False
            before += q[i].item()
    out = torch.where(keep, p, 0.0)
    return out / out.sum()


PROBS = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])  # (1, 5)
LOGITS = PROBS.log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero()[:, 0].tolist()


def test_top_p_keeps_smallest_set_reaching_p():
    assert kept(apply_top_p(LOGITS, 0.6)) == [0, 1]  # 0.5 < 0.6, 0.5 + 0.2 reaches it
    assert kept(apply_top_p(LOGITS, 0.75)) == [0, 1, 2]
    assert kept(apply_top_p(LOGITS, 0.4)) == [0]
    assert kept(apply_top_p(LOGITS, 1.0)) == [0, 1, 2, 3, 4]


def test_top_p_tiny_keeps_the_most_likely_token():
    assert kept(apply_top_p(LOGITS, 1e-6)) == [0]


def test_top_k_keeps_k_largest_and_ties_at_the_boundary():
    assert kept(apply_top_k(LOGITS, 3)) == [0, 1, 2]
    assert kept(apply_top_k(LOGITS, 1)) == [0]
    ties = torch.tensor([[1.0, 3.0, 1.0, 1.0, 0.0]])
    assert kept(apply_top_k(ties, 2)) == [0, 1, 2, 3]  # vLLM keeps every logit >= the k-th largest
    assert kept(apply_top_k(LOGITS, 0)) == [0, 1, 2, 3, 4]  # 0 is off
    assert kept(apply_top_k(LOGITS, 99)) == [0, 1, 2, 3, 4]  # k >= V is off


def test_min_p_drops_tokens_below_fraction_of_max_probability():
    assert kept(apply_min_p(LOGITS, 0.35)) == [0, 1]  # threshold 0.175
    assert kept(apply_min_p(LOGITS, 0.19)) == [0, 1, 2, 3]  # threshold 0.095
    assert kept(apply_min_p(LOGITS, 0.0)) == [0, 1, 2, 3, 4]


def test_min_p_applies_to_the_temperature_scaled_distribution():
    # at T=2 the probabilities are proportional to sqrt(p): 0.707, 0.447, 0.387, 0.316, 0.224 (x const)
    # min_p 0.5 keeps sqrt(p_i) >= 0.5 * sqrt(0.5) = 0.354, i.e. tokens 0, 1, 2
    assert kept(filter_logits(LOGITS, 2.0, min_p=0.5)) == [0, 1, 2]
    assert kept(filter_logits(LOGITS, 1.0, min_p=0.5)) == [0]


def test_top_p_applies_after_top_k_renormalizes():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 2 leaves 0.4/0.7 = 0.571 >= 0.5 on top, so top-p 0.5 keeps only token 0 (vLLM's order);
    # top-p on the unfiltered distribution would have kept tokens 0 and 1
    assert kept(apply_top_k_top_p(probs.log(), 2, 0.5)) == [0]
    assert kept(apply_top_p(probs.log(), 0.5)) == [0, 1]


def test_top_p_applies_after_min_p_renormalizes():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # min_p 0.3 drops 0.1; renormalized 4/9, 3/9, 2/9: top-p 0.75 keeps 0 and 1 (7/9 >= 0.75)
    assert kept(filter_logits(probs.log(), 1.0, top_p=0.75, min_p=0.3)) == [0, 1]
    assert kept(filter_logits(probs.log(), 1.0, top_p=0.75)) == [0, 1, 2]


def test_filters_return_new_tensors_and_leave_input_unchanged():
    logits = torch.randn(3, 11)
    before = logits.clone()
    for out in (apply_min_p(logits, 0.2), apply_top_k(logits, 3), apply_top_p(logits, 0.5),
                apply_top_k_top_p(logits, 4, 0.6), filter_logits(logits, 0.7, 3, 0.8, 0.1)):
        assert out.data_ptr() != logits.data_ptr()
    assert torch.equal(logits, before)


def test_filters_match_reference_on_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(64, 37) * 2.5
    for temperature, top_k, top_p, min_p in [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.05),
                                             (0.9, 12, 0.9, 0.02), (1.0, 1, 0.5, 0.3)]:
        out = filter_logits(logits, temperature, top_k, top_p, min_p)
        for row in range(logits.shape[0]):
            ref = reference_probs(logits[row], temperature, top_k, top_p, min_p)
            assert torch.equal(torch.isfinite(out[row]), ref > 0), (temperature, top_k, top_p, min_p, row)


def test_temperature_rejects_zero():
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(LOGITS, 0.0)


def test_greedy_ignores_filters_and_reports_logp_at_temperature_one():
    logits = torch.randn(4, 9, dtype=torch.float64)
    token, logp = sample_next(logits, Sampling(temperature=0.0, top_k=2, top_p=0.1, min_p=0.5))
    assert torch.equal(token, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), ref, atol=1e-6, rtol=0)


def test_logp_is_unfiltered_log_softmax_at_temperature():
    torch.manual_seed(1)
    logits = torch.randn(50, 30) * 3
    sampling = Sampling(temperature=0.6, top_k=4, top_p=0.7, min_p=0.1, seed=0)
    token, logp = sample_next(logits, sampling, torch.Generator().manual_seed(0))
    ref = torch.log_softmax(logits.double() / 0.6, -1).gather(-1, token[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=0)


def test_same_generator_seed_reproduces_tokens():
    logits = torch.randn(16, 100)
    s = Sampling(temperature=1.0)
    a, _ = sample_next(logits, s, torch.Generator().manual_seed(7))
    b, _ = sample_next(logits, s, torch.Generator().manual_seed(7))
    c, _ = sample_next(logits, s, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (1.0, 6, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.5, 0, 1.0, 0.1),
    (0.8, 7, 0.9, 0.02),
])
def test_sampled_frequencies_match_filtered_distribution(temperature, top_k, top_p, min_p):
    torch.manual_seed(2)
    vocab, draws = 12, 40000
    row = torch.randn(vocab) * 1.5
    logits = row.expand(draws, vocab)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    token, _ = sample_next(logits, sampling, torch.Generator().manual_seed(123))
    counts = torch.bincount(token, minlength=vocab)
    ref = reference_probs(row, temperature, top_k, top_p, min_p)
    assert counts[ref == 0].sum() == 0, "sampled a token the filters remove"
    stat, df = chi2_statistic(counts, ref)
    assert stat < chi2_critical(df), (stat, df, counts.tolist(), ref.tolist())


def test_chi_square_detects_a_wrong_temperature():
    # the check above can fail: the same draws at T=1 do not pass against the T=0.5 reference
    torch.manual_seed(2)
    row = torch.randn(12) * 1.5
    token, _ = sample_next(row.expand(40000, 12), Sampling(temperature=1.0), torch.Generator().manual_seed(1))
    stat, df = chi2_statistic(torch.bincount(token, minlength=12), reference_probs(row, 0.5))
    assert stat > chi2_critical(df)


def test_one_row_one_token_vocabulary():
    token, logp = sample_with_noise(torch.zeros(1, 1), 1.0, 0, 0.5, 0.5, torch.ones(1, 1))
    assert token.tolist() == [0]
    assert logp.abs().item() < 1e-6


def test_noise_of_zero_never_picks_a_dropped_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    noise = torch.zeros(1, 3)  # an exact-zero Exp(1) draw everywhere
    token, _ = sample_with_noise(logits, 1.0, 1, 1.0, 0.0, noise)
    assert token.tolist() == [0]


@pytest.mark.parametrize("top_p, min_p, refused", [(1.0, 0.0, None), (0.01, 0.99, None), (0.0, 0.1, "top_p"),
                                                   (1.01, 0.1, "top_p"), (0.9, 1.0, "min_p"), (0.9, -0.1, "min_p")])
def test_the_command_line_and_sampling_refuse_the_same_top_p_and_min_p(top_p, min_p, refused):
    from grpo.config import Config

    errors = []
    for make in (lambda: Sampling(top_p=top_p, min_p=min_p), lambda: Config(top_p=top_p, min_p=min_p)):
        try:
            make()
        except ValueError as err:
            errors.append(str(err))
    if refused is None:
        assert errors == []
    else:
        assert len(errors) == 2 and errors[0].startswith(f"Sampling.{refused}=")
        assert errors[1].startswith(f"--{refused.replace('_', '-')} ")


def reference_sample_with_noise(logits, temperature, top_k, top_p, min_p, noise):
    """sample_with_noise written plainly: each filter on the whole row, a softmax, one argmax a row."""
    if temperature == 0:
        token = logits.float().argmax(-1)
        return token, logits.float().gather(-1, token[:, None])[:, 0] - torch.logsumexp(logits.float(), -1)
    scaled = apply_temperature(logits, temperature)
    probs = filter_logits(logits, temperature, top_k, top_p, min_p).softmax(-1)
    token = (probs / noise.clamp_min(1e-20)).argmax(-1)
    return token, scaled.gather(-1, token[:, None])[:, 0] - torch.logsumexp(scaled, -1)


def test_rows_are_reduced_in_chunks_that_divide_the_vocabulary():
    assert row_chunks(torch.zeros(2, 128256)).shape == (2, 256, 501)  # Llama 3
    assert row_chunks(torch.zeros(2, 151936)).shape == (2, 128, 1187)  # Qwen2.5
    assert row_chunks(torch.zeros(3, 97)).shape == (3, 1, 97)  # a prime: one chunk, the plain reduction
    assert row_chunks(torch.zeros(1, 300)).shape == (1, 1, 300)  # chunks of at least 256


@pytest.mark.parametrize("vocab", [128256, 151936, 1000, 97])
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.05), (0.0, 0, 1.0, 0.0),  # the chunked race
    (1.0, 50, 1.0, 0.1), (1.0, 0, 0.9, 0.0)])  # a sort: filtered as before, then the chunked argmax
def test_chunked_sampling_draws_the_reference_token_and_log_prob(vocab, temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 3).to(torch.bfloat16)  # the engine's head writes bf16 or fp32
    logits[0, vocab // 2] = logits[0].max()  # a tie for the row's maximum: the first index wins in both
    noise = torch.empty(6, vocab).exponential_(generator=g)
    token, logp = sample_with_noise(logits, temperature, top_k, top_p, min_p, noise)
    ref_token, ref_logp = reference_sample_with_noise(logits, temperature, top_k, top_p, min_p, noise)
    assert torch.equal(token, ref_token)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-5)


def test_the_chunked_argmax_takes_the_first_of_tied_maxima_across_chunks():
    x = torch.zeros(2, 128256)
    x[0, [7000, 600, 128000]] = 5.0  # chunks of 501: 600 is in chunk 1, before 7000's chunk 13
    x[1, [1001, 1000]] = 5.0  # one chunk, two places
    token, _ = sample_with_noise(x, 0.0, 0, 1.0, 0.0, None)
    assert token.tolist() == [600, 1000]


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.1), (0.7, 0.0), (0.0, 0.0)])
def test_bf16_logits_sample_what_their_float32_copy_samples(temperature, min_p):
    # The native engine keeps each step's logits as the output layer gives them (bf16), not a float32 copy:
    # the sampler computes in float32 from them, so tokens and log-probs are those of the copy, bit for bit.
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 1000, generator=g) * 4).bfloat16()
    noise = torch.empty(6, 1000).exponential_(generator=g)
    got = sample_with_noise(logits, temperature, 0, 1.0, min_p, noise)
    want = sample_with_noise(logits.float(), temperature, 0, 1.0, min_p, noise)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].dtype == torch.float32
