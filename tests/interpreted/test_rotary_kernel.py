"""grpo.kernels.rotary's Triton kernel, run by Triton's interpreter on the CPU, against `rotary_ref` (transformers'
ops) and its autograd gradients, and the attention modules that `grpo.model.rotary_attention` gives it against
their class's forward (float32 and float16: the interpreter mishandles bf16 loads; the CUDA test covers bf16).

Collected only when TRITON_INTERPRET=1 (tests/test_decode_gemm.py runs this folder in a subprocess).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from grpo.kernels import rotary
from grpo.model import rotary_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny models
from conftest import tiny_family_model  # noqa: E402


def rope_tables(batch: int, T: int, D: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as transformers' rotary embedding makes them: (batch, T, D), each half the same."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    positions = torch.arange(T).float()[None].expand(batch, T) + torch.arange(batch)[:, None] * 3
    freqs = torch.cat([positions[..., None] * inv] * 2, dim=-1)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def heads_view(B, T, H, D, dtype) -> torch.Tensor:
    """(B, H, T, D) as the projections give it: a transposed view of (B, T, H, D)."""
    return (torch.randn(B, T, H, D) * 2).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,T,H,KV,D,cos_rows", [
    (2, 5, 4, 2, 16, 1),  # cos broadcast over the rows (positions 0..T-1, as the trainer's)
    (2, 5, 4, 2, 16, 2),  # a table a row
    (1, 3, 3, 1, 12, 1),  # heads and a half (6) that are no power of two
    (2, 0, 4, 2, 16, 1),  # no tokens
])
def test_the_kernel_gives_the_references_values_and_gradients(dtype, B, T, H, KV, D, cos_rows):
    torch.manual_seed(0)
    q, k = heads_view(B, T, H, D, dtype), heads_view(B, T, KV, D, dtype)
    cos, sin = rope_tables(cos_rows, T, D, dtype)
    if cos_rows == 2:  # each row's table its own: the kernel must read row b's
        sin = sin.flip(0).contiguous()
    assert rotary.kernel_runs(q, k, cos, sin)
    gq, gk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    results = []
    for fn in (rotary.rotary_ref, rotary.rotary):
        qi, ki = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        out = fn(qi, ki, cos, sin)
        grads = torch.autograd.grad(out, [qi, ki], [gq, gk]) if B * T else (qi, ki)
        results.append((*out, *grads))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]  # a rounding: once in the kernel, twice in eager
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    q_out = results[1][0]
    assert q_out.transpose(1, 2).is_contiguous()  # (B, T, heads, D) memory, as eager's products lay it out


def test_a_wrong_rotation_would_show():
    # sin's halves differ here, so a backward that reused the forward with -sin (right only where they are equal)
    # or swapped s1 and s2 would move the gradients far past the tolerance
    torch.manual_seed(3)
    q, k = heads_view(1, 4, 2, 8, torch.float32), heads_view(1, 4, 1, 8, torch.float32)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    g = torch.randn(q.shape), torch.randn(k.shape)
    grads = []
    for fn in (rotary.rotary_ref, rotary.rotary):
        qi, ki = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(qi, ki, cos, sin), [qi, ki], g))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    half = 4
    s1_for_s2 = torch.cat([sin[..., :half], sin[..., :half]], -1)
    with torch.no_grad():
        wrong = rotary.rotary_ref(q, k, cos, s1_for_s2)[0]
        assert (wrong - rotary.rotary(q, k, cos, sin)[0]).abs().max() > 0.1


@pytest.mark.parametrize("family,checkpointed", [("llama", False), ("llama", True), ("mistral", False),
                                                 ("qwen2", False), ("qwen3", False)])
def test_the_installed_attention_takes_the_kernel_and_gives_the_class_values_and_gradients(family, checkpointed,
                                                                                            monkeypatch):
    model = tiny_family_model(family).train()
    if checkpointed:  # as the trainer enables it: each layer's forward runs again in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = copy.deepcopy(model)
    assert rotary_attention.install(ours) == 2
    calls, kernel = [], rotary._RotaryKernel
    monkeypatch.setattr(rotary, "_RotaryKernel", type("Counted", (), {
        "apply": staticmethod(lambda *a: calls.append(1) or kernel.apply(*a))}))
    ids = torch.randint(0, 200, (2, 5))
    results = []
    for m in (model, ours):
        logits = m(ids, use_cache=False).logits  # as the trainer's passes call it
        weights = [m.model.layers[0].self_attn.q_proj.weight, m.model.layers[1].self_attn.k_proj.weight]
        results.append((logits, *torch.autograd.grad(logits.square().mean(), weights)))
    assert len(calls) == (4 if checkpointed else 2)  # each layer's forward, and its recomputation
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_call_with_a_cache_takes_the_class_forward(monkeypatch):
    # transformers' generate: the cache updated as the class does it, the kernel never called
    model = tiny_family_model("llama").eval()
    ours = copy.deepcopy(model)
    rotary_attention.install(ours)
    monkeypatch.setattr(rotary, "rotary", lambda *a: pytest.fail("the kernel ran under a cache"))
    ids = torch.randint(0, 200, (1, 5))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        got = ours.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
