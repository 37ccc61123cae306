"""The GRPO loss as a research API: pure functions on tensors, no model, no config, no I/O.

    from grpo.loss import clipped_surrogate, group_advantages, kl_penalty

    adv, adv_stats = group_advantages(rewards, group_size=G)             # (P*G,)
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask,           # (B, T) each; adv (B,)
                                    ref_logp=ref_logp, beta=0.04)
    loss.backward()

- `clipped_surrogate` (surrogate.py): GRPO's clipped ratio objective with DAPO, Dr. GRPO, GSPO and
  two-sided-clipping options, CISPO and SAPO in place of the clip (`policy_loss=`), a KL penalty,
  sampler importance weights; returns (loss, stats).
- `group_advantages` (advantages.py): (r - group mean) / (std + eps), or Dr. GRPO's unscaled version;
  returns (adv, stats) with the fraction of groups that carry no signal.
- `kl_penalty` (kl.py): the k1/k2/k3 per-token KL estimators.
- `importance_weights` (importance.py): truncated or masked pi_old / pi_sampler weights for the
  `is_weights` argument when the sampler's numerics differ from the trainer's; `SamplerGap`, how far
  the sampler's log-probs are from the trainer's over a step.

Every formula is written out, with its source, in the docstring of the function that computes it.
The trainer uses nothing else for its loss. Gradients flow only to `logp`.
"""

from .advantages import SCALES, group_advantages
from .importance import SamplerGap, importance_weights
from .kl import KL_KINDS, kl_penalty
from .surrogate import NORMS, POLICY_LOSSES, RATIO_LEVELS, STAT_KEYS, clipped_surrogate

__all__ = [
    "clipped_surrogate", "group_advantages", "kl_penalty", "importance_weights", "SamplerGap",
    "NORMS", "POLICY_LOSSES", "RATIO_LEVELS", "KL_KINDS", "SCALES", "STAT_KEYS",
]
