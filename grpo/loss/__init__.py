"""The GRPO loss as a research API: pure functions on tensors, no model, no config, no I/O.

    from grpo.loss import clipped_surrogate, group_advantages, kl_penalty

    adv, adv_stats = group_advantages(rewards, num_generations=G)        # (P*G,)
    loss, stats = clipped_surrogate(logp, old_logp, adv, mask,           # (B, T) each; adv (B,)
                                    ref_logp=ref_logp, beta=0.04)
    loss.backward()

- `clipped_surrogate` (surrogate.py): GRPO's clipped ratio objective with DAPO, Dr. GRPO, GSPO and
  two-sided-clipping options, CISPO and SAPO in place of the clip (`loss_type=`), a KL penalty,
  sampler importance weights; returns (loss, stats).
- `group_advantages` (advantages.py): (r - group mean) / (std + eps), or Dr. GRPO's unscaled version;
  returns (adv, stats) with the fraction of groups that carry no signal.
- `kl_penalty` (kl.py): the k1/k2/k3 per-token KL estimators.
- `importance_weights` (importance.py): truncated or masked pi_old / pi_sampler weights for the
  `is_weights` argument when the sampler's numerics differ from the trainer's; `SamplerGap`, how far
  the sampler's log-probs are from the trainer's over a step.
- `options` (options.py): the choices of every string option and the range of every number, stated
  once, without torch: the command line imports them.

Every formula is written out, with its source, in the docstring of the function that computes it.
The trainer uses nothing else for its loss. Gradients flow only to `logp`.

The functions are imported on first use (`from grpo.loss import clipped_surrogate` works as usual), so that
importing `grpo.loss.options` does not import torch.
"""

import importlib

from .options import IS_LEVELS, IS_MODES, KL_KINDS, NORMS, POLICY_LOSSES, RATIO_LEVELS, SCALES

# Each name that needs torch -> its module in this package.
_HOMES = {"clipped_surrogate": "surrogate", "STAT_KEYS": "surrogate", "group_advantages": "advantages",
          "kl_penalty": "kl", "importance_weights": "importance", "SamplerGap": "importance"}

__all__ = [
    "clipped_surrogate", "group_advantages", "kl_penalty", "importance_weights", "SamplerGap",
    "NORMS", "POLICY_LOSSES", "RATIO_LEVELS", "KL_KINDS", "SCALES", "IS_LEVELS", "IS_MODES", "STAT_KEYS",
]


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
