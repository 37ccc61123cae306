"""The benchmark suite and its probes on a CPU: the suite skips cleanly, its inputs are what it claims,
render.py renders, and the probes start and record.

The suite itself needs a CUDA GPU; here it must skip with a reason (without --benchmark, and without
CUDA), its fixed-length prompts must really be fixed-length, its steady-state summary and ours/TRL
ratios must be right, and render.py must turn a hand-written results file into RESULTS.md's section
and a PNG without touching anything outside its markers. The probes (benchmarks/probes/) are GPU
studies: here each must parse its command line, their shared timer must take a median and their
writer must keep every row on disk as it comes.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
PROBES = BENCH / "probes"


@pytest.fixture
def bench_modules(monkeypatch):
    """(bench_setup, render) imported from benchmarks/, as the suite and the script import them."""
    monkeypatch.syspath_prepend(str(BENCH))
    bs = importlib.import_module("bench_setup")
    render = importlib.import_module("render")
    return bs, render


def _pytest_benchmarks(tmp_path, *args, cuda_visible: str | None = None) -> subprocess.CompletedProcess:
    # A suite of its own: not an xdist worker, where pytest-benchmark would switch its timing off
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["HF_HUB_OFFLINE"] = "1"
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    # each benchmark loads the real tokenizer again: parsed once, as in this process (tests/tokenizer_once.py)
    cmd = [sys.executable, "-m", "pytest", "benchmarks/", "-q", "-rs", "-p", "no:cacheprovider", "-p",
           "tests.tokenizer_once", "--bench-results-dir", str(tmp_path / "results"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _counts(output: str) -> dict[str, int]:
    last = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", last)}


# The suite without --benchmark, then with it on a machine without CUDA: two pytest sessions of one process (the
# second reuses the first's imports), the GPU hidden between them (nothing in the suite asks for one before a
# benchmark runs). Each session's exit status and output, as JSON.
SKIPPED_TWICE = """
import contextlib, io, json, os, sys
import pytest
said = []
for name, extra in (("plain", []), ("no_cuda", ["--benchmark"])):
    if name == "no_cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(["benchmarks/", "-q", "-rs", "-p", "no:cacheprovider", "--bench-results-dir",
                            f"{sys.argv[1]}/{name}/results", *extra])
    said.append(dict(name=name, code=int(code), stdout=out.getvalue()))
print(json.dumps(said))
"""


@pytest.fixture(scope="session")  # once a worker, as smoke_run
def skipped_runs(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """The two sessions of SKIPPED_TWICE by name ("plain", "no_cuda"): (exit status, output, results folder)."""
    tmp_path = tmp_path_factory.mktemp("skipped")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # as _pytest_benchmarks
    proc = subprocess.run([sys.executable, "-c", SKIPPED_TWICE, str(tmp_path)], cwd=ROOT,
                          env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {s["name"]: (s["code"], s["stdout"], tmp_path / s["name"] / "results")
            for s in json.loads(proc.stdout.splitlines()[-1])}


@pytest.mark.xdist_group("skipped_runs")
@pytest.mark.parametrize("name,reason", [("plain", "benchmarks run only with --benchmark"),  # no --benchmark
                                         ("no_cuda", "needs a CUDA GPU")])  # --benchmark, no GPU
def test_benchmarks_are_all_skipped_with_a_reason_without_the_option_or_a_gpu(skipped_runs, name, reason):
    code, stdout, results = skipped_runs[name]
    assert code == 0, stdout
    counts = _counts(stdout)
    assert set(counts) == {"skipped"} and counts["skipped"] >= 15, stdout
    assert reason in stdout
    assert not results.exists()  # nothing measured, nothing written


def test_fixed_length_prompts_are_exactly_the_requested_length_for_us_and_for_trl(llama_tokenizer, tmp_path,
                                                                                     bench_modules):
    from grpo.data import build_prompts, load_jsonl

    bs, _ = bench_modules
    for length in (128, 288):
        path = bs.write_prompts(tmp_path / f"p{length}.jsonl", llama_tokenizer, length, n=6)
        examples = load_jsonl(path)
        prompts = build_prompts(llama_tokenizer, examples, length)
        assert prompts.dropped == 0
        assert [len(ids) for ids in prompts.prompt_ids] == [length] * 6
        assert len({e.question for e in examples}) == 6
        for e in examples:  # "What is a plus b?" with its sum as the answer
            a, b = map(int, re.search(r"What is (\d+) plus (\d+)\?", e.question).groups())
            assert e.answer == str(a + b)
        # TRL prepends BOS itself: the text it gets must give the very same ids.
        shape = bs.Shape("x", 2, 2, length, 8)
        rows = bs.trl_dataset_rows(llama_tokenizer, path, shape)
        assert [llama_tokenizer(r["prompt"])["input_ids"] for r in rows] == prompts.prompt_ids
    with pytest.raises(ValueError, match="chat template alone"):
        bs.write_prompts(tmp_path / "short.jsonl", llama_tokenizer, 20, n=1)


def test_step_config_is_the_recipe_at_fixed_lengths(bench_modules, tmp_path):
    bs, _ = bench_modules
    cfg = bs.step_config("m", "d.jsonl", bs.LONG, fp8=True, steps=3, output_dir=tmp_path)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.use_rslora, cfg.beta, cfg.optim) == (32, 64, True, 0.04, "adamw_8bit")
    assert set(cfg.lora_targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert cfg.gradient_checkpointing and cfg.load_in_fp8 and cfg.engine == "native"
    assert (cfg.max_prompt_length, cfg.max_completion_length, cfg.max_seq_length) == (288, 1760, 2048)
    assert cfg.batch_size == 16 and cfg.dtype == "bf16"


def test_summarize_steps_takes_medians_after_the_warmup_steps(bench_modules):
    bs, _ = bench_modules
    times = [9.0, 4.0, 1.0, 2.0, 1.5]
    records = [{"step": i + 1, "step_time": t, "time/generate": t / 2, "time/train": t / 4, "peak_mem_gib": 3.0 + i,
                "completion_length": 512.0, "skipped": False, "gap/logp_abs_mean": t / 100} for i, t in enumerate(times)]
    s = bs.summarize_steps(records, warmup=2, rows=16)
    assert s["step_time_s"] == 1.5 and s["steady_steps"] == 3 and s["steps"] == 5
    assert s["phases_s"] == {"generate": 0.75, "train": 0.375}
    assert s["other_s"] == pytest.approx(1.5 - 0.75 - 0.375)
    assert s["peak_alloc_gib"] == 7.0  # the largest steady peak, not the median
    assert s["gap"] == {"logp_abs_mean": 0.015}
    assert s["completion_tokens_per_s"] == pytest.approx(16 * 512 / 1.5)
    assert bs.summarize_steps(records[:1], warmup=2)["step_time_s"] == 9.0  # too few steps: the last one
    assert "step_gc_s" not in s  # records of a trainer that logged no gc_time
    with_gc = bs.summarize_steps([{**r, "gc_time": t / 10} for r, t in zip(records, times)], warmup=2)
    assert with_gc["step_gc_s"] == [0.9, 0.4, 0.1, 0.2, 0.15] and with_gc["step_time_s"] == 1.5
    with pytest.raises(ValueError, match="no step records"):
        bs.summarize_steps([], warmup=1)


def _step(config, impl, dtype, t, mem, reserved=None, phases=None, baseline=0.0):
    return {"name": f"test[{config}-{impl}-{dtype}]", "group": "step", "config": config, "impl": impl, "dtype": dtype,
            "measured": True, "timing_s": {"median": 10 * t, "rounds": 1},
            "extra_info": {"step_time_s": t, "peak_alloc_gib": mem, "peak_reserved_gib": reserved,
                           "baseline_alloc_gib": baseline,
                           "phases_s": phases or {}, "other_s": 0.01, "completion_tokens_per_s": 16 * 512 / t,
                           "shape": {"name": config, "prompts": 4, "generations": 4, "prompt_len": 128,
                                     "completion_len": 512}}}


def test_comparisons_divide_ours_by_trl_and_fall_back_to_the_quoted_figures(bench_modules):
    bs, _ = bench_modules
    records = [_step("bench", "ours", "bf16", 1.46, 2.27), _step("long", "ours", "fp8", 6.76, 4.775)]
    comps = {(c["config"], c["dtype"]): c for c in bs.comparisons(records)}
    assert comps[("bench", "bf16")]["time_ratio"] == pytest.approx(1.46 / 14.6)
    assert comps[("bench", "bf16")]["speedup"] == pytest.approx(10.0)
    assert comps[("bench", "bf16")]["memory_ratio"] == pytest.approx(0.5)
    assert comps[("long", "fp8")]["time_ratio"] == pytest.approx(0.1) and not comps[("long", "fp8")]["trl_measured"]
    measured = records + [_step("bench", "trl", "bf16", 2.92, 4.54)]
    comp = next(c for c in bs.comparisons(measured) if c["config"] == "bench")
    assert comp["time_ratio"] == pytest.approx(0.5) and comp["trl_measured"]  # measured beats quoted
    # a run that started with memory held by an earlier one is charged only its own
    held = [_step("bench", "ours", "bf16", 1.46, 3.27, baseline=1.0)]
    assert bs.comparisons(held)[0]["memory_ratio"] == pytest.approx(2.27 / 4.54)


class _Bench:
    """What Results.add reads of pytest-benchmark's fixture."""

    def __init__(self, record):
        self.name, self.extra_info, self.stats = record["name"], record["extra_info"], None


def _used(record, gib):
    record["extra_info"]["peak_gpu_used_gib"] = gib
    return record


def test_the_processes_of_one_suite_run_add_to_one_file_and_ours_compare_with_unsloths_grpo(bench_modules,
                                                                                            tmp_path):
    bs, _ = bench_modules
    joined = tmp_path / "peers.json"
    runs = [[_used(_step("bench", "ours", "bf16", 1.5, 5.6), 6.0), _used(_step("bench", "ours", "fp8", 1.4, 4.6), 5.0)],
            [_used(_step("bench", "ours-vllm", "bf16", 2.8, 5.2), 56.0)],
            [_used(_step("bench", "unsloth-grpo", "fp8", 4.0, 60.0), 70.0)]]
    for command, records in zip(("native", "vllm", "unsloth"), runs):  # one pytest process each
        res = bs.Results(tmp_path / "elsewhere", command, join=joined)
        for rec in records:
            res.add(_Bench(rec), group="step", config="bench", impl=rec["impl"], dtype=rec["dtype"])
    data = json.loads(joined.read_text())
    assert data["command"] == "native" and [j["command"] for j in data["joined"]] == ["vllm", "unsloth"]
    assert [(r["impl"], r["process"]) for r in data["records"]] == [("ours", 0), ("ours", 0), ("ours-vllm", 1),
                                                                    ("unsloth-grpo", 2)]
    assert not (tmp_path / "elsewhere").exists()
    comps = {(c["impl"], c["dtype"]): c for c in data["engine_comparisons"]}
    assert set(comps) == {("ours", "bf16"), ("ours", "fp8"), ("ours-vllm", "bf16")}
    assert comps[("ours-vllm", "bf16")]["time_ratio"] == pytest.approx(0.7)
    assert comps[("ours-vllm", "bf16")]["gpu_used_ratio"] == pytest.approx(0.8)
    assert comps[("ours", "fp8")]["peer"] == "unsloth-grpo"
    assert bs.engine_comparisons(runs[0]) == []  # no peer measured: nothing to compare with


def test_the_steady_summary_carries_vllms_pool_apart_from_the_trainers_peak(bench_modules):
    bs, _ = bench_modules
    records = [{"step": i, "step_time": 2.0, "peak_mem_gib": 5.0 + i, "engine_pool_gib": 49.0,
                "completion_length": 512.0, "time/generate": 1.0} for i in range(1, 4)]
    summary = bs.summarize_steps(records, warmup=1)
    assert summary["peak_alloc_gib"] == 8.0 and summary["engine_pool_gib"] == 49.0
    assert "engine_pool_gib" not in bs.summarize_steps([{k: v for k, v in r.items() if k != "engine_pool_gib"}
                                                        for r in records], warmup=1)


def _fake_run(date="2026-11-29"):
    phases = {"generate": 0.5, "reference": 0.05, "old_logprobs": 0.0, "train": 0.25}
    return {
        "date": date, "gpu": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8, "smoke": False,
        "versions": {"torch": "2.11.0", "cuda": "13.0", "transformers": "5.17.0", "peft": "0.21.0", "trl": "1.16.0"},
        "command": "pytest benchmarks/ --benchmark",
        "records": [
            _step("bench", "ours", "bf16", 0.8, 3.0, 4.0, phases),
            _step("bench", "ours", "fp8", 0.9, 3.0, 3.5, phases, baseline=0.5),  # 2.5 GiB of its own
            _step("bench", "trl", "bf16", 14.0, 4.5, 6.0),
            _step("long", "ours", "fp8", 5.0, 5.5, 7.0, phases),
            {"name": "test_adamw", "group": "kernel", "config": "adamw_8bit", "impl": "ours", "dtype": "fp32",
             "measured": True, "timing_s": {"median": 0.05}, "extra_info": {"params": 22544384,
                                                                           "achieved_gb_per_s": 180.4}},
            {"name": "test_gen", "group": "decode", "config": "bench", "impl": "ours", "dtype": "bf16",
             "measured": True, "timing_s": {"median": 1.9},
             "extra_info": {"decode_ms_per_step": 3.456, "prefill_ms": 12.3, "capture_ms": 80.0,
                            "tokens_per_s": 4741.0, "achieved_gb_per_s": 912.0}},
        ],
    }


OTHERS = ("# Benchmark results\n\n## Kernels\n\nFP8Linear | 1.23 ms\n\n"
          "## Native engine\n\ndecode 3.1 ms/step\n")


def test_render_writes_only_its_own_section_and_the_chart(bench_modules, tmp_path):
    _, render = bench_modules
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-11-29-h200.json").write_text(json.dumps(_fake_run()))
    smoke = {**_fake_run("2026-12-01"), "smoke": True, "gpu": "cpu"}
    (results / "2026-12-01-cpu-smoke.json").write_text(json.dumps(smoke))  # ignored
    md, png = tmp_path / "RESULTS.md", tmp_path / "step_time.png"
    md.write_text(OTHERS)
    args = ["--results", str(results), "--markdown", str(md), "--chart", str(png)]
    assert render.main(args) == 0

    text = md.read_text()
    assert text.startswith(OTHERS.rstrip("\n"))  # the others' sections, byte for byte
    section = text.split(render.HEADING, 1)[1]
    assert section.count(render.BEGIN) == 1 and section.count(render.END) == 1
    assert "**2026-11-29**, NVIDIA H200" in section and "2026-12-01" not in section
    assert "torch 2.11.0 (CUDA 13.0)" in section and "trl 1.16.0" in section
    assert "`pytest benchmarks/ --benchmark`" in section
    assert "| bench | ours | bf16 | 0.80 | 3.00 | 4.00 | 10240 | 0.057 (17.5x faster) | 0.67 |" in section
    assert "| bench | ours | fp8 | 0.90 | 2.50 | 3.50 |" in section  # peak less the baseline
    assert "| bench | TRL | bf16 | 14.00 | 4.50 | 6.00 |" in section
    assert "| bench | TRL (quoted)* | bf16 | 14.60 | 4.54 |" in section  # beside the measured one
    assert "| long | TRL (quoted)* | bf16 | 67.60 | 9.55 | 14.10 |" in section
    # goals: met, and missed by how much
    assert "| step time (bench, bf16) | <= 1.0 s | 0.80 s | yes |" in section
    assert "| faster than TRL (bench, bf16) | >= 14x | 17.5x | yes |" in section
    assert "| step time (long, fp8) | <= 4 s | 5.00 s | **no**: missed by 1.00 s (25% over) |" in section
    assert "| FP8 no slower than bf16 (bench) | <= 0.80 s | 0.90 s | **no**: missed by 0.10 s (12% over) |" in section
    # per-phase breakdown, with the optimizer taken out of the train phase
    assert "| bench | bf16 | 0.80 | 0.50 | 0.05 | 0.00 | 0.20 | 0.0500 | 0.01 |" in section  # 0.25 - 0.05
    assert "decode 3.46 ms/step, prefill 12.3 ms, capture 80 ms, 4741 tok/s, 912 GB/s" in section
    assert "| adamw_8bit fp32 (params=22544384) | 50.000 ms | 180 GB/s |" in section
    assert "![Step time and peak allocated memory by config](step_time.png)" in section

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (1100, 462)

    # hand-written notes under the heading survive, and a second render changes nothing
    md.write_text(text + "\n### Notes\n\nwritten by hand\n")
    before = md.read_text()
    render.main(args)
    assert md.read_text() == before


def test_render_sets_each_engine_beside_unsloths_grpo_with_gpu_memory_and_pool(bench_modules, tmp_path):
    bs, render = bench_modules
    run = _fake_run()
    for rec in run["records"]:
        rec["extra_info"]["peak_gpu_used_gib"] = 4.0
    vllm = _step("bench", "ours-vllm", "bf16", 2.0, 5.0, 6.0, {"generate": 1.5, "generate/generate": 1.3, "train": 0.4})
    vllm["extra_info"].update(peak_gpu_used_gib=10.0, engine_pool_gib=6.5)
    peer = _step("bench", bs.ENGINE_PEER, "fp8", 4.0, 40.0, 45.0)
    peer["extra_info"]["peak_gpu_used_gib"] = 50.0
    run["records"] += [vllm, peer]
    run["joined"] = [{"command": "pytest -k unsloth_grpo", "versions": {"unsloth": "2026.10.9", "trl": "1.15.0"}}]
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-12-02-h200.json").write_text(json.dumps(run))
    md = tmp_path / "RESULTS.md"
    render.main(["--results", str(results), "--markdown", str(md), "--chart", str(tmp_path / "c.png")])
    section = md.read_text().split(render.BEGIN, 1)[1]
    assert "Commands: `pytest benchmarks/ --benchmark`, then `pytest -k unsloth_grpo` (unsloth 2026.10.9, trl 1.15.0)" \
        in section
    assert "| bench | ours, --engine vllm | bf16 | 2.00 | 5.00 | 6.00 |" in section  # named, not taken for TRL
    assert "| bench | Unsloth's GRPO | fp8 | 4.00 | 40.00 | 45.00 |" in section
    engines = section.split("### The engines against Unsloth's GRPO", 1)[1]
    assert "| ours | bf16 | 0.80 | 0.50 |  | 0.25 | 4.00 |  | 0.20 | 0.08 |" in engines
    assert "| ours, --engine vllm | bf16 | 2.00 | 1.50 | 1.30 | 0.40 | 10.00 | 6.50 | 0.50 | 0.20 |" in engines
    assert "| Unsloth's GRPO | fp8 | 4.00 |  |  |  | 50.00 |  |  |  |" in engines
    assert "| TRL | bf16 | 14.00 |  |  |  | 4.00 |  |  |  |" in engines  # every peer measured at bench
    assert "| ours | fp8 | 5.00 |" not in engines  # the long config's row stays out


def test_render_puts_the_markers_under_an_existing_heading_and_lists_earlier_runs(bench_modules, tmp_path):
    _, render = bench_modules
    results = tmp_path / "results"
    results.mkdir()
    old = _fake_run("2026-11-01")
    old["records"][0]["extra_info"]["step_time_s"] = 2.5
    (results / "2026-11-01-h200.json").write_text(json.dumps(old))
    (results / "2026-11-29-h200.json").write_text(json.dumps(_fake_run()))
    md = tmp_path / "RESULTS.md"
    md.write_text(OTHERS + "\n" + render.HEADING + "\n\nnotes kept\n")
    render.main(["--results", str(results), "--markdown", str(md), "--chart", str(tmp_path / "c.png")])
    text = md.read_text()
    assert text.count(render.HEADING) == 1
    head, tail = text.split(render.END)
    assert "notes kept" in tail and render.BEGIN in head
    assert "**2026-11-29**" in text
    assert "| 2026-11-01 | NVIDIA H200 | bench | ours | bf16 | 2.50 | 3.00 | 2026-11-01-h200.json |" in text


@pytest.fixture(scope="session")  # not module: xdist interleaves modules on a worker, and each return re-ran it
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One --bench-smoke run of the suite on the CPU for the tests below (a run pays a minute of imports
    and set-up): (the process, its results file)."""
    pytest.importorskip("bitsandbytes")
    tmp_path = tmp_path_factory.mktemp("smoke")
    selection = ("(bench_config and bf16) or (token_logprobs and forward_backward) or adamw or native_sampler "
                 "or more_rows or episodes_at")
    proc = _pytest_benchmarks(tmp_path, "--benchmark", "--bench-smoke", "-k", selection, cuda_visible="")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*-smoke.json")
    return proc, json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("smoke_run")
def test_the_suite_runs_end_to_end_on_a_tiny_model_in_smoke_mode(smoke_run):
    """--bench-smoke on the CPU: the real trainer, the native engine and the kernels, tiny sizes."""
    proc, data = smoke_run
    assert data["smoke"] is True and data["gpu"] == "cpu"
    groups = sorted((r["group"], r["config"], r["dtype"]) for r in data["records"]
                    if not r["config"].startswith("rows"))  # (the scale benchmarks: the test below)
    assert groups == [("decode", "bench", "bf16"), ("kernel", "adamw_8bit", "fp32"),
                      ("kernel", "token_logprobs", "forward_backward"), ("step", "bench", "bf16")]
    step = next(r for r in data["records"] if r["group"] == "step" and r["config"] == "bench")
    info = step["extra_info"]
    assert info["steps"] == 2 and info["completion_length"] == 6 and info["step_time_s"] > 0
    assert {"generate", "reference", "old_logprobs", "train"} <= set(info["phases_s"])
    assert step["timing_s"]["rounds"] == 1
    (comp,) = data["comparisons"]
    assert comp["config"] == "bench" and not comp["trl_measured"]
    assert comp["time_ratio"] == pytest.approx(info["step_time_s"] / 14.6)
    assert "ours/TRL at bench (bf16)" in proc.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("smoke_run")
def test_the_sampler_sweep_and_the_step_at_more_rows_run_in_smoke_mode(smoke_run):
    """The scale benchmarks on the CPU: ours at three sizes with the adapter on and off, the step at two."""
    records = smoke_run[1]["records"]
    sampler = {(r["config"], r["impl"]): r["extra_info"] for r in records if r["group"] == "sampler"}
    assert set(sampler) == {(c, i) for c in ("rows16", "rows64", "rows256") for i in ("ours", "ours-no-adapter")}
    assert [sampler[(c, "ours")]["rows"] for c in ("rows16", "rows64", "rows256")] == [4, 8, 16]
    for info in sampler.values():
        steps_s = info["ms_per_token_step"] * info["shape"]["completion_len"] / 1e3
        assert info["tokens_per_s"] == pytest.approx(info["rows"] * info["shape"]["completion_len"] / steps_s)
        assert 0 < info["decode_ms_per_step"] <= info["ms_per_token_step"]
    steps = sorted(r["config"] for r in records if r["group"] == "step")
    assert steps == ["bench", "rows256", "rows64"]


@pytest.mark.slow
@pytest.mark.xdist_group("smoke_run")
def test_the_episodes_benchmark_runs_in_smoke_mode_beside_single_turn(smoke_run):
    """Episodes in place, in blocks of 2, 4 and 8 steps, and resent, each with its model tokens per second and its
    share of the single-turn figure measured in the same run."""
    records = [r for r in smoke_run[1]["records"] if r["group"] == "episodes"]
    assert sorted(r["impl"] for r in records) == ["in-place", "in-place-block4", "in-place-block8", "resent"]
    single = {r["extra_info"]["single_turn_tokens_per_s"] for r in records}
    assert len(single) == 1 and single.pop() > 0
    for r in records:
        info = r["extra_info"]
        assert 0 < info["model_tokens"] <= info["rows"] * info["shape"]["completion_len"]
        assert info["of_single_turn"] == pytest.approx(info["tokens_per_s"] / info["single_turn_tokens_per_s"])
    in_place = next(r["extra_info"] for r in records if r["impl"] == "in-place")
    assert in_place["phases_s"]["decode"] > 0 and in_place["turn_block"] == 2
    assert next(r["extra_info"] for r in records if r["impl"] == "in-place-block8")["turn_block"] == 8


def test_a_second_run_on_the_same_day_gets_its_own_file_and_renders_as_the_latest(bench_modules, tmp_path):
    bs, render = bench_modules
    first = bs.Results(tmp_path, "first")
    first.meta["started"] = "2026-11-29T10:00:00"
    first.write()
    second = bs.Results(tmp_path, "second")
    second.meta["started"] = "2026-11-29T12:00:00"
    second.write()
    assert first.path != second.path and first.path.exists() and second.path.exists()
    assert [r["command"] for r in render.load_runs(tmp_path)] == ["first", "second"]


SCRIPT_PROBES = ["native_engine", "decode_gemm_tiles", "decode_gemm_sass", "train_pass", "engine_sampling",
                 "step_profile", "fp8_host", "attention_tiles", "turn_blocks", "gguf_ways", "unsloth_growth",
                 "train_ops", "overlap", "train_graph"]
# Each probe run as a script (its folder first on the path, as `python probe.py` puts it) with --help, in one
# process: a process a probe spent its seconds importing torch ten times over.
HELP_EACH = """
import contextlib, io, json, runpy, sys, traceback
folder, names, path, said = sys.argv[1], sys.argv[2:], list(sys.path), {}
for name in names:
    sys.path[:] = [folder, *path]
    sys.argv, out, err, code = [name + ".py", "--help"], io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(f"{folder}/{name}.py", run_name="__main__")
        except SystemExit as e:
            code = e.code
        except Exception:
            traceback.print_exc()  # into err: the test shows it
            code = "raised"
    said[name] = dict(code=code, stdout=out.getvalue(), stderr=err.getvalue())
print(json.dumps(said))
"""


@pytest.fixture(scope="session")  # once a worker, as smoke_run
def probes_help() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", HELP_EACH, str(PROBES), *SCRIPT_PROBES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.xdist_group("probes_help")
@pytest.mark.parametrize("probe", SCRIPT_PROBES)
def test_every_probe_parses_its_command_line_as_a_script(probes_help, probe):
    said = probes_help[probe]
    assert said["code"] == 0, said["stderr"][-2000:]
    assert said["stdout"].startswith(f"usage: {probe}.py")


def test_the_train_pass_probe_gives_each_pass_new_widths_and_runs_the_trainers_update(monkeypatch):
    # What the probe prices on the GPU: passes whose micro-batches have widths no earlier pass had (as in a
    # run), and the trainer's own update in place of the bare pass.
    import torch

    from grpo.batch import micro_batches

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("train_pass")
    cpu = torch.device("cpu")
    assert probe.step_lengths(0) == (probe.QWEN_PROMPTS[::probe.GENERATIONS], probe.QWEN_COMPLETIONS)
    policy, vocab, cfg = probe.build_policy(True, "base", False, cpu)
    adv = torch.linspace(-1, 1, len(probe.QWEN_COMPLETIONS))

    def cut(seed):
        return micro_batches(probe.qwen_batch(vocab, cpu, 1.0, seed), adv, 16)

    def widths(seed):
        batch, _, slices = cut(seed)
        return tuple(batch.rows(sl).input_ids.shape[1] for sl in slices)

    assert len({widths(seed) for seed in range(4)}) == 4
    for seed in (1, 2):
        prompts, completions = probe.step_lengths(seed)
        assert all(1 <= n <= probe.MAX_PROMPT_LENGTH for n in prompts)
        assert all(1 <= n <= probe.MAX_COMPLETION_LENGTH for n in completions)
    batch, step_adv, slices = cut(1)
    lora_b = [p for n, p in policy.named_parameters() if "lora_B" in n]
    before = [p.detach().clone() for p in lora_b]
    probe.trainer_update(policy, cfg, cpu)(batch, step_adv, slices)
    assert any(not torch.equal(b, p) for b, p in zip(before, lora_b))


def test_the_train_graph_probes_pass_is_the_trainers_with_the_counted_positions_made_before(monkeypatch):
    # What the probe captures on the GPU: zeroed gradients, then the loss's forward and backward, whose gradients
    # are the plain pass's (the counted positions handed in rather than found at each call), and again the same
    import torch

    from grpo.batch import sequence_logprobs
    from grpo.loss import clipped_surrogate

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("train_graph")
    cpu = torch.device("cpu")
    policy, cfg = probe.bench_policy(True, False, cpu)
    batch = probe.bench_batch(probe.bs.SMOKE_BENCH, policy.config.vocab_size, cpu)
    params = [p for p in policy.parameters() if p.requires_grad]
    adv = torch.linspace(-1, 1, len(batch))
    ref_logp = torch.full(batch.mask.shape, -12.0)
    logp = sequence_logprobs(policy, batch, 1.0)
    loss, _ = clipped_surrogate(logp, logp.detach(), adv, batch.mask, ref_logp=ref_logp, beta=0.04,
                                max_completion_length=batch.completion_ids.shape[1])
    want = torch.autograd.grad(loss, params)
    for p in params:
        p.grad = torch.full_like(p, 7.0)  # what the pass must zero
    with probe.counted_made_before(batch):
        for _ in range(2):
            got = probe.one_pass(policy, cfg, batch, adv, ref_logp, params)
            assert torch.equal(got, loss.detach())
            assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    assert any(w.abs().sum() > 0 for w in want)


@pytest.mark.slow
def test_the_train_pass_probe_times_new_widths_on_a_tiny_model(tmp_path, monkeypatch):
    # every variant at once (the trainer's update, bucketed widths, torch's attention backends), in this process
    # (a new one pays seconds of imports)
    monkeypatch.syspath_prepend(str(PROBES))
    monkeypatch.setattr(sys, "argv", ["train_pass.py", "--smoke", "--micro", "64", "16", "--repeats", "1", "--vary",
                                      "--trainer", "--bucket", "8", "--sdpa", "torch", "--out", str(tmp_path)])
    importlib.import_module("train_pass").main()
    (path,) = tmp_path.glob("train_pass-*.jsonl")
    batch, *passes = [json.loads(line) for line in path.read_text().splitlines()]
    assert batch["vary"] and not batch["timed"]
    assert [(r["micro"], r["passes"]) for r in passes] == [(64, 1), (16, 4)]
    assert all(r["ms"] > 0 and 0 < r["real_token_frac"] <= 1 for r in passes)
    assert passes[1]["real_token_frac"] > passes[0]["real_token_frac"]  # sorted micro-batches pad less


def test_the_overlap_probe_times_the_decode_and_the_update_apart_and_together_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PROBES))  # in this process: a new one pays seconds of imports
    monkeypatch.setattr(sys, "argv", ["overlap.py", "--smoke", "--stop", "--repeats", "2", "--profile",
                                      "--out", str(tmp_path)])
    importlib.import_module("overlap").main()
    (path,) = tmp_path.glob("overlap-*.jsonl")
    assert json.loads(path.with_suffix(".trace.json").read_text())["traceEvents"]  # a CPU trace: no stream rows
    setup, *runs, median = [json.loads(line) for line in path.read_text().splitlines()]  # plumbing: all were timed
    assert setup["stop"] and [r["kind"] for r in runs] == ["run", "run"] and median["kind"] == "median"
    keys = ("sample", "train", "together", "sample_in_together", "train_in_together")
    assert all(r[k] > 0 for r in [*runs, median] for k in keys)


def test_the_overlap_probe_reads_each_streams_kernels_busy_time_and_gaps_from_a_trace(monkeypatch):
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("overlap")

    def kernel(stream, ts, dur, name="gemm"):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {"traceEvents": [kernel(7, 0, 10), kernel(7, 5, 10), kernel(7, 115, 5),  # overlap, then a 100 us gap
                             kernel(9, 50, 30, "decode"), kernel(9, 90, 30, "decode"),
                             {"cat": "cpu_op", "ts": 0, "dur": 999}]}
    got = probe.stream_kernels(trace, gap_us=20)
    assert got == {7: dict(kernels=3, busy_us=20, span_us=120, gaps=1, gap_us=100, most="gemm"),
                   9: dict(kernels=2, busy_us=60, span_us=70, gaps=0, gap_us=0, most="decode")}


def test_the_tile_probe_sweeps_the_keys_the_decode_kernels_read(monkeypatch):
    # The sweep puts each config in force with dg.tuning(tiles={tile_key: cfg}); a key the kernels do not
    # look up would time the device's tiles over and over and report them as the sweep's.
    import torch

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("decode_gemm_tiles")
    from grpo.kernels import decode_gemm as dg

    swept, cpu = dg.TileConfig(16, 128, 2, 2), torch.device("cpu")
    for name in probe.GROUPS:
        for fmt in probe.FORMATS:
            key = probe.tile_key(name, fmt)
            untouched = dg.tile_config(key, 16, cpu)
            with dg.tuning(tiles={key: swept}):
                assert dg.tile_config(key, 16, cpu) == dg.tile_config(key, 64, cpu) == swept
            assert dg.tile_config(key, 16, cpu) == untouched


def test_the_tile_probes_table_run_sweeps_every_entry_of_the_tuned_table(monkeypatch):
    # --write-table rewrites what it sweeps and keeps the rest: a tuned entry it does not sweep would go stale
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("decode_gemm_tiles")
    from grpo.kernels import tiles

    table = tiles.table_for((9, 0), 132)
    swept = {(rows, probe.tile_key(name, fmt)) for rows, name, fmt in probe.PRODUCT_SWEEPS}
    assert swept == {(rows, key) for rows, section in table.gemm.items() for key in section}
    for _, name, fmt in probe.PRODUCT_SWEEPS:  # every config swept is one the kernels take
        kind, fp8 = probe.GROUPS[name][0], probe.FORMATS[fmt][0]
        assert all(tiles.tile_problem(kind, fp8, cfg) is None for cfg in probe.configs(kind, fmt))


def test_the_attention_tiles_probe_writes_the_launch_nearest_each_row_counts_best(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("attention_tiles")
    from grpo.kernels import tiles

    steady, fast_few, fast_many = (tiles.AttentionTiles(), tiles.AttentionTiles(block_s=32),
                                   tiles.AttentionTiles(programs_per_sm=4))
    timings = {16: {steady: 10.5, fast_few: 10.0, fast_many: 30.0},
               256: {steady: 52.0, fast_few: 80.0, fast_many: 50.0, tiles.AttentionTiles(stages=1): 40.0}}
    chosen = probe.pick(timings)  # the stages=1 launch ran at one row count only
    assert chosen == steady and probe.pick({}) is None
    path = tmp_path / "sm90-132sm.json"
    tiles.write_table(path, attention=chosen)
    assert tiles.table_for((9, 0), 132, folder=tmp_path).attention == steady


def test_the_engine_probe_gives_gemm_to_the_engine_and_every_other_knob_to_its_tuning(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("native_engine")
    cfg = LlamaConfig(vocab_size=probe.PAD + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = LlamaForCausalLM(cfg).eval()
    engine = probe.make_engine(model, max_batch=2, max_seq_len=16, use_cuda_graph=False, attention="sdpa",
                               check_every=4)
    assert engine.gemm == "modules" and engine.max_batch == 2 and engine.max_seq_len == 16
    assert (engine.tuning.attention, engine.tuning.check_every, engine.tuning.compile) == ("sdpa", 4, None)
    assert engine.tuning.streams is False  # the plain step unless a variant asks for streams
    with pytest.raises(ValueError, match="kernel_rows"):
        probe.make_engine(model, kernel_rows=probe.decode_gemm.MAX_ROWS + 1)


def test_the_engine_probes_qwen_plan_is_the_packaged_qwen_on_the_products_engine(monkeypatch):
    import inspect
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from grpo.rollout.native import EngineTuning

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("native_engine")
    with torch.device("meta"):
        qwen = AutoModelForCausalLM.from_config(probe.qwen_1_5b_config())
    assert sum(p.numel() for p in qwen.parameters()) == 1_777_088_000  # the trainer's count for the packaged model
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    tiny = Qwen2ForCausalLM(Qwen2Config(vocab_size=probe.PAD + 1, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    engine = probe.make_engine(tiny, max_batch=2, max_seq_len=16, use_cuda_graph=False, **probe.product_engine_kw())
    assert probe.product_engine_kw()["gemm"] == inspect.signature(probe.NativeEngine).parameters["gemm"].default
    assert engine.tuning == replace(EngineTuning(), use_cuda_graph=False).resolved(torch.device("cpu"), True, 2)


def test_probe_timer_takes_the_median_and_the_recorder_keeps_rows_on_disk_as_they_come(monkeypatch, tmp_path):
    import time

    import torch

    monkeypatch.syspath_prepend(str(PROBES))
    timing = importlib.import_module("timing")
    sleeps = iter([0.0, 0.6, 0.001, 0.001, 0.001, 0.001])  # one warm-up, then one slow run among five

    assert timing.median_ms(lambda: time.sleep(next(sleeps)), warmup=1, iters=5) < 50  # the mean is 120

    rec = timing.Recorder("probe", tmp_path / "out")
    rec.record("engine", variant="bf16", ms=torch.tensor(1.25))
    first = json.loads(rec.path.read_text())  # on disk before the run ends, tensors as numbers
    assert first["kind"] == "engine" and first["ms"] == 1.25 and first["t"] >= 0
    rec.record("error", variant="fp8", error="boom")
    rec.say("a table")
    assert [r["variant"] for r in rec.of_kind("engine")] == ["bf16"]
    assert [json.loads(line)["kind"] for line in rec.path.read_text().splitlines()] == ["engine", "error"]
    assert rec.log_path.read_text() == "a table\n" and rec.path.parent == tmp_path / "out"
    assert rec.path.name.startswith("probe-") and rec.path.suffix == ".jsonl"


def test_the_unsloth_benchmarks_skip_without_importing_unsloth(monkeypatch, tmp_path):
    """Importing unsloth turns the CUDA allocator's expandable segments on unless UNSLOTH_VLLM_STANDBY is
    set, and standby then refuses to start (H200, 2026-12-02): only the loaders, after setting it, import it."""
    fake = tmp_path / "installed" / "unsloth"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('unsloth imported by the suite itself')\n")
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(tmp_path / "installed"))
    step = importlib.import_module("test_bench_step")
    step._skip_without_unsloth()  # installed: runs on, and unsloth is not imported
    assert "unsloth" not in sys.modules

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # not installed
    with pytest.raises(pytest.skip.Exception, match="needs unsloth"):
        step._skip_without_unsloth()


def test_the_engine_probes_plans_name_only_steps_it_runs_and_its_families_name_our_kernels(monkeypatch):
    # A plan naming a step no code runs would run nothing and say nothing; a kernel of ours filed under
    # "elementwise/other" would hide where a token step's time goes.
    import re

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("native_engine")
    source = (PROBES / "native_engine.py").read_text()
    named = set(re.findall(r'step\(\s*"(\w+)"', source))  # step("name", ...), and the steps named in loops:
    named |= set(re.findall(r'\("(\w+)", ', re.search(r"for name, kw in \((.*?)\):", source, re.S).group(1)))
    named |= {f"compile_{a}" for a in ("sdpa", "kernel")}
    named |= {f"{name}{part}" for name, *_ in probe.WIDE_STEPS for part in ("", "_graph")}
    named |= {f"{name}_{suffix}" for suffix in probe.CHOICES  # decode_gemm.Tuning's variants
              for name in ("product", "lora_folded", "lora_product", "qwen_product", "fp8_lora_product")}
    named.add("qwen_product_no_pdl")
    for plan, variants in probe.PLANS.items():
        assert set(variants) <= named, (plan, set(variants) - named)
    # the bench's token step as the trainer runs it, without the adapter and with it
    assert {"product", "product_graph", "lora_product", "lora_product_graph"} <= set(probe.PLANS["bench"])
    families = {name: probe._family(name) for name in (
        "proj_kernel", "gated_kernel", "lora_down_kernel", "attend_chunk_kernel", "attend_combine_kernel",
        "rope_store_kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN")}
    assert families == {
        "proj_kernel": "decode GEMM kernels", "gated_kernel": "decode GEMM kernels", "lora_down_kernel": "lora_down",
        "attend_chunk_kernel": "attention", "attend_combine_kernel": "attention",
        "rope_store_kernel": "rope + KV write",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "reduce/softmax",
        "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN": "gemm"}


def test_the_engine_probes_busy_time_counts_overlapping_kernels_once(monkeypatch):
    # A graph's kernels overlap (parallel streams, a launch beside the one it waits for): their sum overstated
    # the step and left the time between them negative. Busy time is the union of their spans.
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("native_engine")
    assert probe.covered_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # 0-12 and 20-25
    assert probe.covered_us([(30, 40), (0, 10), (10, 15)]) == 25  # unordered, touching
    assert probe.covered_us([]) == 0


def test_the_unsloth_growth_probe_reads_vllms_adapters_and_prefix_cache_where_v1_keeps_them(monkeypatch):
    # A GPU session is spent on this probe: a wrong attribute path there would read None for every step.
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("unsloth_growth")
    pool = SimpleNamespace(cached_block_hash_to_block=SimpleNamespace(_cache={"a": 1, "b": 2, "c": 3}),
                           get_num_free_blocks=lambda: 10, blocks=[None] * 12)
    core = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool)))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(list_loras=lambda: {7, 8},
                                                     engine_core=SimpleNamespace(engine_core=core)))
    state = probe.vllm_state(llm)
    assert (state["loras_held"], state["prefix_cached_blocks"], state["free_blocks"], state["total_blocks"]) == (
        2, 3, 10, 12)
    pool.cached_block_hash_to_block = {"a": 1}  # older vLLM: a plain dict
    assert probe.vllm_state(llm)["prefix_cached_blocks"] == 1
    bare = probe.vllm_state(SimpleNamespace())  # another layout: nothing read, nothing raised
    assert bare["loras_held"] is None and bare["prefix_cached_blocks"] is None and bare["free_blocks"] is None


def test_the_unsloth_growth_probes_trends_leave_out_the_warm_up_and_put_the_step_time_first(monkeypatch):
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("unsloth_growth")
    warmup = [{"step": s, "step_time": 30.0, "flat": 5.0, "grows": 99.0} for s in (1, 2)]  # would bend every slope
    steady = [{"step": s, "step_time": 2.0 + 0.1 * (s - 3), "flat": 5.0, "grows": 100.0 + 4 * (s - 3),
               "unread": None, "kind": "step", "t": 10.0 * s} for s in range(3, 9)]
    trends = probe.trends(warmup + steady, warmup=2)
    by = {t["quantity"]: t for t in trends}
    assert trends[0]["quantity"] == "step_time" and set(by) == {"step_time", "flat", "grows"}
    assert by["step_time"]["slope_per_step"] == pytest.approx(0.1)
    assert by["grows"]["slope_per_step"] == pytest.approx(4.0) and by["flat"]["slope_per_step"] == pytest.approx(0.0)
    assert (by["grows"]["first"], by["grows"]["last"]) == (100.0, 120.0)
    assert [t["quantity"] for t in trends[1:]] == ["grows", "flat"]  # by growth per step as a share, largest first


def test_the_memory_probe_groups_the_peak_by_grpo_frame_and_autograd_node(monkeypatch):
    # What autograd's backward allocates has no Python frame; recorded with C++ frames (--stacks all) it is
    # named by its autograd node, so that the peak's unnamed part can be told apart.
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("step_memory")
    ours = [{"filename": "/r/grpo/model/lean_activations.py", "line": 86, "name": "_mlp_forward"},
            {"filename": "/s/peft/tuners/lora/layer.py", "line": 1102, "name": "forward"}]
    mm = [{"filename": "", "line": 0, "name": "at::native::mm_out"},
          {"filename": "", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply(variable_list&&)"},
          {"filename": "", "line": 0, "name": "torch::autograd::generated::MulBackward0::apply(variable_list&&)"}]
    gib = 2**30
    live = {1: (gib, ours), 2: (gib // 2, mm), 3: (gib // 2, mm), 4: (gib // 4, []), 5: (gib // 8, None)}
    out = probe.summarize(3 * gib, live)
    assert out["peak_gib"] == 3.0
    assert {g["where"]: g["gib"] for g in out["groups"]} == {
        "lean_activations.py:86 _mlp_forward <- layer.py:1102 forward": 1.0, "autograd's backward: MmBackward0": 1.0,
        "no Python frame (autograd's backward)": 0.25, "held before the history began": 0.125}
    assert out["blocks"][0] == {"mib": 1024.0, "stack": ["lean_activations.py:86 _mlp_forward"]}
    # the replay: the peak and what is alive then, from what was held and the allocator's entries after it
    trace = [{"action": "alloc", "addr": 10, "size": 5, "frames": ours}, {"action": "alloc", "addr": 11, "size": 7},
             {"action": "free_requested", "addr": 10}, {"action": "alloc", "addr": 12, "size": 2, "frames": mm}]
    peak, at_peak = probe.live_at_peak({1: 3}, trace)
    assert peak == 15 and at_peak == {1: (3, None), 10: (5, ours), 11: (7, [])}


def test_the_step_profile_gives_each_kernel_to_the_phases_that_launched_it_and_counts_overlaps_once(monkeypatch):
    # A kernel runs after its launch returns, often past its phase's range: it belongs to every range holding its
    # launch (runtime or driver API, by correlation id), so an outer phase's GPU time holds its inner phases', as its
    # wall time does. Host ops' own time leaves out their children.
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("step_profile")

    def ev(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {"traceEvents": [
        ev("user_annotation", "phase:update", 0, 100), ev("user_annotation", "phase:update/forward", 0, 40),
        ev("cpu_op", "aten::mm", 5, 20), ev("cpu_op", "aten::t", 6, 4),
        ev("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
        ev("cuda_driver", "cuLaunchKernelEx", 50, 2, correlation=2),
        ev("cuda_runtime", "cudaLaunchKernel", 150, 2, correlation=3),  # outside every phase
        ev("kernel", "gemm", 60, 30, tid=7, correlation=1), ev("kernel", "gemm", 80, 30, tid=7, correlation=2),
        ev("kernel", "add", 160, 5, tid=7, correlation=3)]}
    rows = {r["phase"]: r for r in probe.summarize(trace)}
    assert rows["iteration"]["gpu_busy_ms"] == pytest.approx(0.055)  # 60-110 and 160-165 us
    assert rows["update/forward"]["kernels"] == 1 and rows["update"]["kernels"] == 2 and rows["other"]["kernels"] == 1
    assert rows["update/forward"]["wall_ms"] == pytest.approx(0.040)
    assert rows["update/forward"]["gpu_busy_ms"] == pytest.approx(0.030)  # 60-90 us
    assert rows["update"]["gpu_busy_ms"] == pytest.approx(0.050)  # 60-110 us: its forward's kernel and its own
    assert dict(rows["update/forward"]["top_host_ops_self_ms"]) == pytest.approx({"aten::mm": 0.016, "aten::t": 0.004})
    assert dict(rows["update"]["top_host_ops_self_ms"]) == pytest.approx({"aten::mm": 0.016, "aten::t": 0.004})


def test_the_step_profile_sorts_the_gpus_idle_time_by_the_length_of_each_wait(monkeypatch):
    # waits of 10 and 50 us between kernels, one of 300 us before a norm; overlapping kernels wait for none
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(PROBES))
    probe = importlib.import_module("step_profile")
    spans = [("gemm", 0, 100), ("gemm", 50, 100), ("add", 160, 10), ("mul", 220, 5), ("rmsnorm", 525, 20)]
    got = probe.idle_gaps([{"name": n, "ts": ts, "dur": dur} for n, ts, dur in spans])
    assert got["gpu_idle_ms_by_wait"] == pytest.approx({"<20us": 0.010, "20-100us": 0.050, ">=100us": 0.300})
    assert got["after_long_waits_ms"] == [("rmsnorm", pytest.approx(0.300))]
