"""vLLM and Unsloth on a CUDA GPU: what tests/test_vllm.py cannot show on vLLM's CPU build.

Plain vLLM (`VLLMEngine`) serves a small random Llama (tests/engine_runs.py: Llama 3.2's tokenizer, head_dim
64, an output layer of its own so that samples differ) saved as a bf16 checkpoint and as an FP8-Block one
(128x128 blocks, as unsloth/Llama-3.2-1B-Instruct-FP8-Block is stored): it sleeps while the policy trains and
gives its memory back, wakes, serves the adapter of each step, and its log-probs match the trainer's at
temperatures 1 and 0.7 within bf16's reach (FP8: with vLLM's activation quantization). The figures are printed
(run with -s) for benchmarks/RESULTS.md. The bf16 engine takes a share of the GPU, the FP8-Block one a KV
cache sized for the tests' rows (the trainer's default). vLLM's sleep mode allows one engine per process (its
CuMem allocator), so the FP8-Block checkpoint runs the same tests in a child pytest.

The Unsloth path (`--engine unsloth`) runs two GRPO steps of `train.py` on the FP8-Block checkpoint, in a
child process (importing unsloth patches transformers for the whole process), with a reward whose values
differ within a group (tests/engine_runs.py) and a learning rate that moves the policy visibly: the adapter
changes, the second step's sampler log-probs match the trainer's under the new adapter (not the base's),
and the step line reports the trainer's memory and vLLM's pool (0.3 of the GPU, not standby's 0.88) apart.
The FP8-Block processes run vLLM eager (no torch.compile or CUDA graphs: minutes less start-up); the
bf16 process keeps vLLM's CUDA graphs, the path --engine vllm runs by default.

Skipped without CUDA or vllm; the Unsloth test also without unsloth. On the H200 machine,
`source .vx/kit.sh env unsloth` puts both on the path (benchmarks/README.md says how).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM on CUDA: pip install 'grpo[vllm]'")
# The engine core in this process: nothing to spawn, and the test's own CUDA context is no obstacle.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# On an FP8-Block checkpoint vLLM JIT-compiles DeepGEMM kernels for every shape it might meet before it serves:
# 4.6 minutes on the H200 for this two-layer model (2026-12-02). Skipped, it compiles the shapes it meets.
# The children (the FP8-Block process, Unsloth's train.py) inherit it.
os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")

from engine_runs import PROMPTS, rollout_trainer_logp, write_small_llama  # noqa: E402

from grpo.config import Config  # noqa: E402
from grpo.model.load import load_policy  # noqa: E402
from grpo.rollout.base import Sampling  # noqa: E402
from grpo.rollout.vllm import VLLMEngine, kv_cache_bytes_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
# Per token, |log p_sampler - log p_trainer|: the mean is what the importance correction sees; one token can be
# off by more where the top logits nearly tie. bf16 engine against a bf16 trainer: bf16's rounding, to which
# vLLM adds its adapter term in bf16 where the trainer computes it in float32 (--lora-compute), a difference
# that grows with the adapter: on the H200 (2026-12-02) mean 0.019 / 0.022 (max 0.066 / 0.093) with the adapter
# of _randomize_adapter, 0.032 after the sleep test's training step made it larger. FP8-Block:
# vLLM also quantizes the activations to FP8 (1x128 groups) on CUDA, which the trainer's FP8Linear does not at
# this model's shapes (K or N not a multiple of 512: it dequantizes the weight); that alone moved this model's
# log-probs by mean 0.06-0.09 and max 0.31-0.36 nats at T=1 and 0.7 (CPU, float64, 192 tokens each).
MEAN_GAP = {"bf16": 0.05, "fp8-block": 0.15}
MAX_GAP = {"bf16": 0.5, "fp8-block": 0.75}


# The checkpoint this process serves; the bf16 process starts a child for the FP8-Block one.
CHECKPOINT = os.environ.get("GRPO_VLLM_CHECKPOINT", "bf16")
# vLLM's memory, sized each way once: a share of the GPU (0.2: a 28 GiB pool, mostly KV cache), and a KV cache
# for the tests' 8 rows of 256 tokens (2 MiB here), what --vllm-gpu-memory-utilization's default gives.
MEMORY = {"bf16": lambda config: {"gpu_memory_utilization": 0.2},
          "fp8-block": lambda config: {"kv_cache_bytes": kv_cache_bytes_for(config, rows=8, max_model_len=256,
                                                                            dtype="bf16")}}
# What sleep must free at least: the share's KV cache pool; the sized cache's engine, its weights (0.16 GiB)
SLEEP_FREES = {"bf16": 10 * GiB, "fp8-block": 0.1 * GiB}


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_tokenizer):
    """(engine, policy, checkpoint kind): a bf16 rsLoRA policy on the checkpoint and vLLM serving it."""
    path = write_small_llama(CHECKPOINT, tmp_path_factory.mktemp(CHECKPOINT), llama_tokenizer)
    cfg = Config(model=str(path), lora_rank=8, lora_alpha=16, dtype="bf16", gradient_checkpointing=False)
    policy, _, _ = load_policy(cfg, torch.device("cuda"))
    engine = VLLMEngine(policy, str(path), lora_rank=cfg.lora_rank, max_model_len=256, dtype="bf16", seed=1234,
                        work_dir=str(tmp_path_factory.mktemp("vllm-work")), enforce_eager=CHECKPOINT != "bf16",
                        **MEMORY[CHECKPOINT](policy.config))  # the bf16 process keeps CUDA graphs, the default path
    yield engine, policy, CHECKPOINT


def _randomize_adapter(policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _trainer_logp_with(policy, params, values, rollout) -> torch.Tensor:
    """rollout_trainer_logp at temperature 1 with `params` set to `values` for the call (then put back)."""
    current = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        return rollout_trainer_logp(policy, rollout, 1.0)
    finally:
        with torch.no_grad():
            for p, v in zip(params, current):
                p.copy_(v)


def _gap(rollout, expected: torch.Tensor) -> tuple[float, float]:
    diff = (rollout.sampler_logp.double() - expected).abs()[rollout.mask]
    return diff.mean().item(), diff.max().item()


@pytest.mark.parametrize("sampling", [Sampling(max_new_tokens=24, temperature=1.0),
                                      Sampling(max_new_tokens=24, temperature=0.7, min_p=0.1)],
                         ids=["t1", "t0.7-minp"])
def test_sampler_logp_matches_the_trainers_within_bf16(served, sampling):
    engine, policy, kind = served
    _randomize_adapter(policy, seed=1)
    rollout = engine.generate(PROMPTS, 4, sampling)
    assert rollout.mask.all() and rollout.mask.shape == (8, 24)
    expected = rollout_trainer_logp(policy, rollout, sampling.temperature)
    mean, worst = _gap(rollout, expected)
    print(f"\n[vllm-cuda] {kind} T={sampling.temperature} min_p={sampling.min_p}: sampler-trainer "
          f"|dlogp| mean {mean:.4f} max {worst:.3f} over {int(rollout.mask.sum())} tokens")
    assert mean < MEAN_GAP[kind] and worst < MAX_GAP[kind]
    if sampling.temperature != 1.0:  # the check has teeth: the temperature-1 values are far from these
        wrong_mean, _ = _gap(rollout, rollout_trainer_logp(policy, rollout, 1.0))
        assert wrong_mean > 5 * mean


def test_sleeps_for_training_frees_its_memory_and_serves_each_steps_adapter(served):
    engine, policy, kind = served
    _randomize_adapter(policy, seed=2)
    greedy = Sampling(max_new_tokens=16, temperature=0.0)
    before = engine.generate(PROMPTS, 1, greedy)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.release_memory()  # the trainer's call before its training phase
    free_asleep = torch.cuda.mem_get_info()[0]
    print(f"\n[vllm-cuda] {kind}: sleep freed {(free_asleep - free_awake) / GiB:.2f} GiB of vLLM's "
          f"{engine.pool_bytes() / GiB:.2f}")
    assert free_asleep - free_awake > SLEEP_FREES[kind]
    if kind == "fp8-block":  # sized for the rows: a small fraction of what the share of 0.2 takes (28 GiB)
        assert engine.measured_pool is not None and 0.1 * GiB < engine.pool_bytes() < 3 * GiB

    # A training step on the adapter while vLLM sleeps: make the current greedy completions less likely.
    params = [p for n, p in policy.named_parameters() if "lora_" in n]
    stale = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    for i, completion in enumerate(before.completions()):
        ids = torch.tensor([PROMPTS[i] + completion], device="cuda")
        logits = policy(input_ids=ids).logits[0, len(PROMPTS[i]) - 1: -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion, device="cuda")[:, None])
        logp.sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    after = engine.generate(PROMPTS, 1, greedy)  # wakes up, then serves the new adapter
    assert "wake_up" in after.timings and torch.cuda.mem_get_info()[0] < free_asleep - SLEEP_FREES[kind] / 2
    assert not torch.equal(before.completion_ids, after.completion_ids)
    mean, worst = _gap(after, rollout_trainer_logp(policy, after, 0.0))
    stale_mean, _ = _gap(after, _trainer_logp_with(policy, params, stale, after))
    print(f"[vllm-cuda] {kind} after a step: sampler-trainer |dlogp| mean {mean:.4f} max {worst:.3f} "
          f"(against the adapter before the step: mean {stale_mean:.4f})")
    assert mean < MEAN_GAP[kind] and worst < MAX_GAP[kind]
    # the new adapter's log-probs, not the old one's (on the CPU with transformers' greedy standing in for
    # vLLM, the step moved these tokens' log-probs by 7.5 nats, FP8-Block 8.8)
    assert mean < stale_mean / 4
    assert [p.name for p in engine.work_dir.iterdir()] == [f"adapter-{engine._adapter_id}"]


def _run_child(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run `cmd`, echoing its output line by line as it comes (a stage cut short still shows how far it
    got); returns (exit code, all output)."""
    lines: list[str] = []
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        timer = threading.Timer(timeout, child.kill)
        timer.start()
        try:
            for line in child.stdout:
                print(line, end="", flush=True)
                lines.append(line)
        finally:
            timer.cancel()
    return child.returncode, "".join(lines)


@pytest.mark.skipif(CHECKPOINT != "bf16", reason="run by the bf16 process")
def test_the_fp8_block_checkpoint_passes_the_same_tests_in_its_own_process():
    env = {**os.environ, "GRPO_VLLM_CHECKPOINT": "fp8-block"}
    code, output = _run_child([sys.executable, "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider", __file__,
                               "-k", "sampler_logp or sleeps"], env, timeout=900)
    assert code == 0 and "3 passed" in output, output[-3000:]


def _logp_moved_by(policy, adapters: dict) -> float:
    """Mean |log p| change that `adapters` make to the policy's greedy tokens after PROMPTS (from the
    base, adapters off): how far a step's update moved the policy, which a stale adapter in the engine
    would show as the next step's sampler-trainer gap."""
    from peft import set_peft_model_state_dict

    loaded = set_peft_model_state_dict(policy, adapters)
    assert not loaded.unexpected_keys, loaded.unexpected_keys[:3]
    moved = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad(), policy.disable_adapter():
            greedy = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                     do_sample=False)
            base = torch.log_softmax(policy(input_ids=greedy).logits[0, len(prompt) - 1: -1].float(), -1)
        with torch.no_grad():
            new = torch.log_softmax(policy(input_ids=greedy).logits[0, len(prompt) - 1: -1].float(), -1)
        tokens = greedy[0, len(prompt):, None]
        moved.append((new.gather(-1, tokens) - base.gather(-1, tokens)).abs().mean().item())
    return sum(moved) / len(moved)


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="needs unsloth: pip install 'grpo[unsloth]'")
def test_two_grpo_steps_on_the_unsloth_path_train_the_adapter_that_the_engine_then_serves(tmp_path, llama_tokenizer):
    from engine_runs import VLLM_SHARE, unsloth_run_flags, write_reward
    from safetensors.torch import load_file

    path = write_small_llama("fp8-block", tmp_path / "fp8-block", llama_tokenizer)
    out = tmp_path / "run"
    flags = unsloth_run_flags(path, out, write_reward(tmp_path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, output = _run_child([sys.executable, str(ROOT / "train.py"), *flags], env, timeout=1200)
    assert code == 0, output[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and "time/generate/adapter_sync" in r for r in steps)
    # Unsloth's engine, not plain vLLM's: no adapter files were written for it to read
    assert not list((out / "vllm").glob("adapter-*"))

    # A signal: the rewards of a group differ, so advantages are not all 0 ...
    samples = [line.strip() for line in output.splitlines() if line.lstrip().startswith("answer ")]
    assert steps[0]["reward_std"] > 0 and steps[0]["frac_zero_std"] < 1, (
        f"tied rewards: step 1's reward {steps[0]['reward']:.3f}, sampler-trainer gap "
        f"{steps[0]['gap/logp_abs_mean']} (max {steps[0]['gap/logp_abs_max']}); its completions: {samples[:2]}")
    # ... and each step moved the adapter (B starts at 0).
    after_1 = load_file(str(out / "checkpoint-1" / "adapter_model.safetensors"))
    after_2 = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in after_1.items())
    assert any(not torch.equal(after_1[k], after_2[k]) for k in after_1)

    # The engine served step 1's adapter in step 2: its log-probs stay near the trainer's, where the
    # base's (a stale adapter) are as far off as step 1's update moved the policy.
    cfg = Config(model=str(path), lora_rank=8, lora_alpha=16, dtype="bf16", gradient_checkpointing=False)
    policy, _, _ = load_policy(cfg, torch.device("cuda"))
    moved = _logp_moved_by(policy, after_1)
    gaps = [r["gap/logp_abs_mean"] for r in steps]
    print(f"\n[vllm-cuda] unsloth fp8-block: step 1's update moved log-probs by {moved:.3f} (mean |dlogp|); "
          f"sampler-trainer gap step 1 {gaps[0]:.4f}, step 2 {gaps[1]:.4f}; rewards std {steps[0]['reward_std']:.3f}; "
          f"mem {steps[0]['peak_mem_gib']:.2f} GiB + vllm {steps[0]['engine_pool_gib']:.2f} GiB")
    assert gaps[1] < moved / 4, (gaps, moved)

    # Memory: vLLM's pool is the share asked for (Unsloth takes it of the memory free at load, so at most
    # that much; standby alone would take 0.88), reported apart from ours.
    total_gib = torch.cuda.get_device_properties(0).total_memory / GiB
    assert all(0.5 * VLLM_SHARE * total_gib < r["engine_pool_gib"] <= 1.001 * VLLM_SHARE * total_gib for r in steps)
    assert all(0 < r["peak_mem_gib"] < 4 for r in steps)  # a two-layer model's training, without vLLM's pool
    assert f"+ vllm {steps[0]['engine_pool_gib']:.3g} GiB" in output
