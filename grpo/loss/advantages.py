"""Group-relative advantages: GRPO's replacement for a learned value function.

`group_advantages` turns one scalar reward per completion into one advantage per completion by
comparing each completion with the others sampled for the same prompt. It deliberately is not a
reward function (see `grpo.rewards`) and does no per-token credit assignment: every token of a
completion gets its completion's advantage inside `clipped_surrogate`.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_tensor, shape_str

SCALES = ("group", "batch", "none")  # what the centred rewards are divided by


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Advantages A = (r - group mean) / (std + eps), one per completion, and a few statistics.

    Args:
        rewards: (P*G,) one total reward per completion, in group order: rows g*G ... g*G + G-1 are
            the G completions of prompt g (the order of `Rollout`).
        num_generations: G, completions per prompt (at least 2: GRPO compares completions of one prompt).
        scale_rewards: what to divide by after subtracting the group mean:
            "group": the std of the group (GRPO, DeepSeekMath, Shao et al. 2024, sec. 4.1.2);
            "batch": the std of all P*G rewards (batch-level scaling, as in TRL's scale_rewards="batch");
            "none":  nothing, A = r - group mean (Dr. GRPO, Liu et al. 2025: dividing by the group std
                     up-weights prompts that are almost always or almost never solved).
        eps: added to the std, so a group whose rewards barely differ gets a large but finite advantage.

    Formula, for completion j of group g with rewards r_g1 ... r_gG::

        mean_g = (1/G) sum_k r_gk
        std_g  = sqrt( (1/(G-1)) sum_k (r_gk - mean_g)^2 )     unbiased (Bessel's correction)
        A_gj   = (r_gj - mean_g) / (std_g + eps)               ("group"; "batch" uses the std of all
                                                                P*G rewards, also unbiased)

    Which std, and why: the unbiased one (`torch.std`'s default, correction=1). The paper writes only
    "std"; TRL and verl, with which the reference recipes were run, use the unbiased std, so with it
    advantages, and hence the balance against the KL term beta, match theirs. The biased std would
    give every non-constant group advantages of mean square exactly 1; the unbiased one gives
    (G-1)/G, a constant factor sqrt(G/(G-1)) (1.15 at G=4, 1.41 at G=2) that Adam largely absorbs.

    A group whose G rewards are all equal carries no signal; its advantages are set to exactly 0
    for every `scale_rewards` (not merely close to 0 after rounding: the mean of three 0.1s is not 0.1 in
    floating point). Such groups are detected exactly (max == min), and their fraction is reported:
    a high frac_zero_std means most prompts are too easy or too hard for the current policy.

    Returns:
        adv: (P*G,) float32 (float64 for float64 rewards), detached.
        stats: dict of detached 0-dim tensors:
            "frac_zero_std": fraction of groups whose rewards are all equal (advantage 0);
            "reward_mean": mean of all rewards; "reward_std": unbiased std of all rewards.
            Call float() on a stat to log it.
    """
    check_tensor("rewards", rewards)
    check_choice("scale_rewards", scale_rewards, SCALES)
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations={num_generations!r}: GRPO compares completions of one prompt; use an "
                         "int >= 2")
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % num_generations != 0:
        raise ValueError(f"rewards has shape {shape_str(rewards)} but num_generations is {num_generations}; rewards "
                         "must be (P*G,), one total reward per completion, a non-zero multiple of num_generations "
                         "(sum reward columns first, e.g. rewards.sum(-1))")
    if eps < 0:
        raise ValueError(f"eps={eps}: must be >= 0")

    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.detach().to(dtype).view(-1, num_generations)  # (P, G)
    centered = r - r.mean(-1, keepdim=True)  # (P, G)
    if scale_rewards == "group":
        adv = centered / (r.std(-1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        adv = centered / (r.std() + eps)
    else:
        adv = centered
    constant = r.amax(-1) == r.amin(-1)  # (P,) True where the group carries no signal
    adv = torch.where(constant.unsqueeze(1), 0.0, adv).reshape(-1)  # (P*G,)

    stats = {
        "frac_zero_std": constant.to(dtype).mean(),
        "reward_mean": r.mean(),
        "reward_std": r.std(),
    }
    return adv, stats
