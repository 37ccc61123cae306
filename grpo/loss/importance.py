"""Importance weights that correct for the sampler/trainer mismatch, as a pure function on tensors.

A fast sampler (vLLM, Unsloth's engine) and the trainer run the same policy with different kernels,
so the probability the sampler gave a token (`sampler_logp`) differs slightly from the one the
trainer computes (`logp`). Training on the sampler's tokens as if they were on-policy is then a
little off-policy; the fix is to weight each token's loss by pi_trainer / pi_sampler, bounded
so that rare large ratios cannot blow the gradient up:

- `is_correction="truncate"` (TIS): w = min(ratio, is_cap). Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training" (the truncated importance sampling they add to verl;
  TRL's `vllm_importance_sampling_correction` is the same).
- `is_correction="mask"` (MIS): w = ratio where ratio <= is_cap, else 0: a token (or sequence) the trainer
  likes far more than the sampler did is dropped instead of clipped, since such a token is more
  likely a numerical fault than a signal (Liu, Li et al. 2025, "When speed kills stability:
  demystifying RL collapse from the training-inference mismatch", masked importance sampling;
  TRL's `token_mask` / `sequence_mask`). `is_cap_low` also drops ratios below it (two-sided, as in
  IcePop from Ling Team 2025); off by default, because a ratio below 1 already shrinks its token.
- `is_correction="none"`: all ones.

`is_level="token"` uses each token's own ratio; `is_level="sequence"` gives every token of a row the
row's geometric-mean ratio exp(mean over its tokens of logp - sampler_logp), as GSPO does for the
policy ratio, so one odd token does not decide a row's weight alone.

`clipped_by_correction` says which tokens a given correction would truncate or mask, by the same
rule, for a trainer that reports the sampler-trainer gap even when it applies no correction;
`SamplerGap` adds that gap up over a step's micro-batches and ranks.

The weights are detached: they scale the loss, they are not optimised. This module does not
compute the loss or any log-probabilities; `clipped_surrogate` multiplies its per-token loss by
the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._checks import check_choice

IS_LEVELS = ("token", "sequence")
IS_MODES = ("none", "truncate", "mask")


def check_importance_numbers(*, is_cap: float, is_cap_low: float | None = None,
                             spell: Callable[[str, object], str] = lambda name, value: f"{name}={value}") -> None:
    """The range of is_cap (and is_cap_low); a ValueError naming the option as `spell` writes it (the command
    line passes its own spelling, `--is-cap 0.5`)."""
    if not is_cap >= 1:
        raise ValueError(f"{spell('is_cap', is_cap)}: the importance-weight cap must be 1 or more (a lower cap "
                         "would weigh down tokens on which sampler and trainer agree, ratio 1); 2 is usual")
    if is_cap_low is not None and not 0 <= is_cap_low < is_cap:
        raise ValueError(f"{spell('is_cap_low', is_cap_low)}: must be in [0, is_cap={is_cap})")


def importance_weights(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str = "token",
    is_correction: str = "truncate",
    is_cap: float = 2.0,
    is_cap_low: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights pi_trainer / pi_sampler, truncated or masked at `is_cap`.

    logp, sampler_logp: (B, T) log-probabilities of the sampled tokens under the trainer and under
    the sampler; mask: (B, T) bool, True where a token counts. Returns `(weights, stats)`:
    weights (B, T), detached, float32 (float64 for float64 inputs), 0 where mask is False; stats holds detached scalars:
    `is_ratio_mean` (mean raw ratio over counted tokens, or over rows at sequence level),
    `is_ratio_max`, `is_ratio_min`, and `is_clipped_frac` (fraction of tokens truncated or masked).
    """
    _check(logp, sampler_logp, mask, is_level, is_correction, is_cap, is_cap_low)
    dtype = _dtype(logp, sampler_logp)
    mask = mask.bool()
    maskf = mask.to(dtype)
    zero = logp.new_zeros((), dtype=dtype)
    n_tokens = maskf.sum()

    if is_correction == "none":
        stats = {"is_ratio_mean": zero + 1, "is_ratio_max": zero + 1, "is_ratio_min": zero + 1,
                 "is_clipped_frac": zero}
        return maskf, stats

    ratio = _ratio(logp, sampler_logp, mask, is_level)
    clipped = _clipped(ratio, is_correction, is_cap, is_cap_low)
    weights = ratio.clamp(max=is_cap) if is_correction == "truncate" else torch.where(clipped, zero, ratio)
    weights = (weights * maskf).detach()  # (B, T)

    clipped_tokens = (clipped & mask).to(dtype).sum()
    # The ratio's statistics over its samples: each counted token, or each row with one at sequence level.
    # Masked reductions, not a selection of the samples, so that the device is never waited for.
    values, counted = (ratio, mask) if is_level == "token" else (ratio[:, :1], mask.any(-1, keepdim=True))
    if values.numel() == 0:  # no rows or no columns (shapes: known without the device)
        values, counted = ratio.new_ones(1), mask.new_zeros(1)
    count = counted.sum()
    some = count > 0  # nothing counts: a neutral ratio 1
    stats = {
        "is_ratio_mean": torch.where(some, torch.where(counted, values, 0).sum() / count.clamp(min=1), 1).detach(),
        "is_ratio_max": torch.where(some, values.masked_fill(~counted, -math.inf).amax(), 1).detach(),
        "is_ratio_min": torch.where(some, values.masked_fill(~counted, math.inf).amin(), 1).detach(),
        "is_clipped_frac": (clipped_tokens / n_tokens.clamp(min=1)).detach(),
    }
    return weights, stats


def clipped_by_correction(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str = "token",
    is_correction: str = "truncate",
    is_cap: float = 2.0,
    is_cap_low: float | None = None,
) -> torch.Tensor:
    """(B, T) bool, True at the counted tokens whose weight `importance_weights` with the same arguments
    truncates or masks (none for is_correction="none"). The trainer counts them every step, whether or not its
    engine asks for the correction, to report how far the sampler is from the trainer."""
    _check(logp, sampler_logp, mask, is_level, is_correction, is_cap, is_cap_low)
    mask = mask.bool()
    if is_correction == "none":
        return torch.zeros_like(mask)
    ratio = _ratio(logp, sampler_logp, mask, is_level)
    return _clipped(ratio, is_correction, is_cap, is_cap_low) & mask


def _check(logp, sampler_logp, mask, is_level, is_correction, is_cap, is_cap_low) -> None:
    check_choice("is_level", is_level, IS_LEVELS)
    check_choice("is_correction", is_correction, IS_MODES)
    check_importance_numbers(is_cap=is_cap, is_cap_low=is_cap_low)
    if logp.shape != sampler_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"importance_weights: logp {tuple(logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} "
            f"and mask {tuple(mask.shape)} must all be the same (B, T) shape"
        )


def _dtype(logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.dtype:
    # The difference of two nearby log-probs loses everything in bf16: work in float32 or wider.
    return torch.promote_types(torch.promote_types(logp.dtype, sampler_logp.dtype), torch.float32)


def _ratio(logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, is_level: str) -> torch.Tensor:
    """(B, T): the ratio each token is weighted by, its own or its row's geometric mean."""
    dtype = _dtype(logp, sampler_logp)
    logp, sampler_logp = logp.detach().to(dtype), sampler_logp.detach().to(dtype)
    # Masked positions get log-ratio 0 so padding never overflows exp().
    log_ratio = torch.where(mask, logp - sampler_logp, 0.0)  # (B, T)
    if is_level == "token":
        return log_ratio.exp()
    lengths = mask.to(dtype).sum(-1)  # (B,)
    seq_ratio = (log_ratio.sum(-1) / lengths.clamp(min=1)).exp()  # (B,) geometric mean per row
    return seq_ratio.unsqueeze(-1).expand_as(log_ratio)


def _clipped(ratio: torch.Tensor, is_correction: str, is_cap: float, is_cap_low: float | None) -> torch.Tensor:
    """(B, T) bool: where `is_correction` truncates (ratio above is_cap) or masks (above is_cap, or below
    is_cap_low)."""
    clipped = ratio > is_cap
    if is_correction == "mask" and is_cap_low is not None:
        clipped = clipped | (ratio < is_cap_low)
    return clipped


class SamplerGap:
    """The sampler-trainer gap of one step: how far the sampler's log-prob of each sampled token
    (`Rollout.sampler_logp`) is from the trainer's, before the step updates the policy.

    Fed the log-probs the loss computes anyway (the first pass's, or old_logp with mu > 1), micro-batch
    by micro-batch: no extra forward pass. Reports, over the counted tokens of all ranks:
    `gap/logp_abs_mean` and `gap/logp_abs_max` of |log pi_train - log pi_sampler|, and `gap/is_clipped_frac`,
    the fraction of tokens whose importance weight the correction of `is_level`, `is_correction` and `is_cap`
    (the run's --is-level, --is-correction and --is-cap) would truncate or mask (by `clipped_by_correction`, the rule
    of `importance_weights`), whether or not the engine asks for the correction.
    """

    def __init__(self, *, is_level: str = "token", is_correction: str = "truncate", is_cap: float = 2.0) -> None:
        self.is_level, self.is_correction, self.is_cap = is_level, is_correction, is_cap
        self.abs_sum = self.abs_max = self.clipped = self.tokens = 0.0

    def add(self, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> None:
        """One micro-batch: (B, T) trainer and sampler log-probs of its tokens, (B, T) mask. The sums stay on
        the device until `over_ranks`, so the micro-batches' passes never wait for it."""
        mask = mask.bool()
        diff = (logp.detach().double() - sampler_logp.double()).abs()  # (B, T) a bf16 gap would round
        clipped = clipped_by_correction(logp.detach(), sampler_logp, mask, is_level=self.is_level,
                                        is_correction=self.is_correction, is_cap=self.is_cap)
        counted = diff.masked_fill(~mask, 0)  # |diff| >= 0, so padding's 0 never wins the max; a NaN stays
        self.abs_sum = self.abs_sum + counted.sum()
        if counted.numel():  # (the first max is the micro-batch's own: 0.0 to the device would be a wait)
            top = counted.amax()
            self.abs_max = torch.maximum(self.abs_max, top) if isinstance(self.abs_max, torch.Tensor) else top
        self.clipped = self.clipped + clipped.sum()
        self.tokens = self.tokens + mask.sum()

    def over_ranks(self, world) -> dict[str, float]:
        """The gap over every rank's tokens of `world` (a `grpo.distributed.World`: its `reduce_stats` sums,
        and takes the max of keys ending in _max); a collective: every rank calls it."""
        total = world.reduce_stats({"abs_sum": float(self.abs_sum), "clipped": float(self.clipped),
                                    "tokens": float(self.tokens), "abs_max": float(self.abs_max)})  # _max: the max
        tokens = max(total["tokens"], 1.0)
        return {"gap/logp_abs_mean": total["abs_sum"] / tokens, "gap/logp_abs_max": total["abs_max"],
                "gap/is_clipped_frac": total["clipped"] / tokens}
