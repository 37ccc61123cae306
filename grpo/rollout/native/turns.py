"""Episodes on the native engine: rows that go on after a reply without their context read again.

`NativeEngine.turns` prefills the prompts once and hands a `NativeTurns` (the engine's
`grpo.rollout.base.Turns`) to the episode loop (`grpo.agents.episodes`), which decides what happens between
turns. Here:

- the decode runs every row at its own pace, `EngineTuning.turn_block` steps a block (`NativeEngine._step` with `turns`:
  replayed from CUDA graphs as the single-turn step is; a row that stops keeps its position, a row stops at its
  budget too); after each block the host reads what every row sampled and hands the turns that ended to the loop;
- before it hands them over it queues the next block for the rows still decoding, so the device decodes while
  the host runs tools, steps environments and renders replies;
- `continue_rows` queues each reply's prefill into its row's cache right after the row's last token
  (`NativeEngine._extend`: the replies' tokens alone, in one batch), after that block; the rows decode again
  from the block after it, while the others never stopped.

So a row that stopped waits for the rest of its block and one more (fewer than 2 x `turn_block` steps) before
its reply goes in, and a reply costs one prefill of its own tokens: no decode step per reply token, no re-read of
the context, no row waiting for the slowest of its turn, no device waiting for the host's replies (unless they
take longer than a block).

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
        self.decoding = set(range(self.rows))  # the rows the next block decodes
        self.in_flight: set[int] | None = None  # the rows of the block launched and not yet read, if one is
        self.waiting: set[int] = set()  # the rows whose turns the last `ended()` returned
        self.block = min(engine.tuning.turn_block, engine.max_seq_len)  # the output buffers' columns
        # the KV length that holds every row's end: the graphs were captured up to it
        self.ceiling = engine._kv_bucket(max(self.prompt_lengths), sampling.max_new_tokens - 1)
        self.timings = {**timings, "decode": 0.0, "extend": 0.0, "decode_steps": 0.0}

    def ended(self) -> list[TurnEnd]:
        """Blocks of decode steps until a row's turn has ended: those turns, in row order; [] once every row has
        stopped for good. The block after them is on its way before they are returned: the device decodes the
        other rows while the host answers these (their replies go in after that block)."""
        t0 = time.perf_counter()
        ends: list[TurnEnd] = []
        while not ends and (self.in_flight is not None or self.decoding):
            if self.in_flight is None:
                self._launch()
            ends = self._read_block()
            if self.decoding:
                self._launch()
        self.timings["decode"] += time.perf_counter() - t0
        if self.engine.progress is not None:
            total = self.rows * self.sampling.max_new_tokens
            self.engine.progress(sum(self.lengths) if ends else total, total)
        return ends

    def _launch(self) -> None:
        """The next block of decode steps for the decoding rows, queued without a host sync: as many steps as
        turn_block, or fewer where no row has that many left in its budget."""
        steps = min(self.block, max(self.sampling.max_new_tokens - self.lengths[r] for r in self.decoding))
        top = max(p + n for p, n in zip(self.prompt_lengths, self.lengths))  # the highest position of a row
        self.engine._decode_turns(self.rows, steps, top, self.ceiling, self.sampling, self.stop, self.graphs,
                                  self.generator)
        self.in_flight, self.decoding = self.decoding, set()
        self.steps = steps
        self.timings["decode_steps"] += steps

    def _read_block(self) -> list[TurnEnd]:
        """What the block in flight sampled, read once it is done (a host sync): each row's tokens added to its
        turn, and the turns that ended in it."""
        st, rows, steps = self.engine._state, self.rows, self.steps
        ids = st.out_ids[:rows, :steps].tolist()
        logp = st.out_logp[:rows, :steps].tolist()
        taken = st.out_mask[:rows, :steps].sum(1).tolist()  # a row's tokens in the block come first
        alive, finished = st.alive[:rows].tolist(), st.finished[:rows].tolist()
        st.step.zero_()  # the next block writes from column 0 again
        ends = []
        self.waiting = set()
        for r in sorted(self.in_flight):
            k = taken[r]
            self.turn_ids[r] += ids[r][:k]
            self.turn_logp[r] += logp[r][:k]
            self.lengths[r] += k
            if alive[r]:
                self.decoding.add(r)
            else:
                self.last[r] = self.turn_ids[r][-1]
                ends.append(TurnEnd(r, self.turn_ids[r], self.turn_logp[r], bool(finished[r])))
                self.turn_ids[r], self.turn_logp[r] = [], []
                self.waiting.add(r)
        self.in_flight = None
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
