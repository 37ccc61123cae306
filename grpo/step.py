"""One GRPO step, from prompts to an optimizer update: sample, score, advantages, reference and old
log-probs, mu passes of the clipped surrogate over micro-batches, gradient clipping and the optimizer
step. Also what the step is made of: the `Batch` of prompt+completion rows, the policy's log-probs of
its completion tokens, and the optimizer and learning-rate schedule it steps.

What it deliberately is not: the run. Counters, logging, evaluation, checkpoints and stopping belong
to `grpo.trainer.run`, which calls `grpo_step` once per step and reads the `StepResult` it returns.

Under torchrun every rank runs the step on its own P prompts; the ranks meet in `grpo.distributed`
to gather the scored rows, count tokens, sum adapter gradients and average the loss statistics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpo import data as grpo_data
from grpo import rewards as grpo_rewards
from grpo.config import Config
from grpo.data import Example, PromptSet, PromptStream
from grpo.distributed import World
from grpo.kernels.logprobs import token_logprobs
from grpo.loss import clipped_surrogate, group_advantages, importance_weights
from grpo.rollout import Engine, Rollout, Sampling


# --------------------------------------------------------------------------------------------------
# Log-probabilities of the completion tokens under the policy
# --------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """Prompt+completion rows, right-padded, on the device. Completion token t of row i sits at
    position start[i] + t, and is predicted by the hidden state at start[i] + t - 1."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    start: torch.Tensor  # (B,) prompt lengths
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) bool
    sampler_logp: torch.Tensor  # (B, T)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, sl: slice) -> "Batch":
        return Batch(*(t[sl] for t in (self.input_ids, self.attention_mask, self.start, self.completion_ids,
                                       self.mask, self.sampler_logp)))


def make_batch(rollout: Rollout, pad_id: int, device: torch.device) -> Batch:
    rows = [p for p in rollout.prompt_ids for _ in range(rollout.n)]
    B, T = rollout.completion_ids.shape
    width = max(len(p) for p in rows) + T
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(rows):
        n_tok = int(rollout.mask[i].sum())
        input_ids[i, :len(p)] = torch.tensor(p)
        input_ids[i, len(p):len(p) + T] = rollout.completion_ids[i]
        attention_mask[i, :len(p) + n_tok] = 1
    start = torch.tensor([len(p) for p in rows])
    parts = (input_ids, attention_mask, start, rollout.completion_ids, rollout.mask, rollout.sampler_logp.float())
    return Batch(*(t.to(device) for t in parts))


def sequence_logprobs(policy, batch: Batch, temperature: float) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens at `temperature`; 0 where mask is False.

    Runs the decoder to its final hidden states and hands only the masked completion positions to the
    fused `token_logprobs`, so a (tokens, vocab) logits tensor never exists whole.
    """
    base = policy.get_base_model()
    hidden = base.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        use_cache=False).last_hidden_state
    T = batch.completion_ids.shape[1]
    positions = batch.start[:, None] - 1 + torch.arange(T, device=hidden.device)  # (B, T)
    positions = positions.clamp(max=hidden.shape[1] - 1)
    h = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    lm_head = base.get_output_embeddings().weight
    logp = token_logprobs(h[batch.mask], lm_head, batch.completion_ids[batch.mask], temperature)
    return torch.zeros(batch.mask.shape, dtype=logp.dtype, device=logp.device).masked_scatter(batch.mask, logp)


# --------------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# What a step reads, what it reports
# --------------------------------------------------------------------------------------------------
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
    keep_engine: bool  # --engine-standby: the engine keeps its memory between steps (no release_memory)
    sampling: Sampling  # the run's sampling; each step seeds its own copy
    prompts: PromptSet
    stream: PromptStream  # the global stream of N*P prompts per step; this rank takes its P
    reward_funcs: list[Callable]
    clock: Callable[[], float]  # seconds, after the device has finished its queued work


@dataclass
class InFlight:
    """The step being run, as a second Ctrl-C or an error finds it: where the prompt stream stood
    before it and the RNG states then, and whether an optimizer step has already changed the adapters
    (then its state before is gone)."""

    stream_at_start: dict
    rng_at_start: dict = dataclasses.field(default_factory=dict)
    updated: bool = False


@dataclass
class Scores:
    """Every rank's completions of the step, scored, in rank order (the order of a one-process run)."""

    rewards: torch.Tensor  # (N*P*G, R) one column per reward function; NaN where one returned None
    names: list[str]  # the R reward functions
    correct: torch.Tensor  # (N*P*G, 1) the answer is right
    formatted: torch.Tensor  # (N*P*G, 1) the exact format
    lengths: torch.Tensor  # (N*P*G, 1) completion tokens
    finished: torch.Tensor  # (N*P*G, 1) stopped by EOS or a stop string, not by length

    @property
    def total(self) -> torch.Tensor:  # (N*P*G,)
        """One reward per completion; a function that returned None ("does not apply") adds nothing."""
        return self.rewards.nansum(-1)


@dataclass
class StepResult:
    """What one step did, for the log; the counters are the loop's."""

    scores: Scores
    texts: list[str]  # this rank's P*G completions
    answers: list[str]  # their reference answers
    group_size: int  # G: completions per prompt
    frac_zero_std: float  # groups whose rewards are all equal (no signal)
    loss_stats: dict[str, float]  # weighted means over the step (all ranks), true extremes of the ratio
    grad_norm: float | None  # before clipping, of the last pass; None when skipped
    skipped: bool  # a non-finite loss or gradient on some rank: the failing pass did not update
    timings: dict[str, float]  # seconds per phase


# --------------------------------------------------------------------------------------------------
# The step, phase by phase
# --------------------------------------------------------------------------------------------------
def grpo_step(s: StepSetup, step: int, in_flight: InFlight) -> StepResult:
    """Step `step` (0-based) of the run: this rank's P prompts, G completions each, one update."""
    cfg, world = s.cfg, s.world
    G = cfg.num_generations  # the group size, here and wherever a rollout is split into groups

    # 1. Sample P prompts x G completions with the current policy (this rank's P of the N*P).
    examples, rollout, sample_times = sample(s, step, G)

    # 2. Score (every rank gathers all N*P*G rows) and take advantages within this rank's groups.
    texts, answers, scores = score(s, examples, rollout, G)
    adv, adv_stats = group_advantages(scores.total, G, scale=cfg.scale_rewards)
    adv = adv.view(world.size, -1)[world.rank]  # (P*G,) this rank's groups

    # 3. Reference and old log-probs, only when something uses them (eval mode: no dropout).
    s.policy.eval()
    batch = make_batch(rollout, s.tokenizer.pad_token_id, s.device)
    adv = adv.to(s.device)
    micro = cfg.micro_batch_size or cfg.batch_size
    slices = [slice(i, i + micro) for i in range(0, len(batch), micro)]
    ref_logp, old_logp, logp_times = reference_and_old_logprobs(s, batch, slices)

    # 4. mu passes of clipped-surrogate steps over the rollout, in micro-batches; clip; optimizer step.
    update = update_policy(s, batch, slices, adv, ref_logp, old_logp, in_flight)
    return StepResult(scores=scores, texts=texts, answers=answers, group_size=G,
                      frac_zero_std=float(adv_stats["frac_zero_std"]), loss_stats=update.loss_stats,
                      grad_norm=update.grad_norm, skipped=update.skipped,
                      timings={**sample_times, **logp_times, "train": update.train_s,
                               "optimizer": update.optimizer_s})


def sample(s: StepSetup, step: int, G: int) -> tuple[list[Example], Rollout, dict[str, float]]:
    """This rank's P prompts of the step, G completions of each, and the seconds it took (with the
    engine's own phases as generate/*). The sampling seed is the step's and the rank's."""
    cfg, world = s.cfg, s.world
    P = cfg.prompts_per_step
    idx = s.stream.next()[world.rank * P:(world.rank + 1) * P]
    examples = [s.prompts.examples[i] for i in idx]
    t = s.clock()
    seed = cfg.seed * 100_003 + step + 1_000_003 * world.rank
    rollout = s.engine.generate([s.prompts.prompt_ids[i] for i in idx], G, dataclasses.replace(s.sampling, seed=seed))
    assert rollout.n == G, f"the engine returned groups of {rollout.n} completions; asked for {G}"
    if not s.keep_engine:
        s.engine.release_memory()
    times = {"generate": s.clock() - t}
    times.update({f"generate/{k}": v for k, v in rollout.timings.items() if k != "decode_steps"})
    return examples, rollout, times


def score(s: StepSetup, examples: list[Example], rollout: Rollout, G: int) -> tuple[list[str], list[str], Scores]:
    """This rank's completion texts and answers, and every rank's rows scored: one column per reward
    function. Advantages need only this rank's groups, but scale_rewards="batch" and the log use all."""
    texts = s.tokenizer.batch_decode(rollout.completions(), skip_special_tokens=True)
    answers = [ex.answer for ex in examples for _ in range(G)]
    columns = grpo_data.batch_columns(examples, repeat=G)
    rewards, names = grpo_rewards.score(texts, answers, s.reward_funcs, columns)  # (P*G, R)
    judged = [[grpo_rewards.is_correct(c, a), grpo_rewards.has_exact_format(c)] for c, a in zip(texts, answers)]
    table = s.world.gather_rows(torch.cat([rewards, torch.tensor(judged, dtype=rewards.dtype),
                                           rollout.lengths[:, None].to("cpu", rewards.dtype),
                                           rollout.finished[:, None].to("cpu", rewards.dtype)], dim=1))
    all_rewards, correct, formatted, lengths, finished = table.split([len(names), 1, 1, 1, 1], dim=1)
    return texts, answers, Scores(all_rewards, names, correct, formatted, lengths, finished)


def reference_and_old_logprobs(s: StepSetup, batch: Batch, slices: list[slice]
                               ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
    """(B, T) log-probs with the adapters disabled (only when beta > 0) and of the policy before this
    step's updates (only when mu > 1: with one pass the current log-probs, detached, are the old ones),
    and the seconds each took."""
    cfg, policy = s.cfg, s.policy
    t = s.clock()
    ref_logp = old_logp = None
    if cfg.beta > 0:
        with torch.no_grad(), policy.disable_adapter():
            ref_logp = torch.cat([sequence_logprobs(policy, batch.rows(sl), cfg.temperature) for sl in slices])
    times = {"reference": s.clock() - t}
    t = s.clock()
    if cfg.num_iterations > 1:
        with torch.no_grad():
            old_logp = torch.cat([sequence_logprobs(policy, batch.rows(sl), cfg.temperature) for sl in slices])
    times["old_logprobs"] = s.clock() - t
    return ref_logp, old_logp, times


@dataclass
class PolicyUpdate:
    """What `update_policy` did."""

    loss_stats: dict[str, float]  # all ranks' when not skipped; this rank's partial sums when skipped
    grad_norm: float | None  # the last pass's, before clipping; None when skipped
    skipped: bool  # a non-finite loss or gradient on some rank stopped the passes
    train_s: float  # seconds of loss forward and backward
    optimizer_s: float  # seconds of clipping and optimizer steps


def update_policy(s: StepSetup, batch: Batch, slices: list[slice], adv: torch.Tensor,
                  ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None, in_flight: InFlight) -> PolicyUpdate:
    """mu passes over the micro-batches, each ending in a clipped gradient and an optimizer step; a
    non-finite loss or gradient on any rank stops them (the passes before it did update)."""
    cfg, world, policy, optimizer = s.cfg, s.world, s.policy, s.optimizer
    policy.train()
    train_s = optimizer_s = 0.0
    n_rows = world.size * len(batch)  # completions in the whole step, over all ranks
    n_tokens = world.sum(batch.mask.sum()).clamp(min=1)
    # When the sampler's numerics are not ours, weight each token by pi_trainer/pi_sampler.
    correct_sampler = s.engine.needs_importance_correction and cfg.is_correction != "none"
    agg: dict[str, float] = {}
    nonfinite = False
    grad_norm = None
    for _ in range(cfg.num_iterations):
        t = s.clock()
        optimizer.zero_grad(set_to_none=True)
        for sl in slices:
            mb = batch.rows(sl)
            logp = sequence_logprobs(policy, mb, cfg.temperature)
            mb_old = old_logp[sl] if old_logp is not None else logp.detach()
            is_w = None
            if correct_sampler:
                is_w, _ = importance_weights(mb_old, mb.sampler_logp, mb.mask, level=cfg.is_level,
                                             mode=cfg.is_correction, cap=cfg.is_cap)
            loss, stats = clipped_surrogate(
                logp, mb_old, adv[sl], mb.mask, ref_logp=None if ref_logp is None else ref_logp[sl],
                beta=cfg.beta, eps_low=cfg.epsilon, eps_high=cfg.epsilon_high, delta=cfg.delta,
                ratio_level=cfg.ratio_level, norm=cfg.loss_norm, max_len=s.sampling.max_new_tokens,
                is_weights=is_w, kl=cfg.kl_estimator, policy_loss=cfg.loss_type,
                cispo_eps_low=cfg.cispo_eps_low, cispo_eps_high=cfg.cispo_eps_high,
                sapo_tau_pos=cfg.sapo_tau_pos, sapo_tau_neg=cfg.sapo_tau_neg)
            # Each micro-batch's loss is normalised within itself; weight it by its share of the
            # whole step's batch so that the gradient, accumulated and summed over ranks, equals
            # one pass over all N*P*G rows.
            share = (mb.mask.sum() / n_tokens) if cfg.loss_norm == "token" else len(mb) / n_rows
            if not torch.isfinite(loss):
                nonfinite = True
                break
            (loss * share).backward()
            stats["loss"] = loss.detach()
            accumulate_stats(agg, stats, float(share), cfg.num_iterations)
        nonfinite = world.sum_grads_(s.params, nonfinite)  # a bad loss on any rank skips the step on all
        train_s += s.clock() - t
        if nonfinite:
            break
        t = s.clock()
        grad_norm = torch.nn.utils.clip_grad_norm_(s.params, cfg.max_grad_norm if cfg.max_grad_norm > 0
                                                   else float("inf"))
        if not torch.isfinite(grad_norm):
            nonfinite = True
            break
        optimizer.step()
        in_flight.updated = True
        optimizer_s += s.clock() - t
    if nonfinite:  # every rank agrees on it, so none enters reduce_stats alone
        optimizer.zero_grad(set_to_none=True)
        return PolicyUpdate(agg, None, True, train_s, optimizer_s)
    return PolicyUpdate(world.reduce_stats(agg), float(grad_norm), False, train_s, optimizer_s)


def accumulate_stats(agg: dict[str, float], stats: dict[str, torch.Tensor], share: float, passes: int) -> None:
    """Adds one micro-batch's stats into `agg`: means weighted by its share of the step's batch over
    the passes, but true extremes of the ratio."""
    for k, v in stats.items():
        if k == "ratio_min":
            agg[k] = min(agg.get(k, math.inf), float(v))
        elif k == "ratio_max":
            agg[k] = max(agg.get(k, -math.inf), float(v))
        else:
            agg[k] = agg.get(k, 0.0) + float(v) * share / passes
