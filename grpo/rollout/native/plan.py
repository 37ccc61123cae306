"""Which projections (and norms) of a Llama layer the decode kernels can stand in for, and with which tensors.

The kernels (`grpo.kernels.decode_gemm`) read a projection's tensors instead of calling its module, so
they may stand in only where the module's forward is exactly what they compute: an nn.Linear or an
FP8Linear (with or without a bias: Qwen2's q/k/v have one), bare or inside peft's LoRA Linear with at
most one active plain adapter (not merged, no DoRA or other variant, no LoRA bias) whose A and B layers
compute x @ W^T. Deciding that means reading peft's layer attributes (`base_layer`, `lora_A`,
`active_adapters`, `scaling`, ...); this module is the one place that does. Anything else returns None,
and the engine calls the module. The same for the layer's RMSNorms (`decode_norm`, `rmsnorm.norm_rows`).

Not here: running the kernels (`layer.py`), or when the engine uses them (`engine.py`: steps of at
most `EngineTuning.kernel_rows` rows, `gemm="kernels"`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from grpo.kernels import decode_gemm, rmsnorm
from grpo.kernels.decode_gemm import DecodeProj
from grpo.kernels.fp8 import FP8Linear
from grpo.model.lean_activations import NORM_CLASSES
from grpo.model.lora_addmm import LinearInInputDtype

# LoRA A/B layers whose forward is a plain x @ W^T: peft's nn.Linear, and the class `--lora-compute base`
# swaps in (the same product in the input's dtype; the kernels compute it in float32/TF32 either way).
_PLAIN_LORA_LINEARS = (nn.Linear, LinearInInputDtype)


@dataclass(frozen=True)
class LayerProjections:
    """The seven projections of one decoder layer as the decode kernels read them."""

    q: DecodeProj
    k: DecodeProj
    v: DecodeProj
    o: DecodeProj
    gate: DecodeProj
    up: DecodeProj
    down: DecodeProj

    def each(self) -> list[DecodeProj]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def has_fp8(self) -> bool:
        return any(d.scale_inv is not None for d in self.each())


def decode_proj(module: nn.Module, dtype: torch.dtype) -> DecodeProj | None:
    """The tensors a decode kernel needs to act as `module`, or None when the kernels cannot (then the
    module is called). `dtype` is the activations' dtype, which dense weights must have."""
    lora_a = lora_b = None
    scale = 1.0
    base = module
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a peft LoRA layer
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            return None
        active = [a for a in getattr(module, "active_adapters", ()) if a in module.lora_A]
        if len(active) > 1:
            return None
        if active:
            name = active[0]
            if (getattr(module, "use_dora", {}).get(name) or name in getattr(module, "lora_variant", {})
                    or getattr(module, "lora_bias", {}).get(name)):
                return None
            if not all(type(m[name]) in _PLAIN_LORA_LINEARS for m in (module.lora_A, module.lora_B)):
                return None  # adapter layers with their own forward
            lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name].weight
            scale = float(module.scaling[name])
            if not (lora_a.is_contiguous() and lora_b.is_contiguous()):
                return None
        base = module.base_layer
    if type(base) not in (nn.Linear, FP8Linear):
        return None  # a subclass may override forward: call it instead
    bias = base.bias
    if bias is not None and (bias.dim() != 1 or not bias.is_contiguous()):
        return None
    weight = base.weight
    scale_inv = getattr(base, "weight_scale_inv", None)
    if scale_inv is None and weight.dtype != dtype:
        return None
    if scale_inv is not None and (weight.dtype != torch.float8_e4m3fn or not decode_gemm.can_run_fp8(weight.device)):
        return None
    if not weight.is_contiguous():
        return None
    return DecodeProj(weight, scale_inv, lora_a, lora_b, scale, bias)


def layer_projections(layer: nn.Module, dtype: torch.dtype) -> LayerProjections | None:
    """The kernels' view of `layer`'s projections, or None when they cannot run the whole layer (a
    projection they cannot take, an MLP that is not SiLU-gated, q/k/v or gate/up that differ in LoRA
    rank, weight format or having a bias: each group is one launch)."""
    attn, mlp = layer.self_attn, layer.mlp
    act = getattr(mlp, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):  # transformers' own SiLU
        return None
    mods = dict(q=attn.q_proj, k=attn.k_proj, v=attn.v_proj, o=attn.o_proj, gate=getattr(mlp, "gate_proj", None),
                up=getattr(mlp, "up_proj", None), down=getattr(mlp, "down_proj", None))
    projs = {name: None if m is None else decode_proj(m, dtype) for name, m in mods.items()}
    if any(p is None for p in projs.values()):
        return None
    for group in ([projs["q"], projs["k"], projs["v"]], [projs["gate"], projs["up"]]):
        if len({(p.rank, p.scale_inv is None, p.bias is None) for p in group}) != 1:
            return None
    return LayerProjections(**projs)


@dataclass(frozen=True)
class DecodeNorm:
    """An RMSNorm as `rmsnorm.norm_rows` reads it: the module's weight (never a copy) and its epsilon."""

    weight: torch.Tensor
    eps: float


def decode_norm(module: nn.Module) -> DecodeNorm | None:
    """What `rmsnorm.norm_rows` needs to act as `module`, or None (then the module is called): an RMSNorm of the
    classes whose arithmetic it is (`lean_activations.NORM_CLASSES`) on a device where the kernel runs."""
    weight = getattr(module, "weight", None)
    if type(module).__name__ not in NORM_CLASSES or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if weight.shape[0] > rmsnorm.MAX_COLS or not rmsnorm.can_run(weight.device):
        return None
    return DecodeNorm(weight, float(module.variance_epsilon))
