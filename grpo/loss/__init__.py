"""The GRPO loss as a research API: pure functions on tensors, no model, no config, no I/O.

    from grpo.loss import Clip, clipped_surrogate, group_advantages

    adv, adv_stats = group_advantages(rewards, num_generations=G)        # (P*G,)
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask,           # (B, T) each; adv (B,)
                                    term=Clip(epsilon_high=0.28), ref_logp=ref_logp, beta=0.04)
    loss.backward()

- `clipped_surrogate` (surrogate.py): a policy term, a KL penalty, sampler importance weights, normalised;
  returns (loss, stats with STAT_KEYS).
- the policy terms (terms.py): `Clip`, `Cispo`, `Sapo`, `DppoTV`, `DppoKL`, `Gmpo`, each a frozen dataclass of its
  knobs, registered by name in POLICY_TERMS (`register_policy_term`), made by name with `policy_term`.
- `group_advantages` (advantages.py): (r - group mean) / (std + eps), or Dr. GRPO's unscaled version.
- `kl_penalty` (kl.py): the k1/k2/k3 per-token KL estimators.
- `importance_weights`, `SamplerGap` (importance.py): truncated or masked pi_old / pi_sampler weights, and how
  far the sampler's log-probs are from the trainer's over a step.

The formulas, with their sources, are in docs/loss.md. Gradients flow only to `logp`.
"""

from .advantages import SCALES, group_advantages
from .importance import IS_LEVELS, IS_MODES, SamplerGap, importance_weights
from .kl import KL_KINDS, kl_penalty
from .surrogate import NORMS, RATIO_LEVELS, STAT_KEYS, clipped_surrogate
from .terms import (POLICY_TERMS, Cispo, Clip, DppoKL, DppoTV, Gmpo, PolicyTerm, Sapo, TermInputs, TermOutput,
                    policy_term, register_policy_term)

__all__ = [
    "clipped_surrogate", "group_advantages", "kl_penalty", "importance_weights", "SamplerGap",
    "PolicyTerm", "TermInputs", "TermOutput", "register_policy_term", "policy_term", "POLICY_TERMS",
    "Clip", "Cispo", "Sapo", "DppoTV", "DppoKL", "Gmpo",
    "NORMS", "RATIO_LEVELS", "KL_KINDS", "SCALES", "IS_LEVELS", "IS_MODES", "STAT_KEYS",
]
