"""grpo.run.plots: a PNG of metrics.jsonl (reward, accuracy, format by step), from synthetic records."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.run.plots import plot_metrics, read_metrics, running_mean

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a valid PNG holds right after its signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", head[16:24])


def eval_record(step: int, level: float) -> dict:
    return {"step": step, "eval/prompts": 8.0, "eval/greedy_accuracy": level, "eval/greedy_format": level,
            "eval/pass@1": level / 2, "eval/sampled_format": level / 2, "eval/samples": 2.0}


def write_run(path: Path, steps: int = 30, with_std: bool = True) -> Path:
    lines = [eval_record(0, 0.0)]
    for s in range(1, steps + 1):
        rec = {"step": s, "reward": -4.0 + 0.3 * s, "rewards/format": 0.1 * s, "accuracy": min(1.0, s / steps),
               "format": min(1.0, 2 * s / steps), "loss": 0.1, "grad_norm": None, "skipped": False}
        if with_std:
            rec["reward_std"] = 1.0
        lines.append(rec)
        if s % 10 == 0:
            lines.append(eval_record(s, s / steps))
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n")
    return path


def test_plot_metrics_writes_a_valid_png_of_sensible_size(tmp_path):
    metrics = write_run(tmp_path / "metrics.jsonl")
    png = plot_metrics(metrics, tmp_path / "plots" / "metrics.png")
    assert png == tmp_path / "plots" / "metrics.png" and png.is_file()
    width, height = png_size(png)
    assert 600 <= width <= 2000 and 400 <= height <= 1500
    assert png.stat().st_size > 20_000  # two panels of curves, legend and labels, not an empty canvas
    assert png.read_bytes().endswith(b"IEND\xaeB`\x82")  # complete, not truncated


def test_plot_draws_the_curves_it_is_given(tmp_path):
    # Same axes and legends, different data: the images must differ, so the data is actually drawn.
    a = plot_metrics(write_run(tmp_path / "a.jsonl"), tmp_path / "a.png", title="t")
    rising = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines() if line]
    for r in rising:
        if "reward" in r:
            r["reward"] = -r["reward"]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rising))
    b = plot_metrics(tmp_path / "b.jsonl", tmp_path / "b.png", title="t")
    assert a.read_bytes() != b.read_bytes()


def test_plot_handles_runs_without_std_with_only_eval_records_or_a_single_step(tmp_path):
    for name, records in {
        "no_std": None,
        "eval_only": [eval_record(0, 0.1)],
        "one_step": [{"step": 1, "reward": 0.5, "reward_std": 0.0, "accuracy": 0.0, "format": 1.0}],
    }.items():
        path = tmp_path / f"{name}.jsonl"
        if records is None:
            write_run(path, steps=3, with_std=False)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
        png_size(plot_metrics(path, tmp_path / f"{name}.png"))


def test_read_metrics_splits_train_and_eval_sorts_by_step_and_keeps_a_rewritten_step_once(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [eval_record(0, 0.0), {"step": 2, "reward": 1.0}, {"step": 1, "reward": 0.0},
               {"step": 2, "reward": 5.0}, eval_record(2, 0.5), {"note": "no step"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    train, evals = read_metrics(path)
    assert [(r["step"], r["reward"]) for r in train] == [(1, 0.0), (2, 5.0)]
    assert [r["step"] for r in evals] == [0, 2]


def test_running_mean_is_a_trailing_window_mean():
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([2.0, 4.0], 1) == [2.0, 4.0]
    assert running_mean([], 3) == []


def test_bad_metrics_files_give_a_one_line_error_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        plot_metrics(tmp_path / "missing.jsonl", tmp_path / "x.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no training or eval records"):
        plot_metrics(empty, tmp_path / "x.png")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"step": 1, "reward": 1.0}\n{"step": 2, "rew\n')
    with pytest.raises(ValueError, match="broken.jsonl:2"):
        plot_metrics(broken, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_module_cli_writes_metrics_png_beside_the_file(tmp_path):
    metrics = write_run(tmp_path / "metrics.jsonl", steps=4)
    result = subprocess.run([sys.executable, "-m", "grpo.run.plots", str(metrics)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    png_size(tmp_path / "metrics.png")


def test_side_by_side_draws_each_run_and_refuses_a_single_one(tmp_path):
    from grpo.run.plots import main, plot_side_by_side

    a, b = write_run(tmp_path / "a.jsonl"), write_run(tmp_path / "b.jsonl", steps=20)
    for lines, path in ((a.read_text().splitlines(), a), (b.read_text().splitlines(), b)):
        records = [json.loads(line) for line in lines if line]
        for r in records:
            if "reward" in r:
                r["step_time"] = 3.0 + (r["step"] % 3)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    png = plot_side_by_side({"ours": a, "peer": b}, tmp_path / "both.png")
    assert png_size(png)[1] > 600 and png.stat().st_size > 30_000
    alone = plot_side_by_side({"ours": a, "peer": a}, tmp_path / "same.png")
    assert alone.read_bytes() != png.read_bytes()  # the second run's data is drawn
    with pytest.raises(ValueError, match="two or more"):
        plot_side_by_side({"ours": a}, tmp_path / "one.png")
    assert main(["--compare", f"ours={a}", str(tmp_path / "x.png")]) == 2
    assert main(["--compare", f"ours={a}", f"peer={b}", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").is_file()
