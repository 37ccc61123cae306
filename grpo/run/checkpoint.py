"""Checkpoints, and the run's folder: everything a run needs to continue as if it had never stopped.

A checkpoint is a folder `checkpoint-N` (N finished steps) holding the adapters (PEFT format), the
optimizer, the scheduler, the prompt stream's position, each rank's RNG state, the run's counters
(`RunState`, in trainer_state.json) and the config. It is written under a temporary name, flushed to
disk and renamed, so a crash mid-save never leaves a half-written folder under the final name; a
failed write (a full disk) removes its temporary folder and says so in one line. Pruning
(--save-total-limit) deletes only this run's checkpoints (the run id in trainer_state.json) and never
the one just saved. On `--resume latest` an unreadable newest checkpoint is skipped, with a note, for
the newest intact one.

The output folder holds one run: `claim_output_dir` refuses a folder that a live run holds (its claim file,
`grpo.run.claim`), or that holds another run unless the run resumes it, or --overwrite moves the old run
aside to OUTPUT_DIR.old-N (nothing is deleted).

What it deliberately is not: a model export (the final adapter is `grpo.model.load.save_lora`) or a
general state-dict framework: the four objects it saves are named in `Resumable`.
"""

from __future__ import annotations

import json
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from grpo.config import Config, flag
from grpo.data import PromptStream
from grpo.distributed import World
from grpo.run.durable import fill_folder, publish
from grpo.run.failures import first_line, os_fault, write_failure
from grpo.model.load import save_lora
from grpo.run.claim import CLAIM_FILE, RunClaim

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = f".tmp-{CHECKPOINT_PREFIX}"  # a checkpoint being written; never read


class OutputDirError(ValueError):
    """The output folder cannot take this run (another run's files, a file in its place, unwritable)."""


class RunFinished(Exception):
    """--resume names a checkpoint at --max-steps or past it: nothing is left to train."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; its temporary folder is gone, earlier checkpoints are intact."""


class CheckpointUnreadable(ValueError):
    """A checkpoint folder misses a file or holds one that does not read back (truncated, corrupt)."""


@dataclass
class RunState:
    """The run's counters. Saved in trainer_state.json under these names, beside the stream's state."""

    step: int = 0  # finished steps
    nonfinite_in_row: int = 0  # skipped steps since the last good one
    skipped_steps: int = 0  # skipped steps in the whole run
    world_size: int = 1  # ranks of the run; a checkpoint resumes only on as many
    run_id: str = ""  # drawn at a fresh start, kept across resumes: which checkpoints pruning may delete


@dataclass(frozen=True)
class Resumable:
    """The objects a checkpoint saves and a resume restores, besides the counters and RNG states."""

    policy: Any  # the PeftModel; only its adapters are saved
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: PromptStream


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def rng_state() -> dict:
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def checkpoint_path(out: Path, step: int) -> Path:
    return out / f"{CHECKPOINT_PREFIX}{step}"


# --------------------------------------------------------------------------------------------------
# The output folder
# --------------------------------------------------------------------------------------------------
def aside_path(out: Path) -> Path:
    """OUTPUT_DIR.old-N for the first N not taken: where --overwrite moves an older run."""
    out = out if out.name else out.resolve()  # "." has no name to add to
    n = 1
    while out.with_name(f"{out.name}.old-{n}").exists():
        n += 1
    return out.with_name(f"{out.name}.old-{n}")


class ClaimedOutput(NamedTuple):
    moved: Path | None  # where --overwrite moved an older run
    claim: RunClaim | None  # rank 0's hold on the folder, released when the run ends; None on other ranks


def claim_output_dir(cfg: Config, world: World) -> ClaimedOutput:
    """Every rank calls this before anything is written: rank 0 claims --output-dir (FolderInUse while
    another live run holds it: grpo.run.claim), makes it ready for the run and writes config.json; every
    rank raises rank 0's error if it could not (OutputDirError, or FileNotFoundError for a --resume with
    nothing to resume)."""
    problem = moved = claim = None
    if world.is_main:
        try:
            claim = RunClaim.take(Path(cfg.output_dir))  # first: two runs never judge the folder at once
            moved, claim = _claim(cfg, claim)
        except Exception as err:  # every rank raises it, rather than wait for rank 0 forever
            if claim is not None:
                claim.abandon()
            problem = err
    problem = world.gather_objects(problem)[0]
    if problem is not None:
        raise problem
    return ClaimedOutput(moved, claim)


def _claim(cfg: Config, claim: RunClaim | None) -> tuple[Path | None, RunClaim | None]:
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"--output-dir {out} is a file, not a folder; fix: pass the path of a folder")
    # A config.json alone is a run that never finished a step (say, a --model typo): nothing to keep.
    held = sorted(p.name for p in out.iterdir() if not _left_by_a_run_that_did_nothing(p)) if out.is_dir() else []
    moved = None
    if cfg.resume is not None:
        _refuse_a_finished_run(cfg, find_checkpoint(cfg.resume, out))  # before any write: nothing to resume
        if held and cfg.resume != "latest" and Path(cfg.resume).resolve().parent != out.resolve():
            raise OutputDirError(f"--output-dir {out} holds another run than --resume {cfg.resume}; fix: resume "
                                 f"into an empty --output-dir or into the checkpoint's own folder "
                                 f"{Path(cfg.resume).parent}")
    elif held and not cfg.overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        ways = ["continue it with --resume latest"] if list_checkpoints(out) else []
        ways += ["pick a new --output-dir", f"pass --overwrite to move it aside to {aside_path(out)}"]
        raise OutputDirError(f"--output-dir {out} already holds a run ({shown}); fix: {', '.join(ways[:-1])} "
                             f"or {ways[-1]}")
    elif held:
        if Path.cwd().resolve().is_relative_to(out.resolve()):
            raise OutputDirError(f"--overwrite: --output-dir {out} holds the current directory; fix: run from "
                                 "elsewhere or pick a new --output-dir")
        moved = aside_path(out)
        _write_or_explain(out, lambda: out.rename(moved))
        claim = claim.moved_to(out) if claim is not None else None
    _write_or_explain(out, lambda: out.mkdir(parents=True, exist_ok=True))
    for stale in out.glob(".tmp-*"):  # a save or delete that a kill cut short
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    _write_or_explain(out, lambda: cfg.save(out))
    return moved, claim


def _refuse_a_finished_run(cfg: Config, checkpoint: Path) -> None:
    try:
        step = int(json.loads((checkpoint / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # an unreadable checkpoint is judged when it is read
    if step >= cfg.max_steps:
        try:  # read only here, where the run would be called done: a broken one is for the resume to judge
            read_checkpoint(checkpoint, rank=0)
        except CheckpointUnreadable:
            return
        adapter = checkpoint.parent / "adapter"
        done = f"; its adapter is {adapter}" if (adapter / "adapter_config.json").is_file() else ""
        raise RunFinished(f"--resume {cfg.resume}: {checkpoint} holds step {step} of --max-steps {cfg.max_steps}: the "
                          f"run is done{done}; to train on, pass a larger --max-steps")


def _left_by_a_run_that_did_nothing(path: Path) -> bool:
    return path.name in ("config.json", CLAIM_FILE) or path.name.startswith(".tmp-")


def _write_or_explain(out: Path, write) -> None:
    try:
        write()
    except OSError as err:
        meaning, fix = os_fault(err)
        where = f" ({err.filename})" if err.filename not in (None, str(out)) else ""
        raise OutputDirError(f"--output-dir {out}: cannot write there{where}: {meaning}; fix: {fix}") from None


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------
def save_checkpoint(out: Path, state: RunState, parts: Resumable, cfg: Config, rngs: list[dict]) -> Path:
    """Written by rank 0 alone: the adapters, optimizer and stream are the same on every rank; `rngs`
    holds each rank's RNG state (only rank 0's when the others could not be asked, as on Ctrl-C).
    Raises CheckpointWriteError (one line: the path, why, the fix) when the write fails."""
    final = checkpoint_path(out, state.step)
    publish_folder(final, out / f"{TMP_PREFIX}{state.step}",
                   lambda folder: write_checkpoint_files(folder, state, parts, cfg, rngs), "checkpoint")
    prune_checkpoints(out, cfg.save_total_limit, state.run_id, keep_also=final)
    return final


def save_adapter(policy, final: Path) -> Path:
    """The run's final adapter (PEFT format), published as a checkpoint is: whole or not at all."""
    return publish_folder(final, final.with_name(f".tmp-{final.name}"), lambda folder: save_lora(policy, folder),
                          "the adapter")


def publish_folder(final: Path, tmp: Path, write, what: str) -> Path:
    """`write(tmp)` fills a temporary folder, which is flushed to disk and renamed to `final` (an
    older `final` is replaced). A failed write removes the temporary folder and raises
    CheckpointWriteError: a crash or a full disk never leaves a half-written folder under `final`."""
    try:
        fill_folder(tmp, write)
    except Exception as err:
        reason = write_failure(err) or first_line(str(err), 200) or type(err).__name__
        raise CheckpointWriteError(f"could not write {what} {final} ({reason}); fix: free space on "
                                   f"that disk or make {final.parent} writable (earlier checkpoints are "
                                   "untouched)") from err
    remove_checkpoint(final)  # written again: the new one takes its place
    publish(tmp, final)
    return final


def write_checkpoint_files(folder: Path, state: RunState, parts: Resumable, cfg: Config, rngs: list[dict]) -> None:
    save_lora(parts.policy, folder)
    torch.save(parts.optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(parts.scheduler.state_dict(), folder / "scheduler.pt")
    for rank, rng in enumerate(rngs):
        torch.save(rng, folder / rng_file(rank))
    trainer_state = {"step": state.step, "stream": parts.stream.state_dict(),
                     "nonfinite_in_row": state.nonfinite_in_row, "skipped_steps": state.skipped_steps,
                     "world_size": state.world_size, "run_id": state.run_id}
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state, allow_nan=False))
    cfg.save(folder)


def checkpoint_run_id(path: Path) -> str:
    """The run id in a checkpoint's trainer_state.json; "" when it has none or cannot be read."""
    try:
        return str(json.loads((path / "trainer_state.json").read_text()).get("run_id", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def prune_checkpoints(out: Path, keep: int, run_id: str, keep_also: Path) -> None:
    """Deletes this run's oldest checkpoints beyond `keep` (0: keep all). Another run's checkpoints,
    and `keep_also` (the one just saved), are never deleted."""
    if keep <= 0:
        return
    ours = [p for p in list_checkpoints(out) if p != keep_also and checkpoint_run_id(p) == run_id]
    for old in ours[:max(0, len(ours) - (keep - 1))]:
        remove_checkpoint(old)


def remove_checkpoint(path: Path) -> None:
    """Renamed out of the way first, so a kill mid-delete leaves no half checkpoint under its name."""
    if path.exists():
        doomed = path.with_name(f".tmp-{path.name}-deleted")
        shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def save_from_every_rank(out: Path, state: RunState, parts: Resumable, cfg: Config, world: World) -> Path:
    """Every rank calls this: each hands rank 0 its RNG state, rank 0 writes, and no rank runs ahead."""
    rngs = world.gather_objects(rng_state())
    if world.is_main:
        save_checkpoint(out, state, parts, cfg, rngs)
    world.barrier()
    return checkpoint_path(out, state.step)


# --------------------------------------------------------------------------------------------------
# Finding and loading
# --------------------------------------------------------------------------------------------------
def list_checkpoints(out: Path) -> list[Path]:
    """checkpoint-N folders of `out`, oldest first (other names are left alone)."""
    found = [p for p in out.glob(f"{CHECKPOINT_PREFIX}*") if p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def schedule_note(checkpoint: Path, cfg: Config) -> str | None:
    """A note when a resumed run's flags differ from the checkpoint's in what shapes the learning rate: the
    schedule's shape (steps, warmup, kind) is rebuilt from this run's flags at the restored step count,
    while the base rate is restored with the optimizer, so a new --learning-rate does not apply."""
    try:
        saved = Config.load(checkpoint / "config.json")
    except (OSError, ValueError, TypeError):
        return None
    shape = [f"{flag(k)} {getattr(saved, k)} -> {getattr(cfg, k)}"
             for k in ("max_steps", "warmup_ratio", "lr_scheduler") if getattr(saved, k) != getattr(cfg, k)]
    notes = []
    if shape:
        notes.append(f"the learning-rate schedule now follows {', '.join(shape)}")
    if saved.learning_rate != cfg.learning_rate:
        notes.append(f"--learning-rate stays the checkpoint's {saved.learning_rate:g} (not {cfg.learning_rate:g})")
    return "resumed with other flags: " + "; ".join(notes) if notes else None


def find_checkpoint(resume: str, out: Path) -> Path:
    if resume == "latest":
        found = list_checkpoints(out)
        if not found:
            raise FileNotFoundError(f"--resume latest: no {CHECKPOINT_PREFIX}N folder in {out}; "
                                    "start without --resume (with --overwrite if the folder holds other files)")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: not a checkpoint folder (no trainer_state.json); "
                                f"pass one of {out}/{CHECKPOINT_PREFIX}N or 'latest'")
    return path


@dataclass
class SavedCheckpoint:
    """A checkpoint read whole into memory, so that nothing is applied from one that does not read back."""

    path: Path
    trainer_state: dict
    adapters: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict | None  # this rank's; None where the checkpoint has none for it


def read_checkpoint(path: Path, rank: int) -> SavedCheckpoint:
    """Reads every file of the checkpoint (every rank's RNG state too, so that all ranks judge it alike);
    raises CheckpointUnreadable naming the first file that is missing or does not read back."""
    trainer_state = _read_file(path / "trainer_state.json", lambda p: json.loads(p.read_text()))
    if not isinstance(trainer_state, dict) or not {"step", "stream"} <= set(trainer_state):
        raise CheckpointUnreadable(f"{path / 'trainer_state.json'} is unreadable: no step and stream in it")
    adapters = _read_file(path / "adapter_model.safetensors", load_file)
    optimizer = _read_file(path / "optimizer.pt", _torch_load)
    scheduler = _read_file(path / "scheduler.pt", _torch_load)
    rngs = {f.name: _read_file(f, _torch_load) for f in sorted(path.glob("rng*.pt"))}
    return SavedCheckpoint(path, trainer_state, adapters, optimizer, scheduler, rngs.get(rng_file(rank)))


def _torch_load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def _read_file(path: Path, load) -> Any:
    try:
        return load(path)
    except Exception as err:  # missing, truncated, corrupt: each means the checkpoint cannot be used
        reason = "missing" if not path.exists() else f"unreadable: {first_line(str(err), 160)}"
        raise CheckpointUnreadable(f"{path} is {reason}") from None


def apply_checkpoint(saved: SavedCheckpoint, parts: Resumable, world: World) -> RunState:
    """Puts a read checkpoint into the run's objects and this process's RNGs; returns the counters."""

    path, trainer_state = saved.path, saved.trainer_state
    saved_world = trainer_state.get("world_size", 1)
    if saved_world != world.size:
        raise ValueError(f"--resume {path}: the checkpoint was written by {saved_world} rank(s), this run has "
                         f"{world.size}; fix: resume on {saved_world} (torchrun --nproc-per-node {saved_world})")
    try:
        set_peft_model_state_dict(parts.policy, saved.adapters)
    except RuntimeError as err:
        detail = next((ln.strip() for ln in str(err).splitlines() if "size mismatch" in ln), first_line(str(err)))
        raise ValueError(f"--resume {path}: its adapters do not fit this run's model ({first_line(detail, 200)}); "
                         "fix: resume with the --model and --lora-* flags the run started with") from None
    parts.optimizer.load_state_dict(saved.optimizer)
    parts.scheduler.load_state_dict(saved.scheduler)
    if saved.rng is not None:  # absent for ranks > 0 after Ctrl-C: they keep their seed
        random.setstate(saved.rng["python"])
        torch.set_rng_state(saved.rng["torch"])
        if "cuda" in saved.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved.rng["cuda"])
    parts.stream.load_state_dict(trainer_state["stream"])
    # Counters missing from an older checkpoint start at zero, as in a fresh run.
    return RunState(step=trainer_state["step"], nonfinite_in_row=trainer_state.get("nonfinite_in_row", 0),
                    skipped_steps=trainer_state.get("skipped_steps", 0), world_size=saved_world,
                    run_id=str(trainer_state.get("run_id", "")))


def load_checkpoint(path: Path, parts: Resumable, world: World) -> RunState:
    """Every rank loads the same files; each takes its own RNG state where the checkpoint has it."""
    return apply_checkpoint(read_checkpoint(path, world.rank), parts, world)


def resume_checkpoint(resume: str, out: Path, parts: Resumable, world: World) -> tuple[Path, RunState, list[str]]:
    """--resume: (the checkpoint loaded, its counters, notes to show). `latest` takes the newest
    checkpoint that reads back whole, with a note for each newer one skipped; a named checkpoint that
    does not read back is refused, naming the broken file."""
    if resume != "latest":
        path = find_checkpoint(resume, out)
        try:
            saved = read_checkpoint(path, world.rank)
        except CheckpointUnreadable as err:
            raise CheckpointUnreadable(f"--resume {resume}: {err}; fix: resume from another checkpoint-N of the "
                                       "run, or --resume latest") from None
        return path, apply_checkpoint(saved, parts, world), []
    find_checkpoint(resume, out)  # none at all: says what to do
    notes = []
    for path in reversed(list_checkpoints(out)):
        try:
            saved = read_checkpoint(path, world.rank)
        except CheckpointUnreadable as err:
            notes.append(f"skipped {path.name}: {err}")
            continue
        if notes:
            notes.append(f"resuming from {path}, the newest checkpoint that reads back whole")
        return path, apply_checkpoint(saved, parts, world), notes
    raise CheckpointUnreadable(f"--resume latest: no checkpoint in {out} reads back whole ({'; '.join(notes)}); "
                               "fix: start afresh with --overwrite or a new --output-dir")
