"""The loss's options, stated once (grpo/loss/options.py): the command line and the loss functions refuse
the same numbers, each in its own spelling; the policy terms are exactly the offered choices; and the
command line reads them without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo.config import Config
from grpo.loss import POLICY_LOSSES, clipped_surrogate, importance_weights
from grpo.loss.surrogate import POLICY_TERMS

# (the loss's keywords, the Config fields that set them): both sides of a boundary of every rule.
CASES = [
    (dict(beta=-0.01), dict(beta=-0.01)), (dict(beta=0.0), dict(beta=0.0)),
    (dict(eps_low=0.0), dict(epsilon=0.0)), (dict(eps_low=1.0), dict(epsilon=1.0)),
    (dict(eps_low=1.01), dict(epsilon=1.01)), (dict(eps_low=-0.01), dict(epsilon=-0.01)),
    (dict(eps_high=0.0), dict(epsilon_high=0.0)), (dict(eps_high=-0.01), dict(epsilon_high=-0.01)),
    (dict(delta=1.2), dict(delta=1.2)), (dict(delta=1.19), dict(delta=1.19)),
    (dict(eps_high=0.28, delta=1.28), dict(epsilon_high=0.28, delta=1.28)),
    (dict(eps_high=0.28, delta=1.27), dict(epsilon_high=0.28, delta=1.27)),
    (dict(policy_loss="cispo", delta=3.0), dict(loss_type="cispo", delta=3.0)),
    (dict(policy_loss="cispo", cispo_eps_low=0.0, cispo_eps_high=0.0),
     dict(loss_type="cispo", cispo_eps_low=0.0, cispo_eps_high=0.0)),
    (dict(cispo_eps_high=-0.5), dict(cispo_eps_high=-0.5)),
    (dict(sapo_tau_pos=0.0), dict(sapo_tau_pos=0.0)), (dict(sapo_tau_neg=1e-3), dict(sapo_tau_neg=1e-3)),
]


def _refuses(make) -> str | None:
    try:
        make()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("loss_kw, config_kw", CASES)
def test_the_command_line_and_the_loss_refuse_the_same_numbers_each_in_its_own_spelling(loss_kw, config_kw):
    inputs = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), adv=torch.zeros(2),
                  mask=torch.ones(2, 3, dtype=torch.bool), ref_logp=torch.zeros(2, 3))
    by_loss = _refuses(lambda: clipped_surrogate(**inputs, **loss_kw))
    by_config = _refuses(lambda: Config(**config_kw))
    assert (by_loss is None) == (by_config is None), (by_loss, by_config)
    if by_loss is not None:  # the option that broke the rule, named as each caller wrote it
        name, field = list(loss_kw)[-1], list(config_kw)[-1]
        assert f"{name}=" in by_loss and f"--{field.replace('_', '-')} " in by_config, (by_loss, by_config)

@pytest.mark.parametrize("cap, refused", [(2.0, False), (1.0, False), (0.99, True), (0.0, True)])
def test_the_importance_cap_has_one_rule_for_the_flag_and_the_function(cap, refused):
    x = torch.zeros(1, 2)
    by_function = _refuses(lambda: importance_weights(x, x, torch.ones(1, 2, dtype=torch.bool), cap=cap))
    by_config = _refuses(lambda: Config(is_cap=cap))
    assert (by_function is not None) == (by_config is not None) == refused
    if refused:
        assert by_function.startswith(f"cap={cap}") and by_config.startswith(f"--is-cap {cap}")


def test_every_offered_policy_loss_has_exactly_one_term_function():
    assert tuple(POLICY_TERMS) == POLICY_LOSSES


def test_the_command_line_reads_the_loss_options_without_importing_torch():
    code = ("import sys; from grpo.config import parse_args; parse_args(['--loss-type', 'sapo']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
