"""The wide decode step on torch's GEMMs with the adapters packed (grpo.rollout.native.packed: what
gemm="kernels" runs past EngineTuning.kernel_rows): the projections' products as the reference computes them,
the rollout of peft's modules, and each generate serving the adapter as it is then."""

from __future__ import annotations

import pytest
import torch

from grpo.kernels import decode_gemm
from grpo.kernels.decode_gemm import DecodeProj
from grpo.rollout.base import Sampling
from grpo.rollout.native import EngineTuning, NativeEngine, fold
from grpo.rollout.native.packed import PackedGroup
from test_native_engine import PAD, PROMPTS, small_llama


def projections(n_outs, k=64, rank=4, bias=False, lora=(True, True, True), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, with_lora in zip(n_outs, lora):
        out.append(DecodeProj(torch.randn(n, k, generator=g) / k**0.5, None,
                              torch.randn(rank, k, generator=g) * 0.1 if with_lora else None,
                              torch.randn(n, rank, generator=g) * 0.1 if with_lora else None, 1.5,
                              torch.randn(n, generator=g) if bias else None))
    return out


@pytest.mark.parametrize("bias,lora", [(False, (True, True, True)), (True, (True, True, True)),
                                       (False, (False, True, False))])
def test_a_group_gives_the_references_products(bias, lora):
    projs = projections([48, 16, 16], bias=bias, lora=lora)
    x = torch.randn(5, 64)
    group = PackedGroup.of(projs, torch.float32)
    for got, want in zip(group(x), decode_gemm.project_ref(x, projs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    residual = torch.randn(5, 48)  # o_proj and down_proj: the residual added in the GEMM, in place
    want = decode_gemm.project_ref(x, projs[:1], residual)[0]
    got = PackedGroup.of(projs[:1], torch.float32)(x, residual)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bias or got.data_ptr() == residual.data_ptr()  # the layer's x, replaced: no copy of it first


@pytest.mark.parametrize("bias", [False, True])
def test_a_stacked_group_is_one_gemm_whose_column_slices_are_the_references_products(bias):
    projs = projections([48, 16, 16], bias=bias, lora=(True, False, True))
    x = torch.randn(5, 64)
    group = PackedGroup.of(projs, torch.float32, stacked=True)
    outs = group(x)
    for got, want in zip(outs, decode_gemm.project_ref(x, projs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [o.stride(0) for o in outs] == [80] * 3 and outs[1].data_ptr() == outs[0].data_ptr() + 48 * 4
    projs[2].weight.mul_(2.0)  # the weights change in place (the fold): refresh copies them into the stack
    w = group.w.data_ptr()
    group.refresh()
    assert group.w.data_ptr() == w
    torch.testing.assert_close(group(x)[2], decode_gemm.project_ref(x, projs)[2], rtol=1e-5, atol=1e-5)


def test_the_copies_are_refreshed_in_place_and_follow_the_adapter():
    projs = projections([48, 16, 16])
    group = PackedGroup.of(projs, torch.bfloat16)
    a, bs = group.a.data_ptr(), [b.data_ptr() for b in group.bs]
    assert group.a.dtype == torch.bfloat16 and group.a.shape == (12, 64)  # three rank-4 A's stacked
    projs[1].lora_a.mul_(-2.0)
    projs[2].lora_b.zero_()
    group.refresh()
    assert group.a.data_ptr() == a and [b.data_ptr() for b in group.bs] == bs  # graphs read these in place
    torch.testing.assert_close(group.a[4:8].float(), projs[1].lora_a, rtol=1e-2, atol=1e-3)
    assert not group.bs[2].any()


def lora_llama(seed: int = 3, rank: int = 4):
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS

    return get_peft_model(small_llama(seed=seed), LoraConfig(r=rank, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                                             init_lora_weights=False))


def engines(model, monkeypatch, **tuning):
    """The engine through the modules, and one planned as a GPU plans it (gemm="kernels") with kernel_rows=1:
    every step of two rows or more runs packed. The kernels' check is passed at the build only; running, the
    layers take the kernels' references (the K/V write, the fold), as where triton does not run."""
    modules = NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD, gemm="modules")
    with monkeypatch.context() as patch:
        patch.setattr(decode_gemm, "can_run", lambda device: True)
        packed = NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD, gemm="kernels",
                              tuning=EngineTuning(kernel_rows=1, **tuning))
    return modules, packed


def test_the_packed_step_samples_what_the_modules_do_and_serves_each_generates_adapter(monkeypatch):
    model = lora_llama()
    modules, packed = engines(model, monkeypatch)
    s = Sampling(max_new_tokens=10, temperature=1.0, seed=3)
    a, b = modules.generate(PROMPTS, 2, s), packed.generate(PROMPTS, 2, s)
    assert all(layer.__class__.__name__ == "PackedLayer" for layer in packed._layers)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.sampler_logp, a.sampler_logp, rtol=0, atol=1e-4)
    kept = [p.qkv.a.data_ptr() for p in packed._packs]
    with torch.no_grad():  # an optimizer step: the adapters change in place
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    after = packed.generate(PROMPTS, 1, greedy)
    assert [p.qkv.a.data_ptr() for p in packed._packs] == kept  # refreshed, not made anew
    assert torch.equal(after.completion_ids, modules.generate(PROMPTS, 1, greedy).completion_ids)
    assert not torch.equal(after.completion_ids, b.completion_ids[::2])  # the new adapter changed the tokens


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_packed_step_of_qwen2_and_qwen3_samples_what_their_modules_do(family, monkeypatch):
    # q/k/v come out of one stacked GEMM as column slices: with Qwen2's biases stacked too, and Qwen3's head norms
    # and rotaries outside the attention's launch reading those slices
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from test_native_engine import small_decoder, small_qwen2

    base = small_qwen2(seed=6) if family == "qwen2" else small_decoder("qwen3", seed=6)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                            init_lora_weights=False))
    modules, packed = engines(model, monkeypatch)
    s = Sampling(max_new_tokens=6, temperature=1.0, seed=5)
    a, b = modules.generate(PROMPTS, 2, s), packed.generate(PROMPTS, 2, s)
    assert all(layer.__class__.__name__ == "PackedLayer" for layer in packed._layers)
    assert all(p.qkv.w is not None for p in packed._packs)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.sampler_logp, a.sampler_logp, rtol=0, atol=1e-4)


def test_folded_into_the_packed_step_the_weights_come_back_bit_for_bit(monkeypatch):
    model = lora_llama(seed=4)
    modules, packed = engines(model, monkeypatch, fold_adapter=True)
    before = [p.detach().clone() for p in model.parameters()]
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    b = packed.generate(PROMPTS, 1, greedy)
    assert packed._fold and all(p.qkv.a is None for p in packed._packs)  # the adapters are in the weights
    assert all(torch.equal(fold.bits(p), fold.bits(q)) for p, q in zip(model.parameters(), before))
    a = modules.generate(PROMPTS, 1, greedy)
    torch.testing.assert_close(b.sampler_logp, a.sampler_logp, rtol=0, atol=1e-4)  # float32: folding is exact-ish


def test_steps_the_kernels_take_stay_on_them_and_wider_ones_run_packed(monkeypatch):
    # on a GPU the product's gemm="kernels" runs up to kernel_rows; only the wider steps take the packed layers
    # (planning builds the layers and launches nothing: the kernels need not run here)
    monkeypatch.setattr(decode_gemm, "can_run", lambda device: True)
    model = lora_llama(seed=5)
    engine = NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(kernel_rows=3))
    engine._plan(3)
    assert {type(layer).__name__ for layer in engine._layers} == {"KernelLayer"}
    engine._plan(6)
    assert {type(layer).__name__ for layer in engine._layers} == {"PackedLayer"}


def test_the_modules_stay_where_chosen(monkeypatch):
    # gemm="modules" (what a CPU gets by default): every step calls peft's modules, however wide
    monkeypatch.setattr(decode_gemm, "can_run", lambda device: True)
    engine = NativeEngine(lora_llama(seed=5), max_seq_len=32, max_batch=6, pad_id=PAD, gemm="modules",
                          tuning=EngineTuning(kernel_rows=3))
    engine._plan(6)
    assert "PackedLayer" not in {type(layer).__name__ for layer in engine._layers}
