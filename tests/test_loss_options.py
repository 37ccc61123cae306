"""The loss's options, stated once (grpo/loss/options.py): the command line and the loss functions name each
option alike and refuse the same numbers; the loss functions' old names still work, with a FutureWarning;
the policy terms are exactly the offered choices; and the command line reads them without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo.config import Config
from grpo.loss import POLICY_LOSSES, clipped_surrogate, importance_weights
from grpo.loss.surrogate import POLICY_TERMS

# Options with one name for the loss functions and the command line: both sides of a boundary of every rule.
CASES = [
    dict(beta=-0.01), dict(beta=0.0), dict(epsilon=0.0), dict(epsilon=1.0), dict(epsilon=1.01), dict(epsilon=-0.01),
    dict(epsilon_high=0.0), dict(epsilon_high=-0.01), dict(delta=1.2), dict(delta=1.19),
    dict(epsilon_high=0.28, delta=1.28), dict(epsilon_high=0.28, delta=1.27), dict(loss_type="cispo", delta=3.0),
    dict(loss_type="cispo", cispo_eps_low=0.0, cispo_eps_high=0.0), dict(cispo_eps_high=-0.5),
    dict(sapo_tau_pos=0.0), dict(sapo_tau_neg=1e-3),
]


def _refuses(make) -> str | None:
    try:
        make()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("options", CASES)
def test_the_command_line_and_the_loss_refuse_the_same_numbers_under_one_name(options):
    inputs = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), adv=torch.zeros(2),
                  mask=torch.ones(2, 3, dtype=torch.bool), ref_logp=torch.zeros(2, 3))
    by_loss = _refuses(lambda: clipped_surrogate(**inputs, **options))
    by_config = _refuses(lambda: Config(**options))
    assert (by_loss is None) == (by_config is None), (by_loss, by_config)
    if by_loss is not None:  # the option that broke the rule, named as each caller writes it
        name = list(options)[-1]
        assert f"{name}=" in by_loss and f"--{name.replace('_', '-')} " in by_config, (by_loss, by_config)


@pytest.mark.parametrize("cap, refused", [(2.0, False), (1.0, False), (0.99, True), (0.0, True)])
def test_the_importance_cap_has_one_rule_for_the_flag_and_the_function(cap, refused):
    x = torch.zeros(1, 2)
    by_function = _refuses(lambda: importance_weights(x, x, torch.ones(1, 2, dtype=torch.bool), is_cap=cap))
    by_config = _refuses(lambda: Config(is_cap=cap))
    assert (by_function is not None) == (by_config is not None) == refused
    if refused:
        assert by_function.startswith(f"is_cap={cap}") and by_config.startswith(f"--is-cap {cap}")


def test_every_offered_policy_loss_has_exactly_one_term_function():
    assert tuple(POLICY_TERMS) == POLICY_LOSSES


def test_the_command_line_reads_the_loss_options_without_importing_torch():
    code = ("import sys; from grpo.config import parse_args; parse_args(['--loss-type', 'sapo']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_loss_functions_old_keywords_still_work_with_a_warning_naming_the_new_one():
    from grpo.loss import group_advantages, kl_penalty

    inputs = dict(logp=torch.tensor([[-1.0, -2.0]]), old_logp=torch.tensor([[-1.5, -1.0]]), adv=torch.tensor([1.0]),
                  mask=torch.ones(1, 2, dtype=torch.bool))
    new, _ = clipped_surrogate(**inputs, epsilon=0.1, loss_norm="constant", max_completion_length=4)
    with pytest.warns(FutureWarning) as caught:
        old, _ = clipped_surrogate(**inputs, eps_low=0.1, norm="constant", max_len=4)
    assert [str(w.message).split(";")[0] for w in caught] == [
        "clipped_surrogate(eps_low=...) is now epsilon=...", "clipped_surrogate(norm=...) is now loss_norm=...",
        "clipped_surrogate(max_len=...) is now max_completion_length=..."]
    assert torch.equal(old, new) and not torch.equal(new, clipped_surrogate(**inputs)[0])
    with pytest.raises(TypeError, match="got eps_low= and epsilon=, one option twice"):
        clipped_surrogate(**inputs, eps_low=0.1, epsilon=0.1)
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    with pytest.warns(FutureWarning, match="is now num_generations="):
        old_adv, _ = group_advantages(rewards, group_size=2, scale_rewards="none")
    assert torch.equal(old_adv, group_advantages(rewards, num_generations=2, scale_rewards="none")[0])
    with pytest.warns(FutureWarning, match="is now kl_estimator="):
        assert torch.equal(kl_penalty(inputs["logp"], inputs["old_logp"], kind="k1"),
                           kl_penalty(inputs["logp"], inputs["old_logp"], kl_estimator="k1"))
    logp, sampler_logp = torch.tensor([[0.0, 0.0]]), torch.tensor([[-0.9163, 0.0]])  # ratios 2.5 and 1
    with pytest.warns(FutureWarning, match="is now is_cap="):
        old_w, _ = importance_weights(logp, sampler_logp, inputs["mask"], cap=3.0)
    new_w, _ = importance_weights(logp, sampler_logp, inputs["mask"], is_cap=3.0)
    assert torch.equal(old_w, new_w) and old_w[0, 0] > 2.4  # the cap given, not the default 2
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        clipped_surrogate(**inputs, bogus=1)
