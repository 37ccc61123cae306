"""The model and the GRPO run that tests/test_vllm_cuda.py gives the vLLM engines, kept here so that CPU tests
can check them without a GPU (tests/test_engine_runs.py) and the probe benchmarks/probes/engine_sampling.py
can build the same model; and the trainer's log-probs that the vLLM tests (CPU and CUDA) and that probe
hold the engines' sampler log-probs against.

The model: a random two-layer Llama with Llama 3.2's vocabulary whose dimensions are multiples of 128 (FP8
blocks), with an output layer of its own. Tied to the input embedding, a random model's residual stream is
mostly the input token's embedding, so the logit of that same token stands ~16 standard deviations above
the rest: every completion repeated the prompt's last token (every Unsloth
completion the same, every reward tied). An untied output layer of std 0.125 gives logits of std ~2 over
the vocabulary: samples differ, and temperature and min_p change which tokens are likely.

The run: a step carries a signal only when rewards differ within a group: on a random model every
completion fails the recipe's rewards alike (-7.50 each, so every advantage is 0 and the adapter cannot
move). The extra reward, `longer_text`, pays for the completion's length in characters: different
completions of the same number of tokens decode to texts of different lengths, so a group's rewards differ.
"""

from __future__ import annotations

from pathlib import Path

# Two short prompts in Llama 3.2's token ids: what the engine tests and the probe sample from.
PROMPTS = [[128000, 791, 4320, 315, 220, 18, 10, 19, 374], [128000, 9906, 1917, 11, 856, 836, 374]]
OUTPUT_STD = 0.125  # the output layer's weights: logits of std ~2 (hidden 256, after the final RMSNorm)

REWARD_FUNCTION = "longer_text"
REWARD_SOURCE = '''"""A reward for tests: the completion's length in characters, over 100."""


def longer_text(completions, answers, **columns):
    return [len(text) / 100 for text in completions]
'''
# Large enough that one AdamW step moves the tiny model's log-probs by far more than the sampler-trainer
# gap of FP8 kernels, so a stale adapter in the engine would show in the next step's gap.
LEARNING_RATE = 0.02
VLLM_SHARE = 0.3  # --vllm-gpu-memory-utilization: Unsloth's standby would take 0.88


def write_reward(directory: Path) -> str:
    """Writes the reward module into `directory`; returns its --reward spec (path.py:function)."""
    path = Path(directory) / "longer_text_reward.py"
    path.write_text(REWARD_SOURCE)
    return f"{path}:{REWARD_FUNCTION}"


def unsloth_run_flags(model: Path, out: Path, reward: str) -> list[str]:
    """train.py's flags for two GRPO steps of the tiny model on the Unsloth path (eager vLLM: the start-up
    of torch.compile and CUDA graphs is not what the test is about)."""
    return ["--model", str(model), "--engine", "unsloth", "--dataset", "arithmetic", "--reward", reward,
            "--max-steps", "2", "--learning-rate", str(LEARNING_RATE), "--warmup-ratio", "0",
            "--lr-scheduler", "constant", "--prompts-per-step", "2", "--num-generations", "4",
            "--max-completion-length", "32", "--max-prompt-length", "160", "--max-seq-length", "256",
            "--lora-rank", "8", "--lora-alpha", "16", "--vllm-gpu-memory-utilization", str(VLLM_SHARE),
            "--vllm-enforce-eager", "true", "--eval-size", "0", "--save-steps", "1", "--log-completions-steps",
            "1", "--output-dir", str(out)]


def write_small_llama(kind: str, path: Path, tokenizer) -> Path:
    """The engine tests' model (see the module's docstring), saved as `kind`: "bf16", or "fp8-block" (the
    layout of unsloth/Llama-3.2-1B-Instruct-FP8-Block: the 7 projections as E4M3 codes in 128x128 blocks)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.config import LORA_TARGETS
    from grpo.model.fp8_checkpoint import save_fp8_block_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                         pad_token_id=128004, rope_theta=500000.0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, OUTPUT_STD)
    if kind == "fp8-block":
        save_fp8_block_checkpoint(model, path, LORA_TARGETS)
        model.generation_config.save_pretrained(path)
    elif kind == "bf16":
        model.to(torch.bfloat16).save_pretrained(path)
    else:
        raise ValueError(f"kind {kind!r}: use 'bf16' or 'fp8-block'")
    tokenizer.save_pretrained(path)
    return path


def trainer_logp(policy, prompts: list[list[int]], completions: list[list[int]], n: int, temperature: float = 1.0,
                 width: int | None = None):
    """(rows, width) float64: log softmax(logits / temperature) of each completion token under the policy, as the
    trainer computes it, from one forward over prompt + completion (row i continues prompts[i // n]); 0 past a
    completion's end. Temperature 0 (greedy) is scored at 1, as the trainer does. `width`: the longest
    completion unless given."""
    import torch

    device = next(policy.parameters()).device
    t = temperature if temperature > 0 else 1.0
    out = torch.zeros((len(completions), width or max(len(c) for c in completions)), dtype=torch.float64)
    for i, completion in enumerate(completions):
        prompt = prompts[i // n]
        ids = torch.tensor([prompt + completion], device=device)
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1: -1].double()
        logp = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0]
        out[i, : len(completion)] = logp.cpu()
    return out


def rollout_trainer_logp(policy, rollout, temperature: float):
    """`trainer_logp` for an engine's Rollout: (P*n, T) like its sampler_logp."""
    return trainer_logp(policy, rollout.prompt_ids, rollout.completions(), rollout.num_generations, temperature,
                        rollout.mask.shape[1])
