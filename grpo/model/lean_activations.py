"""The training pass's MLP product and RMSNorms, saving less for backward than transformers' modules do.

Under gradient checkpointing, one recomputed layer holds all of its saved activations at once while its
backward runs, and that is where the bench step peaks (the allocator's history shows it). Two of those
activations are copies the backward can do without:
- `act_fn(gate) * up` saves SiLU's output for the product's backward (a tensor of the intermediate size).
  `SiluMul` saves gate and up, which autograd keeps anyway, and recomputes SiLU in backward. That is one
  elementwise pass, and the gradients are eager's bit for bit (the same ops in the same order). Where
  `grpo.kernels.silu_mul` runs (CUDA), its one launch each way takes that place, within a rounding of eager's.
- transformers' RMSNorm upcasts its input to float32, and `pow` and `mul` save that copy (twice the bytes
  of the input). `RMSNormFn` saves the input as it came and the per-token rstd, and recomputes the float32
  copy in backward: the same ops as autograd's, so the gradients are again eager's bit for bit (the CPU
  tests: float32, bf16, and a float32 weight on bf16 activations).
Without checkpointing (the Qwen preset's micro-batches keep their activations), every layer saves less.
And the MLP's backward makes fewer tensors of the intermediate size: two, the down projection's input
gradients from the base and the adapter, where eager makes six. Autograd adds those two in place when they
are plain products, which they are on the tokens as rows (on 3-D inputs they come back as views, and autograd
made their sum anew), and `SiluMul` makes its gradients in gate's and up's own buffers.

Only where autograd records: generation, evaluation and the reference's pass (no grad) call the modules' own
forward, except the norms where `grpo.kernels.rmsnorm` runs (CUDA): there they take its one launch each way,
with grad or without (the native engine's decode graph too), and their values are within a rounding of the
module's, not bit for bit. It trades bit-for-bit norms for a shorter update and reference pass
(benchmarks/RESULTS.md, "The measured defaults"); `install(model, norm_kernel=False)` keeps torch's ops.
Only for the modules whose forward this reproduces exactly: Llama's,
Qwen2's and Qwen3's (`MLP_CLASSES`, `NORM_CLASSES`). The CPU tests compare values and gradients with the
modules' own.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from grpo.kernels import rmsnorm, silu_mul

MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP")  # forward: down_proj(act_fn(gate_proj(x)) * up_proj(x))
NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # weight * (x32 * rsqrt(mean(x32^2) + eps)).to()
SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch's and transformers' (F.silu both)


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, saving gate and up only. `consume`: gate and up are the caller's own temporaries, which
    nothing reads after this product's backward; it then makes the gradients in their buffers."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, consume: bool = False) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.consume = consume
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # eager's ops, so its gradients bit for bit; each made in place where that keeps eager's dtype: in new
        # buffers, or consumed, in the inputs' own (d_gate in up's, then d_up in gate's, once d_gate read gate),
        # which makes no tensor of the intermediate size beside gate, up and grad
        in_place = gate.dtype == up.dtype == grad.dtype and gate.shape == up.shape == grad.shape
        reuse = in_place and ctx.consume and not torch.is_grad_enabled()
        d_up = d_gate = None
        if ctx.needs_input_grad[0]:
            d_gate = up.mul_(grad) if reuse else (grad * up).to(gate.dtype)  # eager: SiLU's gradient in its dtype
            torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        if ctx.needs_input_grad[1]:
            silu = F.silu(gate, inplace=reuse)
            d_up = silu.mul_(grad) if in_place else grad * silu
        return d_gate, d_up, None


class RMSNormFn(torch.autograd.Function):
    """transformers' RMSNorm, saving its input and the per-token rstd (float32, one number a token); the
    backward repeats autograd's derivatives of the module's ops in their order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad * (x32 * rstd).to(x.dtype)).sum_to_size(weight.shape)
        if not ctx.needs_input_grad[0]:
            return None, d_weight, None
        d_normed = (grad * weight).to(x.dtype).to(torch.float32)  # (eager's product gives its input's dtype)
        d_rstd = (d_normed * x32).sum(-1, keepdim=True)
        d_square = (-0.5 * d_rstd * rstd.pow(3)).expand_as(x32) / x32.shape[-1]  # rsqrt's, then mean's
        d_x = d_normed * rstd + d_square * (2 * x32)  # through the product with rstd, and through pow(2)
        return d_x.to(x.dtype), d_weight, None


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    # On the tokens as rows (2-D): the projections' input gradients then come back as plain products, which
    # autograd adds in place; on 3-D inputs they come back as views, and each sum was a new tensor. gate and up
    # are this forward's own, so the product's backward consumes them.
    rows = x.reshape(-1, x.shape[-1])
    gate, up = self.gate_proj(rows), self.up_proj(rows)
    product = silu_mul.silu_mul(gate, up, True) if silu_mul.kernel_runs(gate, up) else SiluMul.apply(gate, up, True)
    y = self.down_proj(product)
    return y.view(*x.shape[:-1], y.shape[-1])


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if self.__dict__.get("norm_kernel") and rmsnorm.kernel_runs(hidden_states, self.weight):
        return rmsnorm.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    if not torch.is_grad_enabled():
        return type(self).forward(self, hidden_states)
    return RMSNormFn.apply(hidden_states, self.weight, self.variance_epsilon)


def install(model: nn.Module, norm_kernel: bool = True) -> int:
    """Gives `model`'s MLPs (with SiLU) and RMSNorms of the known classes the lean forward: on each module,
    not its class, so other models of the class keep transformers' forward (a bound method on the module:
    deepcopy keeps it, but `torch.save` of the whole model would not load back; save state dicts).
    `norm_kernel`: the norms take `grpo.kernels.rmsnorm` where it runs (False: torch's ops everywhere). Returns
    how many modules changed."""
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name in MLP_CLASSES and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES:
            module.forward = types.MethodType(_mlp_forward, module)
        elif name in NORM_CLASSES:
            module.forward = types.MethodType(_norm_forward, module)
            module.norm_kernel = norm_kernel
        else:
            continue
        changed += 1
    return changed
