"""One full GRPO step, ours and TRL's, at the bench config and at the seed's long config.

Ours is `grpo.trainer.train` itself, run for a few steps: pytest-benchmark times the whole run (model
load and warm-up steps included, ending in a CUDA synchronize), and `extra_info` carries what the
suite is for, the steady state: the median step time and phase times of the steps after the first
ones, from the trainer's own per-step records, and their peak memory. TRL's GRPOTrainer runs the same
model, prompts, lengths and recipe in the same process (`bench_setup.run_trl`); its steps are timed
by a callback, and the ratio of ours to TRL is printed at the end and stored in the results.
"""

from __future__ import annotations

import importlib.util
import statistics

import pytest

import bench_setup as bs


def _skip_without_unsloth() -> None:
    """Skips where unsloth is not installed, without importing it: its import chooses the CUDA allocator's
    settings from UNSLOTH_VLLM_STANDBY (expandable segments unless standby is on, which standby then refuses),
    so only the code that loads Unsloth, after setting that variable, may import it."""
    if importlib.util.find_spec("unsloth") is None:
        pytest.skip("needs unsloth and vLLM: pip install 'grpo[unsloth,vllm]'")


def _run_ours(benchmark, bench_env, results, tmp_path, config_name: str, dtype: str, standby: str = "auto",
              micro_batch: int | None = None, lora_compute: str | None = None, impl: str = "ours",
              engine: str = "native", attention: str = "auto", vllm_share: float | None = None,
              fold_adapter: bool = True, fp8_gemm: str = "auto", sample_ahead: bool = False) -> dict:
    pytest.importorskip("bitsandbytes", reason="the recipe's 8-bit AdamW needs bitsandbytes: pip install bitsandbytes")
    import torch

    from grpo.trainer import train

    shape = bench_env.shape(config_name)
    steps = bench_env.long_steps if config_name == "long" else bench_env.steps
    warmup = 1 if config_name == "long" else min(2, steps - 1)
    out = tmp_path / "run"
    # Unsloth serves FP8 from an FP8-Block checkpoint (the seed's); the others quantize the bf16 one at load.
    fp8_block = engine == "unsloth" and dtype == "fp8"
    model_dir = bench_env.fp8_block_dir() if fp8_block else bench_env.model_dir()
    cfg = bs.step_config(model_dir, bench_env.prompts(shape), shape, fp8=dtype == "fp8" and not fp8_block,
                         steps=steps, output_dir=out, cuda=bench_env.cuda, engine_standby=standby,
                         micro_batch_size=micro_batch, engine=engine, engine_attention=attention,
                         vllm_gpu_memory_utilization=vllm_share, engine_fold_adapter=fold_adapter, fp8_gemm=fp8_gemm,
                         sample_ahead=sample_ahead,
                         **({} if lora_compute is None else {"lora_compute": lora_compute}))  # None: the product's
    baseline = torch.cuda.memory_allocated() / bs.GiB if bench_env.cuda else 0.0

    def run():
        with bs.fixed_lengths():
            train(cfg)
        bs.sync()

    with bs.GpuUsedMemory() as used:
        benchmark.pedantic(run, rounds=1, iterations=1)
    records = bs.read_metrics(out)
    assert len(records) == steps and not any(r["skipped"] for r in records)
    # sampling ahead, the last step starts no generate: its training alone, not a steady step
    summary = bs.summarize_steps(records[:-1] if sample_ahead else records, warmup, rows=shape.rows)
    # Fixed lengths or the numbers mean nothing: every completion ran to the end.
    assert summary["completion_length"] == shape.completion_len
    info = {**summary, "peak_reserved_gib": bs.memory_info()["peak_reserved_gib"], "baseline_alloc_gib": baseline,
            "peak_gpu_used_gib": used.peak_gib, "shape": bs.asdict(shape), "warmup_steps": warmup,
            "note": "peak_reserved_gib: the last step's; peak_gpu_used_gib: nvidia-smi over the whole run, less "
                    "its reading before; timing_s: the whole run (load + all steps)"}
    benchmark.extra_info.update(info)
    results.add(benchmark, group="step", config=config_name, impl=impl, dtype=dtype)
    return info


@pytest.mark.bench_order(30)
@pytest.mark.bench_cost(30)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_grpo_step_at_bench_config(benchmark, bench_env, results, tmp_path, dtype):
    """4 prompts x G=4, 128-token prompts, 512 completion tokens: steady-state step time and memory."""
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", dtype)


@pytest.mark.bench_order(30)
@pytest.mark.bench_cost(15)
def test_grpo_step_on_the_fp8_tensor_cores(benchmark, bench_env, results, tmp_path):
    """FP8 at the bench config with --fp8-gemm fp8: the training pass and the prefill as FP8 GEMMs (`_scaled_mm`,
    activations quantized per 1x128 group; a Python autograd node a projection), beside the product's dense
    bf16 products from the FP8 weights (--fp8-gemm auto with checkpointing)."""
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", "fp8", impl="ours-fp8-gemm", fp8_gemm="fp8")


@pytest.mark.bench_order(31)
@pytest.mark.bench_cost(30)
@pytest.mark.parametrize("config_name, dtype", [("bench", "bf16"), ("rows64", "bf16"), ("bench", "fp8")])
def test_grpo_step_sampling_ahead(benchmark, bench_env, results, tmp_path, config_name, dtype):
    """--sample-ahead at the bench config and at 64 rows (where the training pass is as long as the decode):
    each step's completions generated while the step before trains, on a copy of the policy (bf16: the adapted
    weights with the adapters folded; FP8: the adapters alone), one step off the policy."""
    _run_ours(benchmark, bench_env, results, tmp_path, config_name, dtype, sample_ahead=True, impl="ours-ahead")


@pytest.mark.bench_order(31)
@pytest.mark.bench_cost(15)
def test_grpo_step_releasing_the_engine_each_step(benchmark, bench_env, results, tmp_path):
    """bf16 at the bench config with --engine-standby release: the KV cache and CUDA graphs are dropped
    after each generation (lowest peak) and re-captured in the next (the time that costs)."""
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", "bf16", standby="release", impl="ours-release")


@pytest.mark.bench_order(32)
@pytest.mark.bench_cost(15)
def test_grpo_step_with_adapters_multiplying_in_float32(benchmark, bench_env, results, tmp_path):
    """bf16 at the bench config with --lora-compute float32 (peft's own way): a
    float32 copy of each projection's input made and saved in training, against the default's bf16 products
    (decode's kernels compute the adapters the same way under either setting)."""
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", "bf16", lora_compute="float32", impl="ours-lora-fp32")


@pytest.mark.bench_order(32)
@pytest.mark.bench_cost(15)
def test_grpo_step_in_micro_batches_of_8(benchmark, bench_env, results, tmp_path):
    """bf16 at the bench config with --micro-batch-size 8: the same gradient in two passes, each recomputed layer
    holding half the activations: what the bf16 peak gives back (goal: below TRL's, which trains its 16 rows in
    one pass) for the time of a second pass."""
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", "bf16", micro_batch=8, impl="ours-mb8")


@pytest.mark.bench_order(32)
@pytest.mark.bench_cost(40)
@pytest.mark.parametrize("config_name", ["bench", "long"])
def test_grpo_step_with_the_adapters_unfolded(benchmark, bench_env, results, tmp_path, config_name):
    """bf16 with the native engine sampling through the adapters (--no-engine-fold-adapter; the product folds
    them into the base weights for the prefill and the decode, and FP8 weights never fold), the
    long config in micro-batches of 4 as its goal's: what the fold saves a step, and the sampler-trainer gap it
    adds (the results' `gap`), beside the product's rows of the same run."""
    micro, impl = (4, "ours-mb4-unfolded") if config_name == "long" else (None, "ours-unfolded")
    _run_ours(benchmark, bench_env, results, tmp_path, config_name, "bf16", micro_batch=micro, impl=impl,
              fold_adapter=False)


@pytest.mark.bench_order(33)
@pytest.mark.bench_cost(120)
def test_grpo_step_with_the_vllm_engine(benchmark, bench_env, results, tmp_path):
    """bf16 at the bench config with --engine vllm: our loop and loss, vLLM sampling (sleep mode between
    steps, the adapter synced each step). Its metrics carry the sampler-trainer gap of vLLM's numerics."""
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'grpo[vllm]'")
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", "bf16", impl="ours-vllm", engine="vllm")


@pytest.mark.bench_order(90)
@pytest.mark.bench_cost(300)
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_grpo_step_on_the_unsloth_path(benchmark, bench_env, results, tmp_path, dtype):
    """--engine unsloth at the bench config: Unsloth loads the model (fp8: the FP8-Block checkpoint) with its
    vLLM engine in standby, sharing the base weights; our loop and loss train on them. Importing unsloth
    patches transformers for the whole process, so run it alone: -k unsloth_path."""
    _skip_without_unsloth()
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", dtype, impl="ours-unsloth", engine="unsloth")


@pytest.mark.bench_order(91)
@pytest.mark.bench_cost(300)
def test_grpo_step_on_the_unsloth_path_at_the_peers_share(benchmark, bench_env, results, tmp_path):
    """bf16 on the Unsloth path with vLLM at the share the peers run it at (bs.VLLM_SHARE, 0.35: Unsloth then
    picks max_num_seqs by the KV cache that leaves) instead of the default's, sized for the run's 16 rows:
    whether the sized engine samples as fast as the share. Run alone: -k peers_share."""
    _skip_without_unsloth()
    _run_ours(benchmark, bench_env, results, tmp_path, "bench", "bf16", impl="ours-unsloth-share", engine="unsloth",
              vllm_share=bs.VLLM_SHARE)


@pytest.mark.bench_order(55)
@pytest.mark.bench_cost(60)
@pytest.mark.parametrize("config_name", ["rows64", "rows256"])
def test_grpo_step_at_more_rows(benchmark, bench_env, results, tmp_path, config_name):
    """bf16, the bench config's lengths at 64 and 256 rows (16 and 64 prompts x G=4): how the step scales
    as users outgrow 16 rows (above 64 rows the engine's decode calls the modules, not the decode kernels)."""
    _run_ours(benchmark, bench_env, results, tmp_path, config_name, "bf16")


@pytest.mark.bench_order(50)
@pytest.mark.bench_cost(40)
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_grpo_step_at_long_config(benchmark, bench_env, results, tmp_path, dtype):
    """The seed's long config: 16 completions of 1760 tokens after 288-token prompts."""
    _run_ours(benchmark, bench_env, results, tmp_path, "long", dtype)


@pytest.mark.bench_order(51)
@pytest.mark.bench_cost(40)
def test_grpo_step_at_long_config_in_micro_batches_of_4(benchmark, bench_env, results, tmp_path):
    """bf16 at the long config with --micro-batch-size 4 (the seed recipe's gradient accumulation of 4):
    the same gradient in four passes, so one recomputed layer holds a quarter of the activations."""
    _run_ours(benchmark, bench_env, results, tmp_path, "long", "bf16", micro_batch=4, impl="ours-mb4")


@pytest.mark.bench_order(52)
@pytest.mark.bench_cost(50)
@pytest.mark.parametrize("config_name", ["bench", "long"])
def test_grpo_step_with_sdpa_attention(benchmark, bench_env, results, tmp_path, config_name):
    """bf16 with --engine-attention sdpa (the long config in micro-batches of 4, as above): torch's sdpa in
    every decode step instead of the split-KV attention kernel that auto takes on CUDA from 16 rows, beside
    the default's rows of this run."""
    micro, impl = (4, "ours-mb4-sdpa") if config_name == "long" else (None, "ours-sdpa")
    _run_ours(benchmark, bench_env, results, tmp_path, config_name, "bf16", micro_batch=micro, impl=impl,
              attention="sdpa")


def _run_peer(benchmark, bench_env, results, config_name: str, impl: str, dtype: str, run) -> dict:
    """Times `run()` (a peer's whole run, returning its per-step records) and records its steady state."""
    shape = bench_env.shape(config_name)
    records: list[dict] = []

    def whole_run():
        records.extend(run(shape))
        bs.sync()

    with bs.GpuUsedMemory() as used:
        benchmark.pedantic(whole_run, rounds=1, iterations=1)
    assert len(records) == bench_env.trl_steps
    steady = records[1:] if len(records) > 1 else records
    lengths = [r["completion_length"] for r in records if r.get("completion_length") is not None]
    assert lengths and min(lengths) == shape.completion_len, f"{impl}: completions not all forced: {lengths}"
    step_time = statistics.median(r["step_time"] for r in steady)
    info = {"steps": len(records), "steady_steps": len(steady), "step_time_s": step_time,
            "step_times_s": [round(r["step_time"], 4) for r in records],
            "peak_alloc_gib": max(r["peak_mem_gib"] for r in steady),
            "peak_reserved_gib": max(r.get("peak_reserved_gib", 0.0) for r in steady),
            "peak_gpu_used_gib": used.peak_gib,
            "completion_tokens_per_s": shape.rows * shape.completion_len / step_time,
            "completion_length": min(lengths),
            "shape": bs.asdict(shape), "warmup_steps": len(records) - len(steady),
            "note": "timed per step by a TrainerCallback (on_step_begin to on_step_end, synchronized); "
                    "peak_gpu_used_gib: nvidia-smi over the whole run, less its reading before"}
    benchmark.extra_info.update(info)
    results.add(benchmark, group="step", config=config_name, impl=impl, dtype=dtype)
    return info


@pytest.mark.bench_order(40)
@pytest.mark.bench_cost(80)
@pytest.mark.parametrize("config_name", ["bench", "long"])
def test_trl_grpo_step(benchmark, bench_env, results, tmp_path, request, config_name):
    """The peer: TRL's GRPOTrainer on the same model and config, in the same run."""
    if config_name == "long" and not request.config.getoption("--bench-trl-long"):
        q = bs.TRL_QUOTED["long"]
        pytest.skip(f"TRL at the long config takes ~{q['step_time_s']} s a step; quoted instead "
                    "(--bench-trl-long runs it)")
    pytest.importorskip("trl", reason="the peer needs trl: pip install trl")
    pytest.importorskip("bitsandbytes", reason="the recipe's 8-bit AdamW needs bitsandbytes: pip install bitsandbytes")
    _run_peer(benchmark, bench_env, results, config_name, "trl", "bf16",
              lambda shape: bs.run_trl(bench_env.model_dir(), bench_env.prompts(shape), shape,
                                       steps=bench_env.trl_steps, output_dir=tmp_path / "trl", cuda=bench_env.cuda))


@pytest.mark.bench_order(91)
@pytest.mark.bench_cost(300)
def test_trl_grpo_step_with_vllm_colocated(benchmark, bench_env, results, tmp_path):
    """The peer sampling with vLLM: TRL's GRPOTrainer with use_vllm=True, vllm_mode="colocate" (vLLM in this
    process with the share ours gets on Unsloth's engine, bs.VLLM_SHARE, asleep while training). vLLM allows
    one sleeping engine per process: run it alone, -k vllm_colocated."""
    pytest.importorskip("vllm", reason="needs vLLM: pip install vllm")
    pytest.importorskip("trl", reason="the peer needs trl: pip install trl")
    _run_peer(benchmark, bench_env, results, "bench", "trl-vllm", "bf16",
              lambda shape: bs.run_trl(bench_env.model_dir(), bench_env.prompts(shape), shape,
                                       steps=bench_env.trl_steps, output_dir=tmp_path / "trl", cuda=bench_env.cuda,
                                       vllm_share=bs.VLLM_SHARE))


@pytest.mark.bench_order(92)
@pytest.mark.bench_cost(600)
def test_unsloth_grpo_step(benchmark, bench_env, results, tmp_path):
    """The seed recipe's engine as Unsloth runs it: Unsloth + TRL's GRPOTrainer on the FP8-Block checkpoint of
    the bench model, vLLM in standby sharing the weights (bs.VLLM_SHARE of the GPU, as ours). Importing unsloth patches
    transformers and TRL for the whole process: run it alone, -k unsloth_grpo."""
    _skip_without_unsloth()
    _run_peer(benchmark, bench_env, results, "bench", "unsloth-grpo", "fp8",
              lambda shape: bs.run_unsloth_grpo(bench_env.fp8_block_dir(), bench_env.prompts(shape), shape,
                                                steps=bench_env.trl_steps, output_dir=tmp_path / "unsloth"))
