"""A step's groups: sampled, scored and kept. `sample_groups` samples this rank's P prompts, G completions
each (`sample`), scores every rank's rows (`score`, one column per reward function, gathered over ranks
into `Scores`) and, with --dynamic-sampling (DAPO's), drops the groups whose rewards all tie and samples
the next prompts of the stream until N*P informative groups are kept or the rounds run out
(`rewards_differ`, `first_informative`, `join_groups`).

What it deliberately is not: the advantages or the update (`grpo.step`), nor the reward functions
themselves (`grpo.rewards`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from grpo import data as grpo_data
from grpo import rewards as grpo_rewards
from grpo.agents.environments import Episode
from grpo.agents.episodes import environment, episode_metrics
from grpo.agents.settings import play_episodes
from grpo.data import Example
from grpo.rollout.base import Rollout, Sampling, pad_rows
from grpo.run.log import NOT_APPLIED
from grpo.step_setup import StepSetup


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

    def reward_log(self) -> dict[str, float | int]:
        """Each reward's mean where it applies (`rewards/NAME`, NaN where it applies to none) and, for a reward
        that applies to no completion of the step (None or NaN for every one), how many it returned so for
        (`rewards_applies_to_none/NAME`): the step line says it, and the metrics record keeps it."""
        means = {f"rewards/{name}": float(self.rewards[:, j].nanmean()) for j, name in enumerate(self.names)}
        return {**means, **{f"{NOT_APPLIED}{name}": n for name, n in self.applies_to_none().items()}}

    def applies_to_none(self) -> dict[str, int]:
        """{reward name: completions} for each reward that returned None or NaN for every completion."""
        n = self.rewards.shape[0]
        nan = self.rewards.isnan().sum(0)  # (R,)
        return {name: n for name, count in zip(self.names, nan.tolist()) if n and count == n}

    def table(self) -> torch.Tensor:
        """(rows, R + 4) every column side by side, as ranks gather it: rewards, correct, formatted, lengths,
        finished. `from_table` reads it back."""
        return torch.cat([self.rewards, self.correct, self.formatted, self.lengths, self.finished], dim=1)

    @classmethod
    def from_table(cls, table: torch.Tensor, names: list[str]) -> "Scores":
        """The scores in a (rows, R + 4) `table` of `names`' R rewards and the four judged columns."""
        rewards, correct, formatted, lengths, finished = table.split([len(names), 1, 1, 1, 1], dim=1)
        return cls(rewards, names, correct, formatted, lengths, finished)




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
    episodes: dict[str, float] = dataclasses.field(default_factory=dict)  # every rank's `episode_metrics`; {}: single turn


def sample_groups(s: StepSetup, step: int, num_generations: int) -> SampledGroups:
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
    episodes: list[Episode] = []  # this rank's, of every round
    while True:
        examples, rollout, times, round_episodes = sample(s, step, num_generations, len(rollouts))
        round_texts, round_answers, round_scores = score(s, examples, rollout, num_generations, round_episodes)
        episodes += round_episodes
        rollouts.append(rollout)
        texts += round_texts
        answers += round_answers
        scores.append(round_scores)
        differ.append(rewards_differ(round_scores.total, num_generations))
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
    totals = torch.stack([sc.total.view(world.size, -1, num_generations) for sc in scores], dim=1)  # (N, rounds, P, G)
    kept_per_rank = keep.sum(dim=(0, 2))  # (N,)
    first_row = int(kept_per_rank[:world.rank].sum()) * num_generations
    report = None
    if cfg.dynamic_sampling:
        report = SamplingReport(rounds=rounds, prompts=rounds * target, groups_dropped=int((~informative).sum()),
                                groups_kept=int(keep.sum()))
    return SampledGroups(
        scores=scores_by_rank(scores, world.size), texts=texts, answers=answers,
        frac_zero_std=float((~informative).float().mean()),
        rollout=join_groups(rollouts, keep[:, world.rank], s.tokenizer.pad_token_id),
        kept_rewards=totals[keep.transpose(0, 1)].reshape(-1),  # rank after rank, each round after round
        rank_rows=slice(first_row, first_row + int(kept_per_rank[world.rank]) * num_generations),
        report=report, timings=timings,
        episodes=(episode_metrics([e for rank in world.gather_objects(episodes) for e in rank])
                  if s.episodes is not None else {}))  # single turn: no collective for nothing


def sample(s: StepSetup, step: int, num_generations: int, sampling_round: int = 0
           ) -> tuple[list[Example], Rollout, dict[str, float], list[Episode]]:
    """This rank's P prompts of the step's sampling round, G completions of each, the seconds it took (with
    the engine's own phases as generate/*) and, with --tools or --environment, the episodes that the
    completions are (`grpo.agents.episodes`; [] otherwise). The sampling seed is the step's, the rank's and
    the round's."""
    idx = rank_prompts(s, s.stream.next())
    examples = [s.prompts.examples[i] for i in idx]
    t = s.clock()
    sampling = round_sampling(s, step, sampling_round)
    episodes: list[Episode] = []
    if s.episodes is not None:
        rollout, episodes = play_episodes(s.engine, s.tokenizer, examples, num_generations, sampling, s.episodes)
    else:
        rollout = s.engine.generate([s.prompts.prompt_ids[i] for i in idx], num_generations, sampling)
    assert rollout.num_generations == num_generations, (
        f"the engine returned groups of {rollout.num_generations} completions; asked for {num_generations}")
    times = {"generate": s.clock() - t}
    times.update({f"generate/{k}": v for k, v in rollout.timings.items() if k != "decode_steps"})
    return examples, rollout, times, episodes


def rank_prompts(s: StepSetup, indices: list[int]) -> list[int]:
    """This rank's P of a round's N*P prompt indices."""
    P = s.cfg.prompts_per_step
    return indices[s.world.rank * P:(s.world.rank + 1) * P]


def round_sampling(s: StepSetup, step: int, sampling_round: int) -> Sampling:
    """The run's sampling seeded for this step, rank and sampling round."""
    seed = s.cfg.seed * 100_003 + step + 1_000_003 * s.world.rank + 15_485_863 * sampling_round
    return dataclasses.replace(s.sampling, seed=seed)


def sample_ahead(s: StepSetup, step: int, num_generations: int) -> None:
    """With --sample-ahead: starts the generate of step `step`'s prompts (the stream's next, not taken yet) from
    the policy as it is now; that step's `sample` receives it (`grpo.rollout.ahead`)."""
    idx = rank_prompts(s, s.stream.peek())
    s.engine.prefetch([s.prompts.prompt_ids[i] for i in idx], num_generations, round_sampling(s, step, 0))


def score(s: StepSetup, examples: list[Example], rollout: Rollout, num_generations: int,
          episodes: list[Episode] | None = None) -> tuple[list[str], list[str], Scores]:
    """This rank's completion texts and answers, and every rank's rows scored: one column per reward
    function. Advantages need only this rank's groups, but scale_rewards="batch" and the log use all.
    Reward functions get the dataset's columns and `completion_ids`, each completion's token ids (TRL's name:
    what a length-based reward such as --overlong-penalty reads). An episode's text and ids are its whole
    transcript, its tool calls and errors columns (`tool_calls`, `tool_errors`); with an environment, its reward
    is a column of its own (`rewards/environment`)."""
    completion_ids = rollout.completions()
    texts = s.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    answers = [ex.answer for ex in examples for _ in range(num_generations)]
    columns = {**grpo_data.batch_columns(examples, repeat=num_generations), "completion_ids": completion_ids}
    funcs = s.reward_funcs
    if s.episodes is not None:  # what an episode's reward functions may read beside the transcript
        columns["tool_calls"] = [e.tool_calls for e in episodes]
        columns["tool_errors"] = [e.tool_errors for e in episodes]
        if s.episodes.environment is not None:
            columns["environment_reward"] = [e.reward for e in episodes]
            funcs = [*funcs, environment]
    rewards, names = grpo_rewards.score(texts, answers, funcs, columns)  # (P*G, R)
    judged = [[grpo_rewards.is_correct(c, a), grpo_rewards.has_exact_format(c)] for c, a in zip(texts, answers)]
    judged = torch.tensor(judged, dtype=rewards.dtype).view(-1, 2)  # (P*G, 2) correct, formatted
    local = Scores(rewards, names, judged[:, :1], judged[:, 1:], rollout.lengths[:, None].to("cpu", rewards.dtype),
                   rollout.finished[:, None].to("cpu", rewards.dtype))
    return texts, answers, Scores.from_table(s.world.gather_rows(local.table()), names)


# --------------------------------------------------------------------------------------------------
# Dynamic sampling: which groups a step keeps, and the rows that hold them
# --------------------------------------------------------------------------------------------------
def rewards_differ(total: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(groups,) bool from (groups*G,) rewards: True where a group's rewards are not all equal, exactly
    as `group_advantages` tells a group with no signal (max == min)."""
    r = total.view(-1, num_generations)
    return r.amax(-1) != r.amin(-1)


def first_informative(informative: torch.Tensor, target: int) -> torch.Tensor:
    """(rounds, N, P) bool -> the same shape, True at the first `target` informative groups in the order
    they were drawn (round by round, rank by rank, group by group): DAPO fills its batch and stops."""
    flat = informative.reshape(-1)
    return (flat & (flat.cumsum(0) <= target)).view_as(informative)


def join_groups(rollouts: list[Rollout], keep: torch.Tensor, pad_id: int) -> Rollout:
    """One Rollout of the groups that `keep` (rounds, P) marks, round after round; completions padded
    to the longest. Without any kept group: a Rollout of no rows."""
    num_generations = rollouts[0].num_generations
    T = max(r.completion_ids.shape[1] for r in rollouts)
    prompt_ids, ids, mask, sampler_logp, finished = [], [], [], [], []
    for rollout, kept in zip(rollouts, keep):
        groups = kept.nonzero().flatten().tolist()
        rows = torch.tensor([g * num_generations + k for g in groups for k in range(num_generations)], dtype=torch.long)
        prompt_ids += [rollout.prompt_ids[g] for g in groups]
        ids.append(pad_rows(rollout.completion_ids[rows], pad_id, width=T))
        mask.append(pad_rows(rollout.mask[rows], False, width=T))
        sampler_logp.append(pad_rows(rollout.sampler_logp[rows], 0.0, width=T))
        finished.append(rollout.finished[rows])
    return Rollout(prompt_ids=prompt_ids, completion_ids=torch.cat(ids), mask=torch.cat(mask),
                   sampler_logp=torch.cat(sampler_logp), finished=torch.cat(finished), num_generations=num_generations)


def scores_by_rank(rounds: list[Scores], n_ranks: int) -> Scores:
    """The scores of several rounds as one: each rank's rows of every round, rank after rank (so rank 0's
    own rows come first, as `print_completions` expects)."""
    columns = [r.table() for r in rounds]
    table = torch.cat([c.view(n_ranks, -1, c.shape[-1]) for c in columns], dim=1).reshape(-1, columns[0].shape[-1])
    return Scores.from_table(table, rounds[0].names)
