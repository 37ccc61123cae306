"""grpo.model.rotary_attention and grpo.kernels.rotary on the CPU without Triton's interpreter (the kernel's values:
tests/interpreted/test_rotary_kernel.py): which modules take the forward, the class's values bit for bit where the
kernel does not run, what the kernel takes, and on CUDA its bf16 values against float32's."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import tiny_family_model
from grpo.kernels import rotary
from grpo.model import rotary_attention

NO_INTERPRETER = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs the kernel")


@pytest.mark.parametrize("family,extra,installed", [
    ("llama", {}, 2), ("qwen3", {"sliding_window": None}, 2),
    ("mistral", {"sliding_window": 4096}, 0),  # a window: the class's forward passes it on, so it keeps that forward
    ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, 1),  # layer 1's window
])
def test_install_takes_the_attention_modules_without_a_window(family, extra, installed):
    model = tiny_family_model(family, **extra)
    assert rotary_attention.install(model) == installed
    bound = [("forward" in vars(layer.self_attn)) for layer in model.model.layers]
    assert sum(bound) == installed


def test_a_class_of_the_name_whose_file_has_no_eager_attention_keeps_its_forward():
    stranger = type("LlamaAttention", (torch.nn.Module,), {})()  # this test file defines no eager_attention_forward
    assert rotary_attention.install(stranger) == 0 and "forward" not in vars(stranger)


def test_the_attention_is_the_one_the_class_calls_with_or_without_transformers_get_interface(monkeypatch):
    from transformers.models.llama import modeling_llama

    attention = tiny_family_model("llama").model.layers[0].self_attn
    sdpa = rotary_attention._attention_function(attention)
    assert attention.config._attn_implementation == "sdpa" and sdpa is not modeling_llama.eager_attention_forward
    monkeypatch.setattr(rotary_attention, "ALL_ATTENTION_FUNCTIONS", {"sdpa": sdpa})  # a plain mapping, as older
    assert rotary_attention._attention_function(attention) is sdpa
    attention.config._attn_implementation = "eager"
    assert rotary_attention._attention_function(attention) is modeling_llama.eager_attention_forward


@NO_INTERPRETER
def test_where_the_kernel_does_not_run_the_installed_model_is_the_class_bit_for_bit():
    model = tiny_family_model("llama").train()
    ours = copy.deepcopy(model)
    rotary_attention.install(ours)
    ids = torch.randint(0, 200, (2, 7))
    got = [ours(ids, use_cache=False).logits]
    got += torch.autograd.grad(got[0].square().mean(), [ours.model.layers[0].self_attn.q_proj.weight])
    want = [model(ids, use_cache=False).logits]
    want += torch.autograd.grad(want[0].square().mean(), [model.model.layers[0].self_attn.q_proj.weight])
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@NO_INTERPRETER
def test_without_a_kernel_to_run_the_rotary_says_what_it_lacks():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    assert not rotary.kernel_runs(q, k, cos, sin)
    with pytest.raises(ValueError, match=r"no kernel for q \(1, 4, 3, 8\) torch.float32.* use rotary_ref"):
        rotary.rotary(q, k, cos, sin)


def test_the_kernel_takes_one_dtype_heads_contiguous_and_tables_without_gradients(monkeypatch):
    monkeypatch.setattr(rotary, "can_run", lambda device: True)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    assert rotary.kernel_runs(q, k, cos, sin)
    assert rotary.kernel_runs(q, k, cos.expand(2, 3, 8), sin.expand(2, 3, 8))  # a table a row (stride 0 too)
    assert not rotary.kernel_runs(q, k, cos.half(), sin.half())  # eager would promote: another dtype out
    assert not rotary.kernel_runs(q, k, cos.requires_grad_(), sin)
    cos = cos.detach()
    assert not rotary.kernel_runs(q, k, torch.randn(3, 3, 8), torch.randn(3, 3, 8))  # neither 1 nor B tables
    assert not rotary.kernel_runs(q.transpose(2, 3), k, cos, sin)  # D not contiguous (and not the table's width)
    assert not rotary.kernel_runs(torch.randn(2, 4, 3, 7), torch.randn(2, 2, 3, 7), cos[..., :7], sin[..., :7])
    assert not rotary.kernel_runs(torch.randn(2, 4, 4, 8), k, cos, sin)  # q and k at other positions


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bf16_the_rotary_kernel_is_as_close_to_float32_as_eagers_ops():
    torch.manual_seed(0)
    B, T, H, KV, D = 4, 640, 32, 8, 64  # the bench's micro-batch shapes
    q32 = torch.randn(B, T, H, D, device="cuda").transpose(1, 2)
    k32 = torch.randn(B, T, KV, D, device="cuda").transpose(1, 2)
    inv = 1.0 / 500000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    freqs = torch.cat([torch.arange(T, device="cuda").float()[:, None] * inv] * 2, -1)[None]
    cos32, sin32 = freqs.cos(), freqs.sin()
    gq, gk = torch.randn_like(q32), torch.randn_like(k32)
    q32.requires_grad_(), k32.requires_grad_()
    truth = rotary.rotary_ref(q32, k32, cos32, sin32)
    truth = (*truth, *torch.autograd.grad(truth, [q32, k32], [gq, gk]))
    errors = {}
    for name, fn in (("eager", rotary.rotary_ref), ("kernel", rotary.rotary)):
        q, k = (t.detach().bfloat16().requires_grad_() for t in (q32, k32))
        cos, sin = cos32.bfloat16(), sin32.bfloat16()
        assert name == "eager" or rotary.kernel_runs(q, k, cos, sin)
        out = fn(q, k, cos, sin)
        got = (*out, *torch.autograd.grad(out, [q, k], [gq.bfloat16(), gk.bfloat16()]))
        errors[name] = [float((a.float() - b).norm() / b.norm()) for a, b in zip(got, truth)]
    assert all(k < 1.05 * e + 1e-5 and k < 1e-2 for k, e in zip(errors["kernel"], errors["eager"])), errors
