"""The training pass's decoder layers as one compiled function: norms, attention, MLP and the adapters' products
in one graph for torch.compile, where transformers' and peft's modules issue each op from Python.

The training pass is bound by the host where the GPU is fast: the modules issue about 110 aten ops a layer
forward and a thousand Python calls, and backward about as many again (four times the ops under checkpointing,
with the recomputation), slower than the GPU runs them. `decoder_layer` is the layer written out over its tensors;
compiled, inductor fuses its norms, rotary, SiLU product, casts and residual adds into a few kernels each way and
calls the GEMMs directly. One compiled function serves every layer and width: the layers' tensors are its inputs,
not constants, the rows and their width are dynamic, the first layer's input is given a gradient as the others'
have one, and the trainer rounds its widths up to a multiple of 8 (`width_multiple`), on which inductor's kernels
specialize. So a run compiles it once, at its first training pass.

It trades that compile (seconds) and values within a rounding of the modules' (the norms and the SiLU product in
float32 without rounding between their ops) for a shorter training pass, where the layers keep their activations
(no gradient checkpointing: `--compile-layers auto`). A checkpointed layer keeps its modules: compiled under
checkpointing (its call checkpointed, or the recompute inside the graph), the layer shortened the bench step's
training pass or not, but raised its peak memory each way (benchmarks/RESULTS.md, "The measured defaults").

Only where it reproduces the module and autograd records: the decoder layers of `LAYER_CLASSES` without a sliding
window or attention dropout, SiLU MLPs, projections that are nn.Linear (FP8 base layers keep the modules) with at
most one plain adapter (`grpo.model.lora_addmm`'s case, without dropout), no attention mask and no cache (the
trainer's causal rows, `grpo.batch.sequence_logprobs`). Each call checks what may change during a run (the adapters
switched off, a mask, a cache, no grad, checkpointing) and else calls the module's own forward: the reference and
evaluation passes, and the engines, never take this path.

`decoder_layer` is plain PyTorch: the CPU tests compare it with transformers' layers, eagerly and compiled.
"""

from __future__ import annotations

import functools
import types
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from grpo.kernels.decode_gemm import rope
from grpo.kernels.rmsnorm import rms_norm_ref
from grpo.model.lora_addmm import plain_adapter

# Decoder layers whose forward `decoder_layer` reproduces: pre-norm attention with rotary positions, then a gated
# SiLU MLP; Qwen3's also normalise each head of q and k before the rotary.
LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SILU_CLASSES = ("SiLU", "SiLUActivation")
WIDTH_MULTIPLE = 8  # `width_multiple`


class Projection(NamedTuple):
    """One projection's tensors: y = x W^T + b + scale * (x A^T) B^T (the scale is the layer's `LayerShape`);
    `lora_a`/`lora_b` None without an adapter."""

    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor | None  # (out,)
    lora_a: torch.Tensor | None  # (r, in), float32: multiplied in the activations' dtype
    lora_b: torch.Tensor | None  # (out, r)


class LayerWeights(NamedTuple):
    """A decoder layer's tensors, as `decoder_layer` reads them."""

    input_norm: torch.Tensor  # (hidden,)
    post_norm: torch.Tensor  # (hidden,)
    q_norm: torch.Tensor | None  # (head_dim,): Qwen3's head norms; None elsewhere
    k_norm: torch.Tensor | None
    projections: tuple[Projection, ...]  # in PROJECTIONS' order


class LayerShape(NamedTuple):
    """The numbers `decoder_layer` takes as constants: heads, head width, the norms' eps, the attention's scale
    and each projection's adapter scale (PROJECTIONS' order; 0.0 without an adapter)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    attention_scale: float
    lora_scales: tuple[float, ...]


def project(x: torch.Tensor, p: Projection, scale: float) -> torch.Tensor:
    """(rows, out): x (rows, in) through the base weight and the adapter, the adapter's product added in the GEMM."""
    y = F.linear(x, p.weight, p.bias)
    if p.lora_a is None:
        return y
    return torch.addmm(y, x @ p.lora_a.to(x.dtype).t(), p.lora_b.to(x.dtype).t(), alpha=scale)


def decoder_layer(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights,
                  shape: LayerShape) -> torch.Tensor:
    """One decoder layer over causal rows: h (B, T, hidden) -> (B, T, hidden); cos, sin (1 or B, T, head_dim)."""
    B, T, hidden = h.shape
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj = (
        functools.partial(project, p=p, scale=s) for p, s in zip(w.projections, shape.lora_scales))
    x = rms_norm_ref(h, w.input_norm, shape.eps).view(B * T, hidden)
    q = q_proj(x).view(B, T, shape.heads, shape.head_dim)
    k = k_proj(x).view(B, T, shape.kv_heads, shape.head_dim)
    v = v_proj(x).view(B, T, shape.kv_heads, shape.head_dim)
    if w.q_norm is not None:
        q, k = rms_norm_ref(q, w.q_norm, shape.eps), rms_norm_ref(k, w.k_norm, shape.eps)
    cos, sin = cos[:, None], sin[:, None]  # (1 or B, 1, T, head_dim): broadcast over the heads
    q, k, v = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.attention_scale,
                                              enable_gqa=shape.kv_heads != shape.heads)  # (B, heads, T, head_dim)
    h = h + o_proj(attended.transpose(1, 2).reshape(B * T, -1)).view(B, T, hidden)
    x = rms_norm_ref(h, w.post_norm, shape.eps).view(B * T, hidden)
    y = down_proj(F.silu(gate_proj(x)) * up_proj(x))
    return h + y.view(B, T, hidden)


@functools.cache
def compiled(shape: LayerShape, backend: str = "inductor"):
    """`decoder_layer` for layers of `shape`, compiled once for the process and backend (the CPU tests compile
    with aot_eager): the rows and their width dynamic from the first call, the rest (heads, widths of the weights,
    `shape`'s numbers) constants of the graph. fullgraph: a break in it is a fault, never a silent return to eager
    pieces."""

    def layer(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        return decoder_layer(h, cos, sin, w, shape)

    graph = torch.compile(layer, fullgraph=True, backend=backend)

    def call(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        for t, dims in ((h, (0, 1)), (cos, (1,)), (sin, (1,))):  # rows, positions
            torch._dynamo.maybe_mark_dynamic(t, dims)
        return graph(h, cos, sin, w)

    return call


def projection_weights(module: nn.Module) -> Projection | None:
    """A projection's tensors as `project` reads them, or None where this call is not the plain case (the adapter
    switched off, another adapter variant, no grad)."""
    if type(module) is nn.Linear:
        return Projection(module.weight, module.bias, None, None)
    name = plain_adapter(module, (), {})
    if name is None or len(module.lora_A) != 1:  # (the base layer's type `refusal` checked at install)
        return None
    return Projection(module.base_layer.weight, module.base_layer.bias, module.lora_A[name].weight,
                      module.lora_B[name].weight)


def layer_weights(layer: nn.Module) -> LayerWeights | None:
    """The layer's tensors for this call, or None where one of its projections is not the plain case now."""
    modules = layer.__dict__.get("compiled_projections") or [layer.get_submodule(path) for path in PROJECTIONS]
    projections = tuple(projection_weights(m) for m in modules)
    if any(p is None for p in projections):
        return None
    attention = layer.self_attn
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return LayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                        projections)


def refusal(layer: nn.Module) -> str | None:
    """Why `decoder_layer` does not reproduce this layer's forward, or None when it does."""
    name = type(layer).__name__
    if name not in LAYER_CLASSES:
        return f"{name} is none of {LAYER_CLASSES}"
    attention, config = layer.self_attn, layer.self_attn.config
    if getattr(attention, "sliding_window", None) or getattr(config, "attention_dropout", 0.0):
        return "its attention has a sliding window or dropout"
    if type(getattr(layer.mlp, "act_fn", None)).__name__ not in SILU_CLASSES:
        return "its MLP's activation is not SiLU"
    for path in PROJECTIONS:
        module = layer.get_submodule(path)
        if type(module) is LoraLinear:
            dropouts = module.lora_dropout.values()
            if len(module.lora_A) != 1 or type(module.base_layer) is not nn.Linear or any(
                    type(d) is not nn.Identity for d in dropouts):
                return f"{path} has a base layer other than nn.Linear, adapter dropout, or several adapters"
        elif type(module) is not nn.Linear:
            return f"{path} is a {type(module).__name__}"
    eps = {layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon,
           *(getattr(attention, n).variance_epsilon for n in ("q_norm", "k_norm") if hasattr(attention, n))}
    if len(eps) != 1:
        return "its norms differ in eps"
    return None


def layer_shape(layer: nn.Module) -> LayerShape:
    attention, config = layer.self_attn, layer.self_attn.config
    scales = []
    for path in PROJECTIONS:
        module = layer.get_submodule(path)
        scaling = getattr(module, "scaling", {})
        scales.append(float(scaling[module.active_adapters[0]]) if len(scaling) == 1 else 0.0)
    return LayerShape(config.num_attention_heads, config.num_key_value_heads, attention.head_dim,
                      layer.input_layernorm.variance_epsilon, attention.scaling, tuple(scales))


def _forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
             use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    weights = None
    # A checkpointed layer takes the module's forward, which transformers' checkpointing wraps (the class's): the
    # compiled one would keep every activation that checkpointing drops
    checkpointed = getattr(self, "gradient_checkpointing", False) and self.training
    if (torch.is_grad_enabled() and not checkpointed and attention_mask is None and cache is None
            and kwargs.get("past_key_values") is None and position_embeddings is not None):
        weights = layer_weights(self)
    if weights is None:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    cos, sin = position_embeddings
    if not hidden_states.requires_grad:  # the first layer's (the embedding is frozen): given a gradient it runs the
        hidden_states = hidden_states.detach().requires_grad_()  # others' graph, for one layer's input GEMMs
    try:
        return compiled(self.compiled_shape, self.compiled_backend)(hidden_states, cos, sin, weights)
    except torch._dynamo.exc.TorchDynamoException as err:  # a torch or Triton this compile does not work with
        cause = getattr(err, "inner_exception", None) or err  # the backend's own error, where it failed
        said = (str(cause).strip().splitlines() or [""])[0]
        raise RuntimeError(f"--compile-layers: torch.compile could not compile the training pass's decoder layer "
                           f"({type(cause).__name__}: {said}); run with --compile-layers off") from err


def width_multiple(model: nn.Module) -> int:
    """What the training passes' widths are rounded up to where `model`'s layers are compiled (8), else 1: inductor
    specializes its kernels on whether the width is a multiple of 8 (aligned rows), and each width on the other side
    would compile the layer again."""
    return WIDTH_MULTIPLE if any("compiled_shape" in vars(m) for m in model.modules()) else 1


def install(model: nn.Module, backend: str = "inductor") -> int:
    """Gives `model`'s decoder layers that `decoder_layer` reproduces the compiled forward where autograd records
    (a bound method on each layer, as `lean_activations.install` does). Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ not in LAYER_CLASSES or refusal(module) is not None:
            continue
        module.compiled_projections = [module.get_submodule(path) for path in PROJECTIONS]
        module.compiled_shape = layer_shape(module)
        module.compiled_backend = backend
        module.forward = types.MethodType(_forward, module)
        changed += 1
    return changed
