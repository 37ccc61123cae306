"""The probes' one timer and one results writer.

Timers, each a median so that one slow run does not move the figure:
- `median_ms(fn)`: fn() between two CUDA events per run, after warm-up (wall clock on a CPU).
- `kernel_ms(fn)`: for short kernels, triton's `do_bench` (25 ms of warm-up, 200 ms of repeats).
- `graph_us(fn, copies)`: fn(copy) captured `calls` times in one CUDA graph, rotating over `copies` (more
  bytes than the L2 holds), the graph replayed: microseconds per call, launch gaps included as they are
  inside the engine's own graph.
- `host_ms(fn)`: host wall time per call with the GPU queue not drained (what the enqueueing costs).
- `peak_extra_gib(fn)`: the peak allocated while fn() runs, above what was allocated before it.
- `copy_tbps()`: device copy bandwidth (read + write), the ceiling of every memory-bound figure.
- `covered_us(spans)`: the union of (start, end) spans, a GPU's busy time where kernels overlap.

The writer, `Recorder`: every figure a probe measures is one JSON line `{"kind": ..., ..., "t": seconds
since the start}`, printed as it comes and appended at once to `<out>/<probe>-<start time>.jsonl`, so what
was measured before a crash or the end of a device lease is kept; free text (tables, tracebacks) goes to
the `.log` beside it. `--out` (`add_out_argument`) picks the folder: `$OUT` when set, else
`outputs/probes/` (git-ignored).

What it deliberately is not: the suite's results. `pytest benchmarks/ --benchmark` writes
`benchmarks/results/*.json` through `bench_setup.Results`, and `render.py` turns those into RESULTS.md;
probe output is read by hand. Nothing happens at import.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


# --------------------------------------------------------------------------------------------------
# timers
# --------------------------------------------------------------------------------------------------
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, warmup: int = 2, iters: int = 7) -> float:
    """Median milliseconds of fn() over `iters` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_ms(fn) -> float:
    """Median ms for short kernels: triton's do_bench (25 ms warm-up, 200 ms of repeats)."""
    if not torch.cuda.is_available():
        return median_ms(fn, 1, 3)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_us(fn, copies: list, calls: int = 16, replays: int = 20) -> float:
    """Median microseconds per call of fn(copy) over a CUDA graph of `calls` calls rotating over `copies`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (and Triton's compile) outside the capture
        for c in copies[:2]:
            fn(c)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def host_ms(fn, calls: int = 50) -> float:
    """Host wall time per call with the GPU queue not drained (the GPU may lag: only the enqueueing counts)."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e3
    sync()
    return t


def peak_extra_gib(fn) -> float:
    """Peak memory allocated while fn() runs, above what was allocated before it (NaN without CUDA)."""
    if not torch.cuda.is_available():
        return float("nan")
    sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def copy_tbps(numel: int = 1 << 28) -> float:
    """Device copy bandwidth in TB/s, read + write, of a bf16 buffer of `numel` elements (512 MiB by default)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * src.numel() * src.element_size() / (ms / 1e3) / 1e12


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans: the time at least one of them ran."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


# --------------------------------------------------------------------------------------------------
# the results writer
# --------------------------------------------------------------------------------------------------
def default_out() -> Path:
    """$OUT when set (the device machine's output folder), else outputs/probes/ in the repository."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "outputs" / "probes"


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=default_out(),
                        help="folder for <probe>-<start time>.jsonl and .log (default: $OUT, else outputs/probes/)")


def _to_json(value):
    return float(value) if hasattr(value, "__float__") else str(value)


class Recorder:
    """One probe run's figures, as JSON lines, and its free text, both written as they come."""

    def __init__(self, probe: str, out: str | Path):
        self.rows: list[dict] = []
        self._start = time.perf_counter()
        stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{probe}-{stamp}.jsonl"
        self.log_path = self.path.with_suffix(".log")

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._start

    def record(self, kind: str, **fields) -> dict:
        """One measured row: kept in `rows`, printed, appended to the .jsonl file."""
        row = {"kind": kind, **fields, "t": round(self.elapsed_s(), 1)}
        self.rows.append(row)
        line = json.dumps(row, default=_to_json)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        return row

    def say(self, text: str = "") -> None:
        """Free text for a reader: printed and appended to the .log file."""
        print(text, flush=True)
        with open(self.log_path, "a") as f:
            f.write(text + "\n")

    def of_kind(self, kind: str) -> list[dict]:
        return [row for row in self.rows if row["kind"] == kind]
