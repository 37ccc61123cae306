"""NativeEngine.turns: episodes' rows continued in place (each reply fed into its row's KV cache by the decode
steps, rows at their own pace) give the episodes of the reference way, every turn's whole context re-sent to
`generate`, for the same sampled tokens; and the log-probs they record are the policy's on the whole transcript."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import tiny_llama, tiny_llama_config
from grpo.agents.episodes import ResentTurns, run_episodes
from grpo.batch import make_batch, sequence_logprobs
from grpo.rollout.base import Sampling, TurnEnd
from grpo.rollout.hf import HFEngine
from grpo.rollout.native import EngineTuning, NativeEngine
from test_agent_episodes import TEMPLATE

PAD = 4
BIG_PAD = 128004
PROMPTS = [[5, 17, 300, 42], [7, 8, 9, 10, 11, 12, 13], [99]]  # lengths 4, 7, 1
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def lively_llama(seed: int = 0, vocab: int = 1024, **kw):
    """A tiny random Llama whose weights are large enough that greedy decoding does not repeat one token, so
    that turns end at many lengths (at the default initialisation it writes one token over and over)."""
    from transformers import LlamaForCausalLM

    if vocab < 128256:
        cfg = tiny_llama_config(vocab_size=vocab, initializer_range=0.3)
        cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = PAD, 1, 2
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()
    return tiny_llama(seed=seed, initializer_range=0.3, **kw)


def every(k: int, vocab: int) -> tuple[int, ...]:
    """Every k-th token id as a stop id: a turn of random text ends after about k tokens, at its own length."""
    return tuple(range(3, vocab, k))


class GenerateOnly:
    """An engine without its `turns`: episodes on it take the reference way."""

    needs_importance_correction = False

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_ids, n, sampling):
        return self.engine.generate(prompt_ids, n, sampling)

    def release_memory(self):
        pass

    def standby_bytes(self):
        return None


def play(turns, replies: dict[int, list[int] | None], budget: int) -> dict[int, list[TurnEnd]]:
    """Every row's turns, each row's turn answered by `replies[row]` (None: the row ends) while it has room."""
    ends: dict[int, list[TurnEnd]] = {}
    used: dict[int, int] = {}
    ended = turns.ended()
    while ended:
        go_on = {}
        for end in ended:
            ends.setdefault(end.row, []).append(end)
            used[end.row] = used.get(end.row, 0) + len(end.ids)
            reply = replies[end.row]
            if end.finished and reply is not None and len(ends[end.row]) < 4 and used[end.row] + len(reply) < budget:
                go_on[end.row] = reply
                used[end.row] += len(reply)
        turns.continue_rows(go_on)
        ended = turns.ended()
    return ends


def test_rows_continued_in_place_end_their_turns_as_the_whole_context_resent_does():
    model = lively_llama(seed=0)
    engine = NativeEngine(model, max_seq_len=128, max_batch=6, pad_id=PAD,
                          tuning=EngineTuning(kv_bucket=16, turn_block=4))
    sampling = Sampling(max_new_tokens=30, temperature=0.0, stop_token_ids=every(7, 1024))
    # two replies of different lengths, an empty one (the row goes on after its own last token), rows that end
    replies = {0: [100, 101, 102], 1: [200], 2: [], 3: None, 4: [7, 8, 9, 10, 11, 12, 13, 14], 5: [300, 301]}
    with engine.turns(PROMPTS, 2, sampling) as turns:
        fast = play(turns, replies, sampling.max_new_tokens)
        timings = turns.timings
    with ResentTurns(GenerateOnly(engine), PROMPTS, 2, sampling) as turns:
        reference = play(turns, replies, sampling.max_new_tokens)
    assert sorted(fast) == sorted(reference) == list(range(6))
    for row in range(6):
        assert [(e.ids, e.finished) for e in fast[row]] == [(e.ids, e.finished) for e in reference[row]], row
        for a, b in zip(fast[row], reference[row]):
            torch.testing.assert_close(torch.tensor(a.logp), torch.tensor(b.logp), atol=1e-4, rtol=0)
    turns_per_row = [len(fast[r]) for r in range(6)]
    assert len(set(turns_per_row)) > 1 and max(turns_per_row) >= 3  # rows end at different turns
    assert any(not e[-1].finished for e in fast.values())  # a row that its budget cut
    assert timings["replies"] > 0 and timings["decode_steps"] > 0


def test_replies_go_in_through_one_token_steps_after_the_prompts_prefill():
    """No prefill of a reply: after the prompts' prefill every forward is a step of one token a row (the reply's
    tokens fed in place of the sampled ones), and the transcripts still equal the reference's."""
    model = lively_llama(seed=3)
    engine = NativeEngine(model, max_seq_len=96, max_batch=4, pad_id=PAD,
                          tuning=EngineTuning(kv_bucket=16, turn_block=2))
    sampling = Sampling(max_new_tokens=40, temperature=0.0, stop_token_ids=every(6, 1024))
    replies = {0: [100, 9, 101, 102, 103], 1: [], 2: [200, 201], 3: [300]}  # 9 is a stop id: a fed token never stops
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    try:
        with engine.turns(PROMPTS[:2], 2, sampling) as turns:
            prefill = list(widths)
            fast = play(turns, replies, sampling.max_new_tokens)
    finally:
        hook.remove()
    steps = widths[len(prefill):]
    assert len(prefill) == 1 and prefill[0][1] > 1 and len(steps) == turns.timings["decode_steps"]
    assert set(steps) == {(4, 1)}
    with ResentTurns(GenerateOnly(engine), PROMPTS[:2], 2, sampling) as turns:
        reference = play(turns, replies, sampling.max_new_tokens)
    assert max(len(e) for e in fast.values()) >= 2
    assert {r: [(e.ids, e.finished) for e in ends] for r, ends in fast.items()} == \
        {r: [(e.ids, e.finished) for e in ends] for r, ends in reference.items()}


def rounds_env():
    class Rounds:
        """A deterministic environment whose episodes last 1, 2 or 4 turns (by the order they are made in: rows
        of one group end at different turns), each reply's length set by the model's text."""

        made = 0

        def reset(self, example):
            self.k, self.t = [1, 2, 4][Rounds.made % 3], 0
            Rounds.made += 1
            return f"Say {example['word']} a few times."

        def step(self, text):
            self.t += 1
            return f"Round {self.t}: heard {len(text)} characters.", float(self.t), self.t >= self.k

    return Rounds


@pytest.fixture
def tokenizer(llama_tokenizer):
    saved = llama_tokenizer.chat_template
    llama_tokenizer.chat_template = TEMPLATE
    yield llama_tokenizer
    llama_tokenizer.chat_template = saved


def episodes_on(engine, tokenizer, sampling, max_turns=3):
    examples = [{"word": "apple"}, {"word": "pear"}]
    return run_episodes(engine, tokenizer, [[], []], 3, sampling, environment=rounds_env(), max_turns=max_turns,
                        tool_timeout_s=1.0, examples=examples)


def test_greedy_episodes_in_place_equal_the_reference_ways_on_the_native_engine_and_transformers(tokenizer):
    model = lively_llama(seed=1, vocab=128256)
    engine = NativeEngine(model, max_seq_len=256, max_batch=6, pad_id=BIG_PAD,
                          tuning=EngineTuning(kv_bucket=16, turn_block=4))
    sampling = Sampling(max_new_tokens=64, temperature=0.0, stop_token_ids=every(9, 128000))
    fast, fast_episodes = episodes_on(engine, tokenizer, sampling)
    assert "replies" in fast.timings and "episodes" in fast.timings
    turns = [e.turns for e in fast_episodes]
    cut_by_turns = [e.cut for e in fast_episodes]
    cut_by_tokens = [not f and not c for f, c in zip(fast.finished.tolist(), cut_by_turns)]
    assert len(set(turns)) == 3 and any(cut_by_turns) and any(cut_by_tokens), (turns, cut_by_turns, cut_by_tokens)
    for reference_engine in (GenerateOnly(engine), HFEngine(model, pad_id=BIG_PAD)):
        reference, reference_episodes = episodes_on(reference_engine, tokenizer, sampling)
        assert torch.equal(fast.completion_ids, reference.completion_ids)
        assert torch.equal(fast.mask, reference.mask) and torch.equal(fast.finished, reference.finished)
        torch.testing.assert_close(fast.sampler_logp, reference.sampler_logp, atol=1e-4, rtol=0)
        assert fast_episodes == reference_episodes


def test_in_place_episodes_record_the_logprobs_the_trainer_computes_on_the_whole_transcript(tokenizer):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(lively_llama(seed=2, vocab=128256), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)).eval()
    engine = NativeEngine(policy, max_seq_len=160, max_batch=6, pad_id=BIG_PAD,
                          tuning=EngineTuning(kv_bucket=16, turn_block=3))
    sampling = Sampling(max_new_tokens=60, temperature=1.0, seed=5, stop_token_ids=every(6, 128000))
    rollout, episodes = episodes_on(engine, tokenizer, sampling, max_turns=4)
    assert max(e.turns for e in episodes) >= 3
    assert (~rollout.mask[:, :rollout.spans.min()]).any()  # replies sit between the model's turns
    batch = make_batch(rollout, BIG_PAD, torch.device("cpu"))
    with torch.no_grad():
        trainer_logp = sequence_logprobs(policy, batch, temperature=1.0)
    torch.testing.assert_close(trainer_logp, rollout.sampler_logp, atol=2e-4, rtol=0)


def test_a_stop_sequence_is_matched_within_a_turn_never_across_turns():
    model = lively_llama(seed=5)
    # a check after every step: a row goes on right after the step that stopped it, no padding in its window
    engine = NativeEngine(model, max_seq_len=96, max_batch=2, pad_id=PAD,
                          tuning=EngineTuning(kv_bucket=16, turn_block=1))
    plain = Sampling(max_new_tokens=30, temperature=0.0, stop_token_ids=every(11, 1024))
    with engine.turns([PROMPTS[0]], 1, plain) as turns:
        first = play(turns, {0: [500, 501]}, plain.max_new_tokens)[0]
    assert len(first) >= 2 and first[0].finished and len(first[1].ids) >= 2
    # a turn's last token then the next turn's first: a stop sequence only across the two turns
    across = Sampling(max_new_tokens=30, temperature=0.0, stop_token_ids=every(11, 1024),
                      stop_sequences=((first[0].ids[-1], first[1].ids[0]),))
    assert all(across.stop_sequences[0] not in list(zip(e.ids, e.ids[1:])) for e in first)
    with engine.turns([PROMPTS[0]], 1, across) as turns:
        again = play(turns, {0: [500, 501]}, across.max_new_tokens)[0]
    assert [e.ids for e in again] == [e.ids for e in first]


def test_generate_after_episodes_on_one_engine_gives_a_fresh_engines_rollout():
    model = lively_llama(seed=4)
    sampling = Sampling(max_new_tokens=12, temperature=1.0, seed=9, stop_token_ids=every(5, 1024))
    engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=16))
    with engine.turns(PROMPTS, 2, sampling) as turns:
        play(turns, {r: [10, 11] for r in range(6)}, sampling.max_new_tokens)
    fresh = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=16))
    a, b = engine.generate(PROMPTS, 2, sampling), fresh.generate(PROMPTS, 2, sampling)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.mask, b.mask)


def test_episodes_report_progress_up_to_every_rows_budget():
    model = lively_llama(seed=5)
    engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(turn_block=4))
    reports = []
    engine.progress = lambda done, total: reports.append((done, total))
    sampling = Sampling(max_new_tokens=24, temperature=0.0, stop_token_ids=every(7, 1024))
    with engine.turns(PROMPTS, 2, sampling) as turns:
        play(turns, {r: [40 + r] for r in range(6)}, sampling.max_new_tokens)
    done = [d for d, _ in reports]
    assert len(reports) >= 3 and done == sorted(done) and reports[-1] == (6 * 24, 6 * 24)


def test_a_cache_too_short_for_a_prompt_and_its_whole_transcript_is_one_line():
    engine = NativeEngine(lively_llama(seed=0), max_seq_len=20, max_batch=2, pad_id=PAD)
    with pytest.raises(ValueError, match=r"episode prompt 1 has 7 tokens .* may take 14 more: 21 exceed the "
                                         r"engine's max_seq_len=20"):
        with engine.turns(PROMPTS[:2], 1, Sampling(max_new_tokens=14)):
            pass


def test_continue_rows_takes_only_the_rows_whose_turns_just_ended_and_replies_that_leave_room():
    engine = NativeEngine(lively_llama(seed=0), max_seq_len=64, max_batch=2, pad_id=PAD)
    sampling = Sampling(max_new_tokens=20, temperature=0.0, stop_token_ids=every(7, 1024))
    with engine.turns([PROMPTS[0]], 2, sampling) as turns:
        ends = turns.ended()
        assert [e.row for e in ends] == [0, 1] and ends[0].finished  # greedy: both rows of the group alike
        with pytest.raises(ValueError, match="leaves it no room in its budget of 20"):
            turns.continue_rows({0: [1] * (20 - len(ends[0].ids))})
        turns.continue_rows({0: [1]})  # row 1 ends here
        assert [e.row for e in turns.ended()] == [0]
        with pytest.raises(ValueError, match="row 1's turn is not among those the last ended"):
            turns.continue_rows({1: [1]})


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("gemm", ["modules", "kernels"])
def test_in_place_episodes_in_cuda_graphs_equal_the_reference_way(gemm):
    """On the GPU: the episodes' step replayed from CUDA graphs (compiled, the attention kernel where auto takes
    it), the replies fed through it, gives the episodes of the reference way on the same engine, greedy, in
    float32, with no more host syncs than blocks; sampled, the graphed step gives the eager step's tokens."""
    model = lively_llama(seed=0).cuda()
    sampling = Sampling(max_new_tokens=48, temperature=0.0, stop_token_ids=every(7, 1024))
    replies = {0: [100, 101, 102], 1: [200], 2: [], 3: None, 4: [7, 8, 9, 10, 11, 12, 13, 14], 5: [300, 301]}
    engine = NativeEngine(model, max_seq_len=160, max_batch=6, pad_id=PAD, gemm=gemm,
                          tuning=EngineTuning(kv_bucket=16, turn_block=4))
    with engine.turns(PROMPTS, 2, sampling) as turns:
        with warnings.catch_warnings(record=True) as caught:  # the host waits for the device once a block at most
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fast = play(turns, replies, sampling.max_new_tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) <= turns.launched, [str(w.message) for w in syncs[:3]]
    with ResentTurns(GenerateOnly(engine), PROMPTS, 2, sampling) as turns:
        reference = play(turns, replies, sampling.max_new_tokens)
    for row in range(6):
        assert [(e.ids, e.finished) for e in fast[row]] == [(e.ids, e.finished) for e in reference[row]], row
    sampled = Sampling(max_new_tokens=48, temperature=1.0, seed=3, stop_token_ids=every(7, 1024))
    eager = NativeEngine(model, max_seq_len=160, max_batch=6, pad_id=PAD, gemm=gemm,
                         tuning=EngineTuning(kv_bucket=16, turn_block=4, use_cuda_graph=False, compile=None))
    runs = []
    for each in (engine, eager):
        with each.turns(PROMPTS, 2, sampled) as turns:
            runs.append(play(turns, replies, sampled.max_new_tokens))
    for row in range(6):
        assert [e.ids for e in runs[0][row]] == [e.ids for e in runs[1][row]], row
        for a, b in zip(runs[0][row], runs[1][row]):
            torch.testing.assert_close(torch.tensor(a.logp), torch.tensor(b.logp), atol=1e-4, rtol=0)


@pytest.mark.cuda
@cuda
def test_in_place_episodes_with_the_adapter_folded_record_the_policys_logprobs_on_the_whole_transcript():
    """The trainer's engine on the GPU (decode kernels, the LoRA adapter folded into the weights, graphs): the
    log-probs recorded for every model token, after replies too, are a whole-transcript forward's (float32, where
    folding rounds nothing that matters)."""
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS

    policy = get_peft_model(lively_llama(seed=6), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS),
                                                             init_lora_weights=False)).cuda().eval()
    engine = NativeEngine(policy, max_seq_len=96, max_batch=6, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(kv_bucket=16, turn_block=4, fold_adapter=True))
    sampling = Sampling(max_new_tokens=48, temperature=1.0, seed=2, stop_token_ids=every(6, 1024))
    replies = {r: [100 + r] * (r + 1) for r in range(6)}
    with engine.turns(PROMPTS, 2, sampling) as turns:
        ends = play(turns, replies, sampling.max_new_tokens)
    assert engine.needs_importance_correction and max(len(e) for e in ends.values()) >= 2
    for row, turns_of_row in ends.items():
        ids, counted, logp = list(PROMPTS[row // 2]), [], []
        for k, end in enumerate(turns_of_row):
            counted += range(len(ids), len(ids) + len(end.ids))
            ids += end.ids
            logp += end.logp
            if k + 1 < len(turns_of_row):
                ids += replies[row]
        with torch.no_grad():
            full = torch.log_softmax(policy(torch.tensor([ids], device="cuda")).logits[0].double(), -1)
        want = torch.stack([full[t - 1, ids[t]] for t in counted]).cpu()
        torch.testing.assert_close(torch.tensor(logp, dtype=torch.float64), want, atol=2e-3, rtol=0)
