"""The benchmark suite's switches and shared fixtures.

    pytest benchmarks/ --benchmark                       # everything, on a CUDA GPU
    pytest benchmarks/ --benchmark --bench-budget-s 300  # skip what would end past 300 s

Without `--benchmark` every benchmark is skipped (a plain `pytest` and CI stay fast); without CUDA they
skip with that reason; `--bench-smoke` runs the same code on a tiny model on any device, to check the
plumbing, and marks its results file as a smoke run. Each run writes
`benchmarks/results/<date>-<gpu>.json` (or into `--bench-results-dir`) after every benchmark, and
prints ours-over-TRL at the end. `python benchmarks/render.py` turns the results into RESULTS.md.

Benchmarks run in a fixed order (cheap ones first, the peer before the long config) so that a time
budget cuts the least informative ones. Nothing here touches the GPU before a benchmark asks for it.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub: the model is built, the tokenizer is packaged
# vLLM on an FP8-Block checkpoint JIT-compiles DeepGEMM kernels for every shape it might meet before serving
# (minutes, even for a small model); skipped, it compiles the few shapes a fixed-length
# step uses during the warm-up steps, which the steady-state figures leave out. Every engine alike.
os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")

_RESULTS = pytest.StashKey()
_START = pytest.StashKey()


def pytest_addoption(parser):
    group = parser.getgroup("grpo benchmarks", "the VRAM and step-latency suite in benchmarks/")
    group.addoption("--benchmark", action="store_true", default=False,
                    help="Run the benchmarks in benchmarks/ (they are skipped without it).")
    group.addoption("--bench-smoke", action="store_true", default=False,
                    help="Plumbing check: a tiny model and short lengths, on any device; results marked smoke.")
    group.addoption("--bench-budget-s", type=float, default=0.0,
                    help="Skip a benchmark when its estimated cost would end it past this many seconds "
                         "after the session started (0: no limit).")
    group.addoption("--bench-results-dir", default=str(HERE / "results"),
                    help="Where the results JSON goes (default: benchmarks/results).")
    group.addoption("--bench-join", default=None, metavar="PATH",
                    help="Add this process's results to the results file PATH (made by the first process that "
                         "names it): one suite run over the several processes that vLLM and Unsloth need.")
    group.addoption("--bench-steps", type=int, default=5, help="Optimizer steps per run at the bench config.")
    group.addoption("--bench-long-steps", type=int, default=3, help="Optimizer steps per run at the long config.")
    group.addoption("--bench-trl-steps", type=int, default=3, help="Optimizer steps of the TRL peer.")
    group.addoption("--bench-trl-long", action="store_true", default=False,
                    help="Also run TRL at the long config (about 70 s a step on an H200; otherwise quoted).")


def pytest_configure(config):
    config.addinivalue_line("markers", "bench_order(n): position of a benchmark in the run (low first)")
    config.addinivalue_line("markers", "bench_cost(seconds): estimated seconds on an H200, for --bench-budget-s")


def _ours(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def _skip_reason(config) -> str | None:
    if not config.getoption("--benchmark"):
        return "benchmarks run only with --benchmark (pytest benchmarks/ --benchmark)"
    if importlib.util.find_spec("pytest_benchmark") is None:
        return "needs pytest-benchmark: pip install pytest-benchmark"
    if config.getoption("--bench-smoke"):
        return None
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False); --bench-smoke runs a CPU plumbing check"
    return None


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if _ours(item)]
    if not mine:
        return
    reason = _skip_reason(config)
    if reason:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))

    def order(item) -> int:
        mark = item.get_closest_marker("bench_order")
        return mark.args[0] if mark else 1000

    others = [item for item in items if not _ours(item)]
    items[:] = others + sorted(mine, key=order)  # sorted() is stable: file order within a position


def pytest_sessionstart(session):
    session.config.stash[_START] = time.monotonic()


def pytest_runtest_setup(item):
    if not _ours(item):
        return
    budget = item.config.getoption("--bench-budget-s")
    mark = item.get_closest_marker("bench_cost")
    if budget and mark:
        elapsed = time.monotonic() - item.config.stash.get(_START, time.monotonic())
        if elapsed + mark.args[0] > budget:
            pytest.skip(f"--bench-budget-s {budget:.0f}: {elapsed:.0f} s spent, this one needs about "
                        f"{mark.args[0]} s")


# --------------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------------
class BenchEnv:
    """Settings of this session and the lazily built inputs: the model folder and the prompt files."""

    def __init__(self, config, root: Path):
        import bench_setup as bs

        self.config = config
        self.root = root
        self.smoke = config.getoption("--bench-smoke")
        import torch

        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.bench = bs.SMOKE_BENCH if self.smoke else bs.BENCH
        self.long = bs.SMOKE_LONG if self.smoke else bs.LONG
        self.scale = bs.SMOKE_SCALE if self.smoke else bs.SCALE  # rows -> Shape
        self.steps = 2 if self.smoke else config.getoption("--bench-steps")
        self.long_steps = 2 if self.smoke else config.getoption("--bench-long-steps")
        self.trl_steps = 2 if self.smoke else config.getoption("--bench-trl-steps")
        self._model_dir: Path | None = None
        self._prompts: dict[int, Path] = {}
        self._tokenizer = None

    def rounds(self, n: int) -> int:
        """Timed rounds of a benchmark: n, or 1 in a smoke run."""
        return 1 if self.smoke else n

    def shape(self, name: str):
        return {"bench": self.bench, "long": self.long, **{s.name: s for s in self.scale.values()}}[name]

    def model_dir(self) -> Path:
        import bench_setup as bs

        if self._model_dir is None:
            self._model_dir = bs.build_model_dir(self.root / "model", size="tiny" if self.smoke else "1b",
                                                 device=self.device)
        return self._model_dir

    def fp8_block_dir(self) -> Path:
        """The bench model written as an FP8-Block checkpoint (the seed's format), beside it, once."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grpo.config import LORA_TARGETS
        from grpo.model.fp8_checkpoint import save_fp8_block_checkpoint

        path = self.root / "model-fp8-block"
        if not (path / "config.json").is_file():
            model = AutoModelForCausalLM.from_pretrained(self.model_dir(), dtype=torch.bfloat16).to(self.device)
            partial = path.with_name(path.name + ".partial")
            save_fp8_block_checkpoint(model, partial, LORA_TARGETS)
            model.generation_config.save_pretrained(partial)
            AutoTokenizer.from_pretrained(self.model_dir()).save_pretrained(partial)
            del model
            partial.rename(path)
        return path

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir())
        return self._tokenizer

    def prompts(self, shape) -> Path:
        import bench_setup as bs

        if shape.prompt_len not in self._prompts:
            path = self.root / f"prompts-{shape.prompt_len}.jsonl"
            self._prompts[shape.prompt_len] = bs.write_prompts(path, self.tokenizer(), shape.prompt_len)
        return self._prompts[shape.prompt_len]


@pytest.fixture(scope="session")
def bench_env(request, tmp_path_factory) -> BenchEnv:
    return BenchEnv(request.config, tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="session")
def results(request):
    import bench_setup as bs

    config = request.config
    command = shlex.join(["pytest", *config.invocation_params.args])  # quoted as typed: -k "a or b"
    res = bs.Results(config.getoption("--bench-results-dir"), command, smoke=config.getoption("--bench-smoke"),
                     join=config.getoption("--bench-join"))
    config.stash[_RESULTS] = res
    return res


@pytest.fixture(autouse=True)
def _clean_memory(request):
    """Every benchmark starts with no leftovers of the previous one, so its peaks are its own."""
    if not _ours(request.node):
        yield
        return
    import bench_setup as bs

    bs.free_memory()
    yield
    bs.free_memory()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    res = config.stash.get(_RESULTS, None)
    if res is None or not res.records:
        return
    tr = terminalreporter
    tr.section("grpo benchmarks")
    tr.write_line(f"results: {res.path}")
    rows = res.step_rows()
    if rows:
        tr.write_line(f"{'config':<7} {'impl':<5} {'dtype':<5} {'step s':>8} {'peak alloc GiB':>15} "
                      f"{'peak reserved GiB':>18}")
        for r in rows:
            reserved = "-" if r["peak_reserved_gib"] is None else f"{r['peak_reserved_gib']:.2f}"
            star = "" if r["measured"] else "  (quoted)"
            tr.write_line(f"{r['config']:<7} {r['impl']:<5} {r['dtype']:<5} {r['step_time_s']:8.3f} "
                          f"{r['peak_alloc_gib']:15.2f} {reserved:>18}{star}")
    from bench_setup import comparisons, engine_comparisons

    for c in engine_comparisons(res.records):
        if c["time_ratio"] is None:
            continue
        used = "-" if c["gpu_used_ratio"] is None else f"{c['gpu_used_ratio']:.2f}"
        tr.write_line(f"{c['impl']} ({c['dtype']}) / {c['peer']} at bench: step time {c['time_ratio']:.3f}, "
                      f"nvidia-smi peak {used}")

    for c in comparisons(res.records):
        if c["time_ratio"] is None:
            continue
        tr.write_line(f"ours/TRL at {c['config']} ({c['dtype']}): step time {c['time_ratio']:.3f} "
                      f"({c['speedup']:.1f}x faster), peak allocated {c['memory_ratio']:.2f}"
                      f"{'' if c['trl_measured'] else ' (TRL quoted)'}")
