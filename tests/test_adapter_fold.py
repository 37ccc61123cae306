"""Folding LoRA adapters into the base weights for a decode (grpo.rollout.native.fold): the weights hold
W + scale * B A inside, and W bit for bit after, also after an error."""

from __future__ import annotations

import pytest
import torch

from grpo.kernels.decode_gemm import DecodeProj
from grpo.kernels.fp8 import quantize_fp8_block
from grpo.rollout.native import fold
from grpo.rollout.native.plan import LayerProjections

NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def layer(seed: int, dtype=torch.bfloat16, rank: int = 8, lora_size: float = 0.05, fp8: bool = False):
    g = torch.Generator().manual_seed(seed)
    projs = {}
    for i, name in enumerate(NAMES):
        n, k = 48 + 16 * i, 64
        w = torch.randn(n, k, generator=g) / k**0.5
        weight, scale_inv = quantize_fp8_block(w) if fp8 else (w.to(dtype), None)
        a = torch.randn(rank, k, generator=g) * lora_size
        b = torch.randn(n, rank, generator=g) * lora_size
        projs[name] = DecodeProj(weight, scale_inv, a, b, 2.0)
    return LayerProjections(**projs)


def weights(layers) -> list[torch.Tensor]:
    return [getattr(p, n).weight.clone() for p in layers for n in NAMES]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(fold.bits(a), fold.bits(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inside_the_weights_hold_the_rounded_sum_and_after_exactly_what_they_held(dtype):
    layers = [layer(0, dtype), layer(1, dtype, lora_size=0.3)]  # the second's sums cross powers of two often
    w = layers[0].q.weight
    w[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])  # signed zero, NaN and inf come back as they were
    before = weights(layers)
    with torch.no_grad(), fold.folded(layers) as kept:
        inside = weights(layers)
        adapters = [getattr(p, n) for p in layers for n in NAMES]
        for w, old, d in zip(inside, before, adapters):
            assert same_bits(w, (old.float() + (d.lora_b.float() @ d.lora_a.float()) * 2.0).to(dtype))
    assert kept > 3  # beyond the special values, round trips that did not come back by themselves
    assert any(not same_bits(a, b) for a, b in zip(inside, before))
    for a, b in zip(weights(layers), before):
        assert same_bits(a, b)


def test_an_error_inside_leaves_the_weights_as_they_were():
    layers = [layer(2, lora_size=0.3)]
    before = weights(layers)
    with pytest.raises(RuntimeError, match="mid-decode"), torch.no_grad(), fold.folded(layers):
        raise RuntimeError("mid-decode")
    for a, b in zip(weights(layers), before):
        assert same_bits(a, b)


def test_a_restore_that_fails_restores_the_others_and_raises(monkeypatch):
    layers = [layer(3), layer(4)]
    before = weights(layers)
    unfold, calls = fold._unfold, []

    def failing_once(d, kept):
        calls.append(d)
        if len(calls) == 1:
            raise MemoryError("no room for the float32 difference")
        unfold(d, kept)

    monkeypatch.setattr(fold, "_unfold", failing_once)
    with pytest.raises(MemoryError), torch.no_grad(), fold.folded(layers):
        pass
    restored = [same_bits(a, b) for a, b in zip(weights(layers), before)]
    assert len(calls) == 14 and restored.count(False) == 1  # only the one whose restore failed stays folded


def test_only_layers_on_the_kernels_with_adapters_and_dense_weights_fold():
    assert fold.can_fold([layer(0), layer(1)])
    assert not fold.can_fold([layer(0), None])  # a layer through its modules
    assert not fold.can_fold([layer(0, fp8=True)])
    assert not fold.can_fold([])
    bare = fold.without_adapters(layer(0))
    assert all(getattr(bare, n).lora_a is None and getattr(bare, n).lora_b is None for n in NAMES)
    assert not fold.can_fold([bare])


def test_adapters_off_runs_the_base_layers_and_gives_peft_s_switches_and_requires_grad_back():
    # the folded prefill: the weights hold the adapters, so peft's LoRA layers must not add them again
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.model.load import adapters_off
    from test_native_engine import small_llama

    lora = get_peft_model(small_llama(seed=1), LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                                          init_lora_weights=False))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    grads = {name: p.requires_grad for name, p in lora.named_parameters()}
    with torch.no_grad():
        adapted = lora(ids).logits
        with lora.disable_adapter():
            base = lora(ids).logits
        assert not torch.allclose(adapted, base)  # the adapters change the output
        with adapters_off(lora):
            assert torch.equal(lora(ids).logits, base)
        assert torch.equal(lora(ids).logits, adapted)
    assert {name: p.requires_grad for name, p in lora.named_parameters()} == grads
