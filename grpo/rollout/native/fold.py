"""The LoRA adapters folded into the base weights for a generation, and taken out again exactly.

With W <- W + scale * B A (rounded once into W's dtype) a decode step reads only the base weights: no
lora_down launches and no B products in the GEMM kernels; and the prefill runs the base layers with peft's
adapters off (`grpo.model.load.adapters_off`): one GEMM a projection instead of peft's four ops, mostly host time
(benchmarks/RESULTS.md, "The measured defaults"). TRL's colocated vLLM and Unsloth's merged rollouts fold
the adapter too; here it is done in place, without a second copy of the weights.

Taking it out: rounding W + D and subtracting the same D gives W back, except where the sum crossed a
power of two or met a tie; `folded` finds those elements before folding (by doing the round trip once)
and keeps their old values aside, so the weights after are W bit for bit. D is computed the same way both
times, from adapters that do not change during a decode.

What it changes: the sampler samples from W + D rounded, not from the trainer's W and adapter. Where an
element of D is smaller than half of W's last bit, W + D rounds back to W: early in training, with B near
zero, much of the adapter's change is not in the folded weights (bf16 weights of spread 0.02: a change of
spread 1e-4 left 32% of them as they were and came through at 0.99 of its size; one of 1e-5 left 88% and
came through at 0.28). So the engine asks the trainer for its importance correction while folding
(`NativeEngine.needs_importance_correction`), and the sampler-trainer gap shows the difference. Dense
weights only: an FP8 weight cannot hold W + D without a new quantization.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch

from grpo.kernels import decode_gemm
from grpo.kernels.decode_gemm import DecodeProj
from grpo.rollout.native.plan import LayerProjections


def can_fold(projections: Sequence[LayerProjections | None]) -> bool:
    """Whether every layer runs on the kernels or packed (its projections planned), with an adapter on each
    projection and dense weights."""
    return bool(projections) and all(
        p is not None and all(d.lora_a is not None and d.scale_inv is None for d in p.each()) for p in projections)


def without_adapters(p: LayerProjections) -> LayerProjections:
    """The same projections as the kernels read them once the adapters are folded in: base weights only."""
    return replace(p, **{f.name: replace(getattr(p, f.name), lora_a=None, lora_b=None, lora_scale=1.0)
                         for f in fields(p)})


@dataclass
class _Kept:
    """One weight's elements whose round trip would not come back exact, and their values before folding."""

    index: torch.Tensor  # flat indices into weight; int32 (a weight has fewer than 2**31 elements)
    values: torch.Tensor


def _delta(d: DecodeProj) -> torch.Tensor:
    """scale * B A in float32, (N, K): the same bits every time for the same adapter."""
    return (d.lora_b.float() @ d.lora_a.float()) * d.lora_scale


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns as integers (so -0.0 differs from 0.0, and a NaN equals itself)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _taken_out(w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """w - delta in float32 (type promotion reads w once, as its float32 value), rounded into w's dtype."""
    return torch.sub(w, delta).to(w.dtype)


def _fold(d: DecodeProj) -> _Kept:
    w = d.weight
    delta = _delta(d)
    summed = torch.add(w, delta).to(w.dtype)
    changed = bits(_taken_out(summed, delta)) != bits(w)  # the unfold's arithmetic
    # int32 indices: half the memory of int64 for the elements kept aside (a large random adapter keeps a fifth
    # of a weight's), for at most 2^31 elements a weight (benchmarks/RESULTS.md, "The measured defaults")
    index = changed.view(-1).nonzero().squeeze(1).to(torch.int32)
    kept = _Kept(index, w.view(-1)[index].clone())
    w.copy_(summed)
    return kept


def _unfold(d: DecodeProj, kept: _Kept) -> None:
    w = d.weight
    back = _taken_out(w, _delta(d))
    back.view(-1)[kept.index] = kept.values
    w.copy_(back)


class _KernelFolds:
    """The same fold and restore in one Triton launch a weight each way (`grpo/kernels/_fold_triton.py`), D
    computed inside the tiles: the torch ops above write D and two float32 sums of every weight's size and
    wait on the GPU once a weight to size its kept list. Here a first pass counts every weight's kept elements,
    with one wait for all of them. The kernel's D is float32 FMAs in its own order, so W + D may round apart
    from the torch ops' in the last bit."""

    BLOCK_N, BLOCK_K = 32, 128

    def __init__(self, ds: Sequence[DecodeProj]) -> None:
        from grpo.kernels import _fold_triton

        self.kernels = _fold_triton
        self.slot = {id(d): i for i, d in enumerate(ds)}  # each weight's counter
        self.counts = torch.zeros(len(ds), dtype=torch.int32, device=ds[0].weight.device)
        for d in ds:
            self._launch(d, _fold_triton.COUNT)
        self.sizes = self.counts.tolist()  # the one wait on the GPU
        self.counts.zero_()  # now each FOLD launch's place in its kept list

    def _launch(self, d: DecodeProj, mode: int, kept: _Kept | None = None) -> None:
        w = d.weight
        n, k = w.shape
        r = d.lora_a.shape[0]
        grid = (-(-n // self.BLOCK_N), -(-k // self.BLOCK_K))
        self.kernels.fold_kernel[grid](
            w, d.lora_a.contiguous(), d.lora_b.contiguous(), float(d.lora_scale), n, k, r,
            self.counts[self.slot[id(d)]:], kept.index if kept is not None else self.counts,
            kept.values if kept is not None else w,
            MODE=mode, INT=self.kernels.INT_OF_SIZE[w.element_size()],
            BLOCK_N=self.BLOCK_N, BLOCK_K=self.BLOCK_K, BLOCK_R=max(16, 1 << (r - 1).bit_length()),
            enable_fp_fusion=False)  # D rounded once, then added: a fused multiply-add in one mode only would
        # round W + D and W - D apart from the count's prediction

    def fold(self, d: DecodeProj) -> _Kept:
        size, device = self.sizes[self.slot[id(d)]], d.weight.device
        # (at least one element each: Triton checks every pointer argument, and an empty tensor's may be null)
        kept = _Kept(torch.empty(max(size, 1), dtype=torch.int32, device=device)[:size],
                     torch.empty(max(size, 1), dtype=d.weight.dtype, device=device)[:size])
        self._launch(d, self.kernels.FOLD, kept)
        return kept

    def unfold(self, d: DecodeProj, kept: _Kept) -> None:
        self._launch(d, self.kernels.UNFOLD)
        d.weight.view(-1)[kept.index] = kept.values


def kernel_folds(ds: Sequence[DecodeProj]) -> bool:
    """Whether `folded` takes the Triton kernel: triton runs on the weights' device (CUDA, or the CPU under
    the interpreter in tests) and the weights are contiguous."""
    return bool(ds) and decode_gemm.can_run(ds[0].weight.device) and all(d.weight.is_contiguous() for d in ds)


@contextmanager
def folded(projections: Sequence[LayerProjections], kernel: bool | None = None) -> Iterator[int]:
    """Inside, each projection's weight holds W + scale * B A; after (an exception included), W again, bit
    for bit. Yields how many elements were kept aside. The caller holds no_grad; `can_fold` must be true.
    `kernel`: the Triton kernel (`_KernelFolds`) or torch's ops; None: the kernel where `kernel_folds`.
    Each weight is restored even where another's restore fails (the first error is raised after); an
    exception raised from a signal handler between a weight's fold and its record would leave that one
    weight folded (the next start reloads the base weights; the adapters are never touched)."""
    ds = [d for p in projections for d in p.each()]
    done: list[tuple[DecodeProj, _Kept]] = []
    fold_one, unfold_one = _fold, _unfold
    try:
        if kernel_folds(ds) if kernel is None else kernel:
            folds = _KernelFolds(ds)
            fold_one, unfold_one = folds.fold, folds.unfold
        for d in ds:
            done.append((d, fold_one(d)))
        yield sum(k.index.numel() for _, k in done)
    finally:
        error = None
        for d, kept in reversed(done):
            try:
                unfold_one(d, kept)
            except BaseException as exc:  # noqa: BLE001 -- restore the others first, then raise it
                error = error or exc
        if error is not None:
            raise error
