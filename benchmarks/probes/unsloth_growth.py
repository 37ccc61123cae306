"""Whether ours on Unsloth's engine gets slower step by step, and what grows beside it.

Issue 65: on Unsloth's FP8-Block engine the bench steps after the warm-up took 2.26, 2.27, 2.47, 2.85 s in one
run (bf16 showed no trend), and 1.88 s in an earlier one. Reading the code found nothing of ours that grows with
the step count (vLLM keeps one adapter, max_cpu_loras = max_loras = 1, and evicts the last on each new id), so
this measures instead. It runs `grpo.trainer.train` with `--engine unsloth` at the bench config as the suite does
(`bench_setup.step_config`, fixed lengths; fp8: the bench model written as an FP8-Block checkpoint, as the suite's
`fp8_block_dir`) and, after each step's record is made (outside its step_time), records that step's time and
phases beside what could grow with the steps:
- vLLM's adapters: how many it holds (`list_loras`) and the id this step sent (a new one each step);
- vLLM's prefix cache: cached blocks, and free blocks of all;
- vLLM's sleep-mode pool (CuMemAllocator): allocations and bytes;
- torch's allocator: allocated, reserved, segments, cudaMalloc calls and retries; the device's used memory;
- Python: the objects gc tracks, and one full collection's seconds (Unsloth's sleep and wake each run one);
- torch.compile: dynamo's counters (frames, recompiles, graphs), summed by group;
- the GPU during the step (nvidia-smi every 0.5 s): lowest and mean SM clock, hottest, mean power, so that a
  throttling GPU is told apart from a growing cost.
At the end, one `trend` row per quantity: its least-squares slope per step over the steps after --warmup, first
and last value; the step time's first.

A/B arms, each a run of its own: --remove-lora (the previous adapter removed from vLLM before each generate, as
`VLLMEngine` does), --deep-gemm-warmup (vLLM's own DeepGEMM warm-up instead of the suite's skip, under which a
shape first met mid-run is compiled inside that step). What it found, the figures in benchmarks/RESULTS.md: nothing
grows, and each of Unsloth's sleep and wake collected every object of the process, which the trainer now freezes
after set-up (`gc.freeze()`; `gc_objects` counts what is left to collect).

On the H200 machine (vLLM kit installed, benchmarks/README.md), each run in its own process (importing unsloth
patches the process):
    source .vx/kit.sh env unsloth && for d in fp8 bf16; do python3 benchmarks/probes/unsloth_growth.py --dtype $d; done
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_setup
sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30


# --------------------------------------------------------------------------------------------------
# What could grow, read between steps
# --------------------------------------------------------------------------------------------------
def _read(fn):
    """fn()'s value, or None where this vLLM (or torch) keeps it elsewhere: a quantity not found is not a crash."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - internals differ between versions; None says "not read"
        return None


def _dig(obj, *names):
    for name in names:
        obj = getattr(obj, name, None)
    return obj


def vllm_state(llm) -> dict:
    """What a `vllm.LLM` whose engine core runs in this process (Unsloth's) holds that could grow with the
    steps: its adapters, its prefix cache's blocks, and its sleep-mode pool."""
    engine = getattr(llm, "llm_engine", None)
    # InprocClient.engine_core is the EngineCore itself (VLLM_ENABLE_V1_MULTIPROCESSING=0, as Unsloth sets)
    pool = _dig(engine, "engine_core", "engine_core", "scheduler", "kv_cache_manager", "block_pool")
    cached = getattr(pool, "cached_block_hash_to_block", None)
    cached = getattr(cached, "_cache", cached)  # newer vLLM wraps the dict in BlockHashToBlockMap
    return {"loras_held": _read(lambda: len(engine.list_loras())), "prefix_cached_blocks": _read(lambda: len(cached)),
            "free_blocks": _read(lambda: pool.get_num_free_blocks()), "total_blocks": _read(lambda: len(pool.blocks)),
            **sleep_pool_state()}


def sleep_pool_state() -> dict:
    """vLLM's sleep-mode allocator in this process: how many allocations it maps, and their bytes."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return {"sleep_pool_allocations": None, "sleep_pool_gib": None}
    allocator = getattr(CuMemAllocator, "instance", None)  # read, not get_instance(): that would create one
    return {"sleep_pool_allocations": _read(lambda: len(allocator.pointer_to_data)),
            "sleep_pool_gib": _read(lambda: allocator.get_current_usage() / GiB)}


def torch_state() -> dict:
    """torch's allocator and the device's used memory (GiB), and dynamo's counters summed by group."""
    out = {}
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        out.update(allocated_gib=stats.get("allocated_bytes.all.current", 0) / GiB,
                   reserved_gib=stats.get("reserved_bytes.all.current", 0) / GiB,
                   segments=stats.get("segment.all.current"), cuda_mallocs=stats.get("num_device_alloc"),
                   alloc_retries=stats.get("num_alloc_retries"), device_used_gib=(total - free) / GiB)
    return {**out, **dynamo_counters()}


def dynamo_counters() -> dict:
    """dynamo's counters (frames seen and compiled, recompiles, graphs...), each group summed."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {f"dynamo/{group}": sum(counter.values()) for group, counter in sorted(counters.items())}


def python_state() -> dict:
    """The objects gc tracks, and the seconds of one full collection (what each of Unsloth's costs)."""
    start = time.perf_counter()
    gc.collect()
    return {"gc_objects": len(gc.get_objects()), "gc_collect_s": time.perf_counter() - start}


class GpuSampler:
    """nvidia-smi's SM clock, temperature and power every `interval_s`, in a thread, kept with their times; each
    reading starts a process, so not faster (as `bench_setup.GpuUsedMemory`)."""

    QUERY = "clocks.sm,temperature.gpu,power.draw"

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float, float]] = []  # (time, MHz, degrees C, watts)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def read(self) -> tuple[float, float, float] | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                  "-i", "0"], capture_output=True, text=True, timeout=10).stdout
            clock, temp, power = (float(v) for v in out.split(",")[:3])
            return clock, temp, power
        except (OSError, subprocess.SubprocessError, ValueError):
            return None

    def _poll(self) -> None:
        while not self._stop.is_set():
            reading = self.read()
            if reading is not None:
                self.samples.append((time.perf_counter(), *reading))
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self.read() is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def between(self, t0: float, t1: float) -> dict:
        """The readings taken between t0 and t1 (perf_counter seconds), summarized."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"sm_mhz_min": None, "sm_mhz_mean": None, "temp_c_max": None, "power_w_mean": None}
        return {"sm_mhz_min": min(s[1] for s in inside), "sm_mhz_mean": statistics.fmean(s[1] for s in inside),
                "temp_c_max": max(s[2] for s in inside), "power_w_mean": statistics.fmean(s[3] for s in inside)}


# --------------------------------------------------------------------------------------------------
# Trends
# --------------------------------------------------------------------------------------------------
def slope(ys: list[float]) -> float:
    """The least-squares slope of ys against 0, 1, 2, ... (per step)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / sum((x - mean_x) ** 2 for x in range(n))


NOT_TRENDS = ("kind", "t", "step", "lora_id")  # the row's bookkeeping; the id grows by one a step by design


def trends(rows: list[dict], warmup: int) -> list[dict]:
    """Per numeric quantity of the step rows after the first `warmup`: slope per step, first, last, and the
    slope over the mean (per-step growth as a share); the step time first, then by that share, largest first."""
    steady = rows[warmup:]
    keys = dict.fromkeys(k for r in steady for k in r if k not in NOT_TRENDS)  # dynamo's groups come as they start
    out = []
    for key in keys:
        ys = [r.get(key) for r in steady]
        if not ys or any(not isinstance(y, (int, float)) or isinstance(y, bool) for y in ys):
            continue
        s, mean = slope(ys), statistics.fmean(ys)
        out.append({"quantity": key, "slope_per_step": s, "first": ys[0], "last": ys[-1],
                    "share_per_step": s / mean if mean else 0.0})
    return sorted(out, key=lambda t: (t["quantity"] != "step_time", -abs(t["share_per_step"])))


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def model_dirs(root: Path, dtype: str) -> tuple[Path, Path]:
    """(the checkpoint Unsloth loads, the prompts): the bench model, written as FP8-Block for fp8 as the suite's
    `fp8_block_dir` writes it."""
    import bench_setup as bs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import LORA_TARGETS
    from grpo.model.fp8_checkpoint import save_fp8_block_checkpoint

    model_dir = bs.build_model_dir(root / "model", size="1b", device="cuda")
    prompts = bs.write_prompts(root / "prompts.jsonl", AutoTokenizer.from_pretrained(model_dir), bs.BENCH.prompt_len)
    if dtype == "bf16":
        return model_dir, prompts
    path = root / "model-fp8-block"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    save_fp8_block_checkpoint(model, path, LORA_TARGETS)
    model.generation_config.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    del model
    bs.free_memory()
    return path, prompts


def run(cfg, rec, gpu: GpuSampler, remove_lora: bool) -> list[dict]:
    """Trains `cfg` (fixed lengths), recording a `step` row after each step; returns the rows."""
    import bench_setup as bs
    import grpo.trainer as trainer

    inner_step, inner_report = trainer.grpo_step, trainer.report_step
    seen: dict = {"setup": None, "span": (0.0, 0.0), "lora_id": None}
    rows: list[dict] = []

    def watch_adapters(engine) -> None:
        # the id each step sends; with --remove-lora, the previous adapter leaves vLLM first (as VLLMEngine's)
        original = engine._lora_request

        def lora_request():
            request = original()
            previous, seen["lora_id"] = seen["lora_id"], getattr(request, "lora_int_id", None)
            if remove_lora and previous is not None:
                engine.llm.llm_engine.remove_lora(previous)
            return request

        engine._lora_request = lora_request

    def step(setup, index, in_flight):
        if seen["setup"] is None:
            seen["setup"] = setup
            watch_adapters(setup.engine)
        t0 = time.perf_counter()
        try:
            return inner_step(setup, index, in_flight)
        finally:
            seen["span"] = (t0, time.perf_counter())

    def report(cfg, record, *args, **kwargs):
        inner_report(cfg, record, *args, **kwargs)
        row = {"step": record["step"], "step_time": record["step_time"],
               **{k[len("time/"):]: v for k, v in record.items() if k.startswith("time/")},
               "lora_id": seen["lora_id"], **vllm_state(seen["setup"].engine.llm), **torch_state(),
               **python_state(), **gpu.between(*seen["span"])}
        rows.append(rec.record("step", **row))

    trainer.grpo_step, trainer.report_step = step, report
    try:
        with bs.fixed_lengths():
            trainer.train(cfg)
    finally:
        trainer.grpo_step, trainer.report_step = inner_step, inner_report
    return rows


def main() -> None:
    from timing import Recorder, add_out_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8",
                        help="the checkpoint Unsloth loads: the bench model as FP8-Block (the issue's) or bf16")
    parser.add_argument("--steps", type=int, default=15, help="GRPO steps to run (default: 15)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps left out of the trends, as the suite leaves them out (default: 2)")
    parser.add_argument("--share", type=float, default=None,
                        help="vLLM's share of the GPU (--vllm-gpu-memory-utilization; default: sized for the run)")
    parser.add_argument("--remove-lora", action="store_true",
                        help="remove the previous adapter from vLLM before each generate, as VLLMEngine does")
    parser.add_argument("--deep-gemm-warmup", action="store_true",
                        help="leave VLLM_DEEP_GEMM_WARMUP to vLLM (it compiles every shape at start-up) instead of "
                             "the suite's skip")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps}: run more steps than --warmup {args.warmup}, or no trend is left")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with unsloth and vLLM: pip install 'grpo[unsloth,vllm]'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built, the tokenizer is packaged (as the suite)
    if not args.deep_gemm_warmup:
        os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")  # the suite's setting (benchmarks/conftest.py)

    import bench_setup as bs

    arm = "-remove-lora" if args.remove_lora else ""
    arm += "-deep-gemm-warmup" if args.deep_gemm_warmup else ""
    rec = Recorder(f"unsloth_growth-{args.dtype}{arm}", args.out)
    root = Path(tempfile.mkdtemp(prefix="unsloth-growth-"))
    model_dir, prompts = model_dirs(root, args.dtype)
    cfg = bs.step_config(model_dir, prompts, bs.BENCH, fp8=False, steps=args.steps, output_dir=root / "run",
                         cuda=True, engine="unsloth", vllm_gpu_memory_utilization=args.share)
    rec.record("run", dtype=args.dtype, steps=args.steps, warmup=args.warmup, remove_lora=args.remove_lora,
               deep_gemm_warmup=os.environ.get("VLLM_DEEP_GEMM_WARMUP", "vLLM's default"), **bs.environment())
    gpu = GpuSampler()
    gpu.start()
    try:
        rows = run(cfg, rec, gpu, args.remove_lora)
    finally:
        gpu.stop()
    for trend in trends(rows, args.warmup):
        rec.record("trend", **trend)
    times = ", ".join(f"{r['step_time']:.2f}" for r in rows)
    rec.say(f"step times (s): {times}")


if __name__ == "__main__":
    main()
