"""The loss's options, stated once: the choices of every string option and the range of every number, as
`clipped_surrogate`, `group_advantages`, `kl_penalty` and `importance_weights` check them and as the
command line (`grpo.config`) offers and checks them.

Each option has one name, the command line's: `clipped_surrogate(epsilon=...)` is `--epsilon`, `Config.epsilon`
and TRL's `epsilon`; the error of a rule written once names the option as its caller wrote it (`spell_keyword`
for the functions, `spell_flag` for the command line). The functions' names of before (`eps_low=`, `norm=`,
...) are still taken, with a FutureWarning (`takes_old_keywords`).

What it deliberately is not: the loss. No torch here (the command line imports it before any heavy
import, so that `--help` and a bad flag answer at once), and no rule about tensors: shapes and dtypes are
checked beside each function that takes them.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence

POLICY_LOSSES = ("clip", "cispo", "sapo")  # clipped_surrogate(loss_type=), one term function each
RATIO_LEVELS = ("token", "sequence")  # clipped_surrogate(ratio_level=)
NORMS = ("sequence", "token", "constant")  # clipped_surrogate(loss_norm=)
KL_KINDS = ("k1", "k2", "k3")  # clipped_surrogate(kl_estimator=), kl_penalty(kl_estimator=)
SCALES = ("group", "batch", "none")  # group_advantages(scale_rewards=)
IS_LEVELS = ("token", "sequence")  # importance_weights(is_level=)
IS_MODES = ("none", "truncate", "mask")  # importance_weights(is_correction=)

# The loss functions' keywords before they took the command line's names -> the name now. Still taken, with a
# FutureWarning, so that research code written against them keeps running.
OLD_KEYWORDS = {"eps_low": "epsilon", "eps_high": "epsilon_high", "policy_loss": "loss_type", "norm": "loss_norm",
                "kl": "kl_estimator", "max_len": "max_completion_length", "group_size": "num_generations",
                "scale": "scale_rewards", "kind": "kl_estimator", "level": "is_level", "mode": "is_correction",
                "cap": "is_cap", "cap_low": "is_cap_low"}

Spell = Callable[[str, object], str]  # (keyword, value) -> how the caller wrote it, for an error message


def takes_old_keywords(fn: Callable) -> Callable:
    """`fn`, also taking the keywords of OLD_KEYWORDS that name one of its parameters (with a FutureWarning)."""
    params = set(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for old in [k for k in kwargs if k not in params and OLD_KEYWORDS.get(k) in params]:
            new = OLD_KEYWORDS[old]
            if new in kwargs:
                raise TypeError(f"{fn.__name__}() got {old}= and {new}=, one option twice; pass {new}= only")
            warnings.warn(f"{fn.__name__}({old}=...) is now {new}=...; the old name will be removed",
                          FutureWarning, stacklevel=2)
            kwargs[new] = kwargs.pop(old)
        return fn(*args, **kwargs)

    return wrapper


def spell_keyword(name: str, value: object) -> str:
    """`epsilon=0.3`, `loss_type='sapo'`: as a caller of the loss functions writes it."""
    return f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}"


def spell_flag(name: str, value: object) -> str:
    """`--epsilon 0.3`, `--loss-type sapo`: as the command line writes it."""
    return f"--{name.replace('_', '-')} {value}"


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; choose one of {', '.join(repr(c) for c in choices)}")


def check_policy_numbers(*, beta: float, epsilon: float, epsilon_high: float | None, delta: float | None,
                         loss_type: str, cispo_eps_low: float, cispo_eps_high: float, sapo_tau_pos: float,
                         sapo_tau_neg: float, spell: Spell = spell_keyword) -> None:
    """The ranges of `clipped_surrogate`'s numbers, and what goes with which policy loss; a ValueError that
    names the option as `spell` writes it. `epsilon_high` None means epsilon."""
    if beta < 0:
        raise ValueError(f"{spell('beta', beta)}: the KL coefficient must be >= 0")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"{spell('epsilon', epsilon)}: must be in [0, 1] (the ratio is clipped below at 1 minus "
                         "it; 0.2 is the recipe's)")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon_high < 0:
        raise ValueError(f"{spell('epsilon_high', epsilon_high)}: must be >= 0 (the ratio is clipped above at 1 "
                         "plus it; DAPO uses 0.28)")
    if delta is not None and loss_type != "clip":
        raise ValueError(f"{spell('delta', delta)} caps the unclipped ratio of {spell('loss_type', 'clip')}; "
                         f"{spell('loss_type', loss_type)} has none: leave the cap off")
    if delta is not None and delta < 1.0 + epsilon_high:
        raise ValueError(f"{spell('delta', delta)} must be >= 1 + the upper clip range = {1.0 + epsilon_high:g}: a "
                         "smaller cap would zero the gradient of positive-advantage tokens inside the clip range; "
                         "try 3")
    if cispo_eps_low < 0 or cispo_eps_high < 0:
        raise ValueError(f"{spell('cispo_eps_low', cispo_eps_low)}, {spell('cispo_eps_high', cispo_eps_high)}: both "
                         "must be >= 0 (CISPO's weight is clipped to [1 - cispo_eps_low, 1 + cispo_eps_high])")
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"{spell('sapo_tau_pos', sapo_tau_pos)}, {spell('sapo_tau_neg', sapo_tau_neg)}: SAPO's "
                         "gate temperatures must be > 0 (the paper's are 1.0 and 1.05)")


def check_importance_numbers(*, is_cap: float, is_cap_low: float | None = None, spell: Spell = spell_keyword
                             ) -> None:
    """The range of `importance_weights`' is_cap (and is_cap_low); a ValueError that names the option as
    `spell` writes it."""
    if not is_cap >= 1:
        raise ValueError(f"{spell('is_cap', is_cap)}: the importance-weight cap must be 1 or more (a lower cap "
                         "would weigh down tokens on which sampler and trainer agree, ratio 1); 2 is usual")
    if is_cap_low is not None and not 0 <= is_cap_low < is_cap:
        raise ValueError(f"{spell('is_cap_low', is_cap_low)}: must be in [0, is_cap={is_cap})")
