"""The optimizer over the adapters and its learning-rate schedule, built once by `grpo.trainer.run`.

`make_optimizer` gives 8-bit AdamW (bitsandbytes) or torch's AdamW; `make_scheduler` a warmup then a
linear, cosine or constant schedule that counts finished optimizer steps. The trainer steps the
scheduler after each GRPO step and reads the learning rate from it for the log.

8-bit AdamW steps the adapters as one flat buffer in one call (`grpo.flat_params`) where that is bit for bit
the update of one call per tensor (`flat_refusal` says why not elsewhere); `optimizer_line` says which for the
run's banner, and `clip_grad_norm_` clips either way. It trades one gradient copy a step for the per-tensor calls'
host time (the bench step's A/B: benchmarks/RESULTS.md).

What it deliberately is not: the update. Gradients, clipping and `optimizer.step()` are the step's
(`grpo.step.update_policy`); saving and restoring their state is the checkpoint's.
"""

from __future__ import annotations

import math

import torch

from grpo.config import Config
from grpo.flat_params import MIN_8BIT_SIZE, FlatOptimizer, FlatParams, flat_refusal


def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kwargs = dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2))
    if cfg.optim == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ImportError("--optim adamw_8bit needs bitsandbytes: pip install bitsandbytes "
                              "(or use --optim adamw_torch)") from None
        if flat_refusal(params) is None:
            flat = FlatParams(params)
            return FlatOptimizer(flat, bnb.optim.AdamW8bit([flat.param], min_8bit_size=MIN_8BIT_SIZE, **kwargs))
        return bnb.optim.AdamW8bit(params, min_8bit_size=MIN_8BIT_SIZE, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def optimizer_line(cfg: Config, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> str:
    """How the optimizer steps the adapters, in the words of the run's banner."""
    if isinstance(optimizer, FlatOptimizer):
        return f"{cfg.optim}: one bitsandbytes call a step over a flat buffer of {len(params)} adapter tensors"
    if cfg.optim == "adamw_8bit":
        return f"{cfg.optim}: one bitsandbytes call per adapter tensor ({flat_refusal(params)})"
    return f"{cfg.optim}: torch's AdamW over {len(params)} adapter tensors"


def clip_grad_norm_(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                    max_norm: float) -> torch.Tensor:
    """The adapters' gradient norm before clipping, their gradients scaled to at most `max_norm`: torch's
    clip_grad_norm_, on the flat gradient where the optimizer keeps one (the same floats either way)."""
    if isinstance(optimizer, FlatOptimizer):
        return optimizer.flat.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(math.ceil(cfg.warmup_ratio * cfg.max_steps))

    def factor(step: int) -> float:  # step counts finished optimizer steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, cfg.max_steps - warmup)
        if cfg.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
