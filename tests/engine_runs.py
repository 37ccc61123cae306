"""The GRPO run that tests/test_vllm_cuda.py gives the Unsloth path, kept here so that CPU tests can check
its command line and its reward without a GPU (tests/test_engine_runs.py).

A step carries a signal only when rewards differ within a group: on a random model every completion
fails the recipe's rewards alike (-7.50 each, so every advantage is 0 and the adapter cannot move). The
extra reward, `longer_text`, pays for the completion's length in characters: completions of the same
number of tokens still decode to texts of different lengths, so a group's rewards differ.
"""

from __future__ import annotations

from pathlib import Path

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
            "0", "--output-dir", str(out)]
