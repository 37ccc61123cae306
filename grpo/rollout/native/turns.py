"""Episodes on the native engine: rows that go on after a reply without their context read again.

`NativeEngine.turns` prefills the prompts once and hands a `NativeTurns` (the engine's
`grpo.rollout.base.Turns`) to the episode loop (`grpo.agents.episodes`), which decides what happens between
turns. Here:

- the decode runs every row at its own pace, `EngineTuning.turn_block` steps a block (`NativeEngine._episode_step`,
  replayed from CUDA graphs as the single-turn step is); a row that stops keeps its position, a row stops at its
  budget too;
- a reply is fed, not prefilled: `continue_rows` queues its tokens on the device (`NativeEngine._force`: one
  copy, no host sync) and each step after feeds a row its next queued token instead of the one it sampled (not
  counted, never a stop), writing its K/V as any step does; once the queue is spent the row samples again, from
  the logits of the reply's last token, as the reference's prefill of the reply then sampling would;
- the blocks are pipelined: before the host reads what a block sampled (one host sync a block), the next block is
  already queued, so the device decodes while the host reads, runs tools, steps environments and renders replies;
  the turns that ended go to the loop, and their replies join the block after the one in flight.

So a row that stopped waits for the rest of its block and one more (fewer than 2 x `turn_block` steps) before
its reply goes in, and a reply costs a decode step per token, in the graphs that the other rows' steps replay
anyway: no prefill launched by the host, no re-read of the context, no row waiting for the slowest of its turn.

What it deliberately is not: the turn logic (tools, environments, how a reply is rendered, the limits), which is
`grpo.agents.episodes`'s for every engine; nor a server: the rows are those of one call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from grpo.rollout.base import Sampling, TurnEnd
from grpo.rollout.native.state import StopRule


@dataclass(frozen=True)
class _Block:
    """A block of decode steps launched: its number (blocks count from 0) and its steps."""

    index: int
    steps: int


class NativeTurns:
    """The rows of one `NativeEngine.turns` call, decoded turn after turn (see the module docstring).

    Host bookkeeping only: each row's prompt length, its transcript's length so far (queued replies included), the
    tokens of the turn it is writing, the steps it has room for, and which rows decode from which block; the
    device work is the engine's (`_decode_turns`, `_force`)."""

    def __init__(self, engine, prompt_ids: list[list[int]], n: int, sampling: Sampling, stop: StopRule,
                 graphs: dict, generator: torch.Generator, timings: dict[str, float]):
        self.engine, self.sampling, self.stop, self.graphs, self.generator = engine, sampling, stop, graphs, generator
        self.rows = len(prompt_ids) * n
        self.budget = sampling.max_new_tokens
        self.prompt_lengths = [len(p) for p in prompt_ids for _ in range(n)]
        self.lengths = [0] * self.rows  # each row's transcript after its prompt: its turns and the replies
        self.turn_ids: list[list[int]] = [[] for _ in range(self.rows)]  # the tokens of the turn being written
        self.turn_logp: list[list[float]] = [[] for _ in range(self.rows)]
        self.last: list[int] = [p[-1] for p in prompt_ids for _ in range(n)]  # each row's last token
        self.live = set(range(self.rows))  # the rows decoding (or fed their reply), as far as the host has read
        self.joined = [0] * self.rows  # the block each live row decodes from
        self.room = [self.budget] * self.rows  # the steps a live row may still take after the blocks read
        self.queued: _Block | None = None  # the block launched and not yet read, if one is
        self.launched = 0  # blocks launched so far: the next one's number
        self.waiting: set[int] = set()  # the rows whose turns the last `ended()` returned
        self.block = min(engine.tuning.turn_block, engine.max_seq_len)  # the output buffers' columns
        # the KV length that holds every row's end: the graphs were captured up to it
        self.ceiling = engine._kv_bucket(max(self.prompt_lengths), sampling.max_new_tokens - 1)
        self.cuda = engine.device.type == "cuda"
        self.timings = {**timings, "decode": 0.0, "replies": 0.0, "decode_steps": 0.0}

    def ended(self) -> list[TurnEnd]:
        """Blocks of decode steps until a row's turn has ended: those turns, in row order; [] once every row has
        stopped for good. The block after them is on its way before they are read: the device decodes the other
        rows while the host answers these (their replies go in after that block)."""
        t0 = time.perf_counter()
        ends: list[TurnEnd] = []
        while not ends:
            block = self.queued or self._launch(None)
            if block is None:  # nothing in flight and no row with room left: every row has stopped
                break
            copies = self._copy_out()
            self.queued = self._launch(block)
            ends = self._read(block, *copies)
        self.timings["decode"] += time.perf_counter() - t0
        if self.engine.progress is not None:
            total = self.rows * self.budget
            self.engine.progress(sum(self.lengths) if ends else total, total)
        return ends

    def _in(self, row: int, block: _Block) -> bool:
        """Whether `row` decodes in `block`, as far as the host knows before reading it."""
        return row in self.live and self.joined[row] <= block.index

    def _launch(self, unread: _Block | None) -> _Block | None:
        """The next block of decode steps, queued without a host sync, behind `unread` (the block launched before,
        not read yet: its rows may still be alive after it): as many steps as turn_block, or fewer where no row has
        that many left in its budget; None where no row has any."""
        ahead = [unread.steps if unread is not None and self._in(r, unread) else 0 for r in range(self.rows)]
        steps = min(self.block, max((self.room[r] - ahead[r] for r in self.live), default=0))
        if steps <= 0:
            return None
        # the highest position a row may be at (a stopped row stays at its own): step i writes below top + i + 1
        top = max(p + n + a for p, n, a in zip(self.prompt_lengths, self.lengths, ahead))
        self.engine._decode_turns(self.rows, steps, top, self.ceiling, self.sampling, self.stop, self.graphs,
                                  self.generator)
        block = _Block(self.launched, steps)
        self.launched += 1
        self.timings["decode_steps"] += steps
        return block

    def _copy_out(self) -> tuple:
        """What the block just launched will have written (tokens, log-probs, mask, each row's flags), its copy
        to the host queued behind it; and the output columns rewound for the next block."""
        st, rows = self.engine._state, self.rows
        parts = (st.out_ids[:rows, :self.block], st.out_logp[:rows, :self.block], st.out_mask[:rows, :self.block],
                 st.alive[:rows], st.finished[:rows])
        copies = [t.to("cpu", non_blocking=True, copy=True) for t in parts]  # into pinned memory on CUDA
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        st.step.zero_()  # the next block writes from column 0 again
        return copies, done

    def _read(self, block: _Block, copies: list[torch.Tensor], done) -> list[TurnEnd]:
        """What `block` sampled, once it is done (the one host sync a block): each row's tokens added to its turn
        (a row's reply tokens in the block are not its: the mask leaves them out), and the turns that ended."""
        if done is not None:
            done.synchronize()
        ids, logp, mask, alive, finished = (c.tolist() for c in copies)
        ends = []
        self.waiting = set()
        for r in sorted(self.live):
            if self.joined[r] > block.index:  # continued after this block was launched: not in it
                continue
            taken = [k for k in range(block.steps) if mask[r][k]]
            self.turn_ids[r] += [ids[r][k] for k in taken]
            self.turn_logp[r] += [logp[r][k] for k in taken]
            self.lengths[r] += len(taken)
            if alive[r]:
                self.room[r] -= block.steps
                continue
            self.last[r] = self.turn_ids[r][-1]
            ends.append(TurnEnd(r, self.turn_ids[r], self.turn_logp[r], bool(finished[r])))
            self.turn_ids[r], self.turn_logp[r] = [], []
            self.live.discard(r)
            self.waiting.add(r)
        return ends

    def continue_rows(self, replies: dict[int, list[int]]) -> None:
        """Each reply's tokens after its row's last, queued on the device; the row is fed them from the block after
        the one in flight, then decodes its next turn."""
        t0 = time.perf_counter()
        for r, reply in replies.items():  # all checked before any row changes
            if r not in self.waiting:
                raise ValueError(f"continue_rows: row {r}'s turn is not among those the last ended() returned; "
                                 "continue only those")
            if self.lengths[r] + len(reply) >= self.budget:
                raise ValueError(f"continue_rows: row {r}'s reply of {len(reply)} tokens leaves it no room in its "
                                 f"budget of {self.budget}; end the row instead")
        self.waiting = set()
        rows, starts, tokens = sorted(replies), [], []
        for r in rows:
            reply, start = list(replies[r]), self.prompt_lengths[r] + self.lengths[r]
            if not reply:  # nothing to add: the row's last token again, for the logits that follow it
                reply, start = [self.last[r]], start - 1
            else:
                self.lengths[r] += len(reply)
                self.last[r] = reply[-1]
            starts.append(start)
            tokens.append(reply)
            self.room[r] = self.prompt_lengths[r] + self.budget - start  # its reply's steps and its own
            self.joined[r] = self.launched
            self.live.add(r)
        if rows:
            self.engine._force(rows, starts, tokens)
        self.timings["replies"] += time.perf_counter() - t0
