"""Per-token estimators of the KL divergence from the policy to a reference policy.

This module holds the three sample-based estimators k1, k2, k3 and nothing else: no masking, no
reduction, no coefficient (`clipped_surrogate` does those).

Source: J. Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html). For a
token y sampled from q and r = p(y) / q(y), each k below is an estimator of KL[q || p] = E_q[-log r].
Here q = pi_theta (the policy, which sampled the completion), p = pi_ref, and

    log r = ref_logp - logp                              (x below)
    k1 = -log r                = logp - ref_logp         unbiased, can be negative
    k2 = (log r)^2 / 2                                   biased, >= 0, low variance
    k3 = (r - 1) - log r       = exp(x) - x - 1          unbiased, >= 0, low variance

k3 is the penalty of GRPO (Shao et al. 2024, "DeepSeekMath", eq. 4:
D_KL = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1).

As a loss term, differentiated through logp with the samples held fixed (which is how GRPO uses it),
the expected per-token gradients under on-policy sampling are: k1 -> 0 (useless as a loss);
k2 -> grad KL[pi_theta || pi_ref] (the reverse KL the penalty is named after); k3 -> grad KL[pi_ref ||
pi_theta] (the forward KL), because d k3 / d logp = 1 - pi_ref/pi_theta. Both k2 and k3 pull the
policy towards the reference; they are not the same regularizer.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_logp, check_same_shape

KL_KINDS = ("k1", "k2", "k3")


def kl_from_log_ratio(x: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    """The estimator `kl_estimator` from x = ref_logp - logp, elementwise (no checks; used by the loss)."""
    if kl_estimator == "k1":
        return -x
    if kl_estimator == "k2":
        return 0.5 * x * x
    if kl_estimator == "k3":
        # exp(x) - 1 - x, written with expm1 so that it stays accurate (and >= 0) for tiny x.
        return torch.expm1(x) - x
    raise ValueError(f"kl_estimator={kl_estimator!r} is unknown; choose one of {', '.join(repr(k) for k in KL_KINDS)}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate from the policy to the reference, shape (B, T).

    Args:
        logp: (B, T) log-probabilities of the sampled tokens under the policy (gradients flow here).
        ref_logp: (B, T) log-probabilities of the same tokens under the reference policy.
        kl_estimator: "k1" = logp - ref_logp; "k2" = (logp - ref_logp)^2 / 2;
            "k3" = exp(ref_logp - logp) - (ref_logp - logp) - 1 (GRPO's choice). See the module
            docstring for the sources and for what each one's gradient estimates.

    Returns a (B, T) tensor of the same dtype as `logp`, for every position: mask and reduce it
    yourself (`clipped_surrogate` does). `ref_logp` is not detached here: pass a tensor without grad.
    """
    check_logp("logp", logp)
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    check_choice("kl_estimator", kl_estimator, KL_KINDS)
    return kl_from_log_ratio(ref_logp - logp, kl_estimator)
