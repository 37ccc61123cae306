"""DAPO's overlong handling: the soft overlong punishment as a reward column (`--overlong-penalty`), and the
truncated completions taken out of the loss while they count in their groups' advantages
(`--mask-truncated-completions`)."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import pytest
import torch

from grpo.config import Config, parse_args
from grpo.rewards import overlong_penalty, score, soft_overlong_penalty
from grpo.trainer import train


def dapo_eq_13(length: int, max_length: int, cache: int) -> Fraction:
    """The paper's R_length(y), exactly."""
    if length <= max_length - cache:
        return Fraction(0)
    if length <= max_length:
        return Fraction((max_length - cache) - length, cache)
    return Fraction(-1)


@pytest.mark.parametrize("max_length, cache", [(20, 4), (16384 + 4096, 4096), (7, 7), (5, 1), (10, 3)])
def test_the_penalty_is_dapos_eq_13_at_and_between_its_boundaries(max_length, cache):
    start = max_length - cache
    lengths = sorted({0, 1, start - 1, start, start + 1, (start + max_length) // 2, max_length - 1, max_length,
                      max_length + 1, 3 * max_length} - {-1})
    for length in lengths:
        got = soft_overlong_penalty(length, max_length, cache)
        assert isinstance(got, float) and got == float(dapo_eq_13(length, max_length, cache)), length
    assert soft_overlong_penalty(start, max_length, cache) == 0.0
    assert soft_overlong_penalty(max_length, max_length, cache) == -1.0
    assert soft_overlong_penalty(max_length + 1, max_length, cache) == -1.0
    assert soft_overlong_penalty(start + 1, max_length, cache) == -1 / cache


def test_the_penalty_reads_token_lengths_and_is_its_own_column_named_overlong():
    ids = [[7] * n for n in (0, 16, 17, 18, 20, 25)]
    rewards, names = score(["x"] * len(ids), ["1"] * len(ids), [overlong_penalty(20, 4)],
                           columns={"completion_ids": ids})
    assert names == ["overlong"]
    assert rewards[:, 0].tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("max_length, cache", [(8, 9), (8, 0), (8, -1)])
def test_a_cache_outside_one_to_len_is_refused_naming_the_flag(max_length, cache):
    with pytest.raises(ValueError, match="--overlong-penalty"):
        overlong_penalty(max_length, cache)


def test_the_flags_parse_into_the_config_and_round_trip_through_config_json(tmp_path):
    assert parse_args([]).overlong_penalty is None and not parse_args([]).mask_truncated_completions
    cfg = parse_args(["--overlong-penalty", "1024,256", "--mask-truncated-completions"])
    assert cfg.overlong_penalty == (1024, 256) and cfg.mask_truncated_completions
    assert parse_args(["--overlong-penalty", "256"]).overlong_penalty == (None, 256)
    assert parse_args(["--overlong-penalty", "none"]).overlong_penalty is None
    cfg = dataclasses.replace(cfg, output_dir=str(tmp_path))
    assert Config.load(cfg.save(tmp_path)) == cfg
    cfg = dataclasses.replace(cfg, overlong_penalty=(None, 256))
    assert Config.load(cfg.save(tmp_path)) == cfg


@pytest.mark.parametrize("argv", [["--overlong-penalty", "abc"], ["--overlong-penalty", "8,9"],
                                  ["--overlong-penalty", "0"], ["--overlong-penalty", "1,2,3"],
                                  ["--overlong-penalty", "300", "--max-completion-length", "256",
                                   "--max-prompt-length", "100"]])
def test_a_bad_overlong_penalty_is_one_line_naming_the_flag(capsys, argv):
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overlong-penalty" in err, err
    if "--max-completion-length" in argv:
        assert "--max-completion-length 256" in err


# --- a tiny CPU run ----------------------------------------------------------------------------------

def differs_by_text(completions, answers, **columns):
    """A reward that differs between completions, so that every group has advantages."""
    return [(sum(map(ord, text)) % 13) / 13 for text in completions]


class HalfCut:
    """The hf engine, reporting every odd row as cut by the length limit (every group holds both kinds), or every
    row with `all_cut`, and keeping what it returned for the test to read."""

    needs_importance_correction = False

    def __init__(self, policy, pad_id, all_cut=False):
        from grpo.rollout.hf import HFEngine

        self.hf = HFEngine(policy, pad_id=pad_id)
        self.all_cut = all_cut
        self.rollouts = []

    def generate(self, prompt_ids, n, sampling):
        rollout = self.hf.generate(prompt_ids, n, sampling)
        finished = torch.arange(rollout.completion_ids.shape[0]) % 2 == 0
        finished = finished & (not self.all_cut)
        rollout = dataclasses.replace(rollout, finished=finished)
        self.rollouts.append(rollout)
        return rollout

    def release_memory(self):
        self.hf.release_memory()

    def standby_bytes(self):
        return None


def first_step(model_dir, out, monkeypatch, *, zero_cut_advantages: bool = False, all_cut: bool = False, **kw):
    """One step with HalfCut as the sampler: (the adapters' gradients before clipping, the step's metrics line,
    the engine)."""
    import grpo.step as step_module
    from grpo import trainer

    engines = []

    def build(name, policy, *, pad_id, **_):
        engines.append(HalfCut(policy, pad_id, all_cut))
        return engines[-1]

    monkeypatch.setattr(trainer, "build_engine", build)
    grads = [None]
    real_clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(params, *args, **kwargs):
        params = list(params)
        grads.append([p.grad.detach().clone() for p in params])
        return real_clip(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    if zero_cut_advantages:  # the reference: the cut rows stay in the loss with no advantage
        real_adv = step_module.group_advantages

        def zeroed(rewards, *args, **kwargs):
            adv, rest = real_adv(rewards, *args, **kwargs)
            return torch.where(engines[0].rollouts[-1].finished, adv, 0.0), rest

        monkeypatch.setattr(step_module, "group_advantages", zeroed)
    cfg = Config(model=str(model_dir), dataset="arithmetic", num_train_examples=16, engine="hf", max_steps=1,
                 prompts_per_step=2, num_generations=2, max_completion_length=8, max_seq_length=1024,
                 learning_rate=1e-3, warmup_ratio=0.0, save_steps=0, log_completions_steps=0, output_dir=str(out),
                 seed=11, beta=0.0,
                 reward=("test_overlong:differs_by_text",), **kw)
    train(cfg)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.undo()
    return grads[-1], lines[-1], engines[0]


@pytest.mark.slow
@pytest.mark.parametrize("loss_norm", ["token", "sequence"])
def test_cut_completions_add_no_gradient_and_count_in_their_groups_advantages(tiny_llama_dir, tmp_path, monkeypatch,
                                                                            loss_norm):
    masked, record, engine = first_step(tiny_llama_dir, tmp_path / "masked", monkeypatch, loss_norm=loss_norm,
                                        mask_truncated_completions=True, overlong_penalty=(None, 4))
    # The reference keeps every row in the loss, the cut ones with advantage 0 (so no gradient of theirs), with
    # the advantages computed over all rows; it differs only in what the normalisation counts.
    kept, _, _ = first_step(tiny_llama_dir, tmp_path / "kept", monkeypatch, loss_norm=loss_norm,
                            zero_cut_advantages=True, overlong_penalty=(None, 4))
    plain, _, _ = first_step(tiny_llama_dir, tmp_path / "plain", monkeypatch, loss_norm=loss_norm,
                             overlong_penalty=(None, 4))
    rollout = engine.rollouts[0]
    finished = rollout.finished
    if loss_norm == "token":  # each divides by the tokens it counts
        scale = rollout.mask.sum() / rollout.mask[finished].sum()
    else:  # each divides by its rows
        scale = torch.tensor(len(finished) / int(finished.sum()))
    assert any(g.abs().max() > 0 for g in masked)
    for a, b, c in zip(masked, kept, plain):
        torch.testing.assert_close(a, b * scale.to(b.dtype), rtol=1e-4, atol=1e-7)
    assert not all(torch.allclose(a, c, rtol=1e-3, atol=1e-6) for a, c in zip(masked, plain))

    # The log: the share that finished, and the penalty's column over the lengths in tokens (LEN: the budget, 8)
    assert record["frac_finished"] == 0.5
    lengths = rollout.mask.sum(1).tolist()
    expected = sum(float(dapo_eq_13(n, 8, 4)) for n in lengths) / len(lengths)
    assert record["rewards/overlong"] == pytest.approx(expected, abs=1e-6)


def test_a_step_whose_completions_were_all_cut_makes_no_update(tiny_llama_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    grads, record, _ = first_step(tiny_llama_dir, tmp_path / "run", monkeypatch, mask_truncated_completions=True,
                                  all_cut=True)
    assert grads is None and record["grad_norm"] is None and record["frac_finished"] == 0.0
    adapter = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(not t.any() for t in lora_b)  # B starts at zero: no step moved it
