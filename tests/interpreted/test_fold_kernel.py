"""The adapter fold's Triton kernel (grpo/kernels/_fold_triton.py), run by Triton's interpreter on the CPU.

Collected only when TRITON_INTERPRET=1 (tests/test_decode_gemm.py runs this folder in a subprocess). The
interpreter rounds float32 to bf16 its own way (truncating, where the GPU rounds to nearest even), and the
kernel sums D in its own order, so the folded weights are compared with torch's within the dtype's precision.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from grpo.kernels.decode_gemm import DecodeProj
from grpo.rollout.native import fold

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_adapter_fold's helpers
from test_adapter_fold import layer, same_bits, weights  # noqa: E402


def same_sum_rounded(ours: torch.Tensor, theirs: torch.Tensor, w: torch.Tensor, d: DecodeProj) -> bool:
    """Two roundings of W + D apart by no more than the dtype's precision of |W| + scale |B| |A|: D's terms
    summed in another order differ in float32's last bits of the largest term, and where W and D nearly
    cancel those are many steps of the small result."""
    size = w.float().abs() + (d.lora_b.float().abs() @ d.lora_a.float().abs()) * abs(d.lora_scale)
    return bool(((ours.float() - theirs.float()).abs() <= 2 * torch.finfo(w.dtype).eps * size).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_folds_as_torch_s_ops_do_and_restores_every_bit(dtype):
    layers = [layer(0, dtype), layer(1, dtype, rank=5, lora_size=0.3)]  # rank 5: B and A read under a mask
    layers[0].q.weight[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])
    ds = [d for p in layers for d in p.each()]
    assert fold.kernel_folds(ds)
    before = weights(layers)
    with torch.no_grad(), fold.folded(layers, kernel=False):
        by_torch = weights(layers)
    with torch.no_grad(), fold.folded(layers) as kept:  # the kernel, as the engine takes it where triton runs
        by_kernel = weights(layers)
    assert kept > 3
    for ours, theirs, w, d in zip(by_kernel, by_torch, before, ds):
        special = ~torch.isfinite(w)  # (their restore is checked below)
        ours, theirs, w = (t.masked_fill(special, 0.0) for t in (ours, theirs, w))
        assert same_sum_rounded(ours, theirs, w, d)
    assert any(not same_bits(a, b) for a, b in zip(by_kernel, before))
    for a, b in zip(weights(layers), before):
        assert same_bits(a, b)


def test_the_fold_pass_keeps_exactly_the_elements_the_count_pass_counted():
    layers = [layer(2, lora_size=0.3), layer(3)]
    ds = [d for p in layers for d in p.each()]
    before = weights(layers)
    with torch.no_grad():
        folds = fold._KernelFolds(ds)
        kept = [folds.fold(d) for d in ds]
        assert folds.counts.tolist() == [k.index.numel() for k in kept]  # every reserved place written once
        for k, w in zip(kept, before):
            assert k.index.unique().numel() == k.index.numel()  # no element twice
            assert same_bits(k.values, w.view(-1)[k.index.long()])  # their values before the fold
        for d, k in zip(reversed(ds), reversed(kept)):
            folds.unfold(d, k)
    for a, b in zip(weights(layers), before):
        assert same_bits(a, b)
