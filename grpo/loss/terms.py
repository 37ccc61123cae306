"""The policy terms of the GRPO loss: what each token's importance ratio contributes, one small term each.

A term is a frozen dataclass holding its own knobs (checked when it is made, each error naming the knob and its
flag) and one function, `objective`: the per-token policy objective and the statistics it owns. Terms are
registered by name with `@register_policy_term`; the registry, POLICY_TERMS, is what `--loss-type` offers, and
every knob is a flag with the knob's help text (`--{name}-{knob}`; the clip's keep TRL's names, `--epsilon`).
A new variant is one dataclass in this file. The formulas and their sources are in docs/loss.md.

What it deliberately is not: the loss. The ratio, the importance weights, the KL term, the normalisation and the
input checks are `clipped_surrogate`'s (surrogate.py), the same for every term.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import torch


class TermInputs(NamedTuple):
    """What a term reads: (B, T) each, adv (B, 1). Positions where mask is False hold 0, never inf or nan."""

    log_ratio: torch.Tensor  # log w = logp - old_logp, or its row mean with ratio_level="sequence" (GSPO)
    ratio: torch.Tensor  # w = exp(log_ratio); with log_ratio and logp, the only inputs with a gradient
    logp: torch.Tensor
    old_logp: torch.Tensor  # detached
    adv: torch.Tensor  # detached
    mask: torch.Tensor  # bool, True where a token counts


class TermOutput(NamedTuple):
    """A term's per-token objective and the detached statistics it owns, (B, T) each."""

    policy: torch.Tensor  # the objective to minimise, with its gradient (before importance weights and the norm)
    clipped_low: torch.Tensor  # bool: clipped (or dropped) below: the stat clip_frac_low
    clipped_high: torch.Tensor  # bool: clipped (or dropped) above: clip_frac_high
    grad_weight: torch.Tensor  # g: the token's gradient is -A g times what the norm gives it (1 on-policy)
    capped: torch.Tensor | None = None  # bool: where a cap on the ratio bound it (clip_frac_delta); None: no cap


def knob(default: Any, help: str) -> Any:
    """A term's knob: its default, and its --help text (what it does, when a user would change it)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PolicyTerm:
    """The base of every term: a name, a flag prefix, knobs that are finite numbers."""

    name: ClassVar[str]  # what --loss-type and clipped_surrogate(term=) call it
    flag_prefix: ClassVar[str]  # a knob's flag is --{flag_prefix}{knob}

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            self.require(f.name, not isinstance(value, float) or math.isfinite(value), "must be a finite number")

    def objective(self, x: TermInputs) -> TermOutput:
        raise NotImplementedError

    @classmethod
    def flag(cls, knob_name: str) -> str:
        """The command-line flag of a knob: Sapo's tau_pos -> --sapo-tau-pos."""
        return "--" + (cls.flag_prefix + knob_name).replace("_", "-")

    def require(self, knob_name: str, ok: bool, why: str) -> None:
        """A ValueError naming the knob, its value and its flag, when `ok` is False."""
        if not ok:
            value = getattr(self, knob_name)
            raise ValueError(f"{type(self).__name__}({knob_name}={value!r}), flag {self.flag(knob_name)}: {why}")

    def as_dict(self) -> dict[str, Any]:
        """{"loss_type": name, knob: value, ...}: as config.json holds it; `policy_term(**d)` makes it again."""
        return {"loss_type": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}


POLICY_TERMS: dict[str, type[PolicyTerm]] = {}  # name -> term, in the order registered


def register_policy_term(name: str, *, flag_prefix: str | None = None) -> Callable[[type], type]:
    """Registers a term under `name`; its knobs' flags are --{name}-{knob}, or --{flag_prefix}{knob}."""

    def register(cls: type[PolicyTerm]) -> type[PolicyTerm]:
        prefix = f"{name}_" if flag_prefix is None else flag_prefix
        taken = {other.flag(f.name) for other in POLICY_TERMS.values() for f in fields(other)}
        clash = taken & {"--" + (prefix + f.name).replace("_", "-") for f in fields(cls)}
        if name in POLICY_TERMS or clash:
            raise ValueError(f"policy term {name!r}: its name or flags {sorted(clash)} are taken; rename it")
        cls.name, cls.flag_prefix = name, prefix
        POLICY_TERMS[name] = cls
        return cls

    return register


def policy_term(loss_type: str, **knobs: Any) -> PolicyTerm:
    """The term registered as `loss_type`, with these knobs (the others at their defaults)."""
    if loss_type not in POLICY_TERMS:
        raise ValueError(f"loss_type={loss_type!r} is unknown; choose one of {', '.join(map(repr, POLICY_TERMS))}")
    return POLICY_TERMS[loss_type](**knobs)


# --------------------------------------------------------------------------------------------------
# The terms. Each: -A times what it makes of the ratio; docs/loss.md has each formula and its source.
# --------------------------------------------------------------------------------------------------
@register_policy_term("clip", flag_prefix="")
@dataclass(frozen=True)
class Clip(PolicyTerm):
    """PPO's clipped ratio (GRPO); clip-higher (DAPO) with epsilon_high, dual-clip with delta."""

    epsilon: float = knob(0.2, "Clip: the ratio is clipped below at 1 - epsilon (and above at 1 + epsilon unless "
                               "--epsilon-high is given). Smaller keeps each update closer to the sampling policy.")
    epsilon_high: float | None = knob(None, "Clip: the ratio is clipped above at 1 + this. DAPO's clip-higher "
                                            "raises it to 0.28 so that unlikely tokens can grow and entropy does "
                                            "not collapse. Default: --epsilon.")
    delta: float | None = knob(None, "Clip: cap the unclipped ratio of negative-advantage tokens at this (dual-clip, "
                                     "INTELLECT-2's two-sided clipping), at least 1 + --epsilon-high; try 3 when one "
                                     "token that became far likelier than sampled dominates a step. Default: off.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("epsilon", 0.0 <= self.epsilon <= 1.0,
                     "must be in [0, 1] (the ratio is clipped below at 1 minus it; 0.2 is the recipe's)")
        self.require("epsilon_high", self.epsilon_high is None or self.epsilon_high >= 0,
                     "must be >= 0 (the ratio is clipped above at 1 plus it; DAPO uses 0.28)")
        high = 1.0 + self.high
        self.require("delta", self.delta is None or self.delta >= high,
                     f"must be >= 1 + the upper clip range = {high:g}: a smaller cap would zero the gradient of "
                     "positive-advantage tokens inside the clip range; try 3")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def objective(self, x: TermInputs) -> TermOutput:
        lo, hi, delta, adv = 1.0 - self.epsilon, 1.0 + self.high, self.delta, x.adv
        clipped = x.ratio.clamp(lo, hi)
        unclipped = x.ratio if delta is None else x.ratio.clamp(max=delta)
        policy = -torch.minimum(unclipped * adv, clipped * adv)  # (B, T)
        with torch.no_grad():
            w = x.ratio.detach()
            # The gradient follows the branch the min picked, which passes it while it is not a constant.
            unclipped_passes = w <= delta if delta is not None else torch.ones_like(w, dtype=torch.bool)
            clipped_passes = (w >= lo) & (w <= hi)
            picks_unclipped = unclipped * adv <= clipped * adv
            grad_weight = w * torch.where(picks_unclipped, unclipped_passes, clipped_passes)
            capped = (w > delta) & (adv < 0) if delta is not None else None
        return TermOutput(policy, (w < lo) & (adv < 0), (w > hi) & (adv > 0), grad_weight, capped)


@register_policy_term("cispo")
@dataclass(frozen=True)
class Cispo(PolicyTerm):
    """MiniMax-M1's CISPO: the importance weight clipped and detached, times the log-probability."""

    eps_low: float = knob(1.0, "CISPO: the weight's floor is 1 minus this; 1 (a floor of 0) is no lower bound, as "
                               "in MiniMax-M1.")
    eps_high: float = knob(4.0, "CISPO: the weight's cap is 1 plus this (MiniMax-M1 tunes only this and does not "
                                "publish it; peers cap at 4 to 6). Lower it if rare tokens' updates grow too large.")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("eps_low", "eps_high"):
            self.require(name, getattr(self, name) >= 0,
                         "must be >= 0 (CISPO's weight is clipped to [1 - eps_low, 1 + eps_high])")

    def objective(self, x: TermInputs) -> TermOutput:
        lo, hi = 1.0 - self.eps_low, 1.0 + self.eps_high
        w = x.ratio.detach()
        weight = w.clamp(lo, hi)  # a constant: the gradient flows through logp only
        return TermOutput(-weight * x.adv * x.logp, w < lo, w > hi, weight)


@register_policy_term("sapo")
@dataclass(frozen=True)
class Sapo(PolicyTerm):
    """Qwen's SAPO: a smooth sigmoid gate on the ratio in place of the hard clip."""

    tau_pos: float = knob(1.0, "SAPO: gate temperature for positive advantages (the paper's 1.0); larger closes the "
                               "gate sooner as the ratio leaves 1.")
    tau_neg: float = knob(1.05, "SAPO: gate temperature for negative advantages (the paper's 1.05, above "
                                "--sapo-tau-pos so that negative updates are damped sooner).")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tau_pos", "tau_neg"):
            self.require(name, getattr(self, name) > 0,
                         "SAPO's gate temperatures must be > 0 (the paper's are 1.0 and 1.05)")

    def objective(self, x: TermInputs) -> TermOutput:
        tau = x.adv.new_full(x.adv.shape, self.tau_neg).masked_fill(x.adv > 0, self.tau_pos)  # (B, 1)
        gate = torch.sigmoid(tau * (x.ratio - 1.0))  # (B, T) s
        policy = -gate * (4.0 / tau) * x.adv
        with torch.no_grad():
            s = gate.detach()
            grad_weight = 4.0 * s * (1.0 - s) * x.ratio.detach()
            nothing = torch.zeros_like(s, dtype=torch.bool)
        return TermOutput(policy, nothing, nothing, grad_weight)


def _divergence_masked(x: TermInputs, valid: torch.Tensor, ratio_cap: float) -> TermOutput:
    """DPPO's objective: -sg(min(w, ratio_cap)) * A * logp on the tokens inside the trust region (`valid`)."""
    w = x.ratio.detach()
    weight = w.clamp(max=ratio_cap) * valid  # a constant: the gradient flows through logp only
    up = x.adv > 0
    return TermOutput(-weight * x.adv * x.logp, ~valid & ~up, ~valid & up, weight, valid & (w > ratio_cap))


@register_policy_term("dppo_tv")
@dataclass(frozen=True)
class DppoTV(PolicyTerm):
    """DPPO-Binary-TV: drops the tokens whose probability moved past a trust region, instead of clipping the ratio."""

    low: float = knob(0.15, "DPPO-TV: a negative-advantage token is dropped once its probability fell by more than "
                            "this since sampling (the DPPO authors' 0.15; prime-rl's 0.2). Smaller is a tighter "
                            "trust region.")
    high: float = knob(0.15, "DPPO-TV: a positive-advantage token is dropped once its probability rose by more than "
                             "this since sampling.")
    ratio_cap: float = knob(20.0, "DPPO-TV: the detached ratio that weighs each kept token is truncated at this "
                                  "(verl's 20); raise it to remove the truncation's bias.")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("low", "high"):
            self.require(name, 0.0 <= getattr(self, name) <= 1.0,
                         "must be in [0, 1]: a change of a probability, the bound of the trust region")
        self.require("ratio_cap", self.ratio_cap >= 1.0,
                     "must be >= 1 (a smaller cap would weigh down tokens on which the policies agree)")

    def objective(self, x: TermInputs) -> TermOutput:
        with torch.no_grad():
            rise = x.logp.detach().exp() - x.old_logp.exp()  # (B, T) p - p_old
            valid = torch.where(x.adv > 0, rise <= self.high, rise >= -self.low)
        return _divergence_masked(x, valid, self.ratio_cap)


@register_policy_term("dppo_kl")
@dataclass(frozen=True)
class DppoKL(PolicyTerm):
    """DPPO-Binary-KL: drops the tokens whose binary KL to the sampling policy passed a trust region."""

    low: float = knob(0.05, "DPPO-KL: a negative-advantage token whose probability fell is dropped once the binary KL "
                            "between its old and new probability exceeds this (the DPPO authors' 0.05). Smaller is "
                            "a tighter trust region.")
    high: float = knob(0.05, "DPPO-KL: the same bound for a positive-advantage token whose probability rose.")
    ratio_cap: float = knob(20.0, "DPPO-KL: the detached ratio that weighs each kept token is truncated at this "
                                  "(verl's 20); raise it to remove the truncation's bias.")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("low", "high"):
            self.require(name, getattr(self, name) >= 0, "must be >= 0: a KL divergence, the bound of the trust region")
        self.require("ratio_cap", self.ratio_cap >= 1.0,
                     "must be >= 1 (a smaller cap would weigh down tokens on which the policies agree)")

    def objective(self, x: TermInputs) -> TermOutput:
        with torch.no_grad():
            logp, old_logp = x.logp.detach(), x.old_logp
            p, old_p = logp.exp(), old_logp.exp()
            eps = 1e-8  # keeps log(1 - p) finite at p = 1
            binary_kl = old_p * (old_logp - logp) + (1 - old_p) * (torch.log1p(eps - old_p) - torch.log1p(eps - p))
            valid = torch.where(x.adv > 0, (binary_kl <= self.high) | (p <= old_p),
                                (binary_kl <= self.low) | (p >= old_p))
        return _divergence_masked(x, valid, self.ratio_cap)


@register_policy_term("gmpo")
@dataclass(frozen=True)
class Gmpo(PolicyTerm):
    """GMPO (verl's geo_mean): each row's geometric-mean ratio, its token log-ratios clipped, times -A."""

    epsilon: float = knob(0.4, "GMPO: each token's log-ratio is clipped below at -epsilon (the paper's range is "
                               "(e^-0.4, e^0.4)). Smaller keeps each update closer to the sampling policy.")
    epsilon_high: float | None = knob(None, "GMPO: each token's log-ratio is clipped above at this. Default: "
                                            "--gmpo-epsilon.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("epsilon", self.epsilon >= 0, "must be >= 0 (a bound on a log-ratio; the paper's is 0.4)")
        self.require("epsilon_high", self.epsilon_high is None or self.epsilon_high >= 0,
                     "must be >= 0 (a bound on a log-ratio; the paper's is 0.4)")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def objective(self, x: TermInputs) -> TermOutput:
        lo, hi, log_ratio = -self.epsilon, self.high, x.log_ratio
        sign = torch.sign(x.adv)  # (B, 1)
        # The pessimistic side of the clip, as PPO's min does it: the clip binds above for A > 0, below for A < 0.
        kept = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(lo, hi))  # (B, T)
        n_tok = x.mask.sum(-1, keepdim=True).clamp(min=1)
        row_ratio = torch.exp(torch.where(x.mask, kept, 0.0).sum(-1, keepdim=True) / n_tok)  # (B, 1)
        # The row's objective on each of its tokens: the sequence norm's token mean is the row's objective itself.
        policy = (-x.adv * row_ratio).expand_as(log_ratio)
        with torch.no_grad():
            clipped_low = (x.adv < 0) & (log_ratio < lo)
            clipped_high = (x.adv > 0) & (log_ratio > hi)
            grad_weight = row_ratio.detach() * ~(clipped_low | clipped_high)
        return TermOutput(policy, clipped_low, clipped_high, grad_weight)
