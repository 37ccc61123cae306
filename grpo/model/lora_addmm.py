"""The training pass's LoRA layers: the adapter's product added inside one GEMM, where peft makes three tensors.

peft's LoRA Linear computes `base(x) + lora_B(lora_A(x)) * scaling`: after the base GEMM, the adapter's (rows, out)
product, a second tensor of that size for `* scaling`, and a third for the sum. Each is a pass over the layer's
whole output, and autograd's backward of `* scaling` is one more over the output's gradient.

Here the rows' base output takes the product in place, `y.addmm_(x A^T, B^T, alpha=scaling)`: cuBLAS reads y in
the GEMM's epilogue and adds `scaling * (x A^T) B^T` summed in float32, rounding once where peft rounds three
times. Its backward scales only the rank-wide tensors (rows x r and r x out). Nothing is saved that peft's path
did not save. It trades peft's own forward for ours in training, for a shorter update
(benchmarks/RESULTS.md, "The measured defaults").

Where the base layer's frozen weight can be read again in backward (`_weight_read_again`: nn.Linear, or FP8Linear
dequantizing it for `F.linear`) and there is no dropout, the projection is two autograd Functions instead. `_Down`
makes x A^T and saves what the adapter's gradients need; `_UpAndBase` writes the adapter's product and the base GEMM
adds into it, saving nothing: its backward hands the output's gradient to `_Down`'s (`_Link`), which makes x's whole
gradient in one buffer, the adapter's part and the base's added in place. Under gradient checkpointing two things
follow. The recomputation stops once the layer's last saved tensor is back, and the base GEMM of the layer's last
projection (the MLP's down projection) saves none: it is not recomputed. And x's gradient is made after the
recomputed x is freed: at the down projection, one tensor of the MLP's intermediate size less at the backward's
peak. It trades the base GEMM's own autograd node for ours, for a shorter update at a lower peak
(benchmarks/RESULTS.md, "The measured defaults").

Only where autograd records (the training pass; the engine, the evaluation and the reference pass call peft's
own forward), and only in the case this reproduces: one active adapter without DoRA or other variants, not merged,
without a bias on B, and adapters that multiply in the activations' dtype (`--lora-compute base`,
`LinearInInputDtype` below). Everything else goes to peft's forward. The CPU tests compare values and gradients
with peft's.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from grpo.kernels.fp8 import FP8Linear, dequantize_fp8_block


class LinearInInputDtype(nn.Linear):
    """An adapter matrix that stays float32, the precision the optimizer updates, but multiplies in its
    input's dtype: a bf16 activation is neither copied to float32 nor saved a second time for backward.

    `grpo.model.load.compute_adapters_in_base_dtype` (--lora-compute base) gives peft's LoRA A and B layers this
    class; its product is still x @ W^T, so the native engine's decode kernels take these layers as they take
    nn.Linear (`grpo.rollout.native.plan`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def plain_adapter(layer, args: tuple, kwargs: dict) -> str | None:
    """The adapter whose product `_forward` adds, where this call is the plain case it reproduces; else None."""
    if args or kwargs or not torch.is_grad_enabled() or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in layer.lora_variant:
        return None
    a, b = layer.lora_A[active[0]], layer.lora_B[active[0]]
    plain = type(a) is LinearInInputDtype and type(b) is LinearInInputDtype and b.bias is None and a.bias is None
    return active[0] if plain else None


def _weight_read_again(base: nn.Module, x: torch.Tensor) -> bool:
    """Whether `base`'s product is x W^T (+ bias) with a frozen W that backward can read again in x's dtype:
    nn.Linear itself, or FP8Linear's dense GEMM (its weight dequantized for each product, here in backward too)."""
    if type(base) is nn.Linear:
        return not base.weight.requires_grad and base.weight.dtype == x.dtype
    return type(base) is FP8Linear and base.gemm == "dense" and base.compute_dtype == x.dtype


def _dense_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    return base.weight if type(base) is nn.Linear else dequantize_fp8_block(base.weight, base.weight_scale_inv, dtype)


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # addmm's input where there is none to add (beta=0): the scale then multiplies in the GEMM's epilogue
    return torch.zeros((), dtype=dtype, device=device)


class _Link:
    """The projection's output gradient, from `_UpAndBase`'s backward to `_Down`'s. Autograd runs them in that
    order: `_Down`'s output is `_UpAndBase`'s input. Under checkpointing the original forward's graph (its two
    nodes and this link) runs backward; the recomputation only gives back the saved tensors."""

    grad: torch.Tensor | None = None


class _Down(torch.autograd.Function):
    """d = x A^T (rows, r). Backward: the adapter's gradients and x's whole gradient, the base's part included.
    `b` is an input only so that its gradient is returned here, where d is saved."""

    @staticmethod
    def forward(ctx, x, a, b, link, scale, base):
        a_cast = a.to(x.dtype)  # (r, in): saved as cast, not cast again in backward
        d = x @ a_cast.t()
        ctx.save_for_backward(x, a_cast, d)
        ctx.link, ctx.scale, ctx.base, ctx.a_dtype, ctx.b_dtype = link, scale, base, a.dtype, b.dtype
        return d

    @staticmethod
    def backward(ctx, grad_d):
        x, a_cast, d = ctx.saved_tensors
        g, ctx.link.grad = ctx.link.grad, None
        grad_b = torch.addmm(_zero(g.dtype, g.device), g.t(), d, beta=0, alpha=ctx.scale).to(ctx.b_dtype)
        grad_a = (grad_d.t() @ x).to(ctx.a_dtype)
        # Under checkpointing these hold the recomputed tensors' last references: x (at the down projection the
        # MLP's intermediate size) is freed before its gradient is made
        del x, d
        grad_x = None
        if ctx.needs_input_grad[0]:  # in one buffer: the adapter's part, then the base's added by the GEMM
            grad_x = grad_d @ a_cast
            grad_x.addmm_(g, _dense_weight(ctx.base, g.dtype))
        return grad_x, grad_a, grad_b, None, None, None


class _UpAndBase(torch.autograd.Function):
    """y = bias + scale (d B^T) + x W^T: the adapter's product, then the base GEMM adding into it. Saves no
    activation (W is read again in `_Down`'s backward, which makes x's gradient)."""

    @staticmethod
    def forward(ctx, d, x, b, link, scale, base):
        bias = base.bias
        start = _zero(x.dtype, x.device) if bias is None else bias.to(x.dtype)
        y = torch.addmm(start, d, b.to(x.dtype).t(), alpha=scale)
        y.addmm_(x, _dense_weight(base, x.dtype).t())
        # B (a parameter) held, not saved: under checkpointing, a saved tensor here would make the recomputation
        # run this forward again to give it back
        ctx.link, ctx.scale, ctx.b = link, scale, b
        return y

    @staticmethod
    def backward(ctx, g):
        ctx.link.grad = g
        grad_d = torch.addmm(_zero(g.dtype, g.device), g, ctx.b.to(g.dtype), beta=0, alpha=ctx.scale)
        return grad_d, None, None, None, None, None


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = plain_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    flat = x.dim() == 2  # the MLP's projections get the tokens as rows already (lean_activations): no view either way
    rows = x if flat else x.reshape(-1, x.shape[-1])
    a, b, scale = self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    if _weight_read_again(self.base_layer, rows) and type(self.lora_dropout[name]) is nn.Identity:
        link = _Link()
        y = _UpAndBase.apply(_Down.apply(rows, a, b, link, scale, self.base_layer), rows, b, link, scale,
                             self.base_layer)
    else:
        y = self.base_layer(rows)  # (rows, out): a tensor of its own for nn.Linear, and for FP8Linear unless its
        if y._base is not None:  # rows were padded to 16 for cuBLAS; a view: adding in place would make autograd
            y = y.clone()  # copy the gradient back through it, so one copy here (peft's way made two tensors)
        down = self.lora_A[name](self.lora_dropout[name](rows))  # (rows, r) in the activations' dtype
        y.addmm_(down, b.to(y.dtype).t(), alpha=scale)
    return y if flat else y.view(*x.shape[:-1], y.shape[-1])


def install(model: nn.Module) -> int:
    """Gives `model`'s peft LoRA Linear layers the one-GEMM training forward: on each module (a bound method),
    as `lean_activations.install` does. Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.forward = types.MethodType(_forward, module)
            changed += 1
    return changed
