"""What every GRPO step reads, built once by `grpo.trainer.run`: the run's config, the policy and its
optimizer, the sampler and its sampling, the prompts and their stream, the reward functions.

A module of its own because both the step (`grpo.step`) and the groups it samples (`grpo.groups`) read it,
and the groups sit below the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo.agents.settings import EpisodeSettings
from grpo.config import Config
from grpo.data import PromptSet, PromptStream
from grpo.distributed import World
from grpo.rollout.base import Engine, Sampling


@dataclass(frozen=True)
class StepSetup:
    """What every step reads, built once by `grpo.trainer.run`."""

    cfg: Config
    world: World
    device: torch.device
    policy: Any  # the PeftModel being trained
    params: list[torch.nn.Parameter]  # its trainable adapters
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    engine: Engine
    engine_rows: int  # the most rows the engine generates at once: a step's P*G, or the evaluation's
    keep_engine: bool  # --engine-standby: the engine keeps its memory between steps (no release_memory)
    sampling: Sampling  # the run's sampling; each step seeds its own copy
    # Completion tokens at most, resolved once (`grpo.trainer.load_prompt_sets`) from --max-completion-length or
    # what the longest prompt leaves of the sequence: the sampler's budget (`sampling.max_new_tokens` is set from
    # it) and the constant loss_norm's length.
    max_completion_length: int
    prompts: PromptSet
    stream: PromptStream  # the global stream of N*P prompts per sampling round; this rank takes its P
    reward_funcs: list[Callable]
    clock: Callable[[], float]  # seconds, after the device has finished its queued work
    episodes: EpisodeSettings | None = None  # --tools or --environment: each completion is an episode; None: single turn
    # The training passes' widths rounded up to a multiple of this: --pad-to-multiple-of, and 8 where the layers
    # are compiled (`grpo.model.compiled_layers.width_multiple`)
    width_multiple: int = 1
    sample_ahead: bool = False  # --sample-ahead where the engine can: each step starts the next one's generate
