"""The projections of a wide decode step as torch's GEMMs, the adapters laid out for them once a generate.

Past the decode kernels' rows (`EngineTuning.kernel_rows`) peft's modules would cost, per LoRA matrix, a
cast of its float32 weight to bf16 and a GEMM of its own, then a scale and an add, every token step (14
matrices a Llama layer). Here each projection is one cuBLAS GEMM on the model's own weight (the residual added
in that GEMM where there is one), and its adapter two more: the A matrices of the projections that read one
input (q/k/v, gate/up) stacked into one (sum of ranks, K) matrix,
so one GEMM gives every x A^T of the group, and each adapter's B product added into its projection's output
by its own GEMM (`addmm_`, in place, alpha = the adapter's scale). A and B are copied into the activations'
dtype once a generate, into buffers that stay where they are, so a captured CUDA graph reads the new adapter
each step. Each B product still reads and writes its whole output; folded (`fold.py`), a step has none of
those. q/k/v run as one GEMM on a copy of their weights stacked (copied with the adapters, and again once the
fold has written the weights: `refresh`), and o's and down's residuals are added in place. What each of these
trades: (benchmarks/RESULTS.md, "The measured defaults").

The numerics are peft's with `--lora-compute base` (x A^T rounded to bf16, then B): the scale and the add
happen inside the GEMM's float32 epilogue instead of after it, one rounding fewer.

Not here: which layers run this way (`engine.py`'s plan), the rest of the layer (`layer.py`'s KernelLayer,
whose projections `PackedLayer` replaces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.kernels.decode_gemm import DecodeProj
from grpo.rollout.native.plan import LayerProjections


@dataclass(eq=False)
class PackedGroup:
    """Projections of one input: the model's tensors (`projs`); their adapters' copies: `a` (sum of ranks, K),
    the A matrices stacked, and `bs`, each B (N_i, r_i) or None where a projection has none; and, where the
    group is `stacked`, a copy of its weights stacked (sum of N_i, K) and of its biases, so that one GEMM gives
    every projection (k's and v's narrow GEMMs alone cost about what q's does)."""

    projs: tuple[DecodeProj, ...]
    a: torch.Tensor | None
    bs: tuple[torch.Tensor | None, ...]
    w: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, projs: Sequence[DecodeProj], dtype: torch.dtype, stacked: bool = False) -> PackedGroup:
        with_lora = [p for p in projs if p.lora_a is not None]
        k, device = projs[0].in_features, projs[0].weight.device
        a = w = bias = None
        if with_lora:
            a = torch.empty((sum(p.rank for p in with_lora), k), dtype=dtype, device=device)
        bs = tuple(None if p.lora_b is None else torch.empty(p.lora_b.shape, dtype=dtype, device=p.lora_b.device)
                   for p in projs)
        if stacked and len(projs) > 1:
            w = torch.empty((sum(p.out_features for p in projs), k), dtype=projs[0].weight.dtype, device=device)
            if projs[0].bias is not None:
                bias = torch.empty(w.shape[0], dtype=projs[0].bias.dtype, device=device)
        group = cls(tuple(projs), a, bs, w, bias)
        group.refresh()
        return group

    def refresh(self) -> None:
        """The adapters' and the stacked weights' current values into the copies, in place."""
        at = 0
        for p, b in zip(self.projs, self.bs):
            if b is not None:
                self.a[at: at + p.rank].copy_(p.lora_a)
                b.copy_(p.lora_b)
                at += p.rank
        if self.w is not None:
            torch.cat([p.weight for p in self.projs], out=self.w)
            if self.bias is not None:
                torch.cat([p.bias for p in self.projs], out=self.bias)

    def __call__(self, x2: torch.Tensor, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
        """[x W_i^T (+ bias_i) (+ residual) + scale_i * (x A_i^T) B_i^T] for x2 (M, K): (M, N_i) each, column
        slices of one output where the group is stacked. `residual` is added in place (the layer's x, which the
        output replaces: an out-of-place addmm copies the residual first)."""
        xa = None if self.a is None else x2 @ self.a.t()  # (M, sum of ranks)
        if self.w is not None:
            outs = list(F.linear(x2, self.w, self.bias).split([p.out_features for p in self.projs], dim=1))
        else:
            outs = [self._base(p, x2, residual) for p in self.projs]
        at = 0
        for p, b, y in zip(self.projs, self.bs, outs):
            if b is not None:  # in place: an out-of-place addmm first copies y (7 copies a layer at 256 rows)
                y.addmm_(xa[:, at: at + p.rank], b.t(), alpha=p.lora_scale)
                at += p.rank
        return outs

    @staticmethod
    def _base(p: DecodeProj, x2: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is not None and p.bias is None:
            return residual.addmm_(x2, p.weight.t())
        y = F.linear(x2, p.weight, p.bias)
        return y if residual is None else y + residual


def _where(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), tuple(t.shape))


def _key(d: DecodeProj) -> tuple:
    """Which tensors (and scale) a projection's copies come from."""
    return _where(d.weight), _where(d.bias), _where(d.lora_a), _where(d.lora_b), d.lora_scale


@dataclass(eq=False)
class LayerPack:
    """One decoder layer's projections in their groups: q/k/v, o, gate/up, down; `key` says what from."""

    qkv: PackedGroup
    o: PackedGroup
    gate_up: PackedGroup
    down: PackedGroup
    key: tuple

    @classmethod
    def of(cls, p: LayerProjections, dtype: torch.dtype) -> LayerPack:
        return cls(PackedGroup.of([p.q, p.k, p.v], dtype, stacked=True), PackedGroup.of([p.o], dtype),
                   PackedGroup.of([p.gate, p.up], dtype), PackedGroup.of([p.down], dtype),
                   tuple(_key(d) for d in p.each()))

    def refresh(self) -> None:
        for group in (self.qkv, self.o, self.gate_up, self.down):
            group.refresh()


def packs_for(projections: Sequence[LayerProjections | None], dtype: torch.dtype,
              kept: Sequence[LayerPack | None]) -> list[LayerPack | None]:
    """Each layer's pack for this generate: `kept`'s (so graphs captured on it stay valid) where it was made from
    the same tensors, a new one elsewhere, None where a layer has no projections. The caller refreshes them once
    the weights hold what the generate samples from (after the fold, where it folds)."""
    out: list[LayerPack | None] = []
    for i, p in enumerate(projections):
        old = kept[i] if i < len(kept) else None
        if p is None:
            out.append(None)
        elif old is not None and old.key == tuple(_key(d) for d in p.each()):
            out.append(old)
        else:
            out.append(LayerPack.of(p, dtype))
    return out
