"""Episodes on the native engine: rows that go on after a reply without their context read again.

`NativeEngine.turns` prefills the prompts once and hands a `NativeTurns` (the engine's
`grpo.rollout.base.Turns`) to the episode loop (`grpo.agents.episodes`), which decides what happens between
turns. Here:

- the decode runs every row at its own pace, `check_every` steps at a time (`NativeEngine._step` with `turns`:
  replayed from CUDA graphs as the single-turn step is, a row that stops keeps its position, a row stops at its
  budget too); after each block the host reads what every row sampled and hands the turns that ended to the loop;
- `continue_rows` prefills each reply into its row's cache right after the row's last token
  (`NativeEngine._extend`: the replies' tokens alone, in one batch), and those rows decode again from the next
  block on, while the others never stopped.

So a row that stopped waits for the end of its block (fewer than `check_every` steps) before its reply goes in,
and a reply costs one prefill of its own tokens: no decode step per reply token, no re-read of the context, no
row waiting for the slowest of its turn.

What it deliberately is not: the turn logic (tools, environments, how a reply is rendered, the limits), which is
`grpo.agents.episodes`'s for every engine; nor a server: the rows are those of one call.
"""

from __future__ import annotations

import time

import torch

from grpo.rollout.base import Sampling, TurnEnd
from grpo.rollout.native.state import StopRule


class NativeTurns:
    """The rows of one `NativeEngine.turns` call, decoded turn after turn (see the module docstring).

    Host bookkeeping only: each row's prompt length, its transcript's length so far, the tokens of the turn it
    is writing, and which rows are decoding; the device work is the engine's (`_decode_turns`, `_extend`)."""

    def __init__(self, engine, prompt_ids: list[list[int]], n: int, sampling: Sampling, stop: StopRule,
                 graphs: dict, generator: torch.Generator, timings: dict[str, float]):
        self.engine, self.sampling, self.stop, self.graphs, self.generator = engine, sampling, stop, graphs, generator
        self.rows = len(prompt_ids) * n
        self.prompt_lengths = [len(p) for p in prompt_ids for _ in range(n)]
        self.lengths = [0] * self.rows  # each row's transcript after its prompt: its turns and the replies
        self.turn_ids: list[list[int]] = [[] for _ in range(self.rows)]  # the tokens of the turn being written
        self.turn_logp: list[list[float]] = [[] for _ in range(self.rows)]
        self.last: list[int] = [p[-1] for p in prompt_ids for _ in range(n)]  # each row's last token
        self.decoding = set(range(self.rows))
        self.waiting: set[int] = set()  # the rows whose turns the last `ended()` returned
        self.block = min(engine.tuning.check_every, engine.max_seq_len)  # the output buffers' columns
        # the KV length that holds every row's end: the graphs were captured up to it
        self.ceiling = engine._kv_bucket(max(self.prompt_lengths), sampling.max_new_tokens - 1)
        self.timings = {**timings, "decode": 0.0, "extend": 0.0, "decode_steps": 0.0}

    def ended(self) -> list[TurnEnd]:
        """Blocks of decode steps until a row's turn has ended: those turns, in row order; [] once every row has
        stopped for good."""
        while self.decoding:
            ends = self._decode_block()
            if ends:
                return ends
        if self.engine.progress is not None:
            total = self.rows * self.sampling.max_new_tokens
            self.engine.progress(total, total)
        return []

    def _decode_block(self) -> list[TurnEnd]:
        engine, st, rows = self.engine, self.engine._state, self.rows
        t0 = time.perf_counter()
        top = max(p + n for p, n in zip(self.prompt_lengths, self.lengths))  # the highest position of a row
        engine._decode_turns(rows, self.block, top, self.ceiling, self.sampling, self.stop, self.graphs,
                             self.generator)
        ids = st.out_ids[:rows, :self.block].tolist()
        logp = st.out_logp[:rows, :self.block].tolist()
        taken = st.out_mask[:rows, :self.block].sum(1).tolist()  # a row's tokens in the block come first
        alive, finished = st.alive[:rows].tolist(), st.finished[:rows].tolist()
        st.step.zero_()  # the next block writes from column 0 again
        ends = []
        self.waiting = set()
        for r in sorted(self.decoding):
            k = taken[r]
            self.turn_ids[r] += ids[r][:k]
            self.turn_logp[r] += logp[r][:k]
            self.lengths[r] += k
            if not alive[r]:
                self.last[r] = self.turn_ids[r][-1]
                ends.append(TurnEnd(r, self.turn_ids[r], self.turn_logp[r], bool(finished[r])))
                self.turn_ids[r], self.turn_logp[r] = [], []
                self.decoding.discard(r)
                self.waiting.add(r)
        self.timings["decode"] += time.perf_counter() - t0
        self.timings["decode_steps"] += self.block
        if engine.progress is not None:
            engine.progress(sum(self.lengths), rows * self.sampling.max_new_tokens)
        return ends

    def continue_rows(self, replies: dict[int, list[int]]) -> None:
        """Each reply's tokens after its row's last; the row decodes its next turn from the next block on."""
        t0 = time.perf_counter()
        budget = self.sampling.max_new_tokens
        for r, reply in replies.items():  # all checked before any row changes
            if r not in self.waiting:
                raise ValueError(f"continue_rows: row {r}'s turn is not among those the last ended() returned; "
                                 "continue only those")
            if self.lengths[r] + len(reply) >= budget:
                raise ValueError(f"continue_rows: row {r}'s reply of {len(reply)} tokens leaves it no room in its "
                                 f"budget of {budget}; end the row instead")
        self.waiting = set()
        rows, tokens, starts = sorted(replies), [], []
        for r in rows:
            reply, start = list(replies[r]), self.prompt_lengths[r] + self.lengths[r]
            if not reply:  # nothing to add: the row's last token again, for the logits that follow it
                reply, start = [self.last[r]], start - 1
            else:
                self.lengths[r] += len(reply)
                self.last[r] = reply[-1]
            tokens.append(reply)
            starts.append(start)
        if rows:
            self.engine._extend(rows, tokens, starts)
            self.decoding.update(rows)
        self.timings["extend"] += time.perf_counter() - t0
