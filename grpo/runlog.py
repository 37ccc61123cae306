"""What a run shows and records while it trains: metrics.jsonl (and tensorboard or wandb), the step
record and its one-line summary, the progress bar, the clock that charges each phase with its own GPU
work, peak memory, and the Ctrl-C handler that lets a step finish before the run stops.

What it deliberately is not: a callback system. The loop in `grpo.trainer.run` calls these
explicitly; nothing here decides what the run does next (a Ctrl-C only sets a flag the loop reads).
"""

from __future__ import annotations

import json
import resource
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from grpo.config import Config
from grpo.step import StepResult


class MetricsLog:
    """metrics.jsonl in the output directory, plus tensorboard or wandb when asked."""

    def __init__(self, out: Path, cfg: Config, resumed_step: int):
        self.path = out / "metrics.jsonl"
        if resumed_step == 0 and self.path.exists():
            self.path.unlink()
        elif resumed_step > 0 and self.path.exists():  # drop records past the checkpoint we resume from
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= resumed_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb = self.wandb = None
        if cfg.report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("--report-to tensorboard needs tensorboard: pip install tensorboard") from None
            self.tb = SummaryWriter(str(out / "tensorboard"))
        elif cfg.report_to == "wandb":
            try:
                import wandb
            except ImportError:
                raise ImportError("--report-to wandb needs wandb: pip install wandb") from None
            self.wandb = wandb.init(config=json.loads(cfg.to_json()), dir=str(out), resume="allow")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k.replace(".", "/"), v, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        """Closes tensorboard and wandb (metrics.jsonl is opened per record); a second call does nothing."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def step_record(step: int, result: StepResult, lr: float, step_time: float, peak_mem_gib: float) -> dict:
    """One line of metrics.jsonl: the batch of all ranks; time and memory are this rank's."""
    scores = result.scores
    total = scores.total  # (N*P*G,)
    return {
        "step": step, "reward": float(total.mean()), "reward_std": float(total.std()) if len(total) > 1 else 0.0,
        **{f"rewards/{name}": float(scores.rewards[:, j].nanmean()) for j, name in enumerate(scores.names)},
        "accuracy": float(scores.correct.double().mean()), "format": float(scores.formatted.double().mean()),
        "completion_length": float(scores.lengths.double().mean()),
        "frac_finished": float(scores.finished.double().mean()),
        "frac_zero_std": float(result.frac_zero_std),
        "lr": lr, "grad_norm": result.grad_norm,
        "skipped": result.skipped, **result.loss_stats,
        "step_time": step_time, **{f"time/{k}": v for k, v in result.timings.items()},
        "peak_mem_gib": peak_mem_gib,
    }


def step_line(record: dict, max_steps: int | None = None) -> str:
    """The record in one line of at most 100 columns: the step (of `max_steps`), the reward (mean ± std over
    the batch), answer accuracy, exact-format compliance, KL to the reference, mean completion length in
    tokens, the step's seconds and its peak memory (GPU allocated; on CPU the process's resident size)."""
    step = f"{record['step']:>4}" + ("" if max_steps is None else f"/{max_steps}")
    seconds = record["step_time"]
    took = f"{seconds:.2f} s" if seconds < 100 else f"{seconds:.0f} s"
    return (f"step {step}  reward {record['reward']:6.2f} ± {record['reward_std']:.2f}  acc {record['accuracy']:.2f}  "
            f"fmt {record['format']:.2f}  kl {record.get('kl', 0.0):.4f}  len {record['completion_length']:.0f}  "
            f"{took}  mem {record['peak_mem_gib']:.3g} GiB")


def print_completions(console, result: StepResult, groups: int = 2) -> None:
    """The first completion of this rank's first `groups` prompts, with its answer and reward."""
    total = result.scores.total  # this rank's rows come first only on rank 0, the one that prints
    for j in range(0, len(result.texts), result.group_size)[:groups]:
        console.print(f"  [dim]answer {result.answers[j]!r} reward {float(total[j]):.2f}:[/] {result.texts[j][:400]!r}")


class ProgressBar:
    """The run's live display, shown between `start()` and `stop()`: a bar over the run's steps and, under
    it, the phase in flight: held-out prompts evaluated, and tokens generated (`generation` is the
    engines' `GenerationProgress`). The phase bars show only while their phase runs."""

    def __init__(self, console, total: int, completed: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(TextColumn("[bold]{task.description:>8}"), BarColumn(bar_width=32),
                                  MofNCompleteColumn(), TextColumn("{task.fields[unit]:<7}"), TimeElapsedColumn(),
                                  TextColumn("left"), TimeRemainingColumn(), console=console)
        self._steps = self._progress.add_task("steps", total=total, completed=completed, unit="steps")
        self._eval = self._progress.add_task("eval", total=None, visible=False, unit="prompts")
        self._generate = self._progress.add_task("generate", total=None, visible=False, unit="tokens")
        self._shown = False

    def start(self) -> None:
        self._progress.start()
        self._shown = True

    def update(self, completed: int) -> None:
        """A step is done: the steps bar moves, the phase bars leave until their next report."""
        self._progress.update(self._steps, completed=completed)
        self._progress.update(self._generate, visible=False)

    def generation(self, done: int, total: int) -> None:
        """The engines' `GenerationProgress`: rows x decode steps done of rows x max_new_tokens."""
        if done == 0:  # a new generate call: its own bar and clock
            self._progress.reset(self._generate, total=total, completed=0, visible=True)
        else:
            self._progress.update(self._generate, total=total, completed=done, visible=True)

    def evaluation(self, done: int, total: int) -> None:
        """Held-out prompts evaluated so far (greedy, then sampled: each prompt counts once per pass)."""
        if done == 0:
            self._progress.reset(self._eval, total=total, completed=0, visible=True)
        else:
            self._progress.update(self._eval, total=total, completed=done, visible=done < total)
        if done >= total:
            self._progress.update(self._generate, visible=False)

    def stop(self) -> None:
        """Ends the display; a second call does nothing (rich would print another blank line)."""
        if self._shown:
            self._progress.stop()
            self._shown = False


def peak_memory_gib(device: torch.device) -> float:
    """This step's peak allocated GPU memory; on CPU, the process's peak resident size so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def synced_clock(device: torch.device) -> Callable[[], float]:
    """A clock that first waits for the device, so each phase is charged with its own GPU work."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


class StopOnCtrlC:
    """The first Ctrl-C asks the loop to finish the step in flight, save and stop; the second stops at once.

    Finishing the step keeps a checkpoint exact: resuming from it continues as if never stopped.
    Only the main thread can own the handler; elsewhere Ctrl-C keeps Python's default behaviour.
    """

    def __init__(self, console):
        self.requested = False
        self.console = console
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.console.print("[bold yellow]Ctrl-C[/]: finishing this step, then saving (Ctrl-C again to stop now)")

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
