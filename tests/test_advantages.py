"""grpo.loss.group_advantages against hand-derived cases and a float64 loop reference (statistics.stdev,
the unbiased std), exact zeros for constant groups, and input checks."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from grpo.loss import SCALES, group_advantages

F64 = torch.float64


def advantages_loop(rewards: list[float], G: int, scale: str, eps: float) -> tuple[list[float], float]:
    batch_std = statistics.stdev(rewards)  # unbiased, like the implementation
    out, constant_groups = [], 0
    for start in range(0, len(rewards), G):
        group = rewards[start:start + G]
        if max(group) == min(group):
            out += [0.0] * G
            constant_groups += 1
            continue
        mean = sum(group) / G
        std = {"group": statistics.stdev(group), "batch": batch_std, "none": None}[scale]
        out += [(r - mean) / (std + eps) if std is not None else r - mean for r in group]
    return out, constant_groups / (len(rewards) // G)


def test_hand_derived_G2_all_scales():
    # G = 2, groups [1, 3] and [2, 2]:
    #   group 0: mean 2, unbiased std sqrt(((1-2)^2 + (3-2)^2) / (2-1)) = sqrt(2) -> A = -+1/(sqrt2 + eps)
    #   group 1: constant -> A = 0, and frac_zero_std = 1/2
    #   batch:   mean 2, unbiased std sqrt((1 + 1 + 0 + 0) / 3) = sqrt(2/3) -> group 0: -+1/(sqrt(2/3) + eps)
    #   none:    A = r - mean = [-1, 1, 0, 0]
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    eps = 1e-4
    expected = {
        "group": [-1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps), 0.0, 0.0],
        "batch": [-1 / (math.sqrt(2 / 3) + eps), 1 / (math.sqrt(2 / 3) + eps), 0.0, 0.0],
        "none": [-1.0, 1.0, 0.0, 0.0],
    }
    for scale, values in expected.items():
        adv, stats = group_advantages(rewards, 2, scale_rewards=scale, eps=eps)
        torch.testing.assert_close(adv, torch.tensor(values), rtol=1e-6, atol=1e-7)
        assert float(stats["frac_zero_std"]) == 0.5
        assert float(stats["reward_mean"]) == 2.0
        assert float(stats["reward_std"]) == pytest.approx(math.sqrt(2 / 3), rel=1e-6)


def test_hand_derived_G4_uses_the_unbiased_std():
    # rewards [0, 0, 0, 4]: mean 1, squared deviations 1 + 1 + 1 + 9 = 12,
    # unbiased std sqrt(12 / 3) = 2 (the biased one would be sqrt(3)), so A = [-0.5, -0.5, -0.5, 1.5].
    adv, _ = group_advantages(torch.tensor([0.0, 0.0, 0.0, 4.0]), 4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, -0.5, -0.5, 1.5]))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("G", [2, 3, 8])
def test_matches_float64_loop_reference(scale, G):
    g = torch.Generator().manual_seed(G)
    P = 6
    # integer-valued rewards, like a tiered reward, so that some groups come out constant
    rewards = torch.randint(-2, 3, (P * G,), generator=g).to(F64) * 1.5
    rewards[:G] = 0.7  # one constant group for sure
    adv, stats = group_advantages(rewards, G, scale_rewards=scale, eps=1e-4)
    expected, frac = advantages_loop(rewards.tolist(), G, scale, 1e-4)
    assert adv.dtype == F64 and adv.shape == (P * G,)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)
    assert float(stats["frac_zero_std"]) == pytest.approx(frac)
    assert 0 < frac < 1  # both kinds of group are present


@pytest.mark.parametrize("scale", SCALES)
def test_each_group_has_zero_mean_and_group_scale_gives_unit_unbiased_std(scale):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(5 * 4, generator=g, dtype=F64) * 3 + 2
    adv, _ = group_advantages(rewards, 4, scale_rewards=scale, eps=0.0)
    per_group = adv.view(5, 4)
    torch.testing.assert_close(per_group.mean(-1), torch.zeros(5, dtype=F64), rtol=0, atol=1e-12)
    if scale == "group":
        torch.testing.assert_close(per_group.std(-1), torch.ones(5, dtype=F64), rtol=1e-12, atol=0)
    # shifting every reward by a constant changes nothing
    shifted, _ = group_advantages(rewards + 10.0, 4, scale_rewards=scale, eps=0.0)
    torch.testing.assert_close(shifted, adv, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scale", SCALES)
def test_constant_groups_get_exactly_zero_even_when_the_mean_rounds(scale):
    # The mean of seven 0.7s is not 0.7 in floating point (float32 and float64 alike), so r - mean is
    # ~1e-8 (or ~1e-16) instead of 0, and divided by a std near 0 plus eps it would not be 0. The
    # function must give exactly 0 for such a group.
    for dtype in (torch.float32, F64):
        rewards = torch.tensor([0.7] * 7 + [0.0] * 6 + [1.0], dtype=dtype)
        group = rewards[:7]
        assert (group - group.mean() != 0).all()  # the premise
        adv, stats = group_advantages(rewards, 7, scale_rewards=scale, eps=1e-12)
        assert (adv[:7] == 0).all()
        assert (adv[7:] != 0).all()
        assert float(stats["frac_zero_std"]) == 0.5


@pytest.mark.parametrize("scale", SCALES)
def test_a_fully_constant_batch_gives_zeros_without_nan(scale):
    adv, stats = group_advantages(torch.full((8,), 3.0), 4, scale_rewards=scale, eps=0.0)
    assert (adv == 0).all() and not adv.isnan().any()
    assert float(stats["frac_zero_std"]) == 1.0


def test_dtypes_detach_and_no_mutation():
    ints = torch.tensor([1, 0, 1, 1])
    adv, stats = group_advantages(ints, 2)
    assert adv.dtype == torch.float32 and stats["frac_zero_std"].dtype == torch.float32
    assert group_advantages(ints.to(torch.bfloat16), 2)[0].dtype == torch.float32
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0], requires_grad=True)
    before = rewards.detach().clone()
    adv, stats = group_advantages(rewards, 2)
    assert not adv.requires_grad and all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    assert torch.equal(rewards.detach(), before)
    assert set(stats) == {"frac_zero_std", "reward_mean", "reward_std"}


def test_input_checks_raise_valueerror():
    with pytest.raises(ValueError, match=r"rewards has shape \(5,\) but num_generations is 2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"rewards has shape \(4, 3\)"):
        group_advantages(torch.zeros(4, 3), 2)  # one column per reward function: sum them first
    with pytest.raises(ValueError, match=r"rewards has shape \(0,\)"):
        group_advantages(torch.zeros(0), 2)
    with pytest.raises(ValueError, match="num_generations=1"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")
    with pytest.raises(ValueError, match="eps=-1"):
        group_advantages(torch.zeros(4), 2, eps=-1)
