"""The native engine's static buffers, and the stop rule a decode step applies to them on the device.

`DecodeState` is allocated once for `max_batch` rows and `max_seq_len` positions; a captured step reads
and writes views `[:rows]` of it in place, so its tensors never move while graphs point into them.
`StopRule` is what ends a row (stop ids, stop sequences) with its device constants kept in the state;
it is also part of a graph's key (a graph bakes the rule in).

Not here: the forward of a token (`layer.py`), the graphs and the loop (`engine.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from grpo.rollout.base import Sampling
from grpo.rollout.native.layer import ModelDims


@dataclass
class DecodeState:
    """Static buffers of one engine, allocated once for `max_batch` rows (graphs use views [:B])."""

    k_caches: list[torch.Tensor]  # per layer (max_batch, n_kv, max_seq_len, D)
    v_caches: list[torch.Tensor]
    cos: torch.Tensor  # (max_seq_len, D) model dtype
    sin: torch.Tensor
    kv_range: torch.Tensor  # (max_seq_len,) arange: key positions
    logits: torch.Tensor  # (max_batch, V) model dtype, as the output layer gives them: next-token logits of every
    # row (the sampler computes in float32 from them: a float32 copy would be one more pass over (B, V))
    noise: torch.Tensor | None  # (max_batch, V) float32: Exp(1) draws for the next sample; None until
    # `noise_rows` first needs it (greedy decoding never does)
    tok: torch.Tensor  # (max_batch,) long: the token the next forward consumes
    pos: torch.Tensor  # (max_batch,) long: its position
    end_pos: torch.Tensor  # (max_batch,) long: an episode's row (`turns.py`) has no room from this position on
    step: torch.Tensor  # (1,) long: output column of the next sample
    alive: torch.Tensor  # (max_batch,) bool: the row has not stopped yet
    finished: torch.Tensor  # (max_batch,) bool: stopped by a stop token or sequence
    out_ids: torch.Tensor  # (max_batch, max_seq_len) long
    out_logp: torch.Tensor  # (max_batch, max_seq_len) float32
    out_mask: torch.Tensor  # (max_batch, max_seq_len) bool
    # an episode's replies (`turns.py`): each row's queue of tokens that its next steps take instead of sampling
    forced: torch.Tensor  # (max_batch, max_seq_len) long: the queue, from column 0
    forced_at: torch.Tensor  # (max_batch,) long: the queue's next token
    forced_end: torch.Tensor  # (max_batch,) long: the queue's length; the row samples again once at reaches it
    tails: dict[int, torch.Tensor]  # window length -> (max_batch, W) long: last W sampled tokens
    consts: dict[tuple, torch.Tensor]  # stop ids and sequences as device tensors (graphs keep pointers)

    @classmethod
    def allocate(cls, dims: ModelDims, max_batch: int, max_seq_len: int, pad_id: int, rotary: nn.Module,
                 like: torch.Tensor) -> DecodeState:
        """Zeroed buffers on `like`'s device, the caches in its dtype; cos/sin from the model's `rotary`."""
        dev, dt, B, S = like.device, like.dtype, max_batch, max_seq_len
        cache_shape = (B, dims.n_kv_heads, S, dims.head_dim)
        positions = torch.arange(S, device=dev)[None, :]  # (1, S)
        probe = torch.empty(1, 1, dims.head_dim, device=dev, dtype=dt)
        cos, sin = rotary(probe, position_ids=positions)  # (1, S, D) each, model dtype
        V = dims.vocab_size
        return cls(
            k_caches=[torch.zeros(cache_shape, device=dev, dtype=dt) for _ in range(dims.n_layers)],
            v_caches=[torch.zeros(cache_shape, device=dev, dtype=dt) for _ in range(dims.n_layers)],
            cos=cos[0].contiguous(), sin=sin[0].contiguous(), kv_range=positions[0],
            logits=torch.zeros(B, V, device=dev, dtype=dt), noise=None,
            tok=torch.full((B,), pad_id, device=dev, dtype=torch.long),
            pos=torch.zeros(B, device=dev, dtype=torch.long), end_pos=torch.full((B,), S, device=dev, dtype=torch.long),
            step=torch.zeros(1, device=dev, dtype=torch.long),
            alive=torch.ones(B, device=dev, dtype=torch.bool), finished=torch.zeros(B, device=dev, dtype=torch.bool),
            out_ids=torch.full((B, S), pad_id, device=dev, dtype=torch.long),
            out_logp=torch.zeros(B, S, device=dev), out_mask=torch.zeros(B, S, device=dev, dtype=torch.bool),
            forced=torch.full((B, S), pad_id, device=dev, dtype=torch.long),
            forced_at=torch.zeros(B, device=dev, dtype=torch.long),
            forced_end=torch.zeros(B, device=dev, dtype=torch.long),
            tails={}, consts={},
        )

    def noise_rows(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the noise buffer, allocated on first use and never moved after."""
        if self.noise is None:
            self.noise = torch.ones(self.logits.shape, device=self.logits.device)
        return self.noise[:rows]

    def tensors(self) -> list[torch.Tensor]:
        out = [*self.k_caches, *self.v_caches, self.cos, self.sin, self.kv_range, self.logits, self.tok,
               self.pos, self.end_pos, self.step, self.alive, self.finished, self.out_ids, self.out_logp, self.out_mask,
               self.forced, self.forced_at, self.forced_end]
        noise = [] if self.noise is None else [self.noise]
        return out + noise + list(self.tails.values()) + list(self.consts.values())

    def record(self, rows: int, token: torch.Tensor, logp: torch.Tensor, sampled: torch.Tensor | None = None) -> None:
        """Write this step's token, logp and mask into the output column: the mask True at the rows that sampled
        this token (`sampled` (B,); None: the rows alive before it)."""
        column = self.step.expand(rows)[:, None]  # (B, 1)
        self.out_ids[:rows].scatter_(1, column, token[:, None])
        self.out_logp[:rows].scatter_(1, column, logp[:, None])
        self.out_mask[:rows].scatter_(1, column, (self.alive[:rows] if sampled is None else sampled)[:, None])


@dataclass(frozen=True)
class StopRule:
    """A row stops at any of `ids`, or once its completion ends with one of `seqs`."""

    ids: tuple[int, ...] = ()
    seqs: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, sampling: Sampling) -> StopRule:
        if sampling.ignore_eos:
            return cls()
        return cls(tuple(sorted(set(sampling.stop_token_ids))), tuple(tuple(s) for s in sampling.stop_sequences))

    @property
    def window(self) -> int:
        """The tokens a row must remember to see a stop sequence: the longest one's length."""
        return max((len(s) for s in self.seqs), default=0)

    @property
    def active(self) -> bool:
        return bool(self.ids or self.seqs)

    def prepare(self, st: DecodeState, max_batch: int) -> None:
        """Put this rule's constants and token window in `st` (once: graphs keep their addresses)."""
        device = st.tok.device
        if self.ids and ("ids", self.ids) not in st.consts:
            st.consts[("ids", self.ids)] = torch.tensor(self.ids, device=device, dtype=torch.long)
        for length in {len(seq) for seq in self.seqs}:
            if ("seqs", self.seqs, length) not in st.consts:
                st.consts[("seqs", self.seqs, length)] = torch.tensor(
                    [seq for seq in self.seqs if len(seq) == length], device=device, dtype=torch.long)
        window = self.window
        if window and window not in st.tails:
            st.tails[window] = torch.full((max_batch, window), -1, device=device, dtype=torch.long)

    def apply(self, st: DecodeState, rows: int, token: torch.Tensor, sampled: torch.Tensor | None = None) -> None:
        """Mark the rows that `token` (B,) stops as finished and no longer alive, on the device. Only rows that
        sampled it can stop (`sampled` (B,); None: the rows alive), not a row fed a reply's token."""
        if not self.active:
            return
        may_stop = st.alive[:rows] if sampled is None else sampled
        stop = torch.zeros_like(may_stop)
        if self.ids:
            stop = stop | (token[:, None] == st.consts[("ids", self.ids)][None, :]).any(-1)
        if self.seqs:
            window = self.window
            tail = st.tails[window][:rows]  # (B, W) the last W tokens, oldest first, -1 before the start
            tail.copy_(torch.cat([tail[:, 1:], token[:, None]], dim=1))
            for length in sorted({len(seq) for seq in self.seqs}):  # one compare per length, not per sequence
                want = st.consts[("seqs", self.seqs, length)]  # (S, length)
                stop = stop | (tail[:, None, window - length:] == want[None]).all(-1).any(-1)
        stop = stop & may_stop
        st.finished[:rows] |= stop
        st.alive[:rows] &= ~stop
