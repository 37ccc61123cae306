"""One GRPO step, from prompts to an optimizer update: sample, score, advantages, reference and old
log-probs, mu passes of the clipped surrogate over micro-batches, gradient clipping and the optimizer
step. What it is made of lives in the rooms below it: sampling, scoring and keeping groups (with
--dynamic-sampling, in rounds) in `grpo.groups`, the `Batch` of prompt+completion rows and its
log-probs in `grpo.batch`; the optimizer and schedule it steps are built in `grpo.optim`. Every step
also measures the sampler-trainer gap (`grpo.loss.importance.SamplerGap`) from the log-probs its loss
computes anyway.

What it deliberately is not: the run. Counters, logging, evaluation, checkpoints and stopping belong
to `grpo.trainer.run`, which calls `grpo_step` once per step and reads the `StepResult` it returns.

Under torchrun every rank runs the step on its own P prompts; the ranks meet in `grpo.distributed`
to gather the scored rows, count tokens, sum adapter gradients and average the loss statistics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from grpo.batch import (Batch, batch_logprobs, finished_rows, make_batch, micro_batches, real_token_share,
                        sequence_logprobs)
from grpo.config import Config
from grpo.groups import SamplingReport, Scores, sample_ahead, sample_groups
from grpo.loss import STAT_KEYS, SamplerGap, clipped_surrogate, group_advantages, importance_weights
from grpo.model.load import adapters_off
from grpo.optim import clip_grad_norm_
from grpo.step_setup import StepSetup


# --------------------------------------------------------------------------------------------------
# What a step reports (what it reads is `grpo.step_setup.StepSetup`)
# --------------------------------------------------------------------------------------------------
@dataclass
class InFlight:
    """The step being run, as a second Ctrl-C or an error finds it: where the prompt stream stood
    before it and the RNG states then, and whether an optimizer step has already changed the adapters
    (then its state before is gone)."""

    stream_at_start: dict
    rng_at_start: dict = dataclasses.field(default_factory=dict)
    updated: bool = False


@dataclass
class StepResult:
    """What one step did, and its line of the log (`log_record`); the counters are the loop's."""

    scores: Scores
    texts: list[str]  # this rank's P*G completions (of every sampling round)
    answers: list[str]  # their reference answers
    num_generations: int  # G: completions per prompt
    frac_zero_std: float  # of the groups sampled, those whose rewards are all equal (no signal)
    loss_stats: dict[str, float]  # weighted means over the step (all ranks), true extremes of the ratio
    grad_norm: float | None  # before clipping, of the last pass; None when skipped
    skipped: bool  # a non-finite loss or gradient on some rank: the failing pass did not update
    timings: dict[str, float]  # seconds per phase
    sampling: SamplingReport | None = None  # what --dynamic-sampling did; None without it
    gap: dict[str, float] = dataclasses.field(default_factory=dict)  # the sampler-trainer gap; {} if not trained
    real_token_frac: float | None = None  # this rank's real tokens over the positions trained; None: not trained
    episodes: dict[str, float] = dataclasses.field(default_factory=dict)  # turns, tool calls...; {}: single turn

    def log_record(self, step: int, lr: float, step_time: float, peak_mem_gib: float,
                   engine_pool_gib: float | None = None, gc_time: float | None = None) -> dict:
        """One line of metrics.jsonl: the batch of all ranks; time and memory are this rank's. With
        --dynamic-sampling the batch is every completion sampled, kept or dropped. `peak_mem_gib` is the
        trainer's; `engine_pool_gib` (vLLM's share of the GPU, --engine vllm/unsloth) is logged apart; `gc_time`:
        the step's seconds in Python's garbage collector (`grpo.run.log.GcClock`), inside the phases' times."""
        scores = self.scores
        total = scores.total  # (N*P*G,)
        record = {
            "step": step, "reward": float(total.mean()), "reward_std": float(total.std()) if len(total) > 1 else 0.0,
            **scores.reward_log(),
            "accuracy": float(scores.correct.double().mean()), "format": float(scores.formatted.double().mean()),
            "completion_length": float(scores.lengths.double().mean()),
            "frac_finished": float(scores.finished.double().mean()),
            "frac_zero_std": float(self.frac_zero_std),
            "lr": lr, "grad_norm": self.grad_norm,
            "skipped": self.skipped, **self.loss_stats,
            "step_time": step_time, **{f"time/{k}": v for k, v in self.timings.items()},
            **({} if gc_time is None else {"gc_time": gc_time}),
            "peak_mem_gib": peak_mem_gib,
            **({} if engine_pool_gib is None else {"engine_pool_gib": engine_pool_gib}),
            **self.gap,  # gap/logp_abs_mean, gap/logp_abs_max, gap/is_clipped_frac; none if nothing was trained
            **({} if self.real_token_frac is None else {"train/real_token_frac": self.real_token_frac}),
            **self.episodes,  # episodes/turns, episodes/tool_calls, ...: with --tools or --environment
        }
        if self.sampling is not None:
            report = self.sampling
            record.update({"sampling/rounds": report.rounds, "sampling/prompts": report.prompts,
                           "sampling/groups_dropped": report.groups_dropped,
                           "sampling/groups_kept": report.groups_kept})
        return record


# --------------------------------------------------------------------------------------------------
# The step, phase by phase
# --------------------------------------------------------------------------------------------------
def grpo_step(s: StepSetup, step: int, in_flight: InFlight) -> StepResult:
    """Step `step` (0-based) of the run: this rank's P prompts, G completions each, one update."""
    cfg = s.cfg
    num_generations = cfg.num_generations  # G, the group size: its one name wherever a rollout is split in groups

    # 1. Sample P prompts x G completions with the current policy (this rank's P of the N*P) and score
    #    them (every rank gathers all N*P*G rows). With --dynamic-sampling, the groups whose rewards
    #    tie are dropped and the next prompts sampled, round after round, until N*P groups are kept.
    #    With --sample-ahead the completions were generated during the step before, from the policy before
    #    its update, and the next step's start here, to generate while this one trains.
    groups = sample_groups(s, step, num_generations)
    if s.sample_ahead and step + 1 < cfg.max_steps:  # the next step's completions generate while this one trains
        sample_ahead(s, step + 1, num_generations)
    result = StepResult(scores=groups.scores, texts=groups.texts, answers=groups.answers,
                        num_generations=num_generations, frac_zero_std=groups.frac_zero_std, loss_stats={},
                        grad_norm=None, skipped=False, timings=groups.timings, sampling=groups.report,
                        episodes=groups.episodes)
    if len(groups.kept_rewards) == 0:  # no rank kept a group (all know it): nothing to learn from
        return result

    # 2. Advantages within each kept group; this rank's rows.
    adv, _ = group_advantages(groups.kept_rewards, num_generations, scale_rewards=cfg.scale_rewards)
    adv = adv[groups.rank_rows]  # (this rank's kept groups * G,)

    # 3. Reference and old log-probs, only when something uses them (eval mode: no dropout).
    s.policy.eval()
    batch = make_batch(groups.rollout, s.tokenizer.pad_token_id, s.device)
    adv = adv.to(s.device)
    if cfg.mask_truncated_completions:  # the cut completions leave the loss, after counting in the advantages
        batch, adv = finished_rows(batch, adv, groups.rollout.finished)
        if int(s.world.sum(torch.tensor(len(batch)))) == 0:  # every completion of the step was cut: no update
            return result
    batch, adv, slices = micro_batches(batch, adv, cfg.micro_batch_size or cfg.batch_size,  # like lengths together
                                       s.width_multiple)
    ref_logp, old_logp, logp_times = reference_and_old_logprobs(s, batch, slices)

    # 4. mu passes of clipped-surrogate steps over the rollout, in micro-batches; clip; optimizer step.
    update = update_policy(s, batch, slices, adv, ref_logp, old_logp, in_flight)
    return dataclasses.replace(result, loss_stats=update.loss_stats, grad_norm=update.grad_norm,
                               skipped=update.skipped, gap=update.gap,
                               real_token_frac=real_token_share(batch, slices),
                               timings={**groups.timings, **logp_times, "train": update.train_s,
                                        "optimizer": update.optimizer_s})


def reference_and_old_logprobs(s: StepSetup, batch: Batch, slices: list[slice]
                               ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
    """(B, T) log-probs with the adapters disabled (only when beta > 0) and of the policy before this
    step's updates (only when mu > 1: with one pass the current log-probs, detached, are the old ones),
    and the seconds each took."""
    cfg, policy = s.cfg, s.policy
    t = s.clock()
    ref_logp = old_logp = None
    if cfg.beta > 0:
        with torch.no_grad(), adapters_off(policy):
            ref_logp = batch_logprobs(policy, batch, slices, cfg.temperature)
    times = {"reference": s.clock() - t}
    t = s.clock()
    if cfg.num_iterations > 1:
        with torch.no_grad():
            old_logp = batch_logprobs(policy, batch, slices, cfg.temperature)
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
    gap: dict[str, float]  # the sampler-trainer gap, all ranks (see `SamplerGap`)


def update_policy(s: StepSetup, batch: Batch, slices: list[slice], adv: torch.Tensor,
                  ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None, in_flight: InFlight) -> PolicyUpdate:
    """mu passes over the micro-batches, each ending in a clipped gradient and an optimizer step; a
    non-finite loss or gradient on any rank stops them (the passes before it did update).

    Inside a pass nothing of ours waits for the device: the losses' finiteness and the statistics stay device
    tensors until every micro-batch's backward is queued, so the host queues the next micro-batch while the
    device runs this one. (transformers' forward of each micro-batch waits once, to ask whether rows without a
    mask are packed sequences.) A non-finite loss still runs its backward (its gradients are dropped with the
    step)."""
    cfg, world, policy, optimizer = s.cfg, s.world, s.policy, s.optimizer
    policy.train()
    train_s = optimizer_s = 0.0
    # Completions and tokens in the whole step, over all ranks (with --dynamic-sampling ranks may hold
    # different numbers of groups, or none).
    n_rows = int(world.sum(torch.tensor(len(batch))))
    n_tokens = world.sum(batch.mask.sum()).clamp(min=1)
    # When the sampler's numerics are not ours, weight each token by pi_trainer/pi_sampler.
    correct_sampler = s.engine.needs_importance_correction and cfg.is_correction != "none"
    agg: dict = {}  # statistics: device tensors until host_stats
    gap = SamplerGap(is_level=cfg.is_level, is_correction=cfg.is_correction, is_cap=cfg.is_cap)
    loss_options = surrogate_options(cfg, s.max_completion_length)
    nonfinite = False
    grad_norm = None
    for n_pass in range(cfg.num_iterations):
        t = s.clock()
        optimizer.zero_grad(set_to_none=True)
        bad_loss = torch.zeros((), dtype=torch.bool, device=batch.mask.device)  # a non-finite loss in this pass
        for sl in slices:
            mb = batch.rows(sl)
            logp = sequence_logprobs(policy, mb, cfg.temperature)
            mb_old = old_logp[sl] if old_logp is not None else logp.detach()
            if n_pass == 0:  # the policy before this step's update: what the sampler sampled from
                gap.add(mb_old, mb.sampler_logp, mb.mask)
            is_w = None
            if correct_sampler:
                is_w, _ = importance_weights(mb_old, mb.sampler_logp, mb.mask, is_level=cfg.is_level,
                                             is_correction=cfg.is_correction, is_cap=cfg.is_cap)
            loss, stats = clipped_surrogate(logp, mb_old, adv[sl], mb.mask, is_weights=is_w,
                                            ref_logp=None if ref_logp is None else ref_logp[sl], **loss_options)
            # Each micro-batch's loss is normalised within itself; weight it by its share of the
            # whole step's batch so that the gradient, accumulated and summed over ranks, equals
            # one pass over all the step's rows (N*P*G, or the groups --dynamic-sampling kept).
            share = (mb.mask.sum() / n_tokens) if cfg.loss_norm == "token" else len(mb) / n_rows
            bad_loss |= ~torch.isfinite(loss.detach())
            (loss * share).backward()
            stats["loss"] = loss.detach()
            accumulate_stats(agg, stats, share, cfg.num_iterations)
        if len(batch) == 0:  # this rank kept no group: it adds nothing, and steps as the others do
            agg = no_stats()
            for p in s.params:
                p.grad = torch.zeros_like(p)
        # the pass's one wait for the device; a bad loss on any rank skips the step on all
        nonfinite = world.sum_grads_(s.params, bool(bad_loss))
        train_s += s.clock() - t
        if nonfinite:
            break
        t = s.clock()
        grad_norm = clip_grad_norm_(optimizer, s.params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
        if not torch.isfinite(grad_norm):
            nonfinite = True
            break
        optimizer.step()
        in_flight.updated = True
        optimizer_s += s.clock() - t
    gap_stats = gap.over_ranks(world)  # every rank leaves the passes at the same point
    agg = host_stats(agg)
    if nonfinite:  # every rank agrees on it, so none enters reduce_stats alone
        optimizer.zero_grad(set_to_none=True)
        return PolicyUpdate(agg, None, True, train_s, optimizer_s, gap_stats)
    return PolicyUpdate(world.reduce_stats(agg), float(grad_norm), False, train_s, optimizer_s, gap_stats)


def surrogate_options(cfg: Config, max_completion_length: int) -> dict[str, Any]:
    """`clipped_surrogate`'s keywords that hold for the whole run: the policy term and the KL and normalisation
    choices of the flags."""
    return dict(term=cfg.policy_term, beta=cfg.beta, kl_estimator=cfg.kl_estimator, ratio_level=cfg.ratio_level,
                loss_norm=cfg.loss_norm, max_completion_length=max_completion_length)


def no_stats() -> dict[str, float]:
    """The loss statistics of a rank without rows, which leave every rank's sums and extremes unchanged."""
    return {**{k: 0.0 for k in (*STAT_KEYS, "loss")}, "ratio_min": math.inf, "ratio_max": -math.inf}


def accumulate_stats(agg: dict, stats: dict[str, torch.Tensor], share: torch.Tensor | float, passes: int) -> None:
    """Adds one micro-batch's stats into `agg`: means weighted by its share of the step's batch over
    the passes, but true extremes of the ratio. On the stats' device, in float64, every key in one stacked tensor:
    a handful of ops a micro-batch for the host to issue, where a tensor a key took four or five each (`host_stats`
    reads them). The stats come detached (`clipped_surrogate`'s, and the loss detached)."""
    keys = tuple(stats)  # the same keys every micro-batch: STAT_KEYS and the loss
    values = torch.stack([torch.as_tensor(v) for v in stats.values()]).double()  # (K,)
    weighted = values * share / passes
    low, high = values[keys.index("ratio_min")], values[keys.index("ratio_max")]
    if "sums" not in agg:
        agg.update(keys=keys, sums=weighted, ratio_min=low, ratio_max=high)
        return
    agg.update(sums=agg["sums"] + weighted, ratio_min=torch.minimum(agg["ratio_min"], low),
               ratio_max=torch.maximum(agg["ratio_max"], high))


def host_stats(agg: dict) -> dict[str, float]:
    """`accumulate_stats`' sums as Python floats, read from the device at once (a dict of floats, as `no_stats`
    gives, as it stands)."""
    if "sums" not in agg:
        return dict(agg)
    values = torch.cat([agg["sums"], agg["ratio_min"][None], agg["ratio_max"][None]]).tolist()  # one copy, one wait
    return {**dict(zip(agg["keys"], values)), "ratio_min": values[-2], "ratio_max": values[-1]}
