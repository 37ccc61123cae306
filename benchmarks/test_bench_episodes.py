"""Episodes of several turns on the native engine against single-turn sampling, at 64 rows.

64 rows (16 prompts x G=4) after prompts of about 128 tokens, on the bench model (Llama-3.2-1B shapes, bf16)
with the recipe's rsLoRA adapter (B random), the engine as the trainer builds it (the adapter folded, auto
attention), sampled as the recipe samples (temperature 1, min_p 0.1):
- single turn: `generate` of 512 new tokens, EOS ignored: every row writes 512 model tokens;
- episodes: `run_episodes` with a deterministic environment (`Echo`: the same short reply every turn, never
  done) and a budget of 512 tokens a row, turns and replies together, up to 8 turns. A random model never writes
  its end-of-turn, so a turn ends at any of a set of ordinary token ids: one id in `TURN_TOKENS` of the
  vocabulary, so turns of about that many tokens, each row's of its own length;
  - `in-place` (the product): `NativeEngine.turns`, each reply fed into its row's KV cache by the decode steps
    (queued on the device, taken one a step in place of the sampled token), rows at their own pace (the host
    looks every `EngineTuning.turn_block`, 2, decode steps); `in-place-block4` and `in-place-block8` the same
    with blocks of 4 and 8;
  - `resent` (the reference): every turn one `generate` over each going row's whole context.
What is timed is the whole call (`run_episodes`: host work, tool and environment replies, the chat template,
included; single turn: `generate`), without the graphs' capture (warm-up round). Each record carries model
tokens per second; the episodes' also their share of the single-turn figure measured in the same module
(`of_single_turn`, the goal is >= 0.7 in place), turns per episode, reply tokens per row and time per phase:
capture, prefill, decode (in place: the time in `Turns.ended()`, waiting for blocks), replies (queuing the
replies' tokens), host (the rest: the environment, the chat template, while the next block decodes).
`pytest benchmarks/ --benchmark -k episodes`.
"""

from __future__ import annotations

import statistics

import pytest

import bench_setup as bs

ROWS = 64
TURN_TOKENS = 128  # a turn's mean length in tokens (its ending ids are one in this many)
MAX_TURNS = 8
# Llama 3's turn format without its system date: a template that only appends, as episodes need
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


class Echo:
    """The same short reply after every turn; never done (the budget or the turn limit ends an episode)."""

    def reset(self, example):
        return example["question"]

    def step(self, text):
        return "Noted. Go on.", 0.0, False


class GenerateOnly:
    """The engine without its `turns`: episodes on it re-send each row's whole context every turn."""

    def __init__(self, engine):
        self.engine = engine
        self.needs_importance_correction = engine.needs_importance_correction

    def generate(self, prompt_ids, n, sampling):
        return self.engine.generate(prompt_ids, n, sampling)

    def release_memory(self):
        self.engine.release_memory()

    def standby_bytes(self):
        return self.engine.standby_bytes()


@pytest.fixture(scope="module")
def episodes_setup(bench_env):
    """(policy, tokenizer with TEMPLATE, the examples, the shape): the bench model in bf16 with the recipe's
    rsLoRA adapter, its B random."""
    from grpo.data import load_jsonl

    shape = bench_env.scale[ROWS]
    policy, tokenizer = bs.policy_with_random_b(bench_env.model_dir(), bench_env.prompts(shape), shape,
                                                root=bench_env.root, cuda=bench_env.cuda)
    tokenizer.chat_template = TEMPLATE
    examples = [{"question": ex.question, "answer": ex.answer}
                for ex in load_jsonl(bench_env.prompts(shape))[:shape.prompts]]
    return policy, tokenizer, examples, shape


def _sampling(shape, **kw):
    from grpo.rollout import Sampling

    turn = max(2, min(TURN_TOKENS, shape.completion_len // 4))  # the smoke run's budget is a few tokens
    ends = tuple(range(1000, 128000, turn))  # ordinary ids: a random model writes them at random
    return Sampling(max_new_tokens=shape.completion_len, temperature=1.0, min_p=0.1, seed=7, stop_token_ids=ends,
                    **kw)


def _engine(policy, tokenizer, max_seq_len: int, turn_block: int | None = None):
    """The engine as the trainer builds it (`build_engine`: auto attention, the adapter folded), with
    `turn_block` (episodes' decode steps between the host's looks) where given."""
    from grpo.rollout.native import EngineTuning, NativeEngine

    tuning = EngineTuning(fold_adapter=True)
    if turn_block is not None:
        tuning = EngineTuning(fold_adapter=True, turn_block=turn_block)
    return NativeEngine(policy, max_seq_len=max_seq_len, max_batch=ROWS, pad_id=tokenizer.pad_token_id, tuning=tuning)


_single_turn: dict[str, float] = {}


def _single_turn_tokens_per_s(bench_env, policy, tokenizer, prompts, shape) -> float:
    """Model tokens per second of single-turn sampling of every row to the budget (measured once a module)."""
    if "tokens_per_s" not in _single_turn:
        import time

        engine = _engine(policy, tokenizer, max(map(len, prompts)) + shape.completion_len)
        sampling = _sampling(shape, ignore_eos=True)
        seconds = []
        for _ in range(1 + bench_env.rounds(3)):  # the first captures the graphs
            t0 = time.perf_counter()
            rollout = engine.generate(prompts, shape.generations, sampling)
            bs.sync()
            seconds.append(time.perf_counter() - t0)
            assert int(rollout.mask.sum()) == shape.rows * shape.completion_len
        _single_turn["tokens_per_s"] = shape.rows * shape.completion_len / statistics.median(seconds[1:])
        engine.release_memory()
        del engine
        bs.free_memory()
    return _single_turn["tokens_per_s"]


@pytest.mark.bench_order(75)
@pytest.mark.bench_cost(60)
@pytest.mark.parametrize("path", ["in-place", "in-place-block4", "in-place-block8", "resent"])
def test_episodes_at_64_rows(benchmark, bench_env, results, episodes_setup, path):
    """Episodes at 64 rows, the rows continued in place (`NativeEngine.turns`; `-blockN`: the host looks every N
    decode steps, not every 4: a stopped row waits less or longer, the host reads twice or half as often) or every
    turn's context re-sent to `generate` (the reference), beside single-turn sampling of the same rows and budget."""
    from grpo.agents.episodes import run_episodes

    policy, tokenizer, examples, shape = episodes_setup
    messages = [[] for _ in examples]  # the environment's first observation is the question
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ex["question"]}],
                                                              tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False) for ex in examples]  # the episodes' prompts
    single = _single_turn_tokens_per_s(bench_env, policy, tokenizer, prompts, shape)
    longest = max(map(len, prompts))
    # the reference's turns re-send contexts at the largest budget left: room for a context and a whole budget
    in_place = path.startswith("in-place")
    engine = _engine(policy, tokenizer, longest + shape.completion_len * (1 if in_place else 2),
                     turn_block=int(path.removeprefix("in-place-block")) if "-block" in path else None)
    played = engine if in_place else GenerateOnly(engine)
    sampling = _sampling(shape)
    runs = []

    def play():
        import time

        t0 = time.perf_counter()
        rollout, episodes = run_episodes(played, tokenizer, messages, shape.generations, sampling,
                                          environment=Echo, max_turns=MAX_TURNS, tool_timeout_s=5.0,
                                          examples=examples)
        bs.sync()
        runs.append((time.perf_counter() - t0, rollout, episodes))

    benchmark.pedantic(play, rounds=bench_env.rounds(3), warmup_rounds=1, iterations=1)
    measured = runs[1:]
    seconds = statistics.median(s for s, _, _ in measured)
    _, rollout, episodes = measured[-1]
    model_tokens = int(rollout.mask.sum())
    spans = rollout.spans
    phases = {k: statistics.median(r.timings.get(k, 0.0) for _, r, _ in measured)
              for k in ("capture", "prefill", "decode", "replies", "episodes")}
    tokens_per_s = statistics.median(int(r.mask.sum()) / s for s, r, _ in measured)
    benchmark.extra_info.update({
        "rows": shape.rows, "seconds": seconds, "model_tokens": model_tokens, "tokens_per_s": tokens_per_s,
        "single_turn_tokens_per_s": single, "of_single_turn": tokens_per_s / single,
        "turns_per_episode": sum(e.turns for e in episodes) / len(episodes),
        "reply_tokens_per_row": float((spans.sum() - model_tokens) / shape.rows),
        "phases_s": {**phases, "host": phases["episodes"] - sum(v for k, v in phases.items() if k != "episodes")},
        "decode_steps": rollout.timings.get("decode_steps"), "turn_block": engine.tuning.turn_block,
        "turn_tokens": TURN_TOKENS, "max_turns": MAX_TURNS,
        "shape": bs.asdict(shape),
    })
    results.add(benchmark, group="episodes", config=shape.name, impl=path, dtype="bf16")
    engine.release_memory()
    del engine, played
    bs.free_memory()
