"""The clipped surrogate loss of GRPO and its published variants, as one pure function on tensors.

`clipped_surrogate` turns per-token log-probabilities, advantages and a mask into a scalar loss and a
dict of detached statistics. It covers GRPO (DeepSeekMath), DAPO's clip-higher and token-mean,
Dr. GRPO's constant normalizer, GSPO's sequence-level ratio, INTELLECT-2's two-sided clipping, two
replacements for PPO's clipped min (MiniMax-M1's CISPO and Qwen's SAPO), a KL penalty to a
reference (k1/k2/k3), and importance weights for a sampler whose numerics differ from the trainer's.
It deliberately is not a trainer: no model, no config object, no I/O, no host sync; log-probabilities
come from `grpo.kernels.logprobs`, advantages from `group_advantages`.

Notation: B rows (completions), T token positions, mask[i, t] True where token t of completion i
counts, n_i = sum_t mask[i, t], N = sum_i n_i, A_i the advantage of completion i.
"""

from __future__ import annotations

import torch

from collections.abc import Callable
from dataclasses import dataclass

from ._checks import (
    check_logp,
    check_mask,
    check_same_shape,
    check_tensor,
    compute_dtype,
    shape_str,
)
from .kl import kl_from_log_ratio
from .options import (KL_KINDS, NORMS, POLICY_LOSSES, RATIO_LEVELS, check_choice, check_policy_numbers,
                      takes_old_keywords)

STAT_KEYS = ("policy_loss", "kl", "clip_frac_low", "clip_frac_high", "clip_frac", "clip_frac_delta",
             "ratio_mean", "ratio_min", "ratio_max", "grad_weight_mean")


@takes_old_keywords
def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    ratio_level: str = "token",
    loss_norm: str = "sequence",
    max_completion_length: int | None = None,
    is_weights: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    loss_type: str = "clip",
    cispo_eps_low: float = 1.0,
    cispo_eps_high: float = 4.0,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""The GRPO loss: clipped importance-ratio surrogate plus an optional KL penalty, normalized.

    Args:
        logp: (B, T) log-probabilities of the sampled tokens under the policy being trained: the only
            input that gradients flow to.
        old_logp: (B, T) the same under the policy that the advantages were estimated for (pi_old).
            None means "the current policy": `logp.detach()` (mu = 1 without sampler mismatch), so the
            ratio is 1 and the gradient is the plain policy gradient.
        adv: (B,) advantage of each completion, e.g. from `group_advantages`.
        mask: (B, T) bool, True where a completion token counts. Values of the other inputs at
            positions where mask is False are never read (they may be anything, even inf or nan).
        ref_logp: (B, T) log-probabilities under the reference policy, or None. Needed when beta > 0;
            with beta == 0 it is used only for the "kl" statistic.
        beta: KL coefficient (>= 0).
        epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] of loss_type="clip";
            epsilon_high defaults to epsilon.
        delta: cap on the unclipped ratio (two-sided clipping), >= 1 + epsilon_high, or None for off.
            Only with loss_type="clip".
        ratio_level: "token" (GRPO, DAPO) or "sequence" (GSPO).
        loss_norm: "sequence" (GRPO), "token" (DAPO) or "constant" (Dr. GRPO).
        max_completion_length: the constant of loss_norm="constant" (the generation budget); None means
            T. Ignored by the other norms.
        is_weights: (B, T) or (B,) importance weights pi_old / pi_sampler for a sampler that differs
            from the trainer (see `grpo.loss.importance`), or None.
        kl_estimator: KL estimator: "k1", "k2" or "k3" (see `grpo.loss.kl`).
        loss_type: the per-token policy term: "clip" (PPO's clipped min, GRPO), "cispo" (a clipped,
            detached importance weight times the log-probability, MiniMax-M1) or "sapo" (a sigmoid
            gate on the ratio in place of the clip, Qwen). Formulas below.
        cispo_eps_low, cispo_eps_high: CISPO's weight range [1 - cispo_eps_low, 1 + cispo_eps_high]
            (>= 0 each). Defaults 1.0 and 4.0: no lower bound (the ratio is > 0) and a cap of 5.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0) for A > 0 and A <= 0. Defaults
            1.0 and 1.05, the paper's.

    Returns:
        loss: 0-dim tensor, float32 (float64 if a log-probability input is float64): bf16 inputs are
            upcast, and so is the arithmetic.
        stats: dict of detached 0-dim tensors, keys STAT_KEYS (all present, always finite):
            "policy_loss": the policy term alone, normalized by `loss_norm` (loss minus the KL term);
            "kl": masked token mean of the per-token KL (0 without ref_logp), whatever `loss_norm` is;
            "clip_frac_low": fraction of masked tokens with w < 1 - epsilon and A < 0 (clipped below);
                with "cispo", with w < 1 - cispo_eps_low whatever A (the weight is raised to the
                floor); 0 with "sapo" (nothing is clipped);
            "clip_frac_high": fraction of masked tokens with w > 1 + epsilon_high and A > 0 (clipped above);
                with "cispo", with w > 1 + cispo_eps_high whatever A (the weight is capped); 0 with "sapo";
            "clip_frac": their sum (the two cannot overlap);
            "clip_frac_delta": fraction of masked tokens with w > delta and A < 0 (0 without delta);
            "ratio_mean", "ratio_min", "ratio_max": of w over masked tokens (with ratio_level
            "sequence" each sequence's ratio counts once per token);
            "grad_weight_mean": masked token mean of g_it, the factor each policy loss puts on the
                plain policy gradient: d policy_it / d logp_it = -A_i g_it for the token ratio
                (before is_weights). "clip": w, or 0 where the active branch is clipped or capped;
                "cispo": clip(w); "sapo": 4 s (1 - s) w. It is 1 on-policy (w = 1) for all three.
            Every stat is 0 when no token counts. Call float() on a stat to log it (that is the only
            sync).

    The ratio. Token level (DeepSeekMath, Shao et al. 2024, eq. 3)::

        w_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t) = exp(logp_it - old_logp_it)

    Sequence level (GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization"): the
    length-normalized sequence ratio, the same for every token of completion i (gradient flows to
    every token through the mean)::

        w_i = (pi_theta(y_i | x) / pi_old(y_i | x))^(1 / n_i) = exp((1/n_i) sum_t mask_it (logp_it - old_logp_it))

    A row with n_i = 0 gets w_i = 1 and contributes nothing. GSPO pairs it with loss_norm="sequence" (then
    the loss is exactly GSPO's objective) and with a much narrower clip range (epsilon=3e-4,
    epsilon_high=4e-4 in the paper).

    The per-token policy term (PPO's clipped surrogate as used by GRPO, sign flipped to a loss)::

        policy_it = -min(u_it * A_i, clip(w_it, 1 - epsilon, 1 + epsilon_high) * A_i) * is_it
        u_it      = w_it                  (delta None)
                  = min(w_it, delta)      (two-sided clipping, INTELLECT-2, Prime Intellect 2025)

    epsilon_high > epsilon is DAPO's "clip-higher" (Yu et al. 2025: epsilon = 0.2, epsilon_high = 0.28).
    Why delta: the min() above leaves the ratio unbounded when A < 0 (the pessimistic branch is the
    unclipped one), so one token that became much more likely than under pi_old, with a negative
    advantage, can dominate the batch. Capping only the unclipped branch at delta bounds that term at
    delta * |A| (and zeroes its gradient past delta) while leaving A > 0 unchanged, since there
    clip() already caps at 1 + epsilon_high <= delta. This is how TRL applies its `delta` argument.
    is_it are the sampler importance weights (1 when is_weights is None), constants here (detached).

    loss_type="cispo" (MiniMax-M1, arXiv 2506.13585, eq. 4-5: Clipped IS-weight Policy Optimization)
    clips the importance weight instead of the update and stops its gradient::

        policy_it = -sg(clip(w_it, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A_i * logp_it * is_it

    so d policy_it / d logp_it = -clip(w_it) * A_i: every token keeps a gradient, even one whose ratio
    is far outside the range (PPO's clip zeroes it; MiniMax's point is that rare "fork" tokens such as
    "Wait" or "Recheck" are exactly the ones clipped away). Its value is not the clip loss's: it
    carries logp. MiniMax imposes no lower bound ("setting eps_low^IS to a large value") and tunes
    only eps_high^IS without publishing it; peers default to caps of 4 to 6 (Tinker: w <= 4; slime:
    eps_high 4; SkyRL: 5), hence cispo_eps_low = 1 (a floor of 0, below every ratio) and
    cispo_eps_high = 4 (a cap of 5). TRL's loss_type="cispo" caps w at epsilon_high itself, not at
    1 + epsilon_high. MiniMax normalizes over all tokens of the group (loss_norm="token").

    loss_type="sapo" (Soft Adaptive Policy Optimization, Gao et al., Qwen, arXiv 2511.20347) replaces
    the clipped min with a smooth gate of the ratio, with a steeper one for negative advantages::

        policy_it = -f(w_it) * A_i * is_it,   f(w) = sigmoid(tau_i (w - 1)) * 4 / tau_i,
        tau_i     = sapo_tau_pos if A_i > 0 else sapo_tau_neg

    d f(w) / d logp = 4 s (1 - s) w with s = sigmoid(tau (w - 1)): at w = 1 it is exactly 1 (the plain
    policy gradient, whatever tau: that is what the 4 / tau is for), and it falls smoothly to 0 as w
    leaves 1, faster for larger tau, where the hard clip drops it to 0 at 1 +- eps. The value is
    -2 A / tau at w = 1, not -A. The paper sets tau_pos = 1.0, tau_neg = 1.05 (tau_neg > tau_pos: a
    negative update raises the logits of the whole unsampled vocabulary, so it is damped sooner), as
    do TRL (sapo_temperature_pos/neg), verl and Trinity-RFT; it averages like GRPO (loss_norm="sequence").

    Both take the ratio of `ratio_level` (a GSPO sequence ratio gives a sequence-level weight or gate)
    and the KL term, norms and importance weights below unchanged.

    The KL penalty, added per token (DeepSeekMath eq. 3 subtracts beta * D_KL inside the objective)::

        loss_it = policy_it + beta * kl_it,   kl_it = k3 = exp(ref_it - logp_it) - (ref_it - logp_it) - 1

    (or k1, k2; Schulman 2020, see `grpo.loss.kl`). The KL term is not importance-weighted.

    Normalization (what turns loss_it into one number)::

        "sequence":  (1/B) sum_i (1/max(n_i,1)) sum_t mask_it loss_it     GRPO (DeepSeekMath eq. 3)
        "token":     (1/max(N,1)) sum_it mask_it loss_it                   DAPO (Yu et al. 2025)
        "constant":  (1/(B * L)) sum_it mask_it loss_it, L = max_completion_length   Dr. GRPO (Liu et al. 2025)

    With "sequence", the mean is over all B rows and an empty row (n_i = 0) contributes 0 but still
    counts in B. Two reasons: a row's weight is then always 1/B, so averaging the losses of equal-size
    micro-batches gives the full-batch loss however the empty rows fall; and it matches the paper's
    1/G over the whole group (and TRL). Gradient accumulation: "sequence" and "constant" average
    exactly over equal micro-batches; "token" does not (each micro-batch divides by its own N); for
    DAPO's batch-level token mean, scale each micro-batch loss by N_micro / N_batch.

    Raises ValueError (naming the input and both shapes) on shape mismatch, a non-bool mask, an
    unknown option (listing the choices), beta > 0 without ref_logp, or an out-of-range number.
    """
    check_surrogate_inputs(logp, old_logp, adv, mask, ref_logp=ref_logp, beta=beta, epsilon=epsilon,
                           epsilon_high=epsilon_high, delta=delta, ratio_level=ratio_level, loss_norm=loss_norm,
                           max_completion_length=max_completion_length, is_weights=is_weights,
                           kl_estimator=kl_estimator, loss_type=loss_type, cispo_eps_low=cispo_eps_low,
                           cispo_eps_high=cispo_eps_high, sapo_tau_pos=sapo_tau_pos, sapo_tau_neg=sapo_tau_neg)
    B, T = logp.shape
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    max_completion_length = T if max_completion_length is None else max_completion_length

    # --- the loss -----------------------------------------------------------------------------
    dtype = compute_dtype(logp.dtype, *(t.dtype for t in (old_logp, ref_logp) if t is not None))
    logp = logp.to(dtype)
    # pi_old, pi_ref, the advantages and the sampler weights are constants of this objective. Detaching
    # them here makes clipped_surrogate(logp, logp, ...) mean the same as with logp.detach().
    old_logp = logp.detach() if old_logp is None else old_logp.detach().to(dtype)
    adv = adv.detach().to(dtype).unsqueeze(1)  # (B, 1)
    n_tok = mask.sum(-1)  # (B,) long
    n_all = n_tok.sum()  # () long

    # torch.where, not a multiply by the mask: positions that do not count may hold inf or nan (padding),
    # and 0 * inf is nan in the forward pass and 0 * nan in the backward pass. Every input is sanitized
    # once here, so nothing downstream ever sees a non-counting value.
    log_ratio = torch.where(mask, logp - old_logp, 0.0)  # (B, T)
    if ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / n_tok.clamp(min=1)  # (B,) masked mean; 0 for an empty row
        log_ratio = seq_log_ratio.unsqueeze(1).expand(B, T)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T) w

    knobs = PolicyKnobs(epsilon, epsilon_high, delta, cispo_eps_low, cispo_eps_high, sapo_tau_pos, sapo_tau_neg)
    policy, clip_low, clip_high, grad_weight = POLICY_TERMS[loss_type](ratio, logp, mask, adv, knobs)
    if is_weights is not None:
        is_w = is_weights.detach().to(dtype)
        is_w = is_w.unsqueeze(1) if is_w.dim() == 1 else is_w  # (B, 1) or (B, T)
        policy = policy * torch.where(mask, is_w, 0.0)
    policy = torch.where(mask, policy, 0.0)  # (B, T)

    kl_tok = None
    if ref_logp is not None:
        with torch.set_grad_enabled(beta > 0 and torch.is_grad_enabled()):
            kl_tok = kl_from_log_ratio(torch.where(mask, ref_logp.detach().to(dtype) - logp, 0.0),
                                       kl_estimator)  # (B, T)
    per_token = policy + beta * kl_tok if beta > 0 else policy  # (B, T), 0 where mask is False

    loss = _normalize(per_token, n_tok, n_all, loss_norm, max_completion_length)

    # --- statistics (detached; no host sync) --------------------------------------------------
    with torch.no_grad():
        count = n_all.clamp(min=1).to(dtype)
        any_tok = n_all > 0
        zero = logp.new_zeros(())
        low = mask & clip_low
        high = mask & clip_high
        capped = mask & (ratio > delta) & (adv < 0) if delta is not None else None
        stats = {
            "policy_loss": _normalize(policy, n_tok, n_all, loss_norm, max_completion_length).detach(),
            "kl": kl_tok.detach().sum() / count if kl_tok is not None else zero,
            "clip_frac_low": low.sum() / count,
            "clip_frac_high": high.sum() / count,
            "clip_frac": (low | high).sum() / count,
            "clip_frac_delta": capped.sum() / count if capped is not None else zero,
            "ratio_mean": torch.where(mask, ratio, 0.0).sum() / count,
            "ratio_min": torch.where(any_tok, torch.where(mask, ratio, torch.inf).amin(), zero),
            "ratio_max": torch.where(any_tok, torch.where(mask, ratio, -torch.inf).amax(), zero),
            "grad_weight_mean": torch.where(mask, grad_weight, 0.0).sum() / count,
        }
    return loss, stats


def check_surrogate_inputs(logp, old_logp, adv, mask, *, ref_logp, beta, epsilon, epsilon_high, delta, ratio_level,
                           loss_norm, max_completion_length, is_weights, kl_estimator, loss_type, cispo_eps_low,
                           cispo_eps_high, sapo_tau_pos, sapo_tau_neg) -> None:
    """`clipped_surrogate`'s checks, metadata only (no host sync): a ValueError naming the input and both
    shapes on a shape mismatch or a non-bool mask; the choices and number ranges of `grpo.loss.options`."""
    check_logp("logp", logp)
    B, T = logp.shape
    if old_logp is not None:
        check_same_shape("old_logp", old_logp, "logp", logp)
    check_mask(mask, logp)
    check_tensor("adv", adv)
    if adv.shape != (B,):
        raise ValueError(f"adv has shape {shape_str(adv)} but logp has shape {shape_str(logp)}; "
                         f"adv must be (B,) = ({B},), one advantage per completion")
    if ref_logp is not None:
        check_same_shape("ref_logp", ref_logp, "logp", logp)
    if is_weights is not None:
        check_tensor("is_weights", is_weights)
        if is_weights.shape not in ((B, T), (B,)):
            raise ValueError(f"is_weights has shape {shape_str(is_weights)} but logp has shape "
                             f"{shape_str(logp)}; is_weights must be (B, T) or (B,)")
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    check_choice("loss_norm", loss_norm, NORMS)
    check_choice("kl_estimator", kl_estimator, KL_KINDS)
    check_choice("loss_type", loss_type, POLICY_LOSSES)
    check_policy_numbers(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type,
                         cispo_eps_low=cispo_eps_low, cispo_eps_high=cispo_eps_high, sapo_tau_pos=sapo_tau_pos,
                         sapo_tau_neg=sapo_tau_neg)
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (the reference policy's log-probabilities); "
                         "pass ref_logp or set beta=0")
    length = max_completion_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"max_completion_length={length!r}: must be a positive int (the generation budget of "
                         "loss_norm='constant'), or None for T")


def _normalize(per_token: torch.Tensor, n_tok: torch.Tensor, n_all: torch.Tensor, loss_norm: str,
               max_completion_length: int) -> torch.Tensor:
    """(B, T) per-token values, already 0 where the mask is False -> the scalar loss of `loss_norm`."""
    if loss_norm == "sequence":
        return (per_token.sum(-1) / n_tok.clamp(min=1)).mean()
    if loss_norm == "token":
        return per_token.sum() / n_all.clamp(min=1)
    return per_token.sum() / (per_token.shape[0] * max_completion_length)


# The per-token policy terms, one function each, all called as term(ratio, logp, mask, adv, knobs): ratio,
# logp and mask (B, T), adv (B, 1), knobs the numbers of every term (each reads its own). Each returns
# (policy, clip_low, clip_high, grad_weight), all (B, T): the term with its gradient, then detached
# diagnostics for the statistics: where the ratio was clipped below / above, and g with d policy / d logp
# = -A g (see `clipped_surrogate`). A new variant is one function, one entry in POLICY_TERMS and its name
# in `grpo.loss.options.POLICY_LOSSES`.

@dataclass(frozen=True)
class PolicyKnobs:
    """The numbers of the policy terms, as `clipped_surrogate` takes them (epsilon_high resolved)."""

    epsilon: float
    epsilon_high: float
    delta: float | None
    cispo_eps_low: float
    cispo_eps_high: float
    sapo_tau_pos: float
    sapo_tau_neg: float


def _ppo_clip(ratio: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, knobs: PolicyKnobs
              ) -> tuple[torch.Tensor, ...]:
    """-min(u * A, clip(w, 1 - epsilon, 1 + epsilon_high) * A), u = w or min(w, delta)."""
    epsilon, epsilon_high, delta = knobs.epsilon, knobs.epsilon_high, knobs.delta
    clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    policy = -torch.minimum(unclipped * adv, clipped * adv)  # (B, T)
    with torch.no_grad():
        w = ratio.detach()
        # The gradient follows the branch the min picked, and that branch passes it only while it is
        # not a constant (clipped, or capped at delta).
        unclipped_passes = w <= delta if delta is not None else torch.ones_like(w, dtype=torch.bool)
        clipped_passes = (w >= 1.0 - epsilon) & (w <= 1.0 + epsilon_high)
        picks_unclipped = unclipped * adv <= clipped * adv
        grad_weight = w * torch.where(picks_unclipped, unclipped_passes, clipped_passes)
        clip_low = (w < 1.0 - epsilon) & (adv < 0)
        clip_high = (w > 1.0 + epsilon_high) & (adv > 0)
    return policy, clip_low, clip_high, grad_weight


def _cispo(ratio: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, knobs: PolicyKnobs
           ) -> tuple[torch.Tensor, ...]:
    """-sg(clip(w, 1 - cispo_eps_low, 1 + cispo_eps_high)) * A * logp."""
    low, high = knobs.cispo_eps_low, knobs.cispo_eps_high
    logp = torch.where(mask, logp, 0.0)  # positions that do not count may hold inf or nan
    w = ratio.detach()
    weight = w.clamp(1.0 - low, 1.0 + high)  # (B, T), a constant: the gradient flows via logp only
    policy = -weight * adv * logp
    return policy, w < 1.0 - low, w > 1.0 + high, weight


def _sapo(ratio: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, knobs: PolicyKnobs
          ) -> tuple[torch.Tensor, ...]:
    """-sigmoid(tau (w - 1)) * (4 / tau) * A, tau = tau_pos where A > 0 else tau_neg."""
    tau_pos, tau_neg = knobs.sapo_tau_pos, knobs.sapo_tau_neg
    tau = adv.new_full(adv.shape, tau_neg).masked_fill(adv > 0, tau_pos)  # (B, 1), in the compute dtype
    gate = torch.sigmoid(tau * (ratio - 1.0))  # (B, T) s
    policy = -gate * (4.0 / tau) * adv
    with torch.no_grad():
        s = gate.detach()
        grad_weight = 4.0 * s * (1.0 - s) * ratio.detach()
        nothing = torch.zeros_like(s, dtype=torch.bool)
    return policy, nothing, nothing, grad_weight


# loss_type -> its term; the names are grpo.loss.options.POLICY_LOSSES (a test keeps the two equal).
POLICY_TERMS: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {"clip": _ppo_clip, "cispo": _cispo, "sapo": _sapo}
