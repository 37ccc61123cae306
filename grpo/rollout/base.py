"""The seam between the trainer and every sampler: `Sampling`, `Rollout` and the `Engine` protocol.

Engines take and give token ids; the tokenizer lives outside them. This module holds only the data
types, the protocols (`Engine`, and `Turns` for an engine that continues episodes' rows in place) and
`pad_rows` (rows of different lengths into one padded tensor, as every engine and the step build them), no
sampling code (that is `grpo/rollout/sampling.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from grpo.sampling_ranges import check_sampling_numbers


@dataclass(frozen=True)
class Sampling:
    """How to sample, with the semantics of vLLM's SamplingParams.

    `temperature == 0` is greedy. `top_k <= 0`, `top_p >= 1` and `min_p <= 0` switch that filter off.
    A row stops at any id in `stop_token_ids` (EOS) or once its completion ends with one of the
    token-id sequences in `stop_sequences`; the stop tokens are kept in the completion and counted.
    `ignore_eos` forces every row to `max_new_tokens` (benchmarks use it for fixed lengths).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens={self.max_new_tokens}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"Sampling.temperature={self.temperature}: must be >= 0 (0 is greedy)")
        check_sampling_numbers(top_p=self.top_p, min_p=self.min_p)


@dataclass
class Rollout:
    """P prompts times num_generations (G) completions, in group order: row i belongs to prompt i // G.

    `completion_ids` is right-padded with `pad_id`; `mask` is True where a completion token counts
    (up to and including the stop token). A completion of several turns (`grpo.agents.episodes`) is the
    whole transcript, the tool and environment replies between the model's turns included, with `mask`
    False at those: it has holes, and its padding starts after its last counted token (`spans`). `sampler_logp` holds the sampler's log-probability of each
    sampled token under softmax(logits / temperature) before any top-k/top-p/min-p truncation, which is
    what the trainer computes too, so the two can be compared token by token; 0 where `mask` is False.
    """

    prompt_ids: list[list[int]]  # P prompts
    completion_ids: torch.Tensor  # (P*G, T) long
    mask: torch.Tensor  # (P*G, T) bool
    sampler_logp: torch.Tensor  # (P*G, T) float32
    finished: torch.Tensor  # (P*G,) bool: stopped by EOS or a stop sequence, not by length
    num_generations: int = 1
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, for logging

    def __post_init__(self) -> None:
        rows = len(self.prompt_ids) * self.num_generations
        for name in ("completion_ids", "mask", "sampler_logp"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != rows:
                raise ValueError(f"Rollout.{name} has shape {tuple(t.shape)}; expected ({rows}, T)")
        if self.mask.shape != self.completion_ids.shape or self.sampler_logp.shape != self.completion_ids.shape:
            raise ValueError(
                f"Rollout shapes differ: completion_ids {tuple(self.completion_ids.shape)}, "
                f"mask {tuple(self.mask.shape)}, sampler_logp {tuple(self.sampler_logp.shape)}"
            )

    @property
    def lengths(self) -> torch.Tensor:  # (P*G,)
        """Each completion's counted tokens."""
        return self.mask.sum(-1)

    @property
    def spans(self) -> torch.Tensor:  # (P*G,)
        """Each completion's tokens up to and including its last counted one, the replies between the model's
        turns included: `lengths` where the mask has no holes."""
        return completion_spans(self.mask)

    def completions(self) -> list[list[int]]:
        """The completions as lists of token ids, padding removed (a transcript keeps its replies)."""
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.spans.tolist())]


def completion_spans(mask: torch.Tensor) -> torch.Tensor:
    """(B,) from a (B, T) mask: the index after each row's last True, 0 for a row with none."""
    at = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (mask * at).amax(-1) if mask.shape[-1] else mask.new_zeros(mask.shape[:-1], dtype=torch.long)


# What an engine reports while it generates: (tokens so far, tokens at most) of the call in flight,
# as rows x decode steps done and rows x max_new_tokens. Engines call it after each decode step when
# their `progress` attribute holds one (the trainer's progress display is one); a call whose rows all
# stop early ends with one last report of (at most, at most).
GenerationProgress = Callable[[int, int], None]


@runtime_checkable
class Engine(Protocol):
    """Anything that turns prompt ids into a `Rollout`, and says what the trainer must know of it, so
    the loop never branches on which engine it holds.

    `release_memory()` is called by the trainer after each generation unless `--engine-standby` keeps
    the engine as it is: an engine that holds large buffers (a KV cache) frees or lends them there so
    training can reuse the memory (vLLM sleeps).

    `needs_importance_correction`: True when `Rollout.sampler_logp` comes from other numerics than the
    trainer's forward (vLLM's kernels; the native engine's generates with the adapters folded into the
    weights), so the loss weights tokens by pi_trainer/pi_sampler (`--is-correction`); False when the engine
    runs the policy's own modules as they are (hf, the native engine unfolded).

    `standby_bytes()`: the bytes the engine would keep held between steps if `release_memory()` were
    not called (`--engine-standby auto` keeps an engine that holds little); None when it must release
    every time (vLLM sleeps to give its memory pool back).

    Optional, and so not members of the protocol: an attribute `progress`, a `GenerationProgress` or
    None, that the engine calls as it generates (the trainer sets it; an engine without it shows no
    progress within a generation); and a method `turns(prompt_ids, num_generations, sampling)`, a context
    manager of `Turns`, where an engine can continue a row after a reply without re-reading its context (the
    native engine appends the reply to the row's KV cache). Episodes of several turns take it where an engine
    has it, else re-send each row's whole context to `generate` every turn (`grpo.agents.episodes`). And an
    attribute `full_gc_each_step`, True where the engine runs full garbage collections of this process every
    step (vLLM's sleep and wake where its engine runs in this process): the trainer then freezes its set-up's
    objects out of their reach before the first step (on a GPU every engine's after it).
    """

    needs_importance_correction: bool

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Rollout: ...

    def release_memory(self) -> None: ...

    def standby_bytes(self) -> int | None: ...


@dataclass
class TurnEnd:
    """A model turn that has just ended in row `row` of an episode: its tokens (cut to what the row's token
    budget leaves), their sampler log-probs, and whether it stopped at a stop token or sequence (`finished`;
    False where the budget cut it)."""

    row: int
    ids: list[int]
    logp: list[float]
    finished: bool


class Turns(Protocol):
    """The rows of P prompts times n episodes, decoded turn after turn; row i is prompt i // n.
    `Sampling.max_new_tokens` bounds a row's whole transcript after its prompt: its turns and the replies between.

    `ended()` decodes until at least one row's turn has ended and returns those turns, in row order ([] once no
    row goes on). `continue_rows({row: reply_ids})` appends each reply's tokens after its row's last turn; that
    row then goes on with its next turn, at its own pace. A row whose turn ended and is not continued has ended.
    `timings`: seconds per phase, as `Rollout.timings`."""

    timings: dict[str, float]

    def ended(self) -> list[TurnEnd]: ...

    def continue_rows(self, replies: dict[int, list[int]]) -> None: ...


def pad_rows(rows: Sequence[Sequence[float]] | torch.Tensor, fill: float, *, width: int | None = None,
             dtype: torch.dtype | None = None, left: bool = False) -> torch.Tensor:
    """(len(rows), width) tensor of `rows` (lists of numbers, or the rows of a 2-D tensor), each at the left
    and padded with `fill` on the right; with `left=True`, at the right and padded on the left (as
    decoder-only generation needs its prompts). `width` defaults to the longest row; `dtype` to a tensor's
    own (lists need it). A tensor keeps its device."""
    if isinstance(rows, torch.Tensor):  # (B, t) -> (B, width)
        width = rows.shape[1] if width is None else width
        out = torch.full((rows.shape[0], width), fill, dtype=dtype or rows.dtype, device=rows.device)
        if left:
            out[:, width - rows.shape[1]:] = rows
        else:
            out[:, :rows.shape[1]] = rows
        return out
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        if left:
            out[i, width - len(row):] = torch.tensor(row, dtype=dtype)
        else:
            out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out
