"""The loss's options, stated once: the choices of every string option and the range of every number, as
`clipped_surrogate`, `group_advantages`, `kl_penalty` and `importance_weights` check them and as the
command line (`grpo.config`) offers and checks them.

Each option is named here by the loss function's keyword (`eps_low`, `norm`, `cap`, ...). The command
line sets it through a `Config` field of another name for some (`--epsilon`, `--loss-norm`, `--is-cap`):
`CONFIG_FIELDS` maps one to the other, so that a rule written once speaks, in its error, the spelling of
whoever broke it (`spell_keyword` for the functions, `spell_flag` for the command line).

What it deliberately is not: the loss. No torch here (the command line imports it before any heavy
import, so that `--help` and a bad flag answer at once), and no rule about tensors: shapes and dtypes are
checked beside each function that takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

POLICY_LOSSES = ("clip", "cispo", "sapo")  # clipped_surrogate(policy_loss=), one term function each
RATIO_LEVELS = ("token", "sequence")  # clipped_surrogate(ratio_level=)
NORMS = ("sequence", "token", "constant")  # clipped_surrogate(norm=)
KL_KINDS = ("k1", "k2", "k3")  # clipped_surrogate(kl=), kl_penalty(kind=)
SCALES = ("group", "batch", "none")  # group_advantages(scale=)
IS_LEVELS = ("token", "sequence")  # importance_weights(level=)
IS_MODES = ("none", "truncate", "mask")  # importance_weights(mode=)

# The loss functions' keyword -> the Config field (and so the flag) that sets it, where the two differ.
CONFIG_FIELDS = {"eps_low": "epsilon", "eps_high": "epsilon_high", "policy_loss": "loss_type", "norm": "loss_norm",
                 "kl": "kl_estimator", "scale": "scale_rewards", "level": "is_level", "mode": "is_correction",
                 "cap": "is_cap"}

Spell = Callable[[str, object], str]  # (keyword, value) -> how the caller wrote it, for an error message


def spell_keyword(name: str, value: object) -> str:
    """`eps_low=0.3`, `policy_loss='sapo'`: as a caller of the loss functions writes it."""
    return f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}"


def spell_flag(name: str, value: object) -> str:
    """`--epsilon 0.3`, `--loss-type sapo`: as the command line writes it."""
    return f"--{CONFIG_FIELDS.get(name, name).replace('_', '-')} {value}"


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; choose one of {', '.join(repr(c) for c in choices)}")


def check_policy_numbers(*, beta: float, eps_low: float, eps_high: float | None, delta: float | None,
                         policy_loss: str, cispo_eps_low: float, cispo_eps_high: float, sapo_tau_pos: float,
                         sapo_tau_neg: float, spell: Spell = spell_keyword) -> None:
    """The ranges of `clipped_surrogate`'s numbers, and what goes with which policy loss; a ValueError that
    names the option as `spell` writes it. `eps_high` None means eps_low."""
    if beta < 0:
        raise ValueError(f"{spell('beta', beta)}: the KL coefficient must be >= 0")
    if not 0.0 <= eps_low <= 1.0:
        raise ValueError(f"{spell('eps_low', eps_low)}: must be in [0, 1] (the ratio is clipped below at 1 minus "
                         "it; 0.2 is the recipe's)")
    eps_high = eps_low if eps_high is None else eps_high
    if eps_high < 0:
        raise ValueError(f"{spell('eps_high', eps_high)}: must be >= 0 (the ratio is clipped above at 1 plus it; "
                         "DAPO uses 0.28)")
    if delta is not None and policy_loss != "clip":
        raise ValueError(f"{spell('delta', delta)} caps the unclipped ratio of {spell('policy_loss', 'clip')}; "
                         f"{spell('policy_loss', policy_loss)} has none: leave the cap off")
    if delta is not None and delta < 1.0 + eps_high:
        raise ValueError(f"{spell('delta', delta)} must be >= 1 + the upper clip range = {1.0 + eps_high:g}: a "
                         "smaller cap would zero the gradient of positive-advantage tokens inside the clip range; "
                         "try 3")
    if cispo_eps_low < 0 or cispo_eps_high < 0:
        raise ValueError(f"{spell('cispo_eps_low', cispo_eps_low)}, {spell('cispo_eps_high', cispo_eps_high)}: both "
                         "must be >= 0 (CISPO's weight is clipped to [1 - cispo_eps_low, 1 + cispo_eps_high])")
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"{spell('sapo_tau_pos', sapo_tau_pos)}, {spell('sapo_tau_neg', sapo_tau_neg)}: SAPO's "
                         "gate temperatures must be > 0 (the paper's are 1.0 and 1.05)")


def check_importance_numbers(*, cap: float, cap_low: float | None = None, spell: Spell = spell_keyword) -> None:
    """The range of `importance_weights`' cap (and cap_low); a ValueError that names the option as `spell`
    writes it."""
    if not cap >= 1:
        raise ValueError(f"{spell('cap', cap)}: the importance-weight cap must be 1 or more (a lower cap would weigh "
                         "down tokens on which sampler and trainer agree, ratio 1); 2 is usual")
    if cap_low is not None and not 0 <= cap_low < cap:
        raise ValueError(f"{spell('cap_low', cap_low)}: must be in [0, cap={cap})")
