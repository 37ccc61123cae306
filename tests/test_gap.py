"""The sampler-trainer gap: the clipping rule it shares with importance_weights, its numbers on a tiny
rollout by hand, its path through a training step (no extra forward, old_logp with mu > 1), the
progress line, and how small it is for the native and hf engines on CPU in fp32."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from grpo.config import Config
from grpo.distributed import World
from grpo.loss.importance import SamplerGap, clipped_by_correction, importance_weights
from grpo.run.log import step_line
from grpo.trainer import train
from test_importance import _case  # log-ratios 0.5, -0.25, 1.0 in row 0; 2.0, then padding in row 1


@pytest.mark.parametrize("level, mode, cap, cap_low, expected", [
    ("token", "truncate", 2.0, None, [[False, False, True], [True, False, False]]),  # e^1, e^2 above 2
    ("token", "mask", 2.0, 0.9, [[False, True, True], [True, False, False]]),  # and e^-0.25 below 0.9
    ("token", "truncate", 3.0, None, [[False, False, False], [True, False, False]]),
    ("sequence", "truncate", 1.5, None, [[True, True, True], [True, False, False]]),  # row means e^0.417, e^2
    ("sequence", "mask", 2.0, None, [[False, False, False], [True, False, False]]),
    ("token", "none", 2.0, None, [[False, False, False], [False, False, False]]),
])
def test_clipped_by_correction_marks_the_tokens_importance_weights_truncates_or_masks(level, mode, cap, cap_low,
                                                                                       expected):
    logp, sampler_logp, mask = _case()
    clipped = clipped_by_correction(logp, sampler_logp, mask, is_level=level, is_correction=mode, is_cap=cap,
                                    is_cap_low=cap_low)
    assert clipped.tolist() == expected
    weights, stats = importance_weights(logp, sampler_logp, mask, is_level=level, is_correction=mode, is_cap=cap,
                                        is_cap_low=cap_low)
    assert stats["is_clipped_frac"].item() == pytest.approx(clipped.sum().item() / mask.sum().item())
    if mode == "mask":  # a masked token weighs nothing; every other counted one does
        assert ((weights == 0) & mask).tolist() == clipped.tolist()


def test_the_gap_of_a_tiny_rollout_equals_the_hand_computation_over_counted_tokens_and_micro_batches():
    logp, sampler_logp, mask = _case()
    cfg = Config(is_correction="truncate", is_cap=2.0, is_level="token")
    gap = SamplerGap(is_level=cfg.is_level, is_correction=cfg.is_correction, is_cap=cfg.is_cap)
    gap.add(logp[:1], sampler_logp[:1], mask[:1])  # two micro-batches of one row
    gap.add(logp[1:], sampler_logp[1:], mask[1:])
    got = gap.over_ranks(World())
    # |differences| of the counted tokens: 0.5, 0.25, 1.0, 2.0 (padding's 50 never counts); ratios e^1, e^2 > 2.
    assert got["gap/logp_abs_mean"] == pytest.approx((0.5 + 0.25 + 1.0 + 2.0) / 4, rel=1e-6)
    assert got["gap/logp_abs_max"] == pytest.approx(2.0, rel=1e-6)
    assert got["gap/is_clipped_frac"] == pytest.approx(2 / 4)
    assert SamplerGap().over_ranks(World()) == {"gap/logp_abs_mean": 0.0, "gap/logp_abs_max": 0.0,
                                                "gap/is_clipped_frac": 0.0}  # no token: zeros, no division by 0


def test_the_progress_line_shows_the_gap_only_above_the_threshold():
    record = {"step": 3, "reward": 1.0, "reward_std": 0.5, "accuracy": 0.5, "format": 0.25, "completion_length": 8.0,
              "step_time": 1.0, "peak_mem_gib": 0.5, "gap/logp_abs_mean": 0.08, "gap/logp_abs_max": 1.5,
              "gap/is_clipped_frac": 0.02}
    assert "gap 0.080 (max 1.50, clipped 2.0%)" in step_line(record, gap_warn=0.05)
    assert "gap" not in step_line(record, gap_warn=0.1)
    assert "gap" not in step_line(record)  # no threshold given: never
    assert "gap nan" in step_line({**record, "gap/logp_abs_mean": math.nan}, gap_warn=0.05)


class _OffsetSampler:
    """The hf engine with EOS ignored (every row max-completion-length tokens), reporting log-probs shifted by
    a known amount: -1 at each row's first token (the trainer's ratio is then e > 2, clipped at --is-cap 2) and
    +0.25 at its second, 0 elsewhere."""

    needs_importance_correction = False  # the gap must still count what the correction would clip

    def __init__(self, policy, pad_id):
        from grpo.rollout.hf import HFEngine

        self.hf = HFEngine(policy, pad_id=pad_id)

    def generate(self, prompt_ids, n, sampling):
        rollout = self.hf.generate(prompt_ids, n, replace(sampling, ignore_eos=True))
        offset = torch.zeros_like(rollout.sampler_logp)
        offset[:, 0], offset[:, 1] = -1.0, 0.25
        rollout.sampler_logp = rollout.sampler_logp + offset * rollout.mask
        return rollout

    def release_memory(self):
        self.hf.release_memory()

    def standby_bytes(self):
        return None


def test_every_step_logs_the_gap_from_the_old_logprobs_with_mu_above_one(char_llama_dir, tmp_path, monkeypatch):
    from grpo import batch as batch_module
    from grpo import step as step_module
    from grpo import trainer
    from test_train import tiny_cfg

    monkeypatch.setattr(trainer, "build_engine",
                        lambda name, policy, *, pad_id, **kw: _OffsetSampler(policy, pad_id))
    forwards = []
    real = step_module.sequence_logprobs

    def counted(*args, **kwargs):
        forwards.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "sequence_logprobs", counted)  # the loss passes
    monkeypatch.setattr(batch_module, "sequence_logprobs", counted)  # batch_logprobs: the old log-probs
    T = 4
    train(tiny_cfg(char_llama_dir, tmp_path / "run", max_steps=2, num_iterations=2, beta=0.0,
                   max_completion_length=T, min_p=0.0, is_cap=2.0, lora_rank=4, lora_alpha=8,
                   log_completions_steps=0))
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:  # every row has T tokens: one off by 1, one by 0.25, the rest by float rounding
        assert r["gap/logp_abs_mean"] == pytest.approx(1.25 / T, abs=1e-4)
        assert r["gap/logp_abs_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["gap/is_clipped_frac"] == 1 / T
    # One old_logp pass and mu = 2 loss passes per step, micro-batch of the whole batch: the gap adds none.
    assert len(forwards) == 2 * (1 + 2)


@pytest.mark.parametrize("engine_name", ["hf", "native"])
def test_native_and_hf_engines_in_fp32_on_cpu_sample_with_the_trainers_logprobs(char_llama_dir, engine_name):
    from grpo.model.load import load_policy
    from grpo.rollout import Sampling, build_engine
    from grpo.batch import make_batch, sequence_logprobs

    cfg = Config(model=str(char_llama_dir), dtype="fp32", lora_rank=4, lora_alpha=8, temperature=0.7)
    device = torch.device("cpu")
    policy, tokenizer, _ = load_policy(cfg, device)
    g = torch.Generator().manual_seed(0)
    for name, p in policy.named_parameters():  # adapters that change the logits, so both sides must apply them
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Say 7.")["input_ids"]]
    engine = build_engine(engine_name, policy, pad_id=tokenizer.pad_token_id, max_seq_len=64, max_batch=8)
    rollout = engine.generate(prompts, 4, Sampling(max_new_tokens=24, temperature=0.7, min_p=0.1, seed=5))
    batch = make_batch(rollout, tokenizer.pad_token_id, device)
    policy.eval()
    with torch.no_grad():
        logp = sequence_logprobs(policy, batch, cfg.temperature)
    gap = SamplerGap(is_level=cfg.is_level, is_correction=cfg.is_correction, is_cap=cfg.is_cap)
    gap.add(logp, batch.sampler_logp, batch.mask)
    got = gap.over_ranks(World())
    assert batch.mask.sum() > 40
    # Seen (fp32, CPU), both engines: mean about 1.3e-6, max up to 9e-6. The trainer at temperature 1 instead,
    # or without the adapters, gives a mean of 0.4 and more.
    assert got["gap/logp_abs_mean"] < 2e-5 and got["gap/logp_abs_max"] < 1e-4, got
    assert got["gap/is_clipped_frac"] == 0.0
