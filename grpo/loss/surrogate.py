"""The GRPO loss as one pure function on tensors: a policy term, a KL penalty, a normalisation.

`clipped_surrogate` turns per-token log-probabilities, advantages and a mask into a scalar loss and a dict of
detached statistics. It computes the importance ratio (per token, or GSPO's per sequence), hands it to a policy
term (`grpo.loss.terms`: PPO's clip, CISPO, SAPO, ...), weights the result by the sampler importance weights, adds
the KL penalty to a reference and normalises (GRPO, DAPO or Dr. GRPO). The formulas and their sources are in
docs/loss.md. It deliberately is not a trainer: no model, no config object, no I/O, no host sync.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_logp, check_mask, check_same_shape, check_tensor, compute_dtype, shape_str
from .kl import KL_KINDS, kl_from_log_ratio
from .terms import POLICY_TERMS, Clip, PolicyTerm, TermInputs, policy_term

# GSPO's sequence-level ratio is a ratio level, not a term: every term takes either ratio (TRL's
# importance_sampling_level), so GSPO with CISPO's or SAPO's term costs no code.
RATIO_LEVELS = ("token", "sequence")
NORMS = ("sequence", "token", "constant")
STAT_KEYS = ("policy_loss", "kl", "clip_frac_low", "clip_frac_high", "clip_frac", "clip_frac_delta",
             "ratio_mean", "ratio_min", "ratio_max", "grad_weight_mean")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    term: PolicyTerm | str = Clip(),
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    ratio_level: str = "token",
    loss_norm: str = "sequence",
    max_completion_length: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one batch: mean over counted tokens of policy term + beta * KL; docs/loss.md has each formula.

    Args:
        logp: (B, T) log-probabilities of the sampled tokens under the policy being trained: the only input that
            gradients flow to.
        old_logp: (B, T) the same under the policy that sampled them (pi_old), or None: `logp.detach()`, ratio 1.
        adv: (B,) one advantage per completion (`group_advantages`).
        mask: (B, T) bool, True where a token counts; other positions are never read (they may hold inf or nan).
        term: the policy term: a `grpo.loss.terms` instance such as `Clip(epsilon_high=0.28)` or `Sapo()`, or a
            name of POLICY_TERMS for its default knobs. Default: PPO's clip at 0.2 (GRPO).
        ref_logp: (B, T) log-probabilities under the reference policy; needed when beta > 0, else only logged.
        beta: KL coefficient (>= 0); kl_estimator: "k1", "k2" or "k3" (`grpo.loss.kl`).
        ratio_level: "token" (GRPO) or "sequence" (GSPO: each row's geometric-mean ratio, for every term).
        loss_norm: "sequence" (GRPO: mean over rows of each row's token mean), "token" (DAPO: mean over all
            counted tokens) or "constant" (Dr. GRPO: sum over B * max_completion_length, None meaning T).
        is_weights: (B, T) or (B,) sampler importance weights (`importance_weights`), or None.

    Returns:
        loss: 0-dim, float32 (float64 if a log-probability input is): bf16 inputs are upcast.
        stats: detached 0-dim tensors, keys STAT_KEYS, 0 when no token counts; float() one to log it (the only sync).
            "policy_loss" the term alone, normalised; "kl" the token mean of the KL estimate; "clip_frac_low",
            "clip_frac_high" the share of tokens the term clipped or dropped below / above, "clip_frac" their sum,
            "clip_frac_delta" where a cap bound the ratio (Clip's delta); "ratio_mean/min/max" over counted tokens;
            "grad_weight_mean" the mean factor g the term puts on the plain policy gradient (1 on-policy).

    Gradient accumulation: "sequence" and "constant" average exactly over equal micro-batches; "token" divides by
    each micro-batch's own token count (scale by N_micro / N_batch for DAPO's batch-level mean).

    Raises ValueError, naming the input, on a shape mismatch, a non-bool mask, an unknown option (listing the
    choices), beta > 0 without ref_logp, or a number out of range.
    """
    term = _as_term(term)
    _check_inputs(logp, old_logp, adv, mask, ref_logp=ref_logp, beta=beta, kl_estimator=kl_estimator,
                  ratio_level=ratio_level, loss_norm=loss_norm, max_completion_length=max_completion_length,
                  is_weights=is_weights)
    B, T = logp.shape
    length = T if max_completion_length is None else max_completion_length
    dtype = compute_dtype(logp.dtype, *(t.dtype for t in (old_logp, ref_logp) if t is not None))
    # torch.where, not a multiply by the mask: positions that do not count may hold inf or nan (padding), and
    # 0 * inf is nan. Every input is sanitised once here, so no term ever sees a value that does not count.
    # pi_old, pi_ref, the advantages and the weights are constants: clipped_surrogate(logp, logp) is on-policy.
    logp = torch.where(mask, logp.to(dtype), 0.0)  # (B, T)
    old_logp = logp.detach() if old_logp is None else torch.where(mask, old_logp.detach().to(dtype), 0.0)
    adv = adv.detach().to(dtype).unsqueeze(1)  # (B, 1)
    n_tok = mask.sum(-1)  # (B,) long
    n_all = n_tok.sum()  # () long

    log_ratio = logp - old_logp  # (B, T), 0 where mask is False
    if ratio_level == "sequence":  # each row's masked mean, the same for every token of the row
        log_ratio = (log_ratio.sum(-1, keepdim=True) / n_tok.clamp(min=1).unsqueeze(1)).expand(B, T)
    ratio = torch.exp(log_ratio)  # (B, T) w
    out = term.objective(TermInputs(log_ratio, ratio, logp, old_logp, adv, mask))
    policy = out.policy
    if is_weights is not None:
        is_w = is_weights.detach().to(dtype)
        policy = policy * torch.where(mask, is_w.unsqueeze(1) if is_w.dim() == 1 else is_w, 0.0)
    policy = torch.where(mask, policy, 0.0)  # (B, T)

    kl_tok = None
    if ref_logp is not None:
        with torch.set_grad_enabled(beta > 0 and torch.is_grad_enabled()):
            kl_tok = kl_from_log_ratio(torch.where(mask, ref_logp.detach().to(dtype) - logp, 0.0), kl_estimator)
    per_token = policy + beta * kl_tok if beta > 0 else policy  # (B, T), 0 where mask is False
    loss = _normalize(per_token, n_tok, n_all, loss_norm, length)

    with torch.no_grad():  # the statistics: detached, on the device
        count = n_all.clamp(min=1).to(dtype)
        any_tok = n_all > 0
        zero = logp.new_zeros(())
        low, high = mask & out.clipped_low, mask & out.clipped_high
        stats = {
            "policy_loss": _normalize(policy, n_tok, n_all, loss_norm, length).detach(),
            "kl": kl_tok.detach().sum() / count if kl_tok is not None else zero,
            "clip_frac_low": low.sum() / count,
            "clip_frac_high": high.sum() / count,
            "clip_frac": (low | high).sum() / count,
            "clip_frac_delta": (mask & out.capped).sum() / count if out.capped is not None else zero,
            "ratio_mean": torch.where(mask, ratio, 0.0).sum() / count,
            "ratio_min": torch.where(any_tok, torch.where(mask, ratio, torch.inf).amin(), zero),
            "ratio_max": torch.where(any_tok, torch.where(mask, ratio, -torch.inf).amax(), zero),
            "grad_weight_mean": torch.where(mask, out.grad_weight, 0.0).sum() / count,
        }
    return loss, stats


def _as_term(term: PolicyTerm | str) -> PolicyTerm:
    """A term given by name -> the term with its default knobs."""
    if isinstance(term, str):
        if term not in POLICY_TERMS:
            raise ValueError(f"term={term!r} is unknown; choose one of {', '.join(map(repr, POLICY_TERMS))}")
        return policy_term(term)
    if not isinstance(term, PolicyTerm):
        raise ValueError(f"term={term!r}: pass a policy term such as grpo.loss.Clip(), or its name: one of "
                         f"{', '.join(map(repr, POLICY_TERMS))}")
    return term


def _check_inputs(logp, old_logp, adv, mask, *, ref_logp, beta, kl_estimator, ratio_level, loss_norm,
                  max_completion_length, is_weights) -> None:
    """`clipped_surrogate`'s checks, metadata only (no host sync); a term checks its own knobs when made."""
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
    if not beta >= 0:
        raise ValueError(f"beta={beta}: the KL coefficient must be >= 0")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs ref_logp (the reference policy's log-probabilities); "
                         "pass ref_logp or set beta=0")
    length = max_completion_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"max_completion_length={length!r}: must be a positive int (the generation budget of "
                         "loss_norm='constant'), or None for T")


def _normalize(per_token: torch.Tensor, n_tok: torch.Tensor, n_all: torch.Tensor, loss_norm: str,
               length: int) -> torch.Tensor:
    """(B, T) per-token values, already 0 where the mask is False -> the scalar loss of `loss_norm`."""
    if loss_norm == "sequence":  # an empty row adds 0 but counts in B (docs/loss.md, "Normalisation")
        return (per_token.sum(-1) / n_tok.clamp(min=1)).mean()
    if loss_norm == "token":
        return per_token.sum() / n_all.clamp(min=1)
    return per_token.sum() / (per_token.shape[0] * length)
