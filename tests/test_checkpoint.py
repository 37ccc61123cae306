"""Checkpoints: the trainer_state.json layout, the counters round trip, finding and pruning folders."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
import torch

from conftest import tiny_llama
from grpo.run.checkpoint import (Resumable, RunState, find_checkpoint, list_checkpoints, load_checkpoint,
                             save_checkpoint, save_from_every_rank)
from grpo.config import Config
from grpo.data import PromptStream
from grpo.distributed import World
from grpo.model.load import add_lora
from grpo.optim import make_optimizer, make_scheduler


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


def test_pruning_deletes_only_this_runs_checkpoints_and_never_the_one_just_saved(tmp_path):
    # An older run left checkpoint-4 and -6 in the folder; this run's checkpoint-2 and -3 must not rank
    # below them (the old pruning deleted them at once, and a message then named a missing checkpoint).
    parts, cfg = _parts(), Config(output_dir=str(tmp_path), save_total_limit=2)
    for step in (4, 6):
        save_checkpoint(tmp_path, RunState(step=step, run_id="older"), parts, cfg, [])
    for step in (2, 3):
        assert save_checkpoint(tmp_path, RunState(step=step, run_id="this"), parts, cfg, []).is_dir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3", "checkpoint-4",
                                                            "checkpoint-6"]
    save_checkpoint(tmp_path, RunState(step=5, run_id="this"), parts, cfg, [])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4", "checkpoint-5",
                                                            "checkpoint-6"]
    # Resumed from an earlier checkpoint of its own: the one just saved stays, whatever its number.
    save_checkpoint(tmp_path, RunState(step=1, run_id="older"), parts, Config(save_total_limit=1), [])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3", "checkpoint-5"]
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("broken, damage", [("adapter_model.safetensors", "truncate"), ("optimizer.pt", "truncate"),
                                            ("trainer_state.json", "truncate"), ("scheduler.pt", "delete"),
                                            ("rng.pt", "zeros")])
def test_resume_latest_skips_an_unreadable_newest_checkpoint_and_a_named_one_is_refused(tmp_path, broken, damage):
    from grpo.run.checkpoint import CheckpointUnreadable, resume_checkpoint

    parts = _parts()
    _train_once(parts)
    cfg = Config(output_dir=str(tmp_path), save_total_limit=0)
    for step in (1, 2):
        save_checkpoint(tmp_path, RunState(step=step), parts, cfg, [{"python": random.getstate(),
                                                                     "torch": torch.get_rng_state()}])
    path = tmp_path / "checkpoint-2" / broken
    if damage == "delete":
        path.unlink()
    else:
        size = path.stat().st_size
        path.write_bytes(path.read_bytes()[:size // 2] if damage == "truncate" else bytes(size))
    fresh = _parts(seed=1)
    found, state, notes = resume_checkpoint("latest", tmp_path, fresh, World())
    assert found == tmp_path / "checkpoint-1" and state.step == 1
    assert notes[0].startswith(f"skipped checkpoint-2: {path} is ") and "checkpoint-1" in notes[-1]
    with pytest.raises(CheckpointUnreadable, match=f"--resume {tmp_path / 'checkpoint-2'}: {path} is"):
        resume_checkpoint(str(tmp_path / "checkpoint-2"), tmp_path, _parts(seed=2), World())
    (tmp_path / "checkpoint-1" / "optimizer.pt").write_bytes(b"")
    with pytest.raises(CheckpointUnreadable, match="no checkpoint in .* reads back whole"):
        resume_checkpoint("latest", tmp_path, _parts(seed=2), World())


def test_resuming_with_another_schedule_or_rate_says_what_applies(tmp_path):
    from grpo.run.checkpoint import schedule_note

    saved = Config(max_steps=200, learning_rate=1e-5, warmup_ratio=0.05)
    saved.save(tmp_path)
    assert schedule_note(tmp_path, saved) is None  # the same flags: nothing to say
    note = schedule_note(tmp_path, Config(max_steps=72, learning_rate=1e-5, warmup_ratio=0.05))
    assert "--max-steps 200 -> 72" in note and "learning-rate stays" not in note
    note = schedule_note(tmp_path, Config(max_steps=200, learning_rate=3e-5, warmup_ratio=0.05))
    assert "--learning-rate stays the checkpoint's 1e-05 (not 3e-05)" in note and "schedule" not in note
    assert schedule_note(tmp_path / "missing", saved) is None  # an older checkpoint without config.json


@pytest.fixture
def group_writable_umask():
    """umask 002 for the test (a shared machine's usual one): files should come out 0664, not 0600."""
    old = os.umask(0o002)
    yield 0o664
    os.umask(old)


def test_an_adapter_saved_after_the_vocabulary_grew_holds_only_lora_weights_and_loads_into_the_base(
        tmp_path, char_llama_dir, group_writable_umask):
    """Unsloth grows the model's vocabulary to its tokenizer's length (one more token for Llama 3.2's
    tokenizer in the CUDA tests): the adapter still saves (and checkpoints save) only what was trained,
    and loads into a policy on the unchanged base checkpoint."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from grpo.run.checkpoint import save_adapter
    from grpo.model.load import load_policy

    cfg = Config(model=str(char_llama_dir), gradient_checkpointing=False, lora_rank=4, lora_alpha=8)
    policy, _, _ = load_policy(cfg, torch.device("cpu"))
    policy.get_base_model().resize_token_embeddings(129)
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).fill_(0.5)
    folder = save_adapter(policy, tmp_path / "adapter")
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:3]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert modes["adapter_model.safetensors"] == group_writable_umask, modes  # not safetensors' 0600

    fresh, _, _ = load_policy(cfg, torch.device("cpu"))
    loaded = set_peft_model_state_dict(fresh, saved)
    assert not loaded.unexpected_keys
    assert any(torch.equal(p, torch.full_like(p, 0.5)) for n, p in fresh.named_parameters() if "lora_B" in n)
