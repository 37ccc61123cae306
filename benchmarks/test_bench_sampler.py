"""The sampler alone as users outgrow 16 rows: ours against plain vLLM, with the recipe's LoRA adapter.

16, 64 and 256 rows (4, 16 and 64 prompts x G=4) of 512 new tokens after 128-token prompts, sampled as the
recipe samples (temperature 1, min_p 0.1, EOS ignored), on the bench model (Llama-3.2-1B shapes, bf16) with
rsLoRA r=32 on the 7 projections:
- ours: the native engine as the trainer builds it, kept between calls (its CUDA graphs captured in the
  warm-up round), with the adapter and with it switched off, with the adapter and
  `--engine-attention kernel`, and with the adapter folded into the weights (`EngineTuning.fold_adapter`);
- vLLM: `VLLMEngine` (plain vLLM, the same checkpoint and adapter, CUDA graphs, no sleep), one engine for
  all sizes: vLLM allows one sleeping engine per process, and building it costs a minute.
What is timed is sampling: ours prefill + decode, vLLM's `generate` call (both without the adapter's
save or the graphs' capture). Each record carries tokens/s, ms per token step (sampling time / 512), ours
decode-only ms per step, and the bytes a decode step reads over its time against the device copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import statistics

import pytest

import bench_setup as bs

SWEEP_ROWS = (16, 64, 256)


@pytest.fixture(scope="module")
def sampler_setup(bench_env):
    """(policy, tokenizer, prompt ids of the 128-token prompts): the bench model in bf16 with the recipe's
    rsLoRA adapter, its B matrices random so that the adapter changes what is sampled."""
    from grpo.data import build_prompts, load_jsonl

    shape = bench_env.scale[max(SWEEP_ROWS)]
    policy, tokenizer = bs.policy_with_random_b(bench_env.model_dir(), bench_env.prompts(shape), shape,
                                                root=bench_env.root, cuda=bench_env.cuda)
    prompts = build_prompts(tokenizer, load_jsonl(bench_env.prompts(shape)), shape.prompt_len).prompt_ids
    return policy, tokenizer, prompts


def _sampling(shape):
    from grpo.rollout import Sampling

    return Sampling(max_new_tokens=shape.completion_len, temperature=1.0, min_p=0.1, ignore_eos=True, seed=7)


def _record(benchmark, results, shape, impl: str, sampling_s: list[float], policy, adapter: bool,
            decode_s: list[float] | None = None, copy_tbps: float | None = None) -> None:
    """The figures of one (impl, rows) point, from the timed rounds' sampling (and ours' decode) seconds. The
    bytes of a decode step: every weight once (the adapters when they are on) and the KV cache at its mean
    length over the completion."""
    median = statistics.median(sampling_s)
    cfg = policy.get_base_model().config
    kv_per_pos = 2 * cfg.num_hidden_layers * shape.rows * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if "lora_" in n)
    weights = bs.weight_bytes(policy) - (0 if adapter else adapter_bytes)
    step_bytes = weights + kv_per_pos * (shape.prompt_len + shape.completion_len / 2)
    info = {"rows": shape.rows, "sampling_s": median, "tokens_per_s": shape.rows * shape.completion_len / median,
            "ms_per_token_step": median / shape.completion_len * 1e3, "bytes_per_step": step_bytes,
            "achieved_gb_per_s": step_bytes / (median / shape.completion_len) / 1e9, "shape": bs.asdict(shape)}
    if decode_s is not None:
        info["decode_ms_per_step"] = statistics.median(decode_s) / shape.completion_len * 1e3
    if copy_tbps is not None:
        info["copy_tb_per_s"] = copy_tbps
        info["of_copy_bandwidth"] = info["achieved_gb_per_s"] / (copy_tbps * 1e3)
    benchmark.extra_info.update(info)
    results.add(benchmark, group="sampler", config=shape.name, impl=impl, dtype="bf16")


def _gap(policy, pad_id: int, rollout, temperature: float) -> dict:
    """The sampler-trainer gap of one rollout as the trainer measures it: |log pi_train - log pi_sampler| over
    the completion tokens, the trainer's side computed as its step does (`batch_logprobs`, 16 rows at a
    time). With the adapter's B random (not zero, as a trained adapter), this is where folding shows: the
    bench step's tied rewards leave B at zero there."""
    import torch

    from grpo.batch import batch_logprobs, make_batch

    batch = make_batch(rollout, pad_id, next(policy.parameters()).device)
    slices = [slice(i, min(i + 16, len(batch))) for i in range(0, len(batch), 16)]
    with torch.no_grad():
        train = batch_logprobs(policy, batch, slices, temperature)
    diff = (train.float() - batch.sampler_logp.float()).abs()[batch.mask]
    return {"logp_abs_mean": float(diff.mean()), "logp_abs_max": float(diff.max()),
            "logp_abs_p999": float(diff.quantile(0.999)) if diff.numel() <= 2**24 else None}


@pytest.fixture(scope="module")
def copy_bandwidth(bench_env) -> float | None:
    """The device copy bandwidth (TB/s) in this run: the ceiling the decode steps are read against."""
    if not bench_env.cuda:
        return None
    from probes.timing import copy_tbps

    return copy_tbps()


@pytest.mark.bench_order(70)
@pytest.mark.bench_cost(40)
@pytest.mark.parametrize("adapter", ["lora", "off", "lora-attention-kernel", "lora-folded"])
@pytest.mark.parametrize("rows", SWEEP_ROWS)
def test_native_sampler_at_rows(benchmark, bench_env, results, sampler_setup, copy_bandwidth, rows, adapter):
    """Ours at `rows` rows, with the adapter and with peft's switch off (the engine follows it), attending with
    torch's sdpa; with the adapter and the split-KV attention kernel (`--engine-attention kernel`, auto's
    choice on CUDA from 16 rows) in its place; and with the kernel and the adapter folded into the base weights
    (`--engine-fold-adapter`), whose token step reads the base weights alone: the trainer's engine. Past the
    decode kernels' rows the engine runs the projections as torch's GEMMs with the adapters packed."""
    import contextlib

    from grpo.kernels import decode_attention
    from grpo.rollout import build_engine

    policy, tokenizer, prompts = sampler_setup
    shape = bench_env.scale[rows]
    attention = "sdpa" if adapter in ("lora", "off") else "kernel"
    if attention == "kernel" and not decode_attention.can_run(next(policy.parameters()).device):
        pytest.skip("the attention kernel needs triton and a CUDA model")
    engine = build_engine("native", policy, pad_id=tokenizer.pad_token_id, max_seq_len=shape.seq_len,
                          max_batch=shape.rows, attention=attention, fold_adapter=adapter == "lora-folded")
    sampling, timings, rollouts = _sampling(shape), [], []

    def generate():
        rollout = engine.generate(prompts[:shape.prompts], shape.generations, sampling)
        bs.sync()
        assert int(rollout.mask.sum()) == shape.rows * shape.completion_len
        timings.append(rollout.timings)
        rollouts[:] = [rollout]  # the last, for the gap

    switch = policy.disable_adapter() if adapter == "off" else contextlib.nullcontext()
    with switch:
        benchmark.pedantic(generate, rounds=bench_env.rounds(3), warmup_rounds=1, iterations=1)
    measured = timings[1:]
    if adapter != "off":  # (without it the trainer's side would need peft's switch off too)
        benchmark.extra_info["gap"] = _gap(policy, tokenizer.pad_token_id, rollouts[0], sampling.temperature)
    impl = {"lora": "ours", "off": "ours-no-adapter", "lora-attention-kernel": "ours-attention-kernel",
            "lora-folded": "ours-folded"}[adapter]
    # folded, a token step reads the base weights alone (the adapters went into them before the prefill)
    _record(benchmark, results, shape, impl, [t["prefill"] + t["decode"] for t in measured], policy,
            adapter in ("lora", "lora-attention-kernel"),
            decode_s=[t["decode"] for t in measured], copy_tbps=copy_bandwidth)
    engine.release_memory()
    del engine
    bs.free_memory()


@pytest.fixture(scope="module")
def vllm_sampler(bench_env, sampler_setup, tmp_path_factory):
    """One plain-vLLM engine over the same checkpoint and adapter, for every size (no sleep mode)."""
    pytest.importorskip("vllm", reason="the vLLM sampler needs vLLM: pip install vllm")
    from grpo.rollout.vllm import VLLMEngine

    policy, tokenizer, _ = sampler_setup
    shape = bench_env.scale[max(SWEEP_ROWS)]
    return VLLMEngine(policy, str(bench_env.model_dir()), lora_rank=32, max_model_len=shape.seq_len, dtype="bf16",
                      seed=7, work_dir=str(tmp_path_factory.mktemp("vllm-sampler")), gpu_memory_utilization=0.3,
                      pad_id=tokenizer.pad_token_id, sleep_mode=False, max_num_seqs=max(SWEEP_ROWS))


@pytest.mark.bench_order(95)
@pytest.mark.bench_cost(60)
@pytest.mark.parametrize("rows", SWEEP_ROWS)
@pytest.mark.parametrize("adapter", ["lora", "off"])
def test_vllm_sampler_at_rows(benchmark, bench_env, results, sampler_setup, vllm_sampler, copy_bandwidth, rows,
                              adapter, monkeypatch):
    """Plain vLLM at `rows` rows, the adapter served as the trainer serves it (a LoRA request each call,
    vLLM's LoRA kernels in every step), or off: the base weights alone, as vLLM runs where the trainer merges
    the adapter into the weights it sends (TRL's colocated GRPO), so the two rows price vLLM's LoRA."""
    policy, _, prompts = sampler_setup
    shape = bench_env.scale[rows]
    sampling, timings = _sampling(shape), []
    if adapter == "off":
        monkeypatch.setattr(vllm_sampler, "_lora_request", lambda: None)  # generate(..., lora_request=None)

    def generate():
        rollout = vllm_sampler.generate(prompts[:shape.prompts], shape.generations, sampling)
        assert int(rollout.mask.sum()) == shape.rows * shape.completion_len
        timings.append(rollout.timings)

    benchmark.pedantic(generate, rounds=bench_env.rounds(3), warmup_rounds=1, iterations=1)
    _record(benchmark, results, shape, "vllm" if adapter == "lora" else "vllm-no-adapter",
            [t["generate"] for t in timings[1:]], policy, adapter == "lora", copy_tbps=copy_bandwidth)
