"""Checkpoints: everything a run needs to continue as if it had never stopped.

A checkpoint is a folder `checkpoint-N` (N finished steps) holding the adapters (PEFT format), the
optimizer, the scheduler, the prompt stream's position, each rank's RNG state, the run's counters
(`RunState`, in trainer_state.json) and the config. It is written under a temporary name and renamed,
so a crash mid-save never leaves a half-written folder under the final name.

What it deliberately is not: a model export (the final adapter is `policy.save_pretrained`) or a
general state-dict framework: the four objects it saves are named in `Resumable`.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config
from grpo.data import PromptStream
from grpo.distributed import World

CHECKPOINT_PREFIX = "checkpoint-"


@dataclass
class RunState:
    """The run's counters. Saved in trainer_state.json under these names, beside the stream's state."""

    step: int = 0  # finished steps
    nonfinite_in_row: int = 0  # skipped steps since the last good one
    skipped_steps: int = 0  # skipped steps in the whole run
    world_size: int = 1  # ranks of the run; a checkpoint resumes only on as many


@dataclass(frozen=True)
class Resumable:
    """The objects a checkpoint saves and a resume restores, besides the counters and RNG states."""

    policy: Any  # the PeftModel; only its adapters are saved
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: PromptStream


def rng_state() -> dict:
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def checkpoint_path(out: Path, step: int) -> Path:
    return out / f"{CHECKPOINT_PREFIX}{step}"


def save_checkpoint(out: Path, state: RunState, parts: Resumable, cfg: Config, rngs: list[dict]) -> Path:
    """Written by rank 0 alone: the adapters, optimizer and stream are the same on every rank; `rngs`
    holds each rank's RNG state (only rank 0's when the others could not be asked, as on Ctrl-C)."""
    final = checkpoint_path(out, state.step)
    tmp = out / f".tmp-{CHECKPOINT_PREFIX}{state.step}"
    shutil.rmtree(tmp, ignore_errors=True)
    parts.policy.save_pretrained(tmp)
    torch.save(parts.optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(parts.scheduler.state_dict(), tmp / "scheduler.pt")
    for rank, rng in enumerate(rngs):
        torch.save(rng, tmp / rng_file(rank))
    trainer_state = {"step": state.step, "stream": parts.stream.state_dict(),
                     "nonfinite_in_row": state.nonfinite_in_row, "skipped_steps": state.skipped_steps,
                     "world_size": state.world_size}
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
    cfg.save(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # a crash mid-save never leaves a half-written checkpoint under the final name
    for old in list_checkpoints(out)[:-cfg.save_total_limit] if cfg.save_total_limit > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_from_every_rank(out: Path, state: RunState, parts: Resumable, cfg: Config, world: World) -> Path:
    """Every rank calls this: each hands rank 0 its RNG state, rank 0 writes, and no rank runs ahead."""
    rngs = world.gather_objects(rng_state())
    if world.is_main:
        save_checkpoint(out, state, parts, cfg, rngs)
    world.barrier()
    return checkpoint_path(out, state.step)


def list_checkpoints(out: Path) -> list[Path]:
    """checkpoint-N folders of `out`, oldest first (other names are left alone)."""
    found = [p for p in out.glob(f"{CHECKPOINT_PREFIX}*") if p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_checkpoint(resume: str, out: Path) -> Path:
    if resume == "latest":
        found = list_checkpoints(out)
        if not found:
            raise FileNotFoundError(f"--resume latest: no {CHECKPOINT_PREFIX}N folder in {out}; "
                                    "start without --resume")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: not a checkpoint folder (no trainer_state.json); "
                                f"pass one of {out}/{CHECKPOINT_PREFIX}N or 'latest'")
    return path


def load_checkpoint(path: Path, parts: Resumable, world: World) -> RunState:
    """Every rank loads the same files; each takes its own RNG state where the checkpoint has it."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((path / "trainer_state.json").read_text())
    saved_world = saved.get("world_size", 1)
    if saved_world != world.size:
        raise ValueError(f"--resume {path}: the checkpoint was written by {saved_world} rank(s), this run has "
                         f"{world.size}; fix: resume on {saved_world} (torchrun --nproc-per-node {saved_world})")
    set_peft_model_state_dict(parts.policy, load_file(path / "adapter_model.safetensors"))
    parts.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    parts.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    if (path / rng_file(world.rank)).is_file():  # absent for ranks > 0 after Ctrl-C: they keep their seed
        rng = torch.load(path / rng_file(world.rank), weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    parts.stream.load_state_dict(saved["stream"])
    # Counters missing from an older checkpoint start at zero, as in a fresh run.
    return RunState(step=saved["step"], nonfinite_in_row=saved.get("nonfinite_in_row", 0),
                    skipped_steps=saved.get("skipped_steps", 0), world_size=saved_world)
