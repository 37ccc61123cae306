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
