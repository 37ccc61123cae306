"""The loss's options, stated once: a policy term's knobs are checked by the term, whether research code or the
command line made it, and each error names the knob and its flag; every registered term is what --loss-type
offers, its knobs the flags; a term registered anywhere is offered the same way; the importance cap has one rule."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from grpo.config import Config, build_parser, parse_args
from grpo.loss import (POLICY_TERMS, Cispo, Clip, DppoKL, DppoTV, Gmpo, PolicyTerm, Sapo, TermOutput, clipped_surrogate,
                       importance_weights, policy_term, register_policy_term)
from grpo.loss.terms import knob

# Both sides of a boundary of every knob's rule: (term, knobs).
CASES = [
    (Clip, dict(epsilon=0.0)), (Clip, dict(epsilon=1.0)), (Clip, dict(epsilon=1.01)), (Clip, dict(epsilon=-0.01)),
    (Clip, dict(epsilon_high=0.0)), (Clip, dict(epsilon_high=-0.01)), (Clip, dict(delta=1.2)),
    (Clip, dict(delta=1.19)), (Clip, dict(epsilon_high=0.28, delta=1.28)), (Clip, dict(epsilon_high=0.28, delta=1.27)),
    (Cispo, dict(eps_low=0.0, eps_high=0.0)), (Cispo, dict(eps_high=-0.5)), (Sapo, dict(tau_pos=0.0)),
    (Sapo, dict(tau_neg=1e-3)), (DppoTV, dict(low=0.0, high=1.0)), (DppoTV, dict(high=1.01)),
    (DppoKL, dict(low=-0.01)), (DppoKL, dict(ratio_cap=1.0)), (DppoKL, dict(ratio_cap=0.99)),
    (Gmpo, dict(epsilon=0.0)), (Gmpo, dict(epsilon=-0.1)), (Gmpo, dict(epsilon_high=-0.1)),
]


def _refuses(make) -> str | None:
    try:
        make()
    except ValueError as err:
        return str(err)
    except SystemExit as exit_:  # the parser's one line, on stderr
        return str(exit_.__context__)
    return None


@pytest.mark.parametrize("term, knobs", CASES)
def test_the_command_line_and_research_code_refuse_the_same_knobs_naming_the_knob_and_its_flag(term, knobs):
    by_term = _refuses(lambda: term(**knobs))
    flags = [arg for name, value in knobs.items() for arg in (term.flag(name), str(value))]
    by_command_line = _refuses(lambda: parse_args(["--loss-type", term.name, *flags]))
    assert by_term == by_command_line  # the one rule, in one message
    if by_term is not None:
        name = list(knobs)[-1]  # the knob that broke the rule
        assert f"({name}=" in by_term and f"flag {term.flag(name)}:" in by_term and "\n" not in by_term


def test_a_knob_of_another_term_is_refused_on_the_command_line_naming_both():
    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "cispo", "--delta", "3"])
    err = _refuses(lambda: parse_args(["--sapo-tau-pos", "2"]))  # the default term is clip
    assert err.startswith("--sapo-tau-pos is a knob of --loss-type sapo, and this run's loss type is clip")


@pytest.mark.parametrize("cap, refused", [(2.0, False), (1.0, False), (0.99, True), (0.0, True)])
def test_the_importance_cap_has_one_rule_for_the_flag_and_the_function(cap, refused):
    x = torch.zeros(1, 2)
    by_function = _refuses(lambda: importance_weights(x, x, torch.ones(1, 2, dtype=torch.bool), is_cap=cap))
    by_config = _refuses(lambda: Config(is_cap=cap))
    assert (by_function is not None) == (by_config is not None) == refused
    if refused:
        assert by_function.startswith(f"is_cap={cap}") and by_config.startswith(f"--is-cap {cap}")


def test_loss_type_offers_every_registered_term_and_each_knob_is_a_flag_with_help():
    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["loss_type"].choices) == tuple(POLICY_TERMS)
    for name, term in POLICY_TERMS.items():
        assert term.__doc__ and term.name == name
        assert isinstance(term(), PolicyTerm) and policy_term(name) == term()
        for knob_name, value in term().as_dict().items():
            if knob_name == "loss_type":
                continue
            action = actions[f"{name}:{knob_name}"]
            assert action.option_strings == [term.flag(knob_name)] and len(action.help) > 40, action
            assert action.help.endswith(f"(default: {'none' if value is None else value})")


def test_a_name_or_a_flag_taken_twice_is_refused():
    with pytest.raises(ValueError, match="'sapo': its name or flags"):
        register_policy_term("sapo")(Sapo)
    with pytest.raises(ValueError, match=r"--epsilon"):
        @register_policy_term("another_clip", flag_prefix="")
        @dataclass(frozen=True)
        class AnotherClip(PolicyTerm):
            epsilon: float = knob(0.1, "A clip range.")
    assert "another_clip" not in POLICY_TERMS


def test_a_term_registered_in_one_place_is_a_loss_type_of_the_command_line_and_of_the_loss():
    @register_policy_term("scaled_pg")
    @dataclass(frozen=True)
    class ScaledPolicyGradient(PolicyTerm):
        """The plain policy gradient, scaled: -scale * A * logp."""

        scale: float = knob(1.0, "ScaledPolicyGradient: what the policy gradient is multiplied by.")

        def objective(self, x):
            nothing = torch.zeros_like(x.mask)
            return TermOutput(-self.scale * x.adv * x.logp, nothing, nothing, torch.full_like(x.logp, self.scale))

    try:
        cfg = parse_args(["--loss-type", "scaled_pg", "--scaled-pg-scale", "3"])
        assert cfg.policy_term == ScaledPolicyGradient(scale=3.0)
        logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        loss, stats = clipped_surrogate(logp, None, torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool),
                                        term=cfg.policy_term, loss_norm="token")
        loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor([[-3.0, -3.0]]))  # -scale * A / N, N = 2
        assert float(stats["grad_weight_mean"]) == 3.0
    finally:
        del POLICY_TERMS["scaled_pg"]
