"""What tests/test_vllm_cuda.py's runs rely on, checked without a GPU: its model samples completions that
differ, its reward differs within a group where the recipe's rewards tie, its flags parse into the run it
means, and the trainer hands vLLM's share and eager mode to the engine it builds."""

from __future__ import annotations

import pytest
import torch

from engine_runs import LEARNING_RATE, VLLM_SHARE, unsloth_run_flags, write_reward, write_small_llama
from grpo import rewards as grpo_rewards
from grpo.config import Config, parse_args


def test_the_test_reward_separates_completions_the_recipes_rewards_score_alike(tmp_path, llama_tokenizer):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 120000, (4, 32), generator=gen)  # a random model's group of 4 completions
    texts = llama_tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
    answers = ["7"] * 4
    recipe = grpo_rewards.reward_functions("dapo")
    ours = grpo_rewards.reward_functions("dapo", [write_reward(tmp_path)])
    tied, _ = grpo_rewards.score(texts, answers, recipe, {})
    apart, names = grpo_rewards.score(texts, answers, ours, {})
    assert tied.sum(1).std() == 0  # every advantage would be 0
    assert apart.sum(1).std() > 0 and names[-1] == "longer_text"


def test_the_engine_tests_model_samples_completions_whose_rewards_differ(tmp_path, llama_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(write_small_llama("bf16", tmp_path / "model", llama_tokenizer),
                                                 dtype=torch.float32)
    prompt = torch.tensor([[128000, 791, 4320, 315, 220, 18, 10, 19, 374]])
    torch.manual_seed(0)
    out = model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=32,
                         num_return_sequences=4, pad_token_id=128004)
    completions = out[:, prompt.shape[1]:]
    # A model tied to its input embedding repeats the prompt's last token: one distinct token in 128.
    assert len(set(completions.flatten().tolist())) > completions.numel() // 2
    texts = llama_tokenizer.batch_decode(completions.tolist(), skip_special_tokens=True)
    functions = grpo_rewards.reward_functions("dapo", [write_reward(tmp_path)])
    rewards, _ = grpo_rewards.score(texts, ["7"] * 4, functions, {})
    assert rewards.sum(1).std() > 0
    with torch.no_grad():  # min_p 0.1 keeps many tokens: the tests' truncation is not "all but the top one"
        p = model(prompt).logits[0, -1].softmax(-1)
    assert (p >= 0.1 * p.max()).sum() > 10


def test_the_unsloth_runs_flags_parse_into_two_eager_steps_on_the_chosen_share(tmp_path):
    spec = write_reward(tmp_path)
    cfg = parse_args(unsloth_run_flags(tmp_path / "model", tmp_path / "run", spec))
    assert (cfg.engine, cfg.max_steps, cfg.save_steps, cfg.reward) == ("unsloth", 2, 1, (spec,))
    assert cfg.vllm_gpu_memory_utilization == VLLM_SHARE and cfg.vllm_enforce_eager is True
    assert cfg.learning_rate == LEARNING_RATE and cfg.warmup_ratio == 0 and cfg.lr_scheduler == "constant"


def test_vllms_share_is_none_by_default_or_a_share_and_out_of_range_values_name_the_flag():
    assert parse_args([]).vllm_gpu_memory_utilization is None  # a KV cache sized for the run
    assert parse_args(["--vllm-gpu-memory-utilization", "0.5"]).vllm_gpu_memory_utilization == 0.5
    assert parse_args(["--vllm-gpu-memory-utilization", "none"]).vllm_gpu_memory_utilization is None
    assert parse_args([]).vllm_enforce_eager is False
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"--vllm-gpu-memory-utilization .*\(0, 1\)"):
            Config(vllm_gpu_memory_utilization=bad)


def test_the_trainer_gives_unsloth_the_share_and_eager_mode_from_the_flags(tmp_path, monkeypatch):
    import types

    import grpo.rollout
    from grpo.trainer import load_model

    seen = {}

    def load_unsloth(options, **sizes):
        seen.update(vars(options), **sizes)
        return types.SimpleNamespace(policy="policy", tokenizer="tokenizer")

    monkeypatch.setattr(grpo.rollout, "load_unsloth", load_unsloth)
    cfg = Config(engine="unsloth", vllm_gpu_memory_utilization=0.3, vllm_enforce_eager=True, max_seq_length=640,
                 gradient_checkpointing=False)
    policy, tokenizer, model_dir, engine = load_model(cfg, torch.device("cpu"), tmp_path, rows=16)
    assert (policy, tokenizer, model_dir) == ("policy", "tokenizer", None) and engine.policy == "policy"
    assert seen["gpu_memory_utilization"] == 0.3 and seen["enforce_eager"] is True
    assert (seen["max_seq_length"], seen["rows"], seen["work_dir"]) == (640, 16, str(tmp_path))
    assert seen["model"] == cfg.model and seen["gradient_checkpointing"] is False
