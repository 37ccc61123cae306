"""The training pass's LoRA layers: the adapter's product added inside one GEMM, where peft makes three tensors.

peft's LoRA Linear computes `base(x) + lora_B(lora_A(x)) * scaling`: after the base GEMM, the adapter's (rows, out)
product, a second tensor of that size for `* scaling`, and a third for the sum. Each is a pass over the layer's
whole output, and autograd's backward of `* scaling` is one more over the output's gradient.

Here the rows' base output takes the product in place, `y.addmm_(x A^T, B^T, alpha=scaling)`: cuBLAS reads y in
the GEMM's epilogue and adds `scaling * (x A^T) B^T` summed in float32, rounding once where peft rounds three
times. Its backward scales only the rank-wide tensors (rows x r and r x out). Nothing is saved that peft's path
did not save. It trades peft's own forward for ours in training, for a shorter update
(benchmarks/RESULTS.md, "The measured defaults").

Only where autograd records (the training pass; the engine, the evaluation and the reference pass call peft's
own forward), and only in the case this reproduces: one active adapter without DoRA or other variants, not merged,
without a bias on B, and adapters that multiply in the activations' dtype (`--lora-compute base`,
`LinearInInputDtype` below). Everything else goes to peft's forward. The CPU tests compare values and gradients
with peft's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn


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


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = plain_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    flat = x.dim() == 2  # the MLP's projections get the tokens as rows already (lean_activations): no view either way
    rows = x if flat else x.reshape(-1, x.shape[-1])
    y = self.base_layer(rows)  # (rows, out): a tensor of its own for nn.Linear, and for FP8Linear unless its
    if y._base is not None:  # rows were padded to 16 for cuBLAS; a view: adding in place would make autograd
        y = y.clone()  # copy the gradient back through it, so one copy here (peft's way made two tensors)
    down = self.lora_A[name](self.lora_dropout[name](rows))  # (rows, r) in the activations' dtype
    y.addmm_(down, self.lora_B[name].weight.to(y.dtype).t(), alpha=self.scaling[name])
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
