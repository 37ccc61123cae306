"""One GRPO step, from prompts to an optimizer update: sample, score, advantages, reference and old
log-probs, mu passes of the clipped surrogate over micro-batches, gradient clipping and the optimizer
step. The `Batch` of prompt+completion rows and its log-probs are `grpo.batch`'s; the optimizer and
learning-rate schedule it steps are built in `grpo.optim`.

With --dynamic-sampling (DAPO's) a step samples in rounds: groups whose rewards all tie are dropped
and the next prompts of the stream are sampled until N*P informative groups are kept, or the rounds
run out. Every step also measures the sampler-trainer gap (`SamplerGap`) from the log-probs its loss
computes anyway.

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
from grpo.batch import Batch, batch_logprobs, make_batch, sequence_logprobs
from grpo.config import Config
from grpo.data import Example, PromptSet, PromptStream
from grpo.distributed import World
from grpo.loss import STAT_KEYS, clipped_surrogate, group_advantages, importance_weights
from grpo.loss.importance import clipped_by_correction
from grpo.rollout import Engine, Rollout, Sampling


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
    stream: PromptStream  # the global stream of N*P prompts per sampling round; this rank takes its P
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


@dataclass(frozen=True)
class SamplingReport:
    """What --dynamic-sampling did in one step, counted over all ranks."""

    rounds: int  # sampling rounds, each of N*P prompts
    prompts: int  # prompts taken from the stream: rounds * N * P
    groups_dropped: int  # groups whose rewards all tied
    groups_kept: int  # informative groups the step trained on, at most N*P; 0: no update


@dataclass
class Scores:
    """Every rank's completions of the step, scored, in rank order (the order of a one-process run);
    with several sampling rounds, each rank's rows of every round before the next rank's."""

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
    texts: list[str]  # this rank's P*G completions (of every sampling round)
    answers: list[str]  # their reference answers
    group_size: int  # G: completions per prompt
    frac_zero_std: float  # of the groups sampled, those whose rewards are all equal (no signal)
    loss_stats: dict[str, float]  # weighted means over the step (all ranks), true extremes of the ratio
    grad_norm: float | None  # before clipping, of the last pass; None when skipped
    skipped: bool  # a non-finite loss or gradient on some rank: the failing pass did not update
    timings: dict[str, float]  # seconds per phase
    sampling: SamplingReport | None = None  # what --dynamic-sampling did; None without it
    gap: dict[str, float] = dataclasses.field(default_factory=dict)  # the sampler-trainer gap; {} if not trained


# --------------------------------------------------------------------------------------------------
# The step, phase by phase
# --------------------------------------------------------------------------------------------------
def grpo_step(s: StepSetup, step: int, in_flight: InFlight) -> StepResult:
    """Step `step` (0-based) of the run: this rank's P prompts, G completions each, one update."""
    cfg = s.cfg
    G = cfg.num_generations  # the group size, here and wherever a rollout is split into groups

    # 1. Sample P prompts x G completions with the current policy (this rank's P of the N*P) and score
    #    them (every rank gathers all N*P*G rows). With --dynamic-sampling, the groups whose rewards
    #    tie are dropped and the next prompts sampled, round after round, until N*P groups are kept.
    groups = sample_groups(s, step, G)
    result = StepResult(scores=groups.scores, texts=groups.texts, answers=groups.answers, group_size=G,
                        frac_zero_std=groups.frac_zero_std, loss_stats={}, grad_norm=None, skipped=False,
                        timings=groups.timings, sampling=groups.report)
    if len(groups.kept_rewards) == 0:  # no rank kept a group (all know it): nothing to learn from
        return result

    # 2. Advantages within each kept group; this rank's rows.
    adv, _ = group_advantages(groups.kept_rewards, G, scale=cfg.scale_rewards)
    adv = adv[groups.rank_rows]  # (this rank's kept groups * G,)

    # 3. Reference and old log-probs, only when something uses them (eval mode: no dropout).
    s.policy.eval()
    batch = make_batch(groups.rollout, s.tokenizer.pad_token_id, s.device)
    adv = adv.to(s.device)
    micro = cfg.micro_batch_size or cfg.batch_size
    slices = [slice(i, i + micro) for i in range(0, len(batch), micro)]
    ref_logp, old_logp, logp_times = reference_and_old_logprobs(s, batch, slices)

    # 4. mu passes of clipped-surrogate steps over the rollout, in micro-batches; clip; optimizer step.
    update = update_policy(s, batch, slices, adv, ref_logp, old_logp, in_flight)
    return dataclasses.replace(result, loss_stats=update.loss_stats, grad_norm=update.grad_norm,
                               skipped=update.skipped, gap=update.gap,
                               timings={**groups.timings, **logp_times, "train": update.train_s,
                                        "optimizer": update.optimizer_s})


@dataclass
class SampledGroups:
    """The step's sampled and scored groups: all of them, for the log, and those it trains on."""

    scores: Scores  # every round's rows of every rank
    texts: list[str]  # this rank's completions of every round
    answers: list[str]  # their reference answers
    frac_zero_std: float  # of all sampled groups, the fraction whose rewards all tie
    rollout: Rollout  # this rank's kept groups (all it sampled without --dynamic-sampling)
    kept_rewards: torch.Tensor  # (K*G,) total rewards of every rank's kept groups, rank after rank
    rank_rows: slice  # this rank's rows of kept_rewards, in the order of `rollout`
    report: SamplingReport | None  # None without --dynamic-sampling
    timings: dict[str, float]


def sample_groups(s: StepSetup, step: int, G: int) -> SampledGroups:
    """Sampling rounds of N*P prompts (this rank's P), each scored; one round without --dynamic-sampling.

    With it, a round whose kept groups bring the step's informative groups (over all ranks) to N*P, or the
    last of --max-sampling-rounds, ends the sampling. Which groups are informative is read from the
    gathered rewards, so every rank runs the same rounds and keeps the same groups: the first N*P in the
    order they were drawn (round by round, rank by rank, as a one-process run would draw them). A rank
    may so keep more groups than another, or none.
    """
    cfg, world = s.cfg, s.world
    target = world.size * cfg.prompts_per_step
    max_rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
    rollouts: list[Rollout] = []  # this rank's, one per round
    texts: list[str] = []
    answers: list[str] = []
    scores: list[Scores] = []  # every rank's, one per round
    differ: list[torch.Tensor] = []  # (N*P,) bool per round: the group's rewards are not all equal
    timings: dict[str, float] = {}
    while True:
        examples, rollout, times = sample(s, step, G, len(rollouts))
        round_texts, round_answers, round_scores = score(s, examples, rollout, G)
        rollouts.append(rollout)
        texts += round_texts
        answers += round_answers
        scores.append(round_scores)
        differ.append(rewards_differ(round_scores.total, G))
        for k, v in times.items():
            timings[k] = timings.get(k, 0.0) + v
        if len(rollouts) == max_rounds or int(torch.stack(differ).sum()) >= target:
            break
    t = s.clock()
    if not s.keep_engine:
        s.engine.release_memory()
    timings["generate"] += s.clock() - t

    rounds = len(rollouts)
    informative = torch.stack(differ).view(rounds, world.size, -1)  # (rounds, N, P)
    keep = first_informative(informative, target) if cfg.dynamic_sampling else torch.ones_like(informative)
    totals = torch.stack([sc.total.view(world.size, -1, G) for sc in scores], dim=1)  # (N, rounds, P, G)
    kept_per_rank = keep.sum(dim=(0, 2))  # (N,)
    first_row = int(kept_per_rank[:world.rank].sum()) * G
    report = None
    if cfg.dynamic_sampling:
        report = SamplingReport(rounds=rounds, prompts=rounds * target, groups_dropped=int((~informative).sum()),
                                groups_kept=int(keep.sum()))
    return SampledGroups(
        scores=scores_by_rank(scores, world.size), texts=texts, answers=answers,
        frac_zero_std=float((~informative).float().mean()),
        rollout=join_groups(rollouts, keep[:, world.rank], s.tokenizer.pad_token_id),
        kept_rewards=totals[keep.transpose(0, 1)].reshape(-1),  # rank after rank, each round after round
        rank_rows=slice(first_row, first_row + int(kept_per_rank[world.rank]) * G),
        report=report, timings=timings)


def sample(s: StepSetup, step: int, G: int, sampling_round: int = 0
           ) -> tuple[list[Example], Rollout, dict[str, float]]:
    """This rank's P prompts of the step's sampling round, G completions of each, and the seconds it
    took (with the engine's own phases as generate/*). The sampling seed is the step's, the rank's and
    the round's."""
    cfg, world = s.cfg, s.world
    P = cfg.prompts_per_step
    idx = s.stream.next()[world.rank * P:(world.rank + 1) * P]
    examples = [s.prompts.examples[i] for i in idx]
    t = s.clock()
    seed = cfg.seed * 100_003 + step + 1_000_003 * world.rank + 15_485_863 * sampling_round
    rollout = s.engine.generate([s.prompts.prompt_ids[i] for i in idx], G, dataclasses.replace(s.sampling, seed=seed))
    assert rollout.n == G, f"the engine returned groups of {rollout.n} completions; asked for {G}"
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


# --------------------------------------------------------------------------------------------------
# Dynamic sampling: which groups a step keeps, and the rows that hold them
# --------------------------------------------------------------------------------------------------
def rewards_differ(total: torch.Tensor, G: int) -> torch.Tensor:
    """(groups,) bool from (groups*G,) rewards: True where a group's rewards are not all equal, exactly
    as `group_advantages` tells a group with no signal (max == min)."""
    r = total.view(-1, G)
    return r.amax(-1) != r.amin(-1)


def first_informative(informative: torch.Tensor, target: int) -> torch.Tensor:
    """(rounds, N, P) bool -> the same shape, True at the first `target` informative groups in the order
    they were drawn (round by round, rank by rank, group by group): DAPO fills its batch and stops."""
    flat = informative.reshape(-1)
    return (flat & (flat.cumsum(0) <= target)).view_as(informative)


def join_groups(rollouts: list[Rollout], keep: torch.Tensor, pad_id: int) -> Rollout:
    """One Rollout of the groups that `keep` (rounds, P) marks, round after round; completions padded
    to the longest. Without any kept group: a Rollout of no rows."""
    G = rollouts[0].n
    T = max(r.completion_ids.shape[1] for r in rollouts)
    prompt_ids, ids, mask, sampler_logp, finished = [], [], [], [], []
    for rollout, kept in zip(rollouts, keep):
        groups = kept.nonzero().flatten().tolist()
        rows = torch.tensor([g * G + k for g in groups for k in range(G)], dtype=torch.long)
        prompt_ids += [rollout.prompt_ids[g] for g in groups]
        ids.append(right_pad(rollout.completion_ids[rows], T, pad_id))
        mask.append(right_pad(rollout.mask[rows], T, False))
        sampler_logp.append(right_pad(rollout.sampler_logp[rows], T, 0.0))
        finished.append(rollout.finished[rows])
    return Rollout(prompt_ids=prompt_ids, completion_ids=torch.cat(ids), mask=torch.cat(mask),
                   sampler_logp=torch.cat(sampler_logp), finished=torch.cat(finished), n=G)


def right_pad(t: torch.Tensor, T: int, fill) -> torch.Tensor:
    """(B, t) -> (B, T), the new columns set to `fill`."""
    out = torch.full((t.shape[0], T), fill, dtype=t.dtype, device=t.device)
    out[:, :t.shape[1]] = t
    return out


def scores_by_rank(rounds: list[Scores], n_ranks: int) -> Scores:
    """The scores of several rounds as one: each rank's rows of every round, rank after rank (so rank 0's
    own rows come first, as `print_completions` expects)."""
    columns = [torch.cat([r.rewards, r.correct, r.formatted, r.lengths, r.finished], dim=1) for r in rounds]
    table = torch.cat([c.view(n_ranks, -1, c.shape[-1]) for c in columns], dim=1).reshape(-1, columns[0].shape[-1])
    rewards, correct, formatted, lengths, finished = table.split([len(rounds[0].names), 1, 1, 1, 1], dim=1)
    return Scores(rewards, rounds[0].names, correct, formatted, lengths, finished)


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
    non-finite loss or gradient on any rank stops them (the passes before it did update)."""
    cfg, world, policy, optimizer = s.cfg, s.world, s.policy, s.optimizer
    policy.train()
    train_s = optimizer_s = 0.0
    # Completions and tokens in the whole step, over all ranks (with --dynamic-sampling ranks may hold
    # different numbers of groups, or none).
    n_rows = int(world.sum(torch.tensor(len(batch))))
    n_tokens = world.sum(batch.mask.sum()).clamp(min=1)
    # When the sampler's numerics are not ours, weight each token by pi_trainer/pi_sampler.
    correct_sampler = s.engine.needs_importance_correction and cfg.is_correction != "none"
    agg: dict[str, float] = {}
    gap = SamplerGap()
    nonfinite = False
    grad_norm = None
    for n_pass in range(cfg.num_iterations):
        t = s.clock()
        optimizer.zero_grad(set_to_none=True)
        for sl in slices:
            mb = batch.rows(sl)
            logp = sequence_logprobs(policy, mb, cfg.temperature)
            mb_old = old_logp[sl] if old_logp is not None else logp.detach()
            if n_pass == 0:  # the policy before this step's update: what the sampler sampled from
                gap.add(mb_old, mb.sampler_logp, mb.mask, cfg)
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
            # one pass over all the step's rows (N*P*G, or the groups --dynamic-sampling kept).
            share = (mb.mask.sum() / n_tokens) if cfg.loss_norm == "token" else len(mb) / n_rows
            if not torch.isfinite(loss):
                nonfinite = True
                break
            (loss * share).backward()
            stats["loss"] = loss.detach()
            accumulate_stats(agg, stats, float(share), cfg.num_iterations)
        if len(batch) == 0:  # this rank kept no group: it adds nothing, and steps as the others do
            agg = no_stats()
            for p in s.params:
                p.grad = torch.zeros_like(p)
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
    gap_stats = gap.over_ranks(world)  # every rank leaves the passes at the same point
    if nonfinite:  # every rank agrees on it, so none enters reduce_stats alone
        optimizer.zero_grad(set_to_none=True)
        return PolicyUpdate(agg, None, True, train_s, optimizer_s, gap_stats)
    return PolicyUpdate(world.reduce_stats(agg), float(grad_norm), False, train_s, optimizer_s, gap_stats)


def no_stats() -> dict[str, float]:
    """The loss statistics of a rank without rows, which leave every rank's sums and extremes unchanged."""
    return {**{k: 0.0 for k in (*STAT_KEYS, "loss")}, "ratio_min": math.inf, "ratio_max": -math.inf}


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


class SamplerGap:
    """The sampler-trainer gap of one step: how far the sampler's log-prob of each sampled token
    (`Rollout.sampler_logp`) is from the trainer's, before the step updates the policy.

    Fed the log-probs the loss computes anyway (the first pass's, or old_logp with mu > 1), micro-batch
    by micro-batch: no extra forward pass. Reports, over the counted tokens of all ranks:
    `gap/logp_abs_mean` and `gap/logp_abs_max` of |log pi_train - log pi_sampler|, and `gap/is_clipped_frac`,
    the fraction of tokens whose importance weight --is-correction with --is-cap and --is-level would
    truncate or mask (by `clipped_by_correction`, the rule of `importance_weights`), whether or not the
    engine asks for the correction.
    """

    def __init__(self) -> None:
        self.abs_sum = self.abs_max = self.clipped = self.tokens = 0.0

    def add(self, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cfg: Config) -> None:
        """One micro-batch: (B, T) trainer and sampler log-probs of its tokens, (B, T) mask."""
        diff = (logp.detach().double() - sampler_logp.double()).abs()[mask]  # (tokens,) a bf16 gap would round
        clipped = clipped_by_correction(logp.detach(), sampler_logp, mask, level=cfg.is_level,
                                        mode=cfg.is_correction, cap=cfg.is_cap)
        self.abs_sum += float(diff.sum())
        if diff.numel():
            top = float(diff.max())
            if math.isnan(top) or top > self.abs_max:  # a NaN stays: it says more than any number would
                self.abs_max = top
        self.clipped += float(clipped.sum())
        self.tokens += diff.numel()

    def over_ranks(self, world: World) -> dict[str, float]:
        """The gap over every rank's tokens; a collective: every rank calls it."""
        total = world.reduce_stats({"abs_sum": self.abs_sum, "clipped": self.clipped, "tokens": self.tokens,
                                    "abs_max": self.abs_max})  # keys ending in _max take the max
        tokens = max(total["tokens"], 1.0)
        return {"gap/logp_abs_mean": total["abs_sum"] / tokens, "gap/logp_abs_max": total["abs_max"],
                "gap/is_clipped_frac": total["clipped"] / tokens}
