"""A PNG of a run's `metrics.jsonl`: reward, accuracy and format compliance by step.

Two panels sharing the step axis. Top: the mean reward of each step, with a band of one standard
deviation when the records carry `reward_std`. Bottom: the training batch's answer accuracy and format
compliance (faint per step, solid as a running mean: a batch of P*G completions is noisy), and the
held-out evaluations (`eval/greedy_accuracy`, `eval/greedy_lenient_accuracy`, `eval/greedy_format`,
`eval/pass@1`, `eval/pass@1_lenient`, `eval/sampled_format`; of episodes `eval/greedy_tool_use`,
`eval/greedy_success` and `eval/sampled_success`; each only where the records carry it) as markers joined by
lines, step 0 being the untrained model.

Also `python -m grpo.run.plots METRICS_JSONL [PNG]`; `--compare LABEL=METRICS_JSONL ... PNG` draws several runs
of one recipe on shared axes (`plot_side_by_side`: reward, train and held-out accuracy, step time). What
this is not: a dashboard; use --report-to tensorboard or wandb for live curves. matplotlib is imported
inside the plotting functions and draws on an Agg canvas without pyplot (no display, no global backend
switch), so importing this module costs nothing.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVAL_SERIES = (  # key, label, marker
    ("eval/greedy_accuracy", "held-out accuracy (greedy)", "o"),
    ("eval/pass@1", "held-out accuracy (pass@1)", "s"),
    ("eval/greedy_lenient_accuracy", "held-out lenient accuracy (greedy)", "D"),
    ("eval/pass@1_lenient", "held-out lenient accuracy (pass@1)", "d"),
    ("eval/greedy_format", "held-out format (greedy)", "^"),
    ("eval/sampled_format", "held-out format (sampled)", "v"),
    ("eval/greedy_tool_use", "held-out tool use (greedy)", "P"),  # episodes with tools
    ("eval/greedy_success", "held-out success (greedy)", "*"),  # episodes of an environment
    ("eval/sampled_success", "held-out success (sampled)", "X"),
)


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSON-lines file; a line that is not JSON is
    one ValueError naming the file and line."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not a JSON line; fix or delete that line") from None


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl, each sorted by step; a step logged twice
    keeps its last record (a resumed run rewrites the steps after its checkpoint)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file; pass the metrics.jsonl of a run's --output-dir")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for _, record in json_lines(path):
        if not isinstance(record, dict) or "step" not in record:
            continue
        if any(key in record for key, _, _ in EVAL_SERIES):
            evals[int(record["step"])] = record
        elif "reward" in record:
            train[int(record["step"])] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of `key`, skipping records that lack it (or hold None/NaN)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def running_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(metrics_jsonl: str | Path, png_path: str | Path, title: str | None = None) -> Path:
    """Draw the run in `metrics_jsonl` into `png_path` (folders created); returns the PNG's path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None

    train, evals = read_metrics(metrics_jsonl)
    if not train and not evals:
        raise ValueError(f"{metrics_jsonl}: no training or eval records to plot; run training first")
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)

    # A bare Figure on an Agg canvas, not pyplot: no global backend switch, no figure left open.
    fig = Figure(figsize=(9, 7))
    FigureCanvasAgg(fig)
    ax_r, ax_f = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.2]})
    steps, reward = _series(train, "reward")
    if steps:
        ax_r.plot(steps, reward, color="tab:blue", lw=1.5, label="reward (mean of the step's completions)")
        std_steps, std = _series(train, "reward_std")
        if std_steps == steps:
            ax_r.fill_between(steps, [m - s for m, s in zip(reward, std)], [m + s for m, s in zip(reward, std)],
                              color="tab:blue", alpha=0.15, lw=0, label="± 1 std")
        ax_r.legend(loc="lower right", fontsize=8)
    else:
        ax_r.text(0.5, 0.5, "no training steps logged", ha="center", va="center", transform=ax_r.transAxes)
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)

    window = max(1, len(train) // 20)
    for key, label, color in (("accuracy", "train accuracy", "tab:green"), ("format", "train format", "tab:orange")):
        s, v = _series(train, key)
        if not s:
            continue
        ax_f.plot(s, v, color=color, lw=0.8, alpha=0.3)
        ax_f.plot(s, running_mean(v, window), color=color, lw=1.5,
                  label=label + (f" (mean of {window} steps)" if window > 1 else ""))
    colors = {"eval/greedy_accuracy": "darkgreen", "eval/pass@1": "limegreen",
              "eval/greedy_lenient_accuracy": "purple", "eval/pass@1_lenient": "orchid",
              "eval/greedy_format": "darkorange", "eval/sampled_format": "gold", "eval/greedy_tool_use": "teal",
              "eval/greedy_success": "crimson", "eval/sampled_success": "salmon"}
    for key, label, marker in EVAL_SERIES:
        s, v = _series(evals, key)
        if s:
            ax_f.plot(s, v, color=colors[key], marker=marker, ms=6, lw=1.2, ls="--", label=label)
    ax_f.set_ylim(-0.03, 1.03)
    ax_f.set_ylabel("fraction of completions")
    ax_f.set_xlabel("optimizer step")
    ax_f.grid(alpha=0.3)
    if ax_f.get_legend_handles_labels()[0]:
        ax_f.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.suptitle(title or f"GRPO: {Path(metrics_jsonl).parent.name or 'run'}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
    return png_path


def plot_side_by_side(runs: dict[str, str | Path], png_path: str | Path, title: str = "") -> Path:
    """Runs of one recipe on shared axes, one color each (e.g. ours and TRL's): reward and train accuracy as
    running means, held-out greedy accuracy as markers, and each step's wall clock. `runs`: label -> metrics.jsonl."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if len(runs) < 2:
        raise ValueError("--compare: give two or more LABEL=METRICS_JSONL runs")
    fig = Figure(figsize=(9, 9))
    FigureCanvasAgg(fig)
    ax_r, ax_a, ax_t = fig.subplots(3, 1, sharex=True)
    medians = []  # of the step times: the axis stops at 2.5x the largest, past a first step's compile
    colors = itertools.cycle(("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown"))
    for (label, path), color in zip(runs.items(), colors):
        train, evals = read_metrics(path)
        window = max(1, len(train) // 20)
        for ax, key in ((ax_r, "reward"), (ax_a, "accuracy"), (ax_t, "step_time")):
            s, v = _series(train, key)
            if s:
                if key == "step_time":
                    medians.append(sorted(v)[len(v) // 2])
                ax.plot(s, v, color=color, lw=0.8, alpha=0.25)
                ax.plot(s, v if key == "step_time" else running_mean(v, window), color=color, lw=1.5,
                        label=label if key != "accuracy" else f"{label}: train (mean of {window} steps)")
        s, v = _series(evals, "eval/greedy_accuracy")
        if s:
            ax_a.plot(s, v, color=color, marker="o", ls="--", lw=1.2, label=f"{label}: held-out (greedy)")
    for ax, ylabel in ((ax_r, "reward"), (ax_a, "accuracy (strict)"), (ax_t, "step wall clock, s")):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right" if ax is not ax_t else "upper right")
    ax_a.set_ylim(-0.03, 1.03)
    ax_t.set_ylim(0, 2.5 * max(medians) if medians else None)
    ax_t.set_xlabel("optimizer step")
    fig.suptitle(title or " vs ".join(runs))
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
    return png_path


USAGE = ("usage: python -m grpo.run.plots METRICS_JSONL [PNG]  (default PNG: metrics.png beside it)\n"
         "       python -m grpo.run.plots --compare LABEL=METRICS_JSONL LABEL=METRICS_JSONL ... PNG")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--compare"]:
        *pairs, png = args[1:] or [""]
        if len(pairs) < 2 or not png.endswith(".png") or not all("=" in p for p in pairs):
            print(USAGE)
            return 2
        print(plot_side_by_side(dict(p.split("=", 1) for p in pairs), png))
        return 0
    if len(args) not in (1, 2) or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args and args[0] in ("-h", "--help") else 2
    metrics = Path(args[0])
    print(plot_metrics(metrics, args[1] if len(args) == 2 else metrics.with_name("metrics.png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
