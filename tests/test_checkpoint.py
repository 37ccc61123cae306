"""Checkpoints: the trainer_state.json layout, the counters round trip, finding and pruning folders."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import tiny_llama
from grpo.checkpoint import (Resumable, RunState, find_checkpoint, list_checkpoints, load_checkpoint,
                             save_checkpoint, save_from_every_rank)
from grpo.config import Config
from grpo.data import PromptStream
from grpo.distributed import World
from grpo.model import add_lora
from grpo.step import make_optimizer, make_scheduler


def _parts(seed: int = 0) -> Resumable:
    cfg = Config(gradient_checkpointing=False, optim="adamw_torch", lora_rank=4, lora_alpha=8)
    policy = add_lora(tiny_llama(seed=seed, vocab_size=256, max_pos=64), cfg)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_optimizer(cfg, params)
    return Resumable(policy, optimizer, make_scheduler(cfg, optimizer), PromptStream(10, 3, seed=1))


def _train_once(parts: Resumable) -> None:
    """One optimizer step, so that the adapters and the optimizer state are not the initial ones."""
    ids = torch.randint(0, 256, (2, 8))
    parts.policy(input_ids=ids, labels=ids).loss.backward()
    parts.optimizer.step()
    parts.scheduler.step()
    parts.stream.next()


def test_trainer_state_json_keeps_its_keys_and_the_counters_round_trip(tmp_path):
    parts = _parts()
    _train_once(parts)
    cfg = Config(output_dir=str(tmp_path), save_total_limit=0)
    state = RunState(step=7, nonfinite_in_row=1, skipped_steps=2, world_size=1)
    path = save_checkpoint(tmp_path, state, parts, cfg, [{"python": random.getstate(),
                                                          "torch": torch.get_rng_state()}])
    assert path == tmp_path / "checkpoint-7"
    saved = json.loads((path / "trainer_state.json").read_text())
    assert list(saved) == ["step", "stream", "nonfinite_in_row", "skipped_steps", "world_size", "run_id"]
    assert saved["stream"] == parts.stream.state_dict()

    fresh = _parts(seed=1)
    loaded = load_checkpoint(path, fresh, World())
    assert loaded == state
    assert fresh.stream.state_dict() == parts.stream.state_dict()
    assert fresh.scheduler.state_dict()["last_epoch"] == 1
    assert len(fresh.optimizer.state_dict()["state"]) == len(parts.optimizer.state_dict()["state"]) > 0
    for (name, a), b in zip(parts.policy.named_parameters(), fresh.policy.parameters()):
        if "lora_" in name:
            assert torch.equal(a, b), name


def test_a_checkpoint_without_the_newer_counters_loads_with_them_at_zero(tmp_path):
    parts = _parts()
    path = save_checkpoint(tmp_path, RunState(step=3, nonfinite_in_row=2, skipped_steps=2), parts,
                           Config(output_dir=str(tmp_path)), [])
    (path / "trainer_state.json").write_text(json.dumps({"step": 3, "stream": parts.stream.state_dict()}))
    assert load_checkpoint(path, _parts(), World()) == RunState(step=3, nonfinite_in_row=0, skipped_steps=0,
                                                                world_size=1)


def test_only_checkpoint_n_folders_count_and_the_oldest_are_pruned(tmp_path):
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-x", ".tmp-checkpoint-11", "adapter"):
        (tmp_path / name).mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    assert find_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-10"
    save_from_every_rank(tmp_path, RunState(step=11), _parts(), Config(output_dir=str(tmp_path), save_total_limit=2),
                         World())
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]
    assert not (tmp_path / ".tmp-checkpoint-11").exists()  # written under the temporary name, then renamed
    assert (tmp_path / "checkpoint-11" / "rng.pt").is_file()


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="start without --resume"):
        find_checkpoint("latest", tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        find_checkpoint(str(tmp_path), tmp_path)
