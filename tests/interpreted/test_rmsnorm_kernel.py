"""grpo.kernels.rmsnorm's Triton kernels, run by Triton's interpreter on the CPU, against `rms_norm_ref` and its
autograd gradients (float32 and float16 rows: the interpreter mishandles bf16 loads; the CUDA test covers bf16).

Collected only when TRITON_INTERPRET=1 (tests/test_decode_gemm.py runs this folder in a subprocess).
"""

from __future__ import annotations

import pytest
import torch

from grpo.kernels import rmsnorm


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                           (torch.float16, torch.float32)])
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 64), (0, 64)])  # 96: a row narrower than its block; 0 rows
def test_the_kernels_give_the_modules_values_and_input_gradients(dtype, w_dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(w_dtype)
    grad = torch.randn(shape).to(torch.promote_types(dtype, w_dtype))
    assert rmsnorm.kernel_runs(x, weight)
    ref = rmsnorm.rms_norm_ref(x, weight, 1e-5)
    (ref_dx,) = torch.autograd.grad(ref, x, grad) if x.numel() else (torch.zeros_like(x),)
    ours = rmsnorm.rms_norm(x, weight, 1e-5)
    (dx,) = torch.autograd.grad(ours, x, grad) if x.numel() else (torch.zeros_like(x),)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape and dx.dtype == x.dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]  # a rounding of x's dtype: the row sums' order
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(dx, ref_dx, rtol=10 * tol, atol=10 * tol)


def test_a_wrong_gradient_would_show():
    # the backward's terms both matter at this size: leaving out the one through rstd moves dx far past the tolerance
    torch.manual_seed(1)
    x = torch.randn(4, 32, requires_grad=True)
    weight = torch.ones(32)
    grad = x.detach().clone()  # along x: the rstd term cancels most of the direct one
    (dx,) = torch.autograd.grad(rmsnorm.rms_norm(x, weight, 1e-6), x, grad)
    direct = grad * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (dx - direct).abs().max() > 0.5 and dx.abs().max() < 1e-4


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16)])
def test_the_decode_steps_norm_gives_the_modules_values_for_strided_rows(dtype, w_dtype):
    # norm_rows: the decode's launch (no autograd, no rstd kept), rows taken from a wider tensor
    torch.manual_seed(2)
    wide = (torch.randn(5, 160) * 3).to(dtype)
    x = wide[:, 16:112]  # rows of 96 a stride of 160 apart
    weight = (1 + 0.1 * torch.randn(96)).to(w_dtype)
    ours = rmsnorm.norm_rows(x, weight, 1e-6)
    ref = rmsnorm.rms_norm_ref(x, weight, 1e-6)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)


def test_the_decode_takes_the_norm_kernel_for_llamas_rmsnorm_and_calls_other_norms():
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from grpo.rollout.native.plan import decode_norm

    llama = LlamaRMSNorm(64, eps=1e-5)
    got = decode_norm(llama)
    assert got is not None and got.weight is llama.weight and got.eps == 1e-5  # the module's tensor, not a copy

    class GemmaLikeRMSNorm(LlamaRMSNorm):  # another arithmetic under a name the kernel does not know
        pass

    assert decode_norm(GemmaLikeRMSNorm(64)) is None and decode_norm(nn.LayerNorm(64)) is None
