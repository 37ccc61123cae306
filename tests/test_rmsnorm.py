"""grpo.kernels.rmsnorm in the training pass: where it runs and where torch's ops stay (the kernels themselves
run under Triton's interpreter in tests/interpreted/test_rmsnorm_kernel.py, and on CUDA below)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import tiny_llama
from grpo.model import lean_activations
from grpo.kernels import rmsnorm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _loss_and_grad(model, ids):
    x = model.model.embed_tokens(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=x, labels=ids).loss
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs the kernel on the CPU")
def test_without_a_kernel_to_run_the_norms_keep_torchs_ops_bit_for_bit():
    eager = tiny_llama(seed=4)
    lean = copy.deepcopy(eager)
    asked = copy.deepcopy(eager)
    assert lean_activations.install(lean, norm_kernel=False) == lean_activations.install(asked) > 0
    norm = asked.model.norm
    assert norm.norm_kernel and not lean.model.norm.norm_kernel
    assert not rmsnorm.kernel_runs(torch.zeros(2, norm.weight.shape[0]), norm.weight)
    ids = torch.randint(0, 128256, (2, 12))
    loss, grad = _loss_and_grad(lean, ids)
    loss_asked, grad_asked = _loss_and_grad(asked, ids)
    assert torch.equal(loss, loss_asked) and torch.equal(grad, grad_asked)
    with pytest.raises(ValueError, match="no kernel for x .* use rms_norm_ref"):
        rmsnorm.rms_norm(torch.zeros(2, norm.weight.shape[0]), norm.weight, 1e-5)


def test_a_trainable_or_too_wide_weight_takes_no_kernel(monkeypatch):
    monkeypatch.setattr(rmsnorm, "can_run", lambda device: True)
    x = torch.zeros(2, 8)
    assert rmsnorm.kernel_runs(x, torch.ones(8))
    assert not rmsnorm.kernel_runs(x, torch.ones(8, requires_grad=True))  # its gradient: lean_activations' own
    assert not rmsnorm.kernel_runs(x, torch.ones(4))
    wide = rmsnorm.MAX_COLS + 1
    assert not rmsnorm.kernel_runs(torch.zeros(2, wide), torch.ones(wide))


@pytest.mark.cuda
@cuda
def test_on_cuda_in_bf16_the_kernels_are_as_close_to_float32_as_torchs_ops():
    torch.manual_seed(0)
    x32 = torch.randn(333, 2048, device="cuda") * 4
    w32 = 1 + 0.1 * torch.randn(2048, device="cuda")
    g32 = torch.randn(333, 2048, device="cuda")
    truth = rmsnorm.rms_norm_ref(x32.requires_grad_(True), w32, 1e-5)
    (truth_dx,) = torch.autograd.grad(truth, x32, g32)
    x, w, g = x32.detach().bfloat16().requires_grad_(True), w32.bfloat16(), g32.bfloat16()
    errors = {}
    for name, fn in (("torch", rmsnorm.rms_norm_ref), ("kernel", rmsnorm.rms_norm)):
        y = fn(x, w, 1e-5)
        (dx,) = torch.autograd.grad(y, x, g)
        errors[name] = [float((a.float() - b).norm() / b.norm()) for a, b in ((y, truth), (dx, truth_dx))]
    (y_k, dx_k), (y_t, dx_t) = errors["kernel"], errors["torch"]
    assert y_k < 1.2 * y_t + 1e-4 and dx_k < 1.2 * dx_t + 1e-4, errors
    assert errors["kernel"][0] < 5e-3 and errors["kernel"][1] < 1e-2, errors
    model = tiny_llama(seed=4, dtype=torch.bfloat16).cuda()
    lean, fused = copy.deepcopy(model), copy.deepcopy(model)
    lean_activations.install(lean, norm_kernel=False)
    lean_activations.install(fused)
    ids = torch.randint(0, 128256, (2, 40), device="cuda")
    (loss, grad), (loss_f, grad_f) = _loss_and_grad(lean, ids), _loss_and_grad(fused, ids)
    assert abs(float(loss - loss_f)) < 1e-2 and float((grad_f - grad).float().norm() / grad.float().norm()) < 2e-2


@pytest.mark.cuda
@cuda
def test_inside_torch_compile_the_kernel_gives_its_eager_values():
    # The native engine compiles its pieces around the model's norms (grpo.rollout.native.layer.piece_norm), where
    # inductor launches the kernel itself with the arguments it was given: every constexpr passed, none defaulted
    torch.manual_seed(0)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda rows: rmsnorm.rms_norm(rows, w, 1e-5))
    torch.testing.assert_close(compiled(x), rmsnorm.rms_norm(x, w, 1e-5), rtol=0, atol=0)
