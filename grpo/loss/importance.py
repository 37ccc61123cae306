"""Importance weights that correct for the sampler/trainer mismatch, as a pure function on tensors.

A fast sampler (vLLM, Unsloth's engine) and the trainer run the same policy with different kernels,
so the probability the sampler gave a token (`sampler_logp`) differs slightly from the one the
trainer computes (`logp`). Training on the sampler's tokens as if they were on-policy is then a
little off-policy; the fix is to weight each token's loss by pi_trainer / pi_sampler, bounded
so that rare large ratios cannot blow the gradient up:

- `mode="truncate"` (TIS): w = min(ratio, cap). Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training" (the truncated importance sampling they add to verl;
  TRL's `vllm_importance_sampling_correction` is the same).
- `mode="mask"` (MIS): w = ratio where ratio <= cap, else 0: a token (or sequence) the trainer
  likes far more than the sampler did is dropped instead of clipped, since such a token is more
  likely a numerical fault than a signal (Liu, Li et al. 2025, "When speed kills stability:
  demystifying RL collapse from the training-inference mismatch", masked importance sampling;
  TRL's `token_mask` / `sequence_mask`). `cap_low` also drops ratios below it (two-sided, as in
  IcePop from Ling Team 2025); off by default, because a ratio below 1 already shrinks its token.
- `mode="none"`: all ones.

`level="token"` uses each token's own ratio; `level="sequence"` gives every token of a row the
row's geometric-mean ratio exp(mean over its tokens of logp - sampler_logp), as GSPO does for the
policy ratio, so one odd token does not decide a row's weight alone.

The weights are detached: they scale the loss, they are not optimised. This module does not
compute the loss or any log-probabilities; `clipped_surrogate` multiplies its per-token loss by
the weights.
"""

from __future__ import annotations

import torch

LEVELS = ("token", "sequence")
MODES = ("none", "truncate", "mask")


def importance_weights(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    cap_low: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights pi_trainer / pi_sampler, truncated or masked at `cap`.

    logp, sampler_logp: (B, T) log-probabilities of the sampled tokens under the trainer and under
    the sampler; mask: (B, T) bool, True where a token counts. Returns `(weights, stats)`:
    weights (B, T), detached, float32 (float64 for float64 inputs), 0 where mask is False; stats holds detached scalars:
    `is_ratio_mean` (mean raw ratio over counted tokens, or over rows at sequence level),
    `is_ratio_max`, `is_ratio_min`, and `is_clipped_frac` (fraction of tokens truncated or masked).
    """
    if level not in LEVELS:
        raise ValueError(f"importance_weights level={level!r}: use one of {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"importance_weights mode={mode!r}: use one of {', '.join(MODES)}")
    if not cap > 0:
        raise ValueError(f"importance_weights cap={cap}: must be > 0 (e.g. 2.0)")
    if cap_low is not None and not 0 <= cap_low < cap:
        raise ValueError(f"importance_weights cap_low={cap_low}: must be in [0, cap={cap})")
    if logp.shape != sampler_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"importance_weights: logp {tuple(logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} "
            f"and mask {tuple(mask.shape)} must all be the same (B, T) shape"
        )
    # The difference of two nearby log-probs loses everything in bf16: work in float32 or wider.
    dtype = torch.promote_types(torch.promote_types(logp.dtype, sampler_logp.dtype), torch.float32)
    logp, sampler_logp = logp.detach().to(dtype), sampler_logp.detach().to(dtype)
    mask = mask.bool()
    maskf = mask.to(dtype)
    zero = logp.new_zeros(())
    n_tokens = maskf.sum()

    if mode == "none":
        stats = {"is_ratio_mean": zero + 1, "is_ratio_max": zero + 1, "is_ratio_min": zero + 1,
                 "is_clipped_frac": zero}
        return maskf, stats

    # Masked positions get log-ratio 0 so padding never overflows exp().
    log_ratio = torch.where(mask, logp - sampler_logp, zero)  # (B, T)
    if level == "token":
        ratio = log_ratio.exp()  # (B, T)
        samples = ratio[mask]  # one ratio per counted token
    else:
        lengths = maskf.sum(-1)  # (B,)
        seq_ratio = (log_ratio.sum(-1) / lengths.clamp(min=1)).exp()  # (B,) geometric mean per row
        ratio = seq_ratio.unsqueeze(-1).expand_as(log_ratio)  # (B, T)
        samples = seq_ratio[lengths > 0]  # one ratio per non-empty row

    if mode == "truncate":
        weights = ratio.clamp(max=cap)
        clipped = ratio > cap
    else:  # mask
        clipped = ratio > cap
        if cap_low is not None:
            clipped = clipped | (ratio < cap_low)
        weights = torch.where(clipped, zero, ratio)
    weights = (weights * maskf).detach()  # (B, T)

    clipped_tokens = (clipped & mask).to(dtype).sum()
    if samples.numel() == 0:  # nothing counts: report a neutral ratio
        samples = logp.new_ones(1)
    stats = {
        "is_ratio_mean": samples.mean().detach(),
        "is_ratio_max": samples.max().detach(),
        "is_ratio_min": samples.min().detach(),
        "is_clipped_frac": (clipped_tokens / n_tokens.clamp(min=1)).detach(),
    }
    return weights, stats
