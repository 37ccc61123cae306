"""grpo.kernels.silu_mul's Triton kernels, run by Triton's interpreter on the CPU, against `SiluMul` (eager's ops)
and its gradients (float32 and float16: the interpreter mishandles bf16 loads; the CUDA test covers bf16).

Collected only when TRITON_INTERPRET=1 (tests/test_decode_gemm.py runs this folder in a subprocess).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from grpo.kernels import silu_mul
from grpo.model import lean_activations
from grpo.model.lean_activations import SiluMul

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny models
from conftest import tiny_llama  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 1500), (2, 3, 96), (0, 64)])  # 1500: blocks past the end of a row; 0 rows
@pytest.mark.parametrize("consume", [False, True])
def test_the_kernels_give_eagers_values_and_gradients(dtype, shape, consume):
    torch.manual_seed(0)
    gate, up, grad = ((torch.randn(shape) * 3).to(dtype) for _ in range(3))
    assert silu_mul.kernel_runs(gate, up)
    want = SiluMul.apply(gate.requires_grad_(), up.requires_grad_(), False)
    want_grads = torch.autograd.grad(want, [gate, up], grad) if want.numel() else (gate, up)
    g, u = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    ours = silu_mul.silu_mul(g, u, consume)
    buffers = (g.data_ptr(), u.data_ptr())
    grads = torch.autograd.grad(ours, [g, u], grad) if ours.numel() else (g, u)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]  # a rounding of the dtype: tl.sigmoid against aten's
    assert ours.dtype == dtype and ours.shape == want.shape
    torch.testing.assert_close(ours, want, rtol=tol, atol=tol)
    for got, wanted in zip(grads, want_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got, wanted, rtol=tol, atol=tol)
    if consume and ours.numel():  # d_gate made in up's buffer, d_up in gate's
        assert (grads[0].data_ptr(), grads[1].data_ptr()) == buffers[::-1]


def test_a_gradient_left_out_would_show():
    # at these values each of d_gate's factors moves it past the tolerance: sigmoid's term 1 + g (1 - s) is far from 1
    gate = torch.tensor([[-3.0, -1.0, 0.5, 2.0, 4.0]], requires_grad=True)
    up = torch.full_like(gate, 2.0, requires_grad=True)
    d_gate, d_up = torch.autograd.grad(silu_mul.silu_mul(gate, up), [gate, up], torch.ones_like(gate))
    s = torch.sigmoid(gate.detach())
    assert (d_gate - 2 * s).abs().max() > 0.3
    torch.testing.assert_close(d_up, gate.detach() * s)


def test_the_lean_mlp_takes_the_kernel_and_gives_the_modules_values_and_gradients(monkeypatch):
    model = tiny_llama(seed=4)
    mlp = model.model.layers[0].mlp
    lean = copy.deepcopy(mlp)
    lean_activations.install(lean)
    calls, kernel = [], silu_mul._SiluMulKernel
    monkeypatch.setattr(silu_mul, "_SiluMulKernel", type("Counted", (), {
        "apply": staticmethod(lambda *a: calls.append(1) or kernel.apply(*a))}))
    x = torch.randn(2, 9, mlp.gate_proj.in_features)
    results = []
    for module in (mlp, lean):
        xi = x.clone().requires_grad_()
        y = module(xi)
        results.append((y, *torch.autograd.grad(y.square().sum(), [xi, module.gate_proj.weight])))
    assert calls == [1]
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
