"""--dynamic-sampling: which groups a step keeps (by hand), the loss norms on fewer groups, resume after a
step of several rounds, and two ranks that keep what one process keeps.

Ties are made predictable by the data: a prompt whose answer is "tie" gets one reward for all its
completions, any other prompt a hash of each completion's text (different completions, different
rewards). Which prompt a round draws is read from a twin `PromptStream`, so each test writes its
dataset in the order the stream will draw it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer
from grpo.batch import make_batch, micro_batches, sequence_logprobs
from grpo.config import Config
from grpo.data import Example, PromptStream, build_prompts
from grpo.distributed import World
from grpo.loss import clipped_surrogate, group_advantages
from grpo.rollout import Rollout, Sampling
from grpo.run.log import step_line
from grpo.groups import SamplingReport, first_informative, join_groups, sample_groups
from grpo.step import InFlight, update_policy
from grpo.step_setup import StepSetup
from test_distributed import PromptHashEngine, adapter_tensors, dist_cfg, prompt_hash_engine, records


def tie_or_hash(completions, answers, **columns):
    """0 for every completion of a prompt whose answer is "tie"; otherwise a hash of the completion."""
    return [0.0 if a == "tie" else zlib.crc32(c.encode()) / 2**32 for c, a in zip(completions, answers)]


def drawn_in_order(n: int, per_draw: int, seed: int) -> list[int]:
    """The example indices a PromptStream(n, per_draw, seed) gives over its first epoch, in order."""
    twin = PromptStream(n, per_draw, seed)
    return [i for _ in range(n // per_draw) for i in twin.next()]


def examples_for(pattern: str, per_draw: int, seed: int) -> list[Example]:
    """One example per letter, placed so that the stream draws them in `pattern`'s order: t a tie, i not."""
    order = drawn_in_order(len(pattern), per_draw, seed)
    examples: list[Example | None] = [None] * len(pattern)
    for position, (index, kind) in enumerate(zip(order, pattern)):
        examples[index] = Example(f"Question {position}: what is {position} + 1?",
                                  "tie" if kind == "t" else str(position + 1))
    return examples


def write_jsonl(path: Path, examples: list[Example]) -> Path:
    path.write_text("".join(json.dumps({"question": e.question, "answer": e.answer}) + "\n" for e in examples))
    return path


# --------------------------------------------------------------------------------------------------
# The kept groups, by hand (one process, a stand-in sampler, no model)
# --------------------------------------------------------------------------------------------------
def sampling_setup(pattern: str, *, P: int, dynamic: bool, rounds: int, G: int = 2, seed: int = 3) -> StepSetup:
    tokenizer = char_tokenizer()
    prompts = build_prompts(tokenizer, examples_for(pattern, P, seed), max_prompt_length=10_000)
    cfg = Config(model="unused", num_generations=G, prompts_per_step=P, dynamic_sampling=dynamic,
                 max_sampling_rounds=rounds, max_completion_length=6, seed=seed)
    return StepSetup(cfg=cfg, world=World(), device=torch.device("cpu"), policy=None, params=[], optimizer=None,
                     tokenizer=tokenizer, engine=PromptHashEngine(tokenizer.pad_token_id), engine_rows=P * G, keep_engine=False,
                     sampling=Sampling(max_new_tokens=6), max_completion_length=6, prompts=prompts,
                     stream=PromptStream(len(prompts), P, seed),
                     reward_funcs=[tie_or_hash], clock=time.perf_counter)


def by_hand(pattern: str, P: int, dynamic: bool, rounds: int) -> tuple[list[int], int]:
    """(stream positions of the kept groups, rounds run): DAPO's rule, or every group of one round."""
    if not dynamic:
        return list(range(P)), 1
    kept = []
    for r in range(rounds):
        kept += [j for j in range(r * P, (r + 1) * P) if pattern[j] == "i"]
        if len(kept) >= P:
            return kept[:P], r + 1
    return kept, rounds


@pytest.mark.parametrize("pattern, P, dynamic, rounds", [
    ("iitttttt", 2, True, 3),  # the first round is informative: one round, as without dynamic sampling
    ("tittiitt", 2, True, 3),  # 1 + 0 + 1 informative: three rounds; the surplus group of round 3 is not kept
    ("titiiiii", 2, True, 3),  # two rounds
    ("tttttttt", 2, True, 3),  # nothing informative: three rounds, nothing kept
    ("tiiiiiii", 2, True, 1),  # one round: it only filters
    ("tiiiiiii", 2, False, 3),  # off: one round, the tie group kept (its advantages are 0)
    ("ttittiiiiiii", 3, True, 3),  # P=3: 1 + 1 + 3 informative, the third round fills the step
])
def test_the_kept_groups_are_the_first_informative_ones_in_draw_order(pattern, P, dynamic, rounds):
    s = sampling_setup(pattern, P=P, dynamic=dynamic, rounds=rounds)
    G = s.cfg.num_generations
    groups = sample_groups(s, step=0, num_generations=G)
    kept, n_rounds = by_hand(pattern, P, dynamic, rounds)
    order = drawn_in_order(len(pattern), P, s.cfg.seed)
    kept_prompts = [s.prompts.prompt_ids[order[j]] for j in kept]

    assert groups.rollout.prompt_ids == kept_prompts
    if kept:  # the rows are the sampler's for those prompts, in that order
        alone = s.engine.generate(kept_prompts, G, s.sampling)
        assert torch.equal(groups.rollout.completion_ids, alone.completion_ids)
        assert torch.equal(groups.rollout.mask, alone.mask)
    texts = s.tokenizer.batch_decode(groups.rollout.completions(), skip_special_tokens=True)
    answers = [s.prompts.examples[order[j]].answer for j in kept for _ in range(G)]
    assert groups.kept_rewards.tolist() == pytest.approx(tie_or_hash(texts, answers))
    assert groups.rank_rows == slice(0, len(kept) * G)
    # Advantages within each kept group, as if each group were alone.
    if kept:
        adv, _ = group_advantages(groups.kept_rewards, G)
        for g in range(len(kept)):
            alone_adv, _ = group_advantages(groups.kept_rewards[g * G:(g + 1) * G], G)
            torch.testing.assert_close(adv[g * G:(g + 1) * G], alone_adv)

    drawn = pattern[:n_rounds * P]
    assert s.stream.state_dict()["position"] == n_rounds * P  # the next step draws after the last round's
    assert len(groups.scores.rewards) == len(groups.texts) == n_rounds * P * G  # the log sees every round
    assert groups.frac_zero_std == pytest.approx(drawn.count("t") / len(drawn))
    if dynamic:
        assert groups.report == SamplingReport(rounds=n_rounds, prompts=n_rounds * P, groups_dropped=drawn.count("t"),
                                               groups_kept=len(kept))
    else:
        assert groups.report is None


def test_over_ranks_the_first_informative_groups_are_taken_round_by_round_then_rank_by_rank():
    T, F = True, False
    informative = torch.tensor([[[F, T], [T, T]],   # round 0: rank 0, rank 1 (P = 2 each)
                                [[T, F], [T, T]]])  # round 1
    assert first_informative(informative, 4).tolist() == [[[F, T], [T, T]], [[T, F], [F, F]]]
    # A rank can be left with no group while the others fill the step.
    informative = torch.tensor([[[T], [F]], [[T], [T]]])
    assert first_informative(informative, 2).tolist() == [[[T], [F]], [[T], [F]]]


def test_groups_of_rounds_with_different_completion_widths_join_right_padded():
    a = Rollout(prompt_ids=[[1], [2]], completion_ids=torch.tensor([[5, 6], [7, 8], [9, 9], [3, 4]]),
                mask=torch.tensor([[True, True], [True, False], [True, True], [True, True]]),
                sampler_logp=-torch.ones(4, 2), finished=torch.tensor([True, False, True, True]), num_generations=2)
    b = Rollout(prompt_ids=[[3]], completion_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]),
                mask=torch.ones(2, 3, dtype=torch.bool), sampler_logp=-2 * torch.ones(2, 3),
                finished=torch.tensor([False, True]), num_generations=2)
    joined = join_groups([a, b], torch.tensor([[False, True], [True, False]]), pad_id=0)
    assert joined.prompt_ids == [[2], [3]] and joined.num_generations == 2
    assert joined.completion_ids.tolist() == [[9, 9, 0], [3, 4, 0], [1, 2, 3], [4, 5, 6]]
    assert joined.mask.tolist() == [[True, True, False], [True, True, False], [True] * 3, [True] * 3]
    assert joined.sampler_logp.tolist() == [[-1, -1, 0], [-1, -1, 0], [-2] * 3, [-2] * 3]
    assert joined.finished.tolist() == [True, True, False, True]
    empty = join_groups([a], torch.tensor([[False, False]]), pad_id=0)
    assert empty.prompt_ids == [] and empty.completion_ids.shape == (0, 2)


def test_a_step_without_an_informative_group_is_logged_as_not_trained():
    s = sampling_setup("tttttttt", P=2, dynamic=True, rounds=3)
    from grpo.step import grpo_step

    result = grpo_step(s, 0, InFlight(stream_at_start=s.stream.state_dict()))  # no policy: it must not train
    assert result.sampling.groups_kept == 0 and not result.skipped and result.grad_norm is None
    record = result.log_record(1, lr=1e-3, step_time=1.0, peak_mem_gib=0.0)
    assert record["sampling/rounds"] == 3 and record["sampling/groups_dropped"] == 6 and "loss" not in record
    assert "no informative group, not trained" in step_line(record)


# --------------------------------------------------------------------------------------------------
# The loss norms over fewer groups than P
# --------------------------------------------------------------------------------------------------
class _KeepGrads:
    """An optimizer that only keeps the gradients it is asked to step with."""

    def __init__(self, params):
        self.params, self.grads = params, None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]


def test_each_loss_norm_over_fewer_kept_groups_in_micro_batches_equals_one_pass_over_them(char_llama_dir):
    from grpo.model.load import load_policy

    base = Config(model=str(char_llama_dir), dtype="fp32", lora_rank=4, lora_alpha=8, beta=0.0, max_grad_norm=0.0,
                  prompts_per_step=4, num_generations=2, seed=1)
    policy, tokenizer, _ = load_policy(base, torch.device("cpu"))
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    params = [p for p in policy.parameters() if p.requires_grad]
    sampling = Sampling(max_new_tokens=7)
    # 3 of P=4 groups kept: 6 rows of lengths 1..7, in micro-batches of 4 and 2.
    rollout = PromptHashEngine(tokenizer.pad_token_id).generate([[10, 11, 12], [13, 14], [15]], 2, sampling)
    batch = make_batch(rollout, tokenizer.pad_token_id, torch.device("cpu"))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    for norm in ("token", "sequence", "constant"):
        cfg = dataclasses.replace(base, loss_norm=norm)
        optimizer = _KeepGrads(params)
        s = StepSetup(cfg=cfg, world=World(), device=torch.device("cpu"), policy=policy, params=params,
                      optimizer=optimizer, tokenizer=tokenizer, engine=PromptHashEngine(tokenizer.pad_token_id),
                      engine_rows=len(batch), keep_engine=True, sampling=sampling, max_completion_length=sampling.max_new_tokens, prompts=None,
                      stream=None, reward_funcs=[],
                      clock=time.perf_counter)
        update_policy(s, batch, [slice(0, 4), slice(4, 6)], adv, None, None, InFlight(stream_at_start={}))
        in_order = optimizer.grads
        # as grpo_step runs them: the rows sorted by length, each micro-batch cut to its longest row
        by_length, by_length_adv, slices = micro_batches(batch, adv, 4)
        assert list(by_length.lengths) == sorted(batch.lengths) != list(batch.lengths)
        update_policy(s, by_length, slices, by_length_adv, None, None, InFlight(stream_at_start={}))
        policy.zero_grad(set_to_none=True)
        loss, _ = clipped_surrogate(sequence_logprobs(policy, batch, cfg.temperature), None, adv, batch.mask,
                                    loss_norm=norm, max_completion_length=sampling.max_new_tokens)
        loss.backward()
        assert any(float(g.abs().max()) > 0 for g in in_order)
        for got, sorted_got, p in zip(in_order, optimizer.grads, params):
            # float32 sums in another order: ~1e-6 of the largest entry apart (seen), where a wrong share of the
            # batch would be 10% or more; an absolute 1e-7 failed entries near zero on some random models
            atol = 1e-5 * float(p.grad.abs().max())
            torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=atol, msg=norm)
            torch.testing.assert_close(sorted_got, p.grad, rtol=1e-4, atol=atol, msg=f"{norm}, sorted")


# --------------------------------------------------------------------------------------------------
# Whole runs: resume, and two ranks
# --------------------------------------------------------------------------------------------------
# Stream positions of a run with P=2 and 3 rounds at most, draw by draw:
#   step 1: tt ti ti  -> 3 rounds, kept 2   step 2: tt tt tt -> 3 rounds, nothing kept (not trained)
#   step 3: it ii     -> 2 rounds, kept 2 (a surplus informative group is left out)
RESUME_PATTERN = "tttiti" + "tttttt" + "itii"


def test_resume_after_steps_of_three_rounds_equals_the_uninterrupted_run(char_llama_dir, tmp_path):
    from test_train import tiny_cfg

    from grpo.trainer import train

    data = write_jsonl(tmp_path / "data.jsonl", examples_for(RESUME_PATTERN, 2, 11))
    kw = dict(dataset=str(data), max_prompt_length=1000, dynamic_sampling=True, max_sampling_rounds=3,
              reward=("test_dynamic_sampling:tie_or_hash",), lora_rank=4, lora_alpha=8, log_completions_steps=0,
              max_steps=3, beta=0.0)
    train(tiny_cfg(char_llama_dir, tmp_path / "a", save_steps=1, save_total_limit=4, **kw))
    straight = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["sampling/rounds"], r["sampling/groups_kept"]) for r in straight] == [(3, 2), (3, 0), (2, 2)]
    assert straight[1]["grad_norm"] is None and "loss" not in straight[1] and not straight[1]["skipped"]
    one, two = adapter_tensors(tmp_path / "a" / "checkpoint-1"), adapter_tensors(tmp_path / "a" / "checkpoint-2")
    assert all(torch.equal(one[k], two[k]) for k in one), "the step without an informative group changed the adapter"
    state = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["stream"]["position"] == 12  # two steps of three rounds of two prompts

    train(tiny_cfg(char_llama_dir, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"), **kw))
    a, b = adapter_tensors(tmp_path / "a" / "adapter"), adapter_tensors(tmp_path / "b" / "adapter")
    assert any(not torch.equal(a[k], two[k]) for k in a), "step 3 changed nothing"
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    [resumed] = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    for key in ("sampling/prompts", "sampling/groups_dropped", "reward", "loss", "gap/logp_abs_mean"):
        assert resumed[key] == pytest.approx(straight[2][key], rel=1e-5), key


# N=2 ranks, P=1 each (the stream draws 2 per round):
#   step 1: it it -> rank 0 keeps both groups, rank 1 none   step 2: ti ii -> one each (the last is surplus)
TWO_RANK_PATTERN = "itit" + "tiii"


def two_rank_kw(folder: Path) -> dict:
    """dist_cfg's changes for a dynamic-sampling run over TWO_RANK_PATTERN, its data written into `folder`."""
    data = write_jsonl(folder / "data.jsonl", examples_for(TWO_RANK_PATTERN, 2, 5))
    return dict(dataset=str(data), num_train_examples=None, max_prompt_length=1000, dynamic_sampling=True,
                max_sampling_rounds=3, reward=("test_dynamic_sampling:tie_or_hash",), loss_norm="sequence",
                save_steps=0)


@pytest.mark.slow
@pytest.mark.xdist_group("two_rank_run")
def test_two_ranks_keep_and_train_what_one_process_keeps_and_trains(two_rank_run, char_llama_dir, tmp_path,
                                                                    monkeypatch):
    from grpo import trainer

    # the two ranks (P=1 each) ran in the shared launch, into dynamic/ (tests/test_distributed.py)
    monkeypatch.setattr(trainer, "build_engine", prompt_hash_engine)
    trainer.train(dist_cfg(char_llama_dir, tmp_path / "one", prompts_per_step=2, **two_rank_kw(tmp_path)))

    two, one = records(two_rank_run / "dynamic"), records(tmp_path / "one")
    assert [(r["sampling/rounds"], r["sampling/groups_kept"]) for r in two] == [(2, 2), (2, 2)]
    # (Not "kl": a token mean per micro-batch, weighted by rows under the sequence norm, so it depends on how
    # the rows fall into micro-batches, which differs here in step 2; the loss does not.)
    for r2, r1 in zip(two, one, strict=True):
        for key in ("sampling/rounds", "sampling/prompts", "sampling/groups_dropped", "sampling/groups_kept",
                    "reward", "frac_zero_std", "loss", "policy_loss", "grad_norm", "gap/logp_abs_mean",
                    "gap/logp_abs_max", "gap/is_clipped_frac"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), (r2["step"], key)
    a, b = adapter_tensors(two_rank_run / "dynamic" / "adapter"), adapter_tensors(tmp_path / "one" / "adapter")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
