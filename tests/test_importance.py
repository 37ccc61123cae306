"""importance_weights: hand-worked float64 cases for each level and mode, stats, and input checks."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.loss.importance import importance_weights

F64 = torch.float64


def _case():
    # Row 0: ratios e^0.5, e^-0.25, e^1.0 (all counted). Row 1: ratio e^2 then padding.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]], dtype=F64)
    sampler_logp = torch.tensor([[-1.5, -1.75, -1.5], [-2.1, 50.0, -50.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return logp, sampler_logp, mask


def test_token_truncate_caps_each_ratio_at_cap_and_zeroes_padding():
    logp, sampler_logp, mask = _case()
    w, stats = importance_weights(logp, sampler_logp, mask, is_level="token", is_correction="truncate", is_cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-0.25), 2.0], [2.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-12)
    ratios = [math.exp(0.5), math.exp(-0.25), math.exp(1.0), math.exp(2.0)]
    assert stats["is_ratio_mean"].item() == pytest.approx(sum(ratios) / 4, rel=1e-12)
    assert stats["is_ratio_max"].item() == pytest.approx(math.exp(2.0), rel=1e-12)
    assert stats["is_ratio_min"].item() == pytest.approx(math.exp(-0.25), rel=1e-12)
    assert stats["is_clipped_frac"].item() == pytest.approx(2 / 4)


def test_token_mask_zeroes_ratios_above_cap_and_keeps_the_rest_unclipped():
    logp, sampler_logp, mask = _case()
    w, stats = importance_weights(logp, sampler_logp, mask, is_level="token", is_correction="mask", is_cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-0.25), 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-12)
    assert stats["is_clipped_frac"].item() == pytest.approx(2 / 4)


def test_mask_with_cap_low_also_drops_ratios_below_it():
    logp, sampler_logp, mask = _case()
    w, stats = importance_weights(logp, sampler_logp, mask, is_correction="mask", is_cap=2.0, is_cap_low=0.9)
    # e^-0.25 = 0.78 < 0.9 is dropped too; e^0.5 = 1.65 stays.
    expected = torch.tensor([[math.exp(0.5), 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-12)
    assert stats["is_clipped_frac"].item() == pytest.approx(3 / 4)


def test_sequence_level_uses_the_geometric_mean_ratio_of_each_row():
    logp, sampler_logp, mask = _case()
    w, stats = importance_weights(logp, sampler_logp, mask, is_level="sequence", is_correction="truncate", is_cap=2.0)
    r0 = math.exp((0.5 - 0.25 + 1.0) / 3)  # 1.53: below the cap
    expected = torch.tensor([[r0, r0, r0], [2.0, 0.0, 0.0]], dtype=F64)  # row 1: e^2 truncated
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-12)
    assert stats["is_ratio_mean"].item() == pytest.approx((r0 + math.exp(2.0)) / 2, rel=1e-12)
    assert stats["is_clipped_frac"].item() == pytest.approx(1 / 4)  # row 1's one token

    w_mask, _ = importance_weights(logp, sampler_logp, mask, is_level="sequence", is_correction="mask", is_cap=2.0)
    torch.testing.assert_close(w_mask, torch.tensor([[r0, r0, r0], [0.0, 0.0, 0.0]], dtype=F64))


def test_none_gives_the_mask_as_weights():
    logp, sampler_logp, mask = _case()
    w, stats = importance_weights(logp, sampler_logp, mask, is_correction="none")
    torch.testing.assert_close(w, mask.to(F64))
    assert stats["is_clipped_frac"].item() == 0.0


def test_identical_log_probs_give_weight_one_everywhere_it_counts():
    torch.manual_seed(0)
    logp = -torch.rand(3, 5, dtype=torch.float32) * 4
    mask = torch.rand(3, 5) > 0.3
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            w, stats = importance_weights(logp, logp.clone(), mask, is_level=level, is_correction=mode)
            torch.testing.assert_close(w, mask.float())
            assert stats["is_clipped_frac"].item() == 0.0


def test_weights_are_detached_and_float32_for_bf16_inputs():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    sampler_logp = torch.tensor([[-1.0078125, -2.0]], dtype=torch.float32)
    w, stats = importance_weights(logp, sampler_logp, torch.ones(1, 2, dtype=torch.bool))
    assert not w.requires_grad and w.dtype == torch.float32
    assert all(not v.requires_grad for v in stats.values())
    # The log-ratio is taken in float32: exp(0.0078125), not rounded away.
    assert w[0, 0].item() == pytest.approx(math.exp(0.0078125), rel=1e-6)


def test_all_masked_rows_and_t_equal_one_are_finite():
    logp = torch.tensor([[-1.0], [-3.0]], dtype=F64)
    sampler_logp = torch.tensor([[-1.2], [900.0]], dtype=F64)  # padding value would overflow exp
    mask = torch.tensor([[True], [False]])
    for level in ("token", "sequence"):
        w, stats = importance_weights(logp, sampler_logp, mask, is_level=level)
        torch.testing.assert_close(w, torch.tensor([[math.exp(0.2)], [0.0]], dtype=F64))
        assert all(torch.isfinite(v) for v in stats.values())
    w, stats = importance_weights(logp, sampler_logp, torch.zeros(2, 1, dtype=torch.bool))
    assert w.abs().sum() == 0 and stats["is_ratio_mean"].item() == 1.0


def test_weights_scale_a_per_token_loss_gradient_exactly():
    # The trainer multiplies its per-token loss by the weights: the gradient is scaled, not redirected.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    sampler_logp = torch.tensor([[-1.5, -1.75, -1.5]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, _ = importance_weights(logp, sampler_logp, mask, is_cap=2.0)
    (w * logp).sum().backward()
    torch.testing.assert_close(logp.grad, w)


@pytest.mark.parametrize("kw, match", [
    (dict(is_level="row"), "is_level"), (dict(is_correction="clip"), "is_correction"), (dict(is_cap=0.0), "is_cap"),
    (dict(is_cap=2.0, is_cap_low=3.0), "is_cap_low"),
])
def test_bad_arguments_raise_one_line_value_errors(kw, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        importance_weights(x, x, torch.ones(1, 2, dtype=torch.bool), **kw)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="same"):
        importance_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
