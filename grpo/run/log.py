"""What a run shows and records while it trains: metrics.jsonl (and tensorboard or wandb), the one-line
summary of a step's record (the record itself is `grpo.step.StepResult.log_record`), the progress bar,
the clock that charges each phase with its own GPU work, peak memory, and the time spent collecting garbage.

metrics.jsonl takes one whole line per record, in one write that is flushed to disk; a line cut short
(a kill at the wrong moment, a full disk) is dropped with a note when a resumed run opens the file. Each
line is strict JSON (`json_line`): a value that is not finite (a reward's mean over a step it applies to
none of, a NaN loss) is written as null, not as Python's bare NaN that JSON readers refuse; the key stays,
so every record has the same columns.

What it deliberately is not: a callback system. The loop in `grpo.trainer.run` calls these
explicitly; nothing here decides what the run does next. Signals are `grpo.run.signals`'.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

from grpo.config import Config
from grpo.run.durable import append_line, write_atomically


class MetricsLog:
    """metrics.jsonl in the output directory, plus tensorboard or wandb when asked. `note` says what
    opening it repaired (lines cut short by a kill), for the run to print; None when nothing."""

    def __init__(self, out: Path, cfg: Config, resumed_step: int):
        self.path = out / "metrics.jsonl"
        self.note = None
        if resumed_step == 0 and self.path.exists():
            self.path.unlink()
        elif resumed_step > 0 and self.path.exists():  # drop records past the checkpoint we resume from
            text = self.path.read_text(encoding="utf-8", errors="replace")
            records, torn = read_records(text)
            kept = [ln for ln, record in records if record.get("step", 0) <= resumed_step]
            if torn:
                self.note = f"{self.path}: dropped {torn} line(s) cut short by an earlier stop"
            if torn or len(kept) < len(records) or not text.endswith("\n"):
                write_atomically(self.path, "".join(ln + "\n" for ln in kept).encode())
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
        """Appends the record as one line, in one write, flushed to disk before returning."""
        append_line(self.path, json_line(record).encode())
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


def json_line(record: dict) -> str:
    """`record` as one line of strict JSON: a float that is not finite, at any depth, becomes null."""
    return json.dumps(finite_or_none(record), allow_nan=False) + "\n"


def finite_or_none(value: Any) -> Any:
    """`value` with every NaN or infinite float (in dicts, lists and tuples too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def read_records(text: str) -> tuple[list[tuple[str, dict]], int]:
    """([(line, record)], how many lines were dropped) for metrics.jsonl's text: blank lines are
    skipped, a line that is not a whole JSON object (one cut short by a kill) is dropped."""
    records, dropped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append((line, record))
        else:
            dropped += 1
    return records, dropped


NOT_APPLIED = "rewards_applies_to_none/"  # + a reward's name: the completions of a step it returned None or NaN for


def step_line(record: dict, max_steps: int | None = None, *, gap_warn: float = math.inf) -> str:
    """The record in one line of at most 100 columns (about 112 with vLLM's pool): the step (of
    `max_steps`), the reward (mean ± std over the batch), answer accuracy, exact-format compliance, KL to the reference, mean completion length in
    tokens, the step's seconds and its peak memory (GPU allocated; on CPU the process's resident size),
    then vLLM's pool apart where the engine is vLLM (`mem 5.2 GiB + vllm 7.9 GiB`).
    A second line when there is more to say: the sampler-trainer gap when its mean exceeds `gap_warn`
    (--gap-warn), what --dynamic-sampling kept, and each reward that applied to no completion of the step."""
    step = f"{record['step']}" if max_steps is None else f"{record['step']:>{len(str(max_steps))}}/{max_steps}"
    seconds = record["step_time"]
    took = f"{seconds:.2f} s" if seconds < 100 else f"{seconds:.0f} s"
    line = (f"step {step}  reward {record['reward']:6.2f} ± {record['reward_std']:.2f}  acc {record['accuracy']:.2f}  "
            f"fmt {record['format']:.2f}  kl {record.get('kl', 0.0):.4f}  len {record['completion_length']:.0f}  "
            f"{took}  mem {record['peak_mem_gib']:.3g} GiB")
    if "engine_pool_gib" in record:  # vLLM's own pool, beside ours: never added to it
        line += f" + vllm {record['engine_pool_gib']:.3g} GiB"
    extras = []
    gap = record.get("gap/logp_abs_mean")
    if gap is not None and not gap <= gap_warn:  # NaN shows too
        extras.append(f"gap {gap:.3f} (max {record['gap/logp_abs_max']:.2f}, clipped {record['gap/is_clipped_frac']:.1%})")
    if "sampling/rounds" in record:
        kept = (f"kept {record['sampling/groups_kept']} of {record['sampling/prompts']} prompts in "
                f"{record['sampling/rounds']} rounds")
        if record["sampling/groups_kept"] == 0:
            kept += ": no informative group, not trained"
        extras.append(kept)
    for key, n in record.items():
        if key.startswith(NOT_APPLIED):
            extras.append(f"reward {key[len(NOT_APPLIED):]} returned None or NaN for all {n} completions "
                          "(it applies to none; if it should, check what it returns)")
    return line if not extras else line + "\n  " + " | ".join(extras)


def print_completions(console, result, groups: int = 2) -> None:
    """The first completion of this rank's first `groups` prompts of a step's result (`grpo.step.StepResult`),
    with its answer and reward."""
    total = result.scores.total  # this rank's rows come first only on rank 0, the one that prints
    for j in range(0, len(result.texts), result.num_generations)[:groups]:
        console.print(f"  [dim]answer {result.answers[j]!r} reward {float(total[j]):.2f}:[/] {result.texts[j][:400]!r}")


class TimeLeftColumn(ProgressColumn):
    """`left 0:04:10` beside the elapsed time while a task runs; `elapsed` once it is finished (not `left 0:00:00`)."""

    def __init__(self):
        super().__init__()
        self._remaining = TimeRemainingColumn()

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text("elapsed", style="progress.elapsed")
        return Text("left ") + self._remaining.render(task)


class ProgressBar:
    """The run's live display, shown between `start()` and `stop()`: a bar over the run's steps and, under
    it, the phase in flight: held-out prompts evaluated, and tokens generated (`generation` is the
    engines' `GenerationProgress`). The phase bars show only while their phase runs. `unit` names what the top
    bar counts: a run's steps, or the models `python -m grpo.eval` measures."""

    def __init__(self, console, total: int, completed: int, unit: str = "steps"):
        self._progress = Progress(TextColumn("[bold]{task.description:>8}"), BarColumn(bar_width=32),
                                  MofNCompleteColumn(), TextColumn("{task.fields[unit]:<7}"), TimeElapsedColumn(),
                                  TimeLeftColumn(), console=console)
        self._steps = self._progress.add_task(unit, total=total, completed=completed, unit=unit)
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


def step_memory_gib(device: torch.device, engine: Any) -> tuple[float, float | None]:
    """(the trainer's peak this step, the engine's pool or None), in GiB. An engine with a memory pool
    of its own (vLLM: `pool_bytes()`) has it reported apart; the part of that pool this process's torch
    counts (`pool_bytes_in_torch()`, vLLM's engine core in this process) is taken out of the trainer's
    peak, which is otherwise torch's (on CPU, the process's peak resident size)."""
    peak = peak_memory_gib(device)
    if device.type != "cuda" or not hasattr(engine, "pool_bytes"):  # vLLM's CPU build: no GPU pool
        return peak, None
    return peak - engine.pool_bytes_in_torch() / 2**30, engine.pool_bytes() / 2**30


class GcClock:
    """Seconds this process has spent in Python's garbage collector since the clock was made: a step's share
    (`gc_time` in its record) shows a collection that stalled it, which the phase timers charge to whichever phase it
    fell in. `stop` takes its hook out of `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began: float | None = None
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def stop(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def synced_clock(device: torch.device) -> Callable[[], float]:
    """A clock that first waits for the work queued on this thread's stream, so each phase is charged with its
    own GPU work (and not with a generate that runs ahead on a stream of its own: `grpo.rollout.ahead`)."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()
    return now
