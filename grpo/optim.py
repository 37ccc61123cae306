"""The optimizer over the adapters and its learning-rate schedule, built once by `grpo.trainer.run`.

`make_optimizer` gives 8-bit AdamW (bitsandbytes) or torch's AdamW; `make_scheduler` a warmup then a
linear, cosine or constant schedule that counts finished optimizer steps. The trainer steps the
scheduler after each GRPO step and reads the learning rate from it for the log.

What it deliberately is not: the update. Gradients, clipping and `optimizer.step()` are the step's
(`grpo.step.update_policy`); saving and restoring their state is the checkpoint's.
"""

from __future__ import annotations

import math

import torch

from grpo.config import Config


def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kwargs = dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2))
    if cfg.optim == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ImportError("--optim adamw_8bit needs bitsandbytes: pip install bitsandbytes "
                              "(or use --optim adamw_torch)") from None
        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


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
