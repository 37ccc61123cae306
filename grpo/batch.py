"""The batch a step trains on and its log-probs: prompt+completion rows right-padded into tensors on
the device (`Batch`, `make_batch`), and the policy's log-probability of each completion token
(`sequence_logprobs`, `batch_logprobs` micro-batch by micro-batch).

What it deliberately is not: the loss or the update. It computes log-probs; `grpo.step` decides which
policy (adapters on or off, before or during the update) and what they are for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.kernels.logprobs import token_logprobs
from grpo.rollout.base import Rollout, completion_spans


@dataclass
class Batch:
    """Prompt+completion rows, right-padded, on the device. Completion token t of row i sits at
    position start[i] + t, and is predicted by the hidden state at start[i] + t - 1.

    No attention mask: every row starts at position 0 and its padding comes after its last token, so
    causal attention alone keeps padding out of every token that counts (see `sequence_logprobs`)."""

    input_ids: torch.Tensor  # (B, L)
    start: torch.Tensor  # (B,) prompt lengths
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) bool
    sampler_logp: torch.Tensor  # (B, T)
    # Each row's real length (prompt and completion up to its last counted token, the replies between a
    # transcript's turns included; its padding comes after), kept on the host so that cutting a micro-batch
    # to its longest row never waits for the device. None: read once from `start` and `mask`.
    lengths: tuple[int, ...] | None = None
    # `rows` rounds a micro-batch's width up to a multiple of this (--pad-to-multiple-of; 8 more where the layers
    # are compiled): more padding, but widths that repeat from step to step, for kernels that plan or compile per
    # shape (cuDNN's attention, which the trainer leaves out: `grpo.model.load.attention_without_cudnn`; inductor's
    # aligned kernels: `grpo.model.compiled_layers.width_multiple`)
    width_multiple: int = 1
    # The mask on the host (make_batch keeps one), from which `counted` finds the counted tokens without waiting
    # for the device: a pass over the batch then never stops the host from queueing the work after it. None:
    # `counted` reads `mask` (a wait for the device).
    host_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = tuple((self.start + completion_spans(self.mask)).tolist())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, sl: slice) -> "Batch":
        """Rows `sl`, their input cut to the longest of them (rounded up to `width_multiple`): the positions
        past every row's end hold only padding, which no counted token reads (causal), so a micro-batch of
        short rows runs a shorter forward. The completion columns stay whole, aligned with the step's (B, T)
        tensors."""
        lengths = self.lengths[sl]
        return Batch(self.input_ids[sl, :self.width(lengths)],
                     *(t[sl] for t in (self.start, self.completion_ids, self.mask, self.sampler_logp)), lengths,
                     self.width_multiple, None if self.host_mask is None else self.host_mask[sl])

    def width(self, lengths: tuple[int, ...]) -> int:
        """How wide the forward over rows of these lengths runs: the longest, rounded up to `width_multiple`,
        never past the batch's own width."""
        multiple = self.width_multiple
        return min(-(-max(lengths, default=0) // multiple) * multiple, self.input_ids.shape[1])

    def take(self, order: list[int]) -> "Batch":
        """The rows in `order` (row indices: a permutation of 0..B-1, or some of them to keep only those)."""
        at = torch.tensor(order, dtype=torch.long, device=self.input_ids.device)
        return Batch(*(t[at] for t in (self.input_ids, self.start, self.completion_ids, self.mask,
                                       self.sampler_logp)), tuple(self.lengths[i] for i in order),
                     self.width_multiple, None if self.host_mask is None else self.host_mask[order])

    def counted(self) -> torch.Tensor:
        """(tokens,) the flat positions (row * T + t) of the counted completion tokens, row by row, on the
        device: from `host_mask` where the batch has one, copied without waiting for the device."""
        if self.host_mask is None:
            return self.mask.flatten().nonzero().squeeze(1)
        return self.host_mask.flatten().nonzero().squeeze(1).to(self.mask.device, non_blocking=True)


def make_batch(rollout: Rollout, pad_id: int, device: torch.device) -> Batch:
    rows = [p for p in rollout.prompt_ids for _ in range(rollout.num_generations)]
    B, T = rollout.completion_ids.shape
    width = max((len(p) for p in rows), default=0) + T
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, :len(p)] = torch.tensor(p)
        input_ids[i, len(p):len(p) + T] = rollout.completion_ids[i]
    start = torch.tensor([len(p) for p in rows])
    parts = (input_ids, start, rollout.completion_ids, rollout.mask, rollout.sampler_logp.float())
    # On the host: the prompts' lengths are; the mask comes from the rollout (on the sampler's device), once
    host_mask = rollout.mask.to("cpu", torch.bool)
    lengths = tuple(len(p) + n for p, n in zip(rows, completion_spans(host_mask).tolist()))
    return Batch(*(t.to(device) for t in parts), lengths, host_mask=host_mask)


def finished_rows(batch: Batch, adv: torch.Tensor, finished: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """The rows whose completion finished (EOS or a stop string), `adv` (B,) along with them: what
    --mask-truncated-completions trains on. A truncated row leaves the loss whole: no token, no gradient, and no
    count in any normalisation; its reward already counted in its group's advantages. `finished`: (B,) bool."""
    keep = finished.to("cpu", torch.bool).nonzero().flatten().tolist()
    return batch.take(keep), adv[torch.tensor(keep, dtype=torch.long, device=adv.device)]


def micro_batches(batch: Batch, adv: torch.Tensor, micro: int, pad_to_multiple_of: int = 1
                  ) -> tuple[Batch, torch.Tensor, list[slice]]:
    """The step's rows in micro-batches of `micro` rows. With more than one, the rows are first sorted by
    length (`adv` along with them), so that each micro-batch holds rows of like length and its forward runs
    only as wide as its longest (`Batch.rows`): less padding for the same rows (logged as
    train/real_token_frac). Every statistic of the step is a sum over rows or tokens, so the order changes
    none of them.
    `pad_to_multiple_of`: each micro-batch's width rounded up to a multiple of it (`Batch.width_multiple`)."""
    if pad_to_multiple_of != batch.width_multiple:
        # the batch itself as wide as a multiple too, for the micro-batch of its longest row: the positions added
        # come after every row's end, read by no counted token (causal), so any id will do
        extra = -batch.input_ids.shape[1] % pad_to_multiple_of
        batch = dataclasses.replace(batch, input_ids=F.pad(batch.input_ids, (0, extra)),
                                    width_multiple=pad_to_multiple_of)
    slices = [slice(i, i + micro) for i in range(0, len(batch), micro)]
    if len(slices) > 1:
        order = sorted(range(len(batch)), key=batch.lengths.__getitem__)  # stable
        batch = batch.take(order)
        adv = adv[torch.tensor(order, device=adv.device)]
    return batch, adv, slices


def real_token_share(batch: Batch, slices: list[slice]) -> float:
    """Real tokens (prompts and completions up to their last counted token) over the positions the training forwards run:
    each micro-batch runs as wide as its longest row (`Batch.width`), so the rest of its rows are padded to
    that. 1.0: no padding; what `micro_batches`' sorting buys shows here (logged as train/real_token_frac)."""
    run = sum(len(part) * batch.width(part) for part in (batch.lengths[sl] for sl in slices) if part)
    return sum(batch.lengths) / run if run else 1.0


def sequence_logprobs(policy, batch: Batch, temperature: float) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens at `temperature`; 0 where mask is False.

    Runs the decoder to its final hidden states and hands only the masked completion positions to the
    fused `token_logprobs`, so a (tokens, vocab) logits tensor never exists whole.

    The forward is causal with no padding mask: a counted token sees only the tokens before it in its own
    row, none of them padding, so a mask would change no value that is read. Passing one is what broke:
    with a mask, scaled_dot_product_attention took cuDNN's kernel on Hopper, whose backward returned NaN for
    every row that had padding (the step was skipped). Without one, attention is plain causal; the padded
    positions' outputs are read by nothing.
    """
    base = policy.get_base_model()
    hidden = base.model(input_ids=batch.input_ids, use_cache=False).last_hidden_state
    T = batch.completion_ids.shape[1]
    positions = batch.start[:, None] - 1 + torch.arange(T, device=hidden.device)  # (B, T)
    positions = positions.clamp(max=hidden.shape[1] - 1)
    h = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    lm_head = base.get_output_embeddings().weight
    at = batch.counted()  # flat positions, not the bool mask: indexing by a mask waits for the device
    logp = token_logprobs(h.flatten(0, 1).index_select(0, at), lm_head,
                          batch.completion_ids.flatten().index_select(0, at), temperature)
    out = torch.zeros(batch.mask.numel(), dtype=logp.dtype, device=logp.device)
    return out.index_copy(0, at, logp).view(batch.mask.shape)


def batch_logprobs(policy, batch: Batch, slices: list[slice], temperature: float) -> torch.Tensor:
    """(B, T) `sequence_logprobs` of the whole batch, micro-batch by micro-batch; B may be 0."""
    if not slices:
        return batch.sampler_logp.new_zeros(batch.mask.shape)
    return torch.cat([sequence_logprobs(policy, batch.rows(sl), temperature) for sl in slices])
