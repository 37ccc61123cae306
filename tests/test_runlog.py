"""What a run records and shows: metrics.jsonl on resume, the step record, the progress bar."""

from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch

from grpo.config import Config
from grpo.run.log import MetricsLog, ProgressBar, step_line
from grpo.groups import Scores
from grpo.step import StepResult


def test_metrics_log_starts_afresh_or_drops_the_records_past_the_resumed_step(tmp_path):
    lines = [{"step": 0, "eval/pass@1": 0.1}, {"step": 1, "reward": 1.0}, {"step": 2, "reward": 2.0},
             {"step": 3, "reward": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = MetricsLog(tmp_path, Config(), resumed_step=2)
    log.write({"step": 3, "reward": 4.0})
    log.close()
    log.close()  # a second close does nothing
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == lines[:3] + [{"step": 3, "reward": 4.0}]
    MetricsLog(tmp_path, Config(), resumed_step=0)
    assert not (tmp_path / "metrics.jsonl").exists()


def _result(skipped: bool) -> StepResult:
    rewards = torch.tensor([[1.0, float("nan")], [3.0, 1.0], [0.0, 0.0], [2.0, 2.0]])  # (N*P*G, R)
    column = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    scores = Scores(rewards, ["a", "b"], correct=column, formatted=1 - column, lengths=4 * column, finished=column)
    return StepResult(scores=scores, texts=["x"] * 4, answers=["1"] * 4, num_generations=2, frac_zero_std=0.5,
                      loss_stats={} if skipped else {"loss": 0.25, "kl": 0.125}, grad_norm=None if skipped else 2.0,
                      skipped=skipped, timings={"generate": 1.0, "train": 0.5})


def test_the_step_record_has_the_metrics_keys_in_order_with_nan_rewards_left_out_of_sums():
    record = _result(skipped=False).log_record(5, lr=1e-3, step_time=2.5, peak_mem_gib=1.5)
    assert list(record) == ["step", "reward", "reward_std", "rewards/a", "rewards/b", "accuracy", "format",
                            "completion_length", "frac_finished", "frac_zero_std", "lr", "grad_norm", "skipped",
                            "loss", "kl", "step_time", "time/generate", "time/train", "peak_mem_gib"]
    assert record["reward"] == pytest.approx((1 + 4 + 0 + 4) / 4)  # a None reward (NaN) adds nothing
    assert record["rewards/b"] == pytest.approx(1.0) and record["accuracy"] == 0.75 and record["format"] == 0.25
    assert record["completion_length"] == 3.0 and record["grad_norm"] == 2.0 and record["skipped"] is False
    assert "kl 0.1250" in step_line(record) and "2.50 s" in step_line(record)
    skipped = _result(skipped=True).log_record(6, lr=1e-3, step_time=2.5, peak_mem_gib=1.5)
    assert skipped["grad_norm"] is None and skipped["skipped"] is True and "loss" not in skipped
    assert "kl 0.0000" in step_line(skipped) and math.isfinite(skipped["reward"])


def test_the_gc_clock_counts_the_collectors_time_until_stopped_and_the_record_carries_a_steps_share():
    import gc

    from grpo.run.log import GcClock

    clock = GcClock()
    assert clock.seconds == 0.0
    gc.collect()
    after_one = clock.seconds
    assert after_one > 0 and clock._hook in gc.callbacks
    clock.stop()
    gc.collect()
    assert clock.seconds == after_one and clock._hook not in gc.callbacks
    clock.stop()  # twice: nothing left to take out
    record = _result(skipped=False).log_record(5, lr=1e-3, step_time=2.5, peak_mem_gib=1.5, gc_time=0.125)
    assert record["gc_time"] == 0.125 and list(record).index("gc_time") == list(record).index("time/train") + 1


def test_the_step_line_shows_vllms_pool_apart_from_the_trainers_peak_never_added_to_it():
    record = _result(skipped=False).log_record(12, lr=1e-3, step_time=2.5, peak_mem_gib=5.21, engine_pool_gib=122.5)
    assert record["peak_mem_gib"] == 5.21 and record["engine_pool_gib"] == 122.5
    record["completion_length"] = 1760.0
    line = step_line(record, max_steps=500)
    assert line.endswith("mem 5.21 GiB + vllm 122 GiB") and len(line) <= 112, line
    ours = _result(skipped=False).log_record(12, lr=1e-3, step_time=2.5, peak_mem_gib=5.21)
    assert "engine_pool_gib" not in ours and "vllm" not in step_line(ours)


def test_the_progress_bar_stops_once_however_often_it_is_told():
    from rich.console import Console

    text = io.StringIO()
    bar = ProgressBar(Console(file=text, force_terminal=False), total=3, completed=1)
    bar.stop()  # never shown: nothing to end
    assert text.getvalue() == ""
    bar.start()
    bar.update(2)
    bar.stop()
    ended = text.getvalue()
    bar.stop()
    assert ended and text.getvalue() == ended


def test_a_metrics_line_cut_short_is_dropped_with_a_note_when_the_run_resumes(tmp_path):
    whole = "".join(json.dumps({"step": s, "reward": 1.0}) + "\n" for s in (1, 2))
    (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 3, "rew')
    log = MetricsLog(tmp_path, Config(), resumed_step=2)
    assert log.note and "dropped 1 line" in log.note
    log.write({"step": 3, "reward": 3.0})
    assert (tmp_path / "metrics.jsonl").read_text() == whole + json.dumps({"step": 3, "reward": 3.0}) + "\n"
    assert MetricsLog(tmp_path, Config(), resumed_step=3).note is None  # nothing to repair now


def test_each_metrics_record_is_appended_whole_in_one_write(tmp_path, monkeypatch):
    # One write() of the whole line: a kill lands before or after it, never inside a line.
    log = MetricsLog(tmp_path, Config(), resumed_step=0)
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: (writes.append(bytes(data)), real_write(fd, data))[1])
    log.write({"step": 1, "text": "x" * 20000})
    assert len(writes) == 1 and writes[0].endswith(b"\n") and json.loads(writes[0])["step"] == 1


def test_a_reward_that_applies_to_no_completion_is_one_line_of_the_step_and_null_in_strict_json(tmp_path):
    rewards = torch.tensor([[1.0, float("nan")], [3.0, float("nan")], [0.0, float("nan")], [2.0, float("nan")]])
    column = torch.ones(4, 1)
    scores = Scores(rewards, ["format_exact", "never"], correct=column, formatted=column, lengths=column,
                    finished=column)
    result = StepResult(scores=scores, texts=["x"] * 4, answers=["1"] * 4, num_generations=2, frac_zero_std=0.0,
                        loss_stats={"loss": float("nan")}, grad_norm=float("inf"), skipped=True, timings={})
    record = result.log_record(3, lr=1e-3, step_time=2.5, peak_mem_gib=1.5)
    line = step_line(record, max_steps=10)
    assert line.splitlines()[1] == ("  reward never returned None or NaN for all 4 completions (it applies to none; "
                                    "if it should, check what it returns)")
    assert "format_exact" not in line
    log = MetricsLog(tmp_path, Config(), resumed_step=0)
    log.write(record)
    text = (tmp_path / "metrics.jsonl").read_text()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert written["rewards/never"] is None and written["loss"] is None and written["grad_norm"] is None
    assert written["rewards_applies_to_none/never"] == 4 and written["rewards/format_exact"] == 1.5


def test_the_finished_progress_bar_says_elapsed_not_zero_time_left():
    from rich.console import Console

    text = io.StringIO()
    bar = ProgressBar(Console(file=text, force_terminal=False, width=200), total=2, completed=0)
    bar.start()
    bar.update(2)
    bar.stop()
    last = text.getvalue().strip().splitlines()[-1]
    assert "2/2" in last and last.endswith("elapsed") and "left" not in last, last


def _stats_one_key_at_a_time(micro_batches, passes):
    """The statistics' sums as the step made them before they were stacked: four or five ops a key."""
    agg = {}
    for stats, share in micro_batches:
        for k, v in stats.items():
            v = torch.as_tensor(v).detach().double()
            if k not in agg:
                agg[k] = v if k in ("ratio_min", "ratio_max") else v * share / passes
            elif k == "ratio_min":
                agg[k] = torch.minimum(agg[k], v)
            elif k == "ratio_max":
                agg[k] = torch.maximum(agg[k], v)
            else:
                agg[k] = agg[k] + v * share / passes
    return {k: float(v) for k, v in agg.items()}


def test_the_steps_statistics_sum_every_key_at_once_to_the_same_floats_in_a_few_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpo.loss import STAT_KEYS
    from grpo.step import accumulate_stats, host_stats, no_stats

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    keys = (*STAT_KEYS, "loss")
    # three micro-batches: a token share (a float32 tensor, --loss-norm token) or a row share (a float)
    micro_batches = [({k: torch.randn((), generator=gen) for k in keys}, share)
                     for share in (torch.tensor(0.3), 1 / 3, torch.tensor(0.45))]
    expected = _stats_one_key_at_a_time(micro_batches, passes=2)
    agg = {}
    with Ops():
        for stats, share in micro_batches:
            accumulate_stats(agg, stats, share, 2)
    got = host_stats(agg)
    assert got == expected and list(got) == list(keys)  # bit for bit, in the stats' order
    assert got["ratio_min"] == min(float(s["ratio_min"]) for s, _ in micro_batches)
    assert Ops.count <= 3 * 9, Ops.count  # one key at a time took 52 ops a micro-batch
    assert host_stats(no_stats()) == no_stats()
