"""grpo.loss.clipped_surrogate and kl_penalty against hand-derived cases and a
float64 loop-by-loop reference (values, statistics and gradients), plus edge cases and input checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from grpo.loss import (
    KL_KINDS,
    NORMS,
    POLICY_TERMS,
    RATIO_LEVELS,
    STAT_KEYS,
    Cispo,
    Clip,
    DppoKL,
    DppoTV,
    Gmpo,
    Sapo,
    clipped_surrogate,
    group_advantages,
    kl_penalty,
    policy_term,
)

F64 = torch.float64
LOOP_TERMS = ("clip", "cispo", "sapo")  # the terms the loop reference below writes out
LN = math.log


# ----------------------------------------------------------------------------------------------
# The reference: one token at a time, Python control flow for every min/clip, float64 autograd.
# It reads only positions where mask is True, so garbage elsewhere must not change the result.
# ----------------------------------------------------------------------------------------------
def surrogate_loop(logp, old_logp, adv, mask, *, term=Clip(), ref_logp=None, beta=0.0, ratio_level="token",
                   loss_norm="sequence", max_completion_length=None, is_weights=None, kl_estimator="k3"):
    B, T = logp.shape
    term = policy_term(term) if isinstance(term, str) else term
    loss_type = term.name
    clip = loss_type == "clip"
    epsilon, epsilon_high, delta = (term.epsilon, term.epsilon_high, term.delta) if clip else (0, 0, None)
    cispo_eps_low, cispo_eps_high = (term.eps_low, term.eps_high) if loss_type == "cispo" else (0, 0)
    sapo_tau_pos, sapo_tau_neg = (term.tau_pos, term.tau_neg) if loss_type == "sapo" else (1, 1)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    lo, hi = 1.0 - epsilon, 1.0 + epsilon_high
    cispo_lo, cispo_hi = 1.0 - cispo_eps_low, 1.0 + cispo_eps_high
    rows, policy_rows, counts = [], [], []
    kl_sum, n_low, n_high, n_delta, ratios, grad_weights = 0.0, 0, 0, 0, [], []
    for i in range(B):
        idx = [t for t in range(T) if bool(mask[i, t])]
        a = float(adv[i])
        if ratio_level == "sequence" and idx:
            seq_log_ratio = sum(logp[i, t] - old_logp[i, t] for t in idx) / len(idx)
        row = logp.new_zeros(())
        policy_row = logp.new_zeros(())
        for t in idx:
            x = seq_log_ratio if ratio_level == "sequence" else logp[i, t] - old_logp[i, t]
            w = torch.exp(x)
            wv = float(w.detach())
            ratios.append(wv)
            if loss_type == "clip":
                # unclipped branch, capped at delta (a constant once capped: no gradient)
                u = w if (delta is None or wv <= delta) else torch.tensor(float(delta), dtype=F64)
                # clipped branch
                if wv < lo:
                    c = torch.tensor(lo, dtype=F64)
                elif wv > hi:
                    c = torch.tensor(hi, dtype=F64)
                else:
                    c = w
                picks_u = float(u.detach()) * a <= float(c.detach()) * a
                term = -(u * a if picks_u else c * a)  # -min(u*A, c*A)
                n_low += wv < lo and a < 0
                n_high += wv > hi and a > 0
                n_delta += delta is not None and wv > delta and a < 0
                # the picked branch passes d w / d logp = w unless it is a constant
                passes = (delta is None or wv <= delta) if picks_u else lo <= wv <= hi
                grad_weights.append(wv if passes else 0.0)
            elif loss_type == "cispo":
                c = min(max(wv, cispo_lo), cispo_hi)  # a Python float: no gradient through the weight
                term = -(c * a) * logp[i, t]
                n_low += wv < cispo_lo
                n_high += wv > cispo_hi
                grad_weights.append(c)
            elif loss_type == "sapo":
                tau = sapo_tau_pos if a > 0 else sapo_tau_neg
                s = 1.0 / (1.0 + torch.exp(-tau * (w - 1.0)))  # sigmoid, written out
                term = -(4.0 / tau) * s * a
                sv = float(s.detach())
                grad_weights.append(4.0 * sv * (1.0 - sv) * wv)
            else:
                raise NotImplementedError(f"the loop reference has no {loss_type!r}: test it against its peer")
            if is_weights is not None:
                term = term * float(is_weights[i] if is_weights.dim() == 1 else is_weights[i, t])
            policy_row = policy_row + term
            if ref_logp is not None:
                d = float(ref_logp[i, t]) - logp[i, t]  # log(pi_ref / pi_theta)
                k = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1.0}[kl_estimator]
                kl_sum += float(k.detach())
                if beta > 0:
                    term = term + beta * k
            row = row + term
        rows.append(row)
        policy_rows.append(policy_row)
        counts.append(len(idx))

    def normalize(values):
        if loss_norm == "sequence":
            return sum(v / max(n, 1) for v, n in zip(values, counts)) / B
        if loss_norm == "token":
            return sum(values) / max(sum(counts), 1)
        return sum(values) / (B * (max_completion_length if max_completion_length is not None else T))

    n = max(sum(counts), 1)
    stats = {
        "policy_loss": float(normalize(policy_rows).detach()),
        "kl": kl_sum / n,
        "clip_frac_low": n_low / n,
        "clip_frac_high": n_high / n,
        "clip_frac": (n_low + n_high) / n,
        "clip_frac_delta": n_delta / n,
        "ratio_mean": sum(ratios) / n,
        "ratio_min": min(ratios) if ratios else 0.0,
        "ratio_max": max(ratios) if ratios else 0.0,
        "grad_weight_mean": sum(grad_weights) / n,
    }
    return normalize(rows), stats


def random_batch(seed, B=5, T=6, spread=0.35):
    """Random inputs with right-padded masks: row 0 full, row 1 empty, others random lengths.
    Positions that do not count hold garbage (huge values, nan) that must never leak."""
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=F64)
    old_logp = logp + spread * torch.randn(B, T, generator=g, dtype=F64)
    ref_logp = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[-1] = 0.0  # a zero advantage: neither branch clipped, no policy gradient
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    mask = torch.arange(T) < lengths[:, None]
    is_tok = 0.5 + torch.rand(B, T, generator=g, dtype=F64)
    is_row = 0.5 + torch.rand(B, generator=g, dtype=F64)
    logp[~mask] = 50.0
    old_logp[~mask] = -float("inf")  # logp - old_logp = inf, and inf * 0 = nan
    ref_logp[~mask] = float("nan")
    is_tok[~mask] = float("nan")
    return logp, old_logp, ref_logp, adv, mask, is_tok, is_row


def fast_and_reference(logp, old_logp, adv, mask, **kw):
    """Loss, stats and gradient of `clipped_surrogate` and of the loop reference on the same inputs."""
    x, x_ref = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, old_logp, adv, mask, **kw)
    loss.backward()
    ref_loss, ref_stats = surrogate_loop(x_ref, old_logp, adv, mask, **kw)
    ref_loss.backward()
    return (loss, stats, x.grad), (ref_loss, ref_stats, x_ref.grad)


def assert_stats_close(stats, ref_stats, tol):
    assert set(stats) == set(STAT_KEYS)
    for key in STAT_KEYS:
        assert stats[key].dim() == 0 and not stats[key].requires_grad, key
        assert float(stats[key]) == pytest.approx(ref_stats[key], abs=tol, rel=tol), key


# ----------------------------------------------------------------------------------------------
# Hand-derived cases
# ----------------------------------------------------------------------------------------------
def hand_batch():
    """Two completions, eps = 0.2, so the clip range is [0.8, 1.2].
    row 0: A = +1, ratios w = [1.5, 0.5, 1.0]   (3 tokens)
    row 1: A = -1, ratios w = [0.5, 1.5, --]    (2 tokens; the third is padding)"""
    old_logp = torch.full((2, 3), -1.0, dtype=F64)
    w = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]], dtype=F64)
    logp = (old_logp + w.log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, old_logp, adv, mask


def test_hand_derived_token_ratio_all_three_norms_and_stats():
    # per-token loss -min(w*A, clip(w)*A):
    #   row 0 (A=+1): w=1.5 -> -min(1.5, 1.2) = -1.2 (clipped high)
    #                 w=0.5 -> -min(0.5, 0.8) = -0.5
    #                 w=1.0 -> -1.0
    #   row 1 (A=-1): w=0.5 -> -min(-0.5, -0.8) = 0.8 (clipped low)
    #                 w=1.5 -> -min(-1.5, -1.2) = 1.5
    # row sums: -2.7 (3 tokens) and 2.3 (2 tokens); total -0.4 over N=5 tokens.
    logp, old_logp, adv, mask = hand_batch()
    cases = {
        "sequence": (-2.7 / 3 + 2.3 / 2) / 2,  # (-0.9 + 1.15) / 2 = 0.125
        "token": -0.4 / 5,  # -0.08
        "constant": -0.4 / (2 * 3),  # max_completion_length None -> T = 3
    }
    for loss_norm, expected in cases.items():
        loss, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm=loss_norm)
        assert float(loss.detach()) == pytest.approx(expected, abs=1e-12), loss_norm
    loss, _ = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="constant", max_completion_length=4)
    assert float(loss.detach()) == pytest.approx(-0.4 / (2 * 4), abs=1e-12)  # -0.05

    # stats: clipped low: (0.5, A<0) once; clipped high: (1.5, A>0) once; of 5 tokens.
    # ratio mean (1.5 + 0.5 + 1.0 + 0.5 + 1.5) / 5 = 1.0, min 0.5, max 1.5 (the padding's 1.0 is not read).
    # gradient weights: the two clipped tokens 0, the others their w: (0.5 + 1.0 + 1.5) / 5 = 0.6.
    _, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token")
    expected_stats = dict(policy_loss=-0.08, kl=0.0, clip_frac_low=0.2, clip_frac_high=0.2, clip_frac=0.4,
                          clip_frac_delta=0.0, ratio_mean=1.0, ratio_min=0.5, ratio_max=1.5, grad_weight_mean=0.6)
    assert_stats_close(stats, expected_stats, 1e-12)


def test_hand_derived_gradient_is_zero_on_clipped_tokens_and_minus_A_w_over_N_elsewhere():
    # token norm: d loss / d logp_it = -A_i * w_it / N on unclipped tokens (dw/dlogp = w), 0 on
    # clipped ones and on padding. N = 5.
    #   row 0: [0 (clipped), -(+1)(0.5)/5 = -0.1, -(+1)(1.0)/5 = -0.2]
    #   row 1: [0 (clipped), -(-1)(1.5)/5 = +0.3, 0 (padding)]
    logp, old_logp, adv, mask = hand_batch()
    loss, _ = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token")
    loss.backward()
    expected = torch.tensor([[0.0, -0.1, -0.2], [0.0, 0.3, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_hand_derived_clip_higher_and_delta():
    logp, old_logp, adv, mask = hand_batch()
    # DAPO clip-higher epsilon_high = 0.28: row 0's w = 1.5 now clips at 1.28 instead of 1.2:
    # total = -1.28 - 0.5 - 1.0 + 0.8 + 1.5 = -0.48, token mean -0.48 / 5 = -0.096.
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token", term=Clip(epsilon_high=0.28))
    assert float(loss.detach()) == pytest.approx(-0.096, abs=1e-12)
    assert float(stats["clip_frac_high"]) == pytest.approx(0.2)
    # delta = 1.4 caps the unclipped branch: row 1's w = 1.5 with A = -1 gives
    # -min(min(1.5, 1.4) * -1, 1.2 * -1) = -min(-1.4, -1.2) = 1.4 instead of 1.5;
    # row 0's w = 1.5 with A = +1 is unchanged: -min(1.4, 1.2) = -1.2.
    # total = -2.7 + 0.8 + 1.4 = -0.5, token mean -0.1; the capped token has zero gradient.
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token", term=Clip(delta=1.4))
    assert float(loss.detach()) == pytest.approx(-0.1, abs=1e-12)
    assert float(stats["clip_frac_delta"]) == pytest.approx(0.2)
    loss.backward()
    assert float(logp.grad[1, 1]) == 0.0


def test_hand_derived_sequence_level_ratio_gspo():
    # row 0: A=+1, log-ratios [log 2, 0] -> w_0 = exp(log(2)/2) = sqrt(2) = 1.4142 > 1.2: clipped,
    #        every token's loss is -1.2, the row mean -1.2, no gradient.
    # row 1: A=+1, log-ratios [log 0.5, 0] -> w_1 = 1/sqrt(2) = 0.7071 < 0.8 but A > 0, so the
    #        unclipped branch is the min: loss -0.7071 per token, row mean -0.7071.
    # sequence norm: (-1.2 - 0.7071) / 2 = -0.95355.
    # gradient on row 1: d/dlogp_1t of (1/2)(-w_1) = -(1/2) w_1 (1/2) = -w_1/4 = -0.17678 (each token).
    old_logp = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[LN(2.0), 0.0], [LN(0.5), 0.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask, ratio_level="sequence", loss_norm="sequence")
    r2 = math.sqrt(2.0)
    assert float(loss.detach()) == pytest.approx((-1.2 - 1 / r2) / 2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-1 / r2 / 4] * 2], dtype=F64),
                               rtol=0, atol=1e-12)
    # the ratio statistics count each sequence's ratio once per token: mean (2*sqrt2 + 2/sqrt2) / 4
    assert float(stats["ratio_mean"]) == pytest.approx((2 * r2 + 2 / r2) / 4, abs=1e-12)
    assert float(stats["clip_frac_high"]) == pytest.approx(0.5)


def test_hand_derived_kl_penalty_k1_k2_k3_and_the_k3_gradient():
    # ref - logp = log 2: k1 = logp - ref = -log 2 = -0.693147
    #                     k2 = (log 2)^2 / 2 = 0.240227
    #                     k3 = 2 - log 2 - 1 = 0.306853, d k3 / d logp = 1 - pi_ref/pi = 1 - 2 = -1
    # ref - logp = 0:     every k is 0, and so is the gradient of k2 and k3.
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref_logp = torch.tensor([[-1.0 + LN(2.0), -2.0]], dtype=F64)
    ln2 = LN(2.0)
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k1"), torch.tensor([[-ln2, 0.0]], dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k2"), torch.tensor([[ln2 ** 2 / 2, 0.0]], dtype=F64))
    k3 = kl_penalty(logp, ref_logp)  # the default is k3
    torch.testing.assert_close(k3, torch.tensor([[1.0 - ln2, 0.0]], dtype=F64))
    k3.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.0]], dtype=F64))


def test_hand_derived_kl_term_is_added_per_token_and_normalized_with_the_policy_term():
    # one row, two tokens, w = 1 (old = logp), A = 0: the policy term is 0 and the loss is beta * mean k3.
    # k3 = [1 - log 2, 0] -> token mean (1 - log 2)/2 = 0.153426; beta = 0.1 -> 0.0153426.
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref_logp = torch.tensor([[-1.0 + LN(2.0), -2.0]], dtype=F64)
    loss, stats = clipped_surrogate(logp, logp, torch.zeros(1, dtype=F64), torch.ones(1, 2, dtype=torch.bool),
                                    ref_logp=ref_logp, beta=0.1)
    assert float(loss.detach()) == pytest.approx(0.1 * (1 - LN(2.0)) / 2, abs=1e-12)
    assert float(stats["kl"]) == pytest.approx((1 - LN(2.0)) / 2, abs=1e-12)
    assert float(stats["policy_loss"]) == 0.0


def test_hand_derived_cispo_clips_the_weight_but_every_token_keeps_its_gradient():
    # CISPO with the weight range [0.8, 1.2] on hand_batch: the weights c = clip(w) are
    #   row 0 (A=+1): w [1.5, 0.5, 1.0] -> c [1.2, 0.8, 1.0];  row 1 (A=-1): w [0.5, 1.5] -> c [0.8, 1.2]
    # token norm, N = 5: d loss / d logp_it = -A_i c_it / N, nonzero on the clipped tokens too:
    #   row 0: [-0.24, -0.16, -0.2];  row 1: [+0.16, +0.24, 0 (padding)]
    # PPO's clip zeroes the two clipped tokens instead: [0, -0.1, -0.2], [0, 0.3, 0] (test above).
    # value: -(1/N) sum c A logp with logp = -1 + log w; the pairs (1.5, 0.5) of the two rows cancel,
    # leaving -(1.0 * 1 * -1) / 5 = 0.2.
    logp, old_logp, adv, mask = hand_batch()
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token", term=Cispo(eps_low=0.2, eps_high=0.2))
    loss.backward()
    cispo_grad = logp.grad.clone()
    torch.testing.assert_close(cispo_grad, torch.tensor([[-0.24, -0.16, -0.2], [0.16, 0.24, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    assert float(loss.detach()) == pytest.approx(0.2, abs=1e-12)
    # clipped: below (w = 0.5, whatever A) twice, above (w = 1.5) twice; mean weight (1.2+0.8+1+0.8+1.2)/5
    expected_stats = dict(policy_loss=0.2, kl=0.0, clip_frac_low=0.4, clip_frac_high=0.4, clip_frac=0.8,
                          clip_frac_delta=0.0, ratio_mean=1.0, ratio_min=0.5, ratio_max=1.5, grad_weight_mean=1.0)
    assert_stats_close(stats, expected_stats, 1e-12)

    logp.grad = None
    clip_loss, _ = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token")
    clip_loss.backward()
    clipped = torch.tensor([[True, False, False], [True, False, False]])
    assert (logp.grad[clipped] == 0).all() and (cispo_grad[clipped] != 0).all()

    # The defaults (no lower bound, cap 5) clip nothing here: the weight is w itself, -A w / N.
    logp.grad = None
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token", term="cispo")
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.3, -0.1, -0.2], [0.1, 0.3, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    assert float(stats["clip_frac"]) == 0.0


def test_hand_derived_cispo_caps_a_runaway_weight_at_one_plus_eps_high():
    # w = 10 with A = +1: PPO's clip gives no gradient; CISPO's default cap 1 + 4 = 5 gives -5 (one token).
    old_logp = torch.zeros(1, 1, dtype=F64)
    logp = torch.full((1, 1), LN(10.0), dtype=F64, requires_grad=True)
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask, term=Cispo())
    loss.backward()
    assert float(logp.grad) == pytest.approx(-5.0, abs=1e-12)
    assert float(stats["clip_frac_high"]) == 1.0 and float(stats["grad_weight_mean"]) == pytest.approx(5.0)


def sapo_weight(w, tau):
    """d f(w) / d logp for SAPO's f(w) = sigmoid(tau (w - 1)) 4 / tau: 4 s (1 - s) w."""
    s = 1.0 / (1.0 + math.exp(-tau * (w - 1.0)))
    return 4.0 * s * (1.0 - s) * w


def test_hand_derived_sapo_gate_is_smooth_where_the_hard_clip_gives_zero_gradient():
    # Just outside the clip range [0.8, 1.2], on the side where PPO clips: w = 1.25 with A = +1 and
    # w = 0.75 with A = -1. Hard clip: gradient exactly 0. SAPO (tau_pos 1, tau_neg 1.05), token norm
    # over N = 2: -A * 4 s (1 - s) w / 2, close to the unclipped -A w / 2 (the gate is nearly flat at 1).
    old_logp = torch.zeros(2, 1, dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.ones(2, 1, dtype=torch.bool)
    grads = {}
    for loss_type in ("clip", "sapo"):
        logp = torch.tensor([[LN(1.25)], [LN(0.75)]], dtype=F64, requires_grad=True)
        loss, stats = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token", term=loss_type)
        loss.backward()
        grads[loss_type] = logp.grad
    assert (grads["clip"] == 0).all()
    expected = torch.tensor([[-sapo_weight(1.25, 1.0) / 2], [sapo_weight(0.75, 1.05) / 2]], dtype=F64)
    torch.testing.assert_close(grads["sapo"], expected, rtol=1e-12, atol=0)
    assert float(expected[0]) == pytest.approx(-1.25 / 2, rel=0.02)  # the gate has barely closed
    assert float(stats["clip_frac"]) == 0.0  # SAPO clips nothing
    # value: -A f(w) / N with f(w) = sigmoid(tau (w - 1)) * 4 / tau
    f = lambda w, tau: 4.0 / tau / (1.0 + math.exp(-tau * (w - 1.0)))  # noqa: E731
    assert float(loss.detach()) == pytest.approx((-f(1.25, 1.0) + f(0.75, 1.05)) / 2, abs=1e-12)


def test_sapo_gate_decays_away_from_ratio_one_and_faster_for_negative_advantages():
    # The factor on the ratio's gradient, 4 s (1 - s), is 1 at w = 1 and falls monotonically on both
    # sides; with tau_neg > tau_pos it falls faster for A < 0 than for A > 0 at the same w.
    ws = [0.3, 0.6, 0.8, 0.95, 1.0, 1.05, 1.2, 1.5, 2.0, 3.0]
    old_logp = torch.zeros(2, len(ws), dtype=F64)
    logp = torch.tensor([ws, ws], dtype=F64).log().requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.ones(2, len(ws), dtype=torch.bool)
    loss, _ = clipped_surrogate(logp, old_logp, adv, mask, loss_norm="token", term=Sapo(tau_pos=1.0, tau_neg=3.0))
    loss.backward()
    n = 2 * len(ws)
    gate = -logp.grad * n / adv[:, None] / torch.tensor(ws, dtype=F64)  # 4 s (1 - s), (2, len(ws))
    one = ws.index(1.0)
    torch.testing.assert_close(gate[:, one], torch.ones(2, dtype=F64), rtol=1e-12, atol=0)
    for row in gate:
        assert (row[:one].diff() > 0).all() and (row[one:].diff() < 0).all(), row
    others = [k for k in range(len(ws)) if k != one]
    assert (gate[1, others] < gate[0, others]).all()


# ----------------------------------------------------------------------------------------------
# Against the loop reference, every option
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio_level,loss_norm,kl_estimator", list(itertools.product(RATIO_LEVELS, NORMS, KL_KINDS)))
def test_matches_float64_loop_reference_values_stats_and_gradients(ratio_level, loss_norm, kl_estimator):
    for variant, (beta, delta, weights, epsilon_high) in enumerate(
        itertools.product((0.0, 0.05), (None, 1.5), (None, "row", "token"), (None, 0.28))
    ):
        logp, old_logp, ref_logp, adv, mask, is_tok, is_row = random_batch(seed=variant)
        is_weights = {None: None, "row": is_row, "token": is_tok}[weights]
        max_completion_length = 9 if variant % 2 else None
        kw = dict(ref_logp=ref_logp, beta=beta, term=Clip(epsilon_high=epsilon_high, delta=delta),
                  ratio_level=ratio_level, loss_norm=loss_norm, max_completion_length=max_completion_length,
                  is_weights=is_weights, kl_estimator=kl_estimator)
        (loss, stats, grad), (ref_loss, ref_stats, ref_grad) = fast_and_reference(logp, old_logp, adv, mask, **kw)
        where = f"variant {variant}: beta={beta} delta={delta} is_weights={weights} epsilon_high={epsilon_high}"
        assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), abs=1e-12), where
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12, msg=where)
        assert_stats_close(stats, ref_stats, 1e-12)


def test_the_reference_cases_actually_exercise_clipping_and_delta():
    # Guards the test above against vacuity: the random inputs must reach every branch.
    seen = dict(low=0.0, high=0.0, delta=0.0)
    for seed in range(24):
        logp, old_logp, _, adv, mask, _, _ = random_batch(seed)
        _, stats = clipped_surrogate(logp, old_logp, adv, mask, term=Clip(delta=1.5))
        seen["low"] += float(stats["clip_frac_low"])
        seen["high"] += float(stats["clip_frac_high"])
        seen["delta"] += float(stats["clip_frac_delta"])
    assert all(v > 0 for v in seen.values()), seen


# Each with its defaults and with a setting that clips (CISPO) or gates (SAPO) much harder.
VARIANT_PARAMS = {
    "cispo": (Cispo(), Cispo(eps_low=0.1, eps_high=0.15)),
    "sapo": (Sapo(), Sapo(tau_pos=3.0, tau_neg=6.0)),
}


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
@pytest.mark.parametrize("ratio_level,loss_norm,kl_estimator", list(itertools.product(RATIO_LEVELS, NORMS, KL_KINDS)))
def test_cispo_and_sapo_match_float64_loop_reference_values_stats_and_gradients(loss_type, ratio_level, loss_norm,
                                                                                kl_estimator):
    for variant, (beta, weights, term) in enumerate(
        itertools.product((0.0, 0.05), (None, "row", "token"), VARIANT_PARAMS[loss_type])
    ):
        logp, old_logp, ref_logp, adv, mask, is_tok, is_row = random_batch(seed=variant)
        is_weights = {None: None, "row": is_row, "token": is_tok}[weights]
        max_completion_length = 9 if variant % 2 else None
        kw = dict(ref_logp=ref_logp, beta=beta, ratio_level=ratio_level, loss_norm=loss_norm,
                  max_completion_length=max_completion_length, is_weights=is_weights, kl_estimator=kl_estimator,
                  term=term)
        (loss, stats, grad), (ref_loss, ref_stats, ref_grad) = fast_and_reference(logp, old_logp, adv, mask, **kw)
        where = f"variant {variant}: beta={beta} is_weights={weights} {term}"
        assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), abs=1e-12), where
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12, msg=where)
        assert_stats_close(stats, ref_stats, 1e-12)


def test_the_reference_cases_exercise_cispo_clipping_and_sapo_gating():
    # Guards the test above against vacuity: CISPO's harder setting clips on both sides, and SAPO's
    # gate moves the gradient weight visibly away from w (4 s (1 - s) < 1 off w = 1).
    seen = dict(low=0.0, high=0.0, gate=0.0)
    for seed in range(12):
        logp, old_logp, _, adv, mask, _, _ = random_batch(seed)
        _, stats = clipped_surrogate(logp, old_logp, adv, mask, term=VARIANT_PARAMS["cispo"][1])
        seen["low"] += float(stats["clip_frac_low"])
        seen["high"] += float(stats["clip_frac_high"])
        _, stats = clipped_surrogate(logp, old_logp, adv, mask, term=VARIANT_PARAMS["sapo"][1])
        seen["gate"] += float(stats["ratio_mean"] - stats["grad_weight_mean"])
    assert all(v > 0.05 for v in seen.values()), seen


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_on_policy_cispo_and_sapo_gradient_equals_plain_policy_gradient(loss_type, ratio_level):
    # w = 1: CISPO's weight is 1 and SAPO's gate slope 4 s (1 - s) w is 1 whatever tau (the 4 / tau
    # is what makes it so: non-default taus here), so both give -(1/N) sum_it mask_it A_i logp_it's gradient.
    logp, _, _, adv, mask, _, _ = random_batch(seed=5)
    logp = torch.where(mask, logp, -1.0)
    x = logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, x.detach(), adv, mask, loss_norm="token", ratio_level=ratio_level,
                                    term=Sapo(tau_pos=2.0, tau_neg=3.0) if loss_type == "sapo" else loss_type)
    loss.backward()
    y = logp.clone().requires_grad_()
    pg_loss = -(adv[:, None] * y * mask).sum() / mask.sum()
    pg_loss.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)
    assert float(stats["grad_weight_mean"]) == pytest.approx(1.0, abs=1e-12)
    assert float(stats["clip_frac"]) == 0.0
    if loss_type == "cispo":  # the value is the policy-gradient loss itself
        assert float(loss.detach()) == pytest.approx(float(pg_loss.detach()), abs=1e-12)
    else:  # -A f(1) = -A * (1/2) * 4 / tau = -2 A / tau per token
        tau = torch.where(adv > 0, 2.0, 3.0).to(F64)
        expected = -((2 * adv / tau)[:, None] * mask).sum() / mask.sum()
        assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-12)


# ----------------------------------------------------------------------------------------------
# DPPO and GMPO against verl's own formulas (verl/trainer/ppo/core_algos.py: compute_policy_loss_dppo_tv,
# compute_policy_loss_dppo_kl, compute_policy_loss_geo_mean), written out here as plain float64 references.
# ----------------------------------------------------------------------------------------------
def verl_dppo(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c, divergence):
    """verl's DPPO-Binary-TV / -KL loss with loss_agg_mode="token-mean"; advantages (B,) broadcast per token."""
    advantages = advantages[:, None].expand_as(log_prob)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        valid_positive = (prob - old_prob) <= high
        valid_negative = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive = (binary_kl <= high) | (prob <= old_prob)
        valid_negative = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, valid_positive, valid_negative).detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated_ratio * log_prob * valid
    mask = response_mask.to(log_prob.dtype)
    return (pg_losses * mask).sum() / mask.sum(), 1.0 - (valid * mask).sum() / mask.sum()


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    """verl's GMPO loss (geo_mean): the mean over rows of -A times the row's geometric-mean clipped ratio."""
    advantages = advantages[:, None].expand_as(log_prob)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -clip_low, clip_high)
    negative_approx_kl_min = sgn_advantage * torch.min(sgn_advantage * negative_approx_kl,
                                                       sgn_advantage * negative_approx_kl_clamp)
    mask_sum = mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * mask).sum(dim=-1) / (mask_sum + 1e-8))
    advantage = (advantages * mask).sum(dim=-1) / (mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


def clean_batch(seed, B=6, T=7, spread=0.35):
    """`random_batch` with finite values everywhere (verl's formulas multiply by the mask, so padding must be
    finite there), an empty row and a zero advantage kept."""
    logp, old_logp, _, adv, mask, _, _ = random_batch(seed, B=B, T=T, spread=spread)
    g = torch.Generator().manual_seed(seed + 100)
    filler = -3.0 * torch.rand(B, T, generator=g, dtype=F64)
    return torch.where(mask, logp, filler), torch.where(mask, old_logp, filler + 0.1), adv, mask


def ours_and_peer(term, peer, seed, **kw):
    logp, old_logp, adv, mask = clean_batch(seed)
    x, x_peer = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, old_logp, adv, mask, term=term, **kw)
    loss.backward()
    peer_out = peer(old_logp, x_peer, adv, mask)
    peer_loss = peer_out[0] if isinstance(peer_out, tuple) else peer_out
    peer_loss.backward()
    return (loss, stats, x.grad), (peer_loss, peer_out, x_peer.grad)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("knobs", [dict(), dict(low=0.02, high=0.03, ratio_cap=1.3)])
def test_dppo_matches_verls_formula_in_float64_values_and_gradients(divergence, knobs):
    term = (DppoTV if divergence == "tv" else DppoKL)(**knobs)
    peer = lambda o, x, a, m: verl_dppo(o, x, a, m, term.low, term.high, term.ratio_cap, divergence)  # noqa: E731
    dropped = truncated = 0.0
    for seed in range(6):
        (loss, stats, grad), (peer_loss, (_, peer_dropped), peer_grad) = ours_and_peer(term, peer, seed,
                                                                                        loss_norm="token")
        assert float(loss.detach()) == pytest.approx(float(peer_loss.detach()), rel=1e-12, abs=1e-14), seed
        torch.testing.assert_close(grad, peer_grad, rtol=1e-12, atol=1e-14)
        assert float(stats["clip_frac"]) == pytest.approx(float(peer_dropped), abs=1e-12)  # verl's pg_clipfrac
        dropped += float(stats["clip_frac"])
        truncated += float(stats["clip_frac_delta"])
    assert dropped > 0 and (truncated > 0 or knobs == {})  # the trust region and the cap both bound some token


@pytest.mark.parametrize("knobs", [dict(), dict(epsilon=0.1, epsilon_high=0.05)])
@pytest.mark.parametrize("spread", [0.35, 1.0])
def test_gmpo_matches_verls_geo_mean_in_float64_values_and_gradients(knobs, spread):
    term = Gmpo(**knobs)
    peer = lambda o, x, a, m: verl_geo_mean(o, x, a, m, term.epsilon, term.high)  # noqa: E731
    clipped = 0.0
    for seed in range(6):
        logp, old_logp, adv, mask = clean_batch(seed, spread=spread)
        x, x_peer = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        loss, stats = clipped_surrogate(x, old_logp, adv, mask, term=term, loss_norm="sequence")
        loss.backward()
        peer_loss = peer(old_logp, x_peer, adv, mask)
        peer_loss.backward()
        # verl adds 1e-8 to each row's token count: a relative difference of about 1e-8 / n_i
        assert float(loss.detach()) == pytest.approx(float(peer_loss.detach()), rel=1e-7, abs=1e-12), seed
        torch.testing.assert_close(x.grad, x_peer.grad, rtol=1e-7, atol=1e-12)
        clipped += float(stats["clip_frac"])
    assert clipped > 0  # the clip binds on some token


def test_hand_derived_gmpo_clips_log_ratios_then_takes_the_geometric_mean():
    # One row, A = +1, log-ratios [0.5, -0.5, 0.1], epsilon 0.4: A > 0 clips above only: [0.4, -0.5, 0.1],
    # mean 0.0 -> row ratio 1, loss -1. Gradient: the clipped token none; the others -A * 1 / 3 each.
    old_logp = torch.zeros(1, 3, dtype=F64)
    logp = torch.tensor([[0.5, -0.5, 0.1]], dtype=F64).requires_grad_()
    loss, stats = clipped_surrogate(logp - 1.0, old_logp - 1.0, torch.ones(1, dtype=F64),
                                    torch.ones(1, 3, dtype=torch.bool), term="gmpo")
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1 / 3, -1 / 3]], dtype=F64), rtol=0, atol=1e-12)
    assert float(stats["clip_frac_high"]) == pytest.approx(1 / 3) and float(stats["clip_frac_low"]) == 0.0


def test_hand_derived_dppo_tv_drops_a_token_whose_probability_rose_past_the_bound():
    # A = +1; probabilities old [0.5, 0.1] -> new [0.7, 0.15]: rises 0.2 (> 0.15: dropped) and 0.05 (kept).
    # The kept token: -sg(w) * A * logp with w = 1.5: gradient -1.5 / N, N = 2; the dropped one 0.
    old_logp = torch.tensor([[0.5, 0.1]], dtype=F64).log()
    logp = torch.tensor([[0.7, 0.15]], dtype=F64).log().requires_grad_()
    loss, stats = clipped_surrogate(logp, old_logp, torch.ones(1, dtype=F64), torch.ones(1, 2, dtype=torch.bool),
                                    term="dppo_tv", loss_norm="token")
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.75]], dtype=F64), rtol=0, atol=1e-12)
    assert float(loss.detach()) == pytest.approx(-1.5 * math.log(0.15) / 2, abs=1e-12)
    assert float(stats["clip_frac_high"]) == 0.5 and float(stats["grad_weight_mean"]) == pytest.approx(0.75)


@pytest.mark.parametrize("loss_type", list(POLICY_TERMS))
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_on_policy_every_term_gives_the_plain_policy_gradient(loss_type, ratio_level):
    # w = 1: nothing is clipped, dropped or gated, so every term's gradient is -(1/N) sum_it mask_it A_i logp_it's.
    logp, _, _, adv, mask, _, _ = random_batch(seed=5)
    logp = torch.where(mask, logp, -1.0)
    x = logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, x.detach(), adv, mask, loss_norm="token", ratio_level=ratio_level,
                                    term=loss_type)
    loss.backward()
    y = logp.clone().requires_grad_()
    (-(adv[:, None] * y * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)
    assert float(stats["grad_weight_mean"]) == pytest.approx(1.0, abs=1e-12) and float(stats["clip_frac"]) == 0.0


@pytest.mark.parametrize("loss_type", LOOP_TERMS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-6)])
def test_low_precision_inputs_are_computed_in_float32(dtype, tol, loss_type):
    # bf16 inputs are upcast, so the result equals the float64 reference on the same (rounded) values
    # to float32 precision, not to bf16 precision.
    logp, old_logp, ref_logp, adv, mask, is_tok, _ = random_batch(seed=3)
    kw = dict(beta=0.05, term=Clip(delta=1.5) if loss_type == "clip" else loss_type, ratio_level="token",
              loss_norm="token", is_weights=is_tok)
    lo = [t.to(dtype) for t in (logp, old_logp, ref_logp)]
    x = lo[0].clone().requires_grad_()
    loss, stats = clipped_surrogate(x, lo[1], adv.to(dtype), mask, ref_logp=lo[2], **kw)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype
    x_ref = lo[0].to(F64).requires_grad_()
    ref_loss, _ = surrogate_loop(x_ref, lo[1].to(F64), adv.to(dtype).to(F64), mask, ref_logp=lo[2].to(F64),
                                 **kw)
    ref_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), abs=tol, rel=tol)
    grad_tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the gradient is rounded back to the input dtype
    torch.testing.assert_close(x.grad.to(F64), x_ref.grad, rtol=grad_tol, atol=grad_tol)


# ----------------------------------------------------------------------------------------------
# Edge cases
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", list(POLICY_TERMS))
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_norm", NORMS)
def test_all_masked_rows_give_zero_gradient_and_no_nan(ratio_level, loss_norm, loss_type):
    logp, old_logp, ref_logp, adv, mask, is_tok, _ = random_batch(seed=7)
    assert not mask[1].any()  # row 1 is empty and holds garbage (inf log-ratio, nan ref, nan weights)
    x = logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, old_logp, adv, mask, ref_logp=ref_logp, beta=0.1,
                                    term=Clip(delta=2.0) if loss_type == "clip" else loss_type,
                                    ratio_level=ratio_level, loss_norm=loss_norm, is_weights=is_tok)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    assert (x.grad[~mask] == 0).all()
    assert (x.grad[0] != 0).any()  # the full row does get a gradient


@pytest.mark.parametrize("loss_type", list(POLICY_TERMS))
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("loss_norm", NORMS)
def test_a_batch_with_no_counted_token_gives_zero_loss_zero_grad_and_zero_stats(ratio_level, loss_norm, loss_type):
    logp, old_logp, ref_logp, adv, _, is_tok, _ = random_batch(seed=1)
    mask = torch.zeros_like(logp, dtype=torch.bool)
    x = logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, old_logp, adv, mask, ref_logp=ref_logp, beta=0.1,
                                    ratio_level=ratio_level, loss_norm=loss_norm, is_weights=is_tok, term=loss_type)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert (x.grad == 0).all()
    assert all(float(v) == 0.0 for v in stats.values()), stats


def test_sequence_norm_averages_over_all_rows_counting_empty_ones():
    # Decision: an empty row contributes 0 but counts in B. Appending one empty row to a batch of B
    # rows multiplies the sequence-loss_norm loss by B / (B + 1); the token norm is unchanged.
    logp, old_logp, ref_logp, adv, mask, _, _ = random_batch(seed=11)
    keep = mask.any(-1)
    logp, old_logp, ref_logp, adv, mask = (t[keep] for t in (logp, old_logp, ref_logp, adv, mask))
    B = logp.shape[0]
    pad = lambda t, v: torch.cat([t, torch.full_like(t[:1], v)])  # noqa: E731
    args = (old_logp, adv, mask)
    wider = (pad(old_logp, -1.0), pad(adv, 2.0), pad(mask, False))
    kw = dict(ref_logp=ref_logp, beta=0.05)
    kw_wider = dict(ref_logp=pad(ref_logp, -1.0), beta=0.05)
    seq, _ = clipped_surrogate(logp, *args, loss_norm="sequence", **kw)
    seq_wider, _ = clipped_surrogate(pad(logp, -0.5), *wider, loss_norm="sequence", **kw_wider)
    assert float(seq_wider.detach()) == pytest.approx(float(seq.detach()) * B / (B + 1), abs=1e-12)
    tok, _ = clipped_surrogate(logp, *args, loss_norm="token", **kw)
    tok_wider, _ = clipped_surrogate(pad(logp, -0.5), *wider, loss_norm="token", **kw_wider)
    assert float(tok_wider.detach()) == pytest.approx(float(tok.detach()), abs=1e-12)


@pytest.mark.parametrize("loss_type", LOOP_TERMS)
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_single_token_completions_T1_with_G2_advantages_match_reference(ratio_level, loss_type):
    # End to end at the smallest shapes: 3 prompts x G=2, one token each.
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, -1.0, 3.0], dtype=F64)
    adv, adv_stats = group_advantages(rewards, num_generations=2)
    assert float(adv_stats["frac_zero_std"]) == pytest.approx(1 / 3)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 1, generator=g, dtype=F64)
    old_logp = logp + 0.4 * torch.randn(6, 1, generator=g, dtype=F64)
    ref_logp = logp + 0.2 * torch.randn(6, 1, generator=g, dtype=F64)
    mask = torch.tensor([[True], [True], [True], [False], [True], [True]])
    for loss_norm in NORMS:
        kw = dict(ref_logp=ref_logp, beta=0.04, ratio_level=ratio_level, loss_norm=loss_norm, term=loss_type)
        (loss, stats, grad), (ref_loss, ref_stats, ref_grad) = fast_and_reference(logp, old_logp, adv, mask, **kw)
        assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), abs=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert_stats_close(stats, ref_stats, 1e-12)


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_on_policy_token_norm_gradient_equals_plain_policy_gradient(ratio_level):
    # old_logp = logp.detach(), beta 0: w = 1 everywhere, no clipping is active, and
    # d loss / d logp_it = -A_i * mask_it / N: the gradient of -(1/N) sum_it mask_it A_i logp_it.
    # (For the sequence ratio dw_i/dlogp_it = w_i/n_i and the n_i tokens of row i add up to the same.)
    logp, _, _, adv, mask, _, _ = random_batch(seed=5)
    logp = torch.where(mask, logp, -1.0)
    x = logp.clone().requires_grad_()
    loss, stats = clipped_surrogate(x, x.detach(), adv, mask, loss_norm="token", ratio_level=ratio_level)
    loss.backward()
    y = logp.clone().requires_grad_()
    pg_loss = -(adv[:, None] * y * mask).sum() / mask.sum()
    pg_loss.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)
    assert float(stats["clip_frac"]) == 0.0 and float(stats["ratio_mean"]) == 1.0
    # the loss value is the policy-gradient loss with logp replaced by 1: -(1/N) sum A_i mask_it
    assert float(loss.detach()) == pytest.approx(float(-(adv[:, None] * mask).sum() / mask.sum()), abs=1e-12)


def test_old_logp_none_or_undetached_logp_mean_the_current_policy():
    logp, _, _, adv, mask, _, _ = random_batch(seed=6)
    logp = torch.where(mask, logp, -1.0)
    grads = []
    for old in ("detached", "none", "same tensor"):
        x = logp.clone().requires_grad_()
        old_logp = {"detached": x.detach(), "none": None, "same tensor": x}[old]
        loss, _ = clipped_surrogate(x, old_logp, adv, mask)
        loss.backward()
        grads.append(x.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[2], grads[0], rtol=0, atol=0)


def test_is_weights_per_row_equal_per_token_broadcast_and_get_no_gradient():
    logp, old_logp, _, adv, mask, _, is_row = random_batch(seed=8)
    w_row = is_row.clone().requires_grad_()
    x1 = logp.clone().requires_grad_()
    loss_row, _ = clipped_surrogate(x1, old_logp, adv, mask, is_weights=w_row)
    loss_row.backward()
    x2 = logp.clone().requires_grad_()
    loss_tok, _ = clipped_surrogate(x2, old_logp, adv, mask, is_weights=is_row[:, None].expand_as(logp))
    loss_tok.backward()
    assert float(loss_row.detach()) == pytest.approx(float(loss_tok.detach()), abs=1e-14)
    torch.testing.assert_close(x1.grad, x2.grad)
    assert w_row.grad is None
    plain, _ = clipped_surrogate(logp, old_logp, adv, mask)
    assert float(plain.detach()) != pytest.approx(float(loss_row.detach()))  # the weights do change the loss


def test_beta_zero_with_ref_logp_reports_kl_but_leaves_loss_and_gradient_unchanged():
    logp, old_logp, ref_logp, adv, mask, _, _ = random_batch(seed=9)
    x1 = logp.clone().requires_grad_()
    with_ref, stats = clipped_surrogate(x1, old_logp, adv, mask, ref_logp=ref_logp, beta=0.0)
    with_ref.backward()
    x2 = logp.clone().requires_grad_()
    without, stats_without = clipped_surrogate(x2, old_logp, adv, mask)
    without.backward()
    assert float(with_ref.detach()) == float(without.detach())
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    expected_kl = kl_penalty(logp, torch.where(mask, ref_logp, logp))[mask].mean()
    assert float(stats["kl"]) == pytest.approx(float(expected_kl), abs=1e-12) and float(stats["kl"]) > 0
    assert float(stats_without["kl"]) == 0.0


def test_inputs_are_not_mutated_and_stats_are_detached():
    logp, old_logp, ref_logp, adv, mask, is_tok, _ = random_batch(seed=2)
    x = logp.clone().requires_grad_()
    before = [t.clone() for t in (x.detach(), old_logp, ref_logp, adv, mask, is_tok)]
    loss, stats = clipped_surrogate(x, old_logp, adv, mask, ref_logp=ref_logp, beta=0.1, is_weights=is_tok,
                                    ratio_level="sequence")
    loss.backward()
    after = (x.detach(), old_logp, ref_logp, adv, mask, is_tok)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert loss.requires_grad and loss.dim() == 0
    assert list(stats) == list(STAT_KEYS)
    assert all(v.dim() == 0 and v.grad_fn is None for v in stats.values())


def test_kl_penalty_matches_loop_and_k2_k3_are_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(4, 5, generator=g, dtype=F64)
    ref_logp = logp + torch.randn(4, 5, generator=g, dtype=F64)
    for kind in KL_KINDS:
        out = kl_penalty(logp, ref_logp, kind)
        assert out.shape == (4, 5)
        for i, t in itertools.product(range(4), range(5)):
            d = float(ref_logp[i, t] - logp[i, t])
            expected = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[kind]
            assert float(out[i, t]) == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert (kl_penalty(logp, ref_logp, "k2") >= 0).all() and (kl_penalty(logp, ref_logp, "k3") >= 0).all()
    # k3 stays accurate for tiny differences (expm1): exp(x) - x - 1 ~ x^2 / 2
    tiny = kl_penalty(torch.zeros(1, 1, dtype=torch.float32), torch.full((1, 1), 1e-4), "k3")
    assert float(tiny) == pytest.approx(0.5e-8, rel=1e-3)


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------
def _ok_inputs(B=2, T=3):
    return dict(logp=torch.zeros(B, T), old_logp=torch.zeros(B, T), adv=torch.zeros(B),
                mask=torch.ones(B, T, dtype=torch.bool))


@pytest.mark.parametrize("name,bad_shape", [("old_logp", (2, 4)), ("mask", (3, 3)), ("adv", (3,)),
                                            ("adv", (2, 1)), ("ref_logp", (2,)), ("is_weights", (3,)),
                                            ("is_weights", (2, 3, 1))])
def test_shape_mismatch_raises_valueerror_naming_both_shapes(name, bad_shape):
    kw = _ok_inputs()
    bad = torch.zeros(bad_shape, dtype=torch.bool if name == "mask" else torch.float32)
    kw[name] = bad
    with pytest.raises(ValueError) as err:
        clipped_surrogate(kw.pop("logp"), kw.pop("old_logp"), kw.pop("adv"), kw.pop("mask"), **kw)
    msg = str(err.value)
    assert name in msg and str(bad_shape) in msg and "(2, 3)" in msg


def test_kl_penalty_and_logp_shape_checks():
    with pytest.raises(ValueError, match=r"ref_logp has shape \(2, 4\) but logp has shape \(2, 3\)"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"logp has shape \(6,\); expected \(B, T\)"):
        clipped_surrogate(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.bool))


@pytest.mark.parametrize("option,choices", [("loss_norm", NORMS), ("ratio_level", RATIO_LEVELS),
                                            ("kl_estimator", KL_KINDS), ("term", tuple(POLICY_TERMS))])
def test_unknown_option_raises_valueerror_listing_the_choices(option, choices):
    kw = _ok_inputs()
    with pytest.raises(ValueError) as err:
        clipped_surrogate(**kw, **{option: "bogus"})
    assert option in str(err.value) and all(repr(c) in str(err.value) for c in choices)
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3'"):
        kl_penalty(kw["logp"], kw["old_logp"], "k4")


def test_bad_numbers_and_dtypes_raise_valueerror():
    kw = _ok_inputs()
    with pytest.raises(ValueError, match="needs ref_logp"):
        clipped_surrogate(**kw, beta=0.1)
    with pytest.raises(ValueError, match="beta=-0.1"):
        clipped_surrogate(**kw, beta=-0.1, ref_logp=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mask has dtype torch.int64"):
        clipped_surrogate(**{**kw, "mask": torch.ones(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"Clip\(delta=1.1\), flag --delta"):
        Clip(delta=1.1)  # below 1 + epsilon_high = 1.2
    with pytest.raises(ValueError, match=r"Clip\(epsilon=-0.1\), flag --epsilon"):
        Clip(epsilon=-0.1)
    with pytest.raises(ValueError, match="epsilon_high=nan.*finite"):
        Clip(epsilon_high=float("nan"))
    with pytest.raises(ValueError, match="term=0.2: pass a policy term"):
        clipped_surrogate(**kw, term=0.2)
    with pytest.raises(ValueError, match="max_completion_length=0"):
        clipped_surrogate(**kw, loss_norm="constant", max_completion_length=0)
    with pytest.raises(ValueError, match="floating dtype"):
        clipped_surrogate(**{**kw, "logp": torch.zeros(2, 3, dtype=torch.long)})
    clipped_surrogate(**kw, term=Clip(delta=1.2))  # the boundary 1 + epsilon_high is allowed


def test_cispo_and_sapo_take_only_their_own_knobs_each_in_range():
    for term in (Cispo, Sapo):
        with pytest.raises(TypeError, match="delta"):  # the clip's cap is no knob of theirs
            term(delta=3.0)
    with pytest.raises(ValueError, match=r"Cispo\(eps_low=-0.1\), flag --cispo-eps-low"):
        Cispo(eps_low=-0.1)
    with pytest.raises(ValueError, match=r"Cispo\(eps_high=-1\), flag --cispo-eps-high"):
        Cispo(eps_high=-1)
    with pytest.raises(ValueError, match=r"Sapo\(tau_pos=0\), flag --sapo-tau-pos"):
        Sapo(tau_pos=0)
    with pytest.raises(ValueError, match=r"Sapo\(tau_neg=-1\), flag --sapo-tau-neg"):
        Sapo(tau_neg=-1)
    clipped_surrogate(**_ok_inputs(), term=Cispo(eps_low=0.0, eps_high=0.0))  # a weight of 1: allowed
