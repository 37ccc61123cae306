"""Generation with the native engine at the bench config: decode ms per step, prefill, capture.

One `generate` is what a training step's generation phase does: the engine as the trainer builds it
(`grpo.rollout.build_engine`), its memory released before each call as the trainer does with
`--engine-standby release`, so every call pays the CUDA-graph capture too (with the default `auto`,
steps after the first skip it: the GRPO step benchmark measures both). `Rollout.timings` splits the call into
capture, prefill and decode. Achieved bandwidth counts the bytes a decode step must read: every
parameter once (FP8 codes and scales, the tied embedding as the LM head, the adapters) and the KV
cache up to the length the step attends over.
"""

from __future__ import annotations

import statistics

import pytest

import bench_setup as bs
from bench_setup import weight_bytes as param_bytes


@pytest.mark.bench_order(20)
@pytest.mark.bench_cost(20)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_native_generate_at_bench_config(benchmark, bench_env, results, dtype):
    """16 rows x 512 new tokens after 128-token prompts, sampled as the recipe samples (min_p 0.1)."""
    from grpo.data import build_prompts, load_jsonl
    from grpo.model.load import load_policy
    from grpo.rollout import Sampling, build_engine

    shape = bench_env.bench
    cfg = bs.step_config(bench_env.model_dir(), bench_env.prompts(shape), shape, fp8=dtype == "fp8", steps=1,
                         output_dir=bench_env.root / "unused", cuda=bench_env.cuda)
    policy, tokenizer, _ = load_policy(cfg)
    prompts = build_prompts(tokenizer, load_jsonl(bench_env.prompts(shape)), shape.prompt_len).prompt_ids
    prompts = prompts[:shape.prompts]
    engine = build_engine("native", policy, pad_id=tokenizer.pad_token_id, max_seq_len=shape.seq_len,
                          max_batch=shape.rows)
    sampling = Sampling(max_new_tokens=shape.completion_len, temperature=1.0, min_p=0.1, ignore_eos=True, seed=7)
    timings: list[dict] = []

    def generate():
        rollout = engine.generate(prompts, shape.generations, sampling)
        bs.sync()
        timings.append(rollout.timings)
        assert int(rollout.mask.sum()) == shape.rows * shape.completion_len

    bs.free_memory()
    rounds = bench_env.rounds(3)
    benchmark.pedantic(generate, setup=engine.release_memory, rounds=rounds, warmup_rounds=1, iterations=1)
    measured = timings[-rounds:]
    decode = statistics.median(t["decode"] for t in measured)
    steps = measured[-1]["decode_steps"]
    step_s = decode / steps
    lm = policy.get_base_model()
    cfg_m = lm.config
    weight_bytes = param_bytes(policy)
    kv_elem = 2  # bf16 cache
    kv_per_pos = 2 * cfg_m.num_hidden_layers * shape.rows * cfg_m.num_key_value_heads * cfg_m.head_dim * kv_elem
    bucket = engine.tuning.kv_bucket
    kv_lens = [min(-(-(shape.prompt_len + i + 1) // bucket) * bucket, shape.seq_len) for i in range(int(steps))]
    kv_bytes = kv_per_pos * statistics.mean(kv_lens)
    benchmark.extra_info.update({
        "decode_ms_per_step": step_s * 1e3,
        "prefill_ms": statistics.median(t["prefill"] for t in measured) * 1e3,
        "capture_ms": statistics.median(t["capture"] for t in measured) * 1e3,
        "decode_s": decode, "decode_steps": steps,
        "tokens_per_s": shape.rows * steps / decode,
        "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes,
        "achieved_gb_per_s": (weight_bytes + kv_bytes) / step_s / 1e9,
        **bs.memory_info(), "shape": bs.asdict(shape),
    })
    results.add(benchmark, group="decode", config="bench", impl="ours", dtype=dtype)
    engine.release_memory()
