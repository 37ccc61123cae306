"""The training pass's checkpointed decoder layers, recomputed and differentiated by hand.

Under gradient checkpointing the backward of each layer runs the layer's forward again and then autograd's backward
of it: transformers' and peft's modules issue the recomputation op by op from Python, checkpointing's hooks pack and
unpack every saved tensor, and autograd walks about 400 nodes a layer. On a fast GPU the host is then the slower
side: the bench's update spends most of its wall time with the GPU waiting between kernels
(`benchmarks/probes/step_profile.py`). Here a layer is one autograd node (`_RecomputedLayer`): its forward runs the
layer without autograd and keeps the layer's input alone, as checkpointing does; its backward recomputes the layer
keeping what the gradients need and runs the derivatives written out below, GEMM by GEMM, with autograd only around
scaled_dot_product_attention (for its own backward). It holds what the modules hold at their peak (the recomputed
layer's activations, the SiLU product's gradients made in the gate's and up's buffers as `lean_activations.SiluMul`
makes them) and computes what they compute in the same dtypes: values and gradients within a rounding of theirs (the
sums of a layer's input gradient are added in place, one rounding where autograd makes one a term).

Only where it reproduces the trainer's modules (`grpo.model.compiled_layers.refusal`: Llama, Mistral, Qwen2 and
Qwen3 layers with nn.Linear projections, or FP8Linear ones multiplying by their dense weight, and at most one plain
adapter each, multiplied in the activations' dtype), and only for a training pass under gradient checkpointing (grad
enabled, the layer checkpointed, causal rows without a mask or cache), or for the reference pass (no grad, the
adapters off: `_forward` of the base layers, the same host work saved); every other call takes the module's own
forward, which transformers checkpoints.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from grpo.kernels import rmsnorm
from grpo.kernels.decode_gemm import rope
from grpo.kernels.fp8 import dequantize_fp8_block
from grpo.model.compiled_layers import (LayerShape, LayerWeights, Projection, layer_shape, layer_weights,
                                        written_out_layers)


def _in_dtype(p: Projection, dtype: torch.dtype) -> Projection:
    """p in the activations' dtype, made once for a layer's recomputation and gradients: an FP8 weight dequantized
    (FP8Linear's dense way, whose recomputation dequantizes once too) and its bias cast, the adapter matrices cast
    (the modules cast them at each use)."""
    if p.scale_inv is not None:
        p = p._replace(weight=dequantize_fp8_block(p.weight, p.scale_inv, dtype), scale_inv=None,
                       bias=None if p.bias is None else p.bias.to(dtype))
    if p.lora_a is None:
        return p
    return p._replace(lora_a=p.lora_a.to(dtype), lora_b=p.lora_b.to(dtype))


def _project(x: torch.Tensor, p: Projection, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x W^T + b + scale * (x A^T) B^T, x A^T) for rows x, as `lora_addmm` computes them (p `_in_dtype`); x A^T
    None without an adapter."""
    y = F.linear(x, p.weight, p.bias)
    if p.lora_a is None:
        return y, None
    down = F.linear(x, p.lora_a)
    return y.addmm_(down, p.lora_b.t(), alpha=scale), down


def _project_grad(dy: torch.Tensor, x: torch.Tensor, down: torch.Tensor | None, p: Projection, scale: float,
                  dx: torch.Tensor | None, need_dx: bool, into: torch.dtype) -> tuple[torch.Tensor | None, list]:
    """The gradients of `_project` given dy: x's added into dx (made where None; skipped unless need_dx), and
    [dA, dB] in dtype `into` ([] without an adapter). autograd's products in its order: g = (dy B) * scale,
    dA = g^T x, dB = (dy^T x A^T) * scale, dx = dy W + g A."""
    grads = []
    if p.lora_a is not None:
        g = torch.mm(dy, p.lora_b).mul_(scale)
        grads = [torch.mm(g.t(), x).to(into), torch.mm(dy.t(), down).mul_(scale).to(into)]
    if need_dx:
        dx = torch.mm(dy, p.weight) if dx is None else dx.addmm_(dy, p.weight)
        if p.lora_a is not None:
            dx.addmm_(g, p.lora_a)
    return dx, grads


def _rotated(y: torch.Tensor, B: int, heads: int, head_norm: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, shape: LayerShape) -> tuple[torch.Tensor, tuple | None]:
    """q's or k's projection y (B * T, heads * head_dim) as attention reads it, (B, heads, T, head_dim): Qwen3's
    norm of each head (head_norm; None elsewhere), then the rotary; and what the head norm's gradient needs."""
    x, saved = y.view(B, -1, heads, shape.head_dim), None
    if head_norm is not None:
        x, saved = rmsnorm.norm_with_rstd(x, head_norm, shape.eps)
    return rope(x.transpose(1, 2), cos, sin), saved


def _rotated_grad(d: torch.Tensor, head_norm: torch.Tensor | None, saved: tuple | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """The projection's gradient (B * T, heads * head_dim) from the rotated heads' d (B, heads, T, head_dim): the
    rotary's transpose, d cos - rotate_half(d sin), then the head norm's."""
    half = d.shape[-1] // 2
    d_sin = d * sin
    dx = (d * cos).transpose(1, 2)  # (B, T, heads, head_dim)
    dx[..., :half] += d_sin[..., half:].transpose(1, 2)
    dx[..., half:] -= d_sin[..., :half].transpose(1, 2)
    if head_norm is not None:
        dx = rmsnorm.norm_input_grad(dx, head_norm, saved)
    return dx.reshape(-1, dx.shape[-2] * dx.shape[-1])


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """Causal attention of the rotated heads q, k and v (B, kv_heads, T, head_dim): (B * T, heads * head_dim)."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.attention_scale,
                                         enable_gqa=shape.kv_heads != shape.heads)  # (B, heads, T, head_dim)
    return out.transpose(1, 2).reshape(-1, shape.heads * shape.head_dim)


def _forward(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights, shape: LayerShape
             ) -> torch.Tensor:
    """The layer's output (B, T, hidden), nothing kept: checkpointing's first forward."""
    B, T, hidden = h.shape
    x = h.reshape(B * T, hidden)
    q, k, v, o, gate, up, down = range(7)

    def project(i: int, rows: torch.Tensor) -> torch.Tensor:  # (an FP8 weight dequantized for this product alone)
        return _project(rows, _in_dtype(w.projections[i], h.dtype), shape.lora_scales[i])[0]

    cos, sin = cos[:, None], sin[:, None]  # (1 or B, 1, T, head_dim): broadcast over the heads
    normed = rmsnorm.norm_with_rstd(x, w.input_norm, shape.eps)[0]
    q_rot = _rotated(project(q, normed), B, shape.heads, w.q_norm, cos, sin, shape)[0]
    k_rot = _rotated(project(k, normed), B, shape.kv_heads, w.k_norm, cos, sin, shape)[0]
    v_heads = project(v, normed).view(B, T, shape.kv_heads, shape.head_dim).transpose(1, 2)
    mid = x + project(o, _attention(q_rot, k_rot, v_heads, shape))
    normed = rmsnorm.norm_with_rstd(mid, w.post_norm, shape.eps)[0]
    product = F.silu(project(gate, normed), inplace=True).mul_(project(up, normed))
    return (mid + project(down, product)).view(B, T, hidden)


def _backward(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights, shape: LayerShape,
              grad: torch.Tensor, need_dh: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The layer recomputed from its input h, then its gradients given the output's: (h's or None, the adapters'
    in `_adapters`' order and dtypes). One function, so that each tensor is dropped (`del`) once its last gradient
    is made: what it holds at a time is what the modules' backward holds."""
    B, T, hidden = h.shape
    x = h.reshape(B * T, hidden)
    into = [(p.lora_a.dtype if p.lora_a is not None else None) for p in w.projections]
    (q, cq), (k, ck), (v, cv), (o, co), (gate, cg), (up, cu), (down, cd) = (
        (_in_dtype(p, h.dtype), c) for p, c in zip(w.projections, shape.lora_scales))
    cos, sin = cos[:, None], sin[:, None]
    # the recomputation, keeping what the gradients read (the down projection's output is not needed: only its
    # adapter's x A^T)
    normed_in, in_saved = rmsnorm.norm_with_rstd(x, w.input_norm, shape.eps)
    q_out, q_down = _project(normed_in, q, cq)
    q_rot, q_saved = _rotated(q_out, B, shape.heads, w.q_norm, cos, sin, shape)
    k_out, k_down = _project(normed_in, k, ck)
    k_rot, k_saved = _rotated(k_out, B, shape.kv_heads, w.k_norm, cos, sin, shape)
    v_out, v_down = _project(normed_in, v, cv)
    del q_out, k_out
    with torch.enable_grad():  # autograd around scaled_dot_product_attention alone
        leaves = [q_rot.requires_grad_(), k_rot.requires_grad_(),
                  v_out.view(B, T, shape.kv_heads, shape.head_dim).transpose(1, 2).requires_grad_()]
        attended = _attention(*leaves, shape)
    o_out, o_down = _project(attended.detach(), o, co)
    mid = x + o_out
    del o_out
    normed_post, post_saved = rmsnorm.norm_with_rstd(mid, w.post_norm, shape.eps)
    del mid
    (g_out, g_down), (u_out, u_down) = _project(normed_post, gate, cg), _project(normed_post, up, cu)
    product = F.silu(g_out) * u_out
    d_down = None if down.lora_a is None else F.linear(product, down.lora_a)
    # the MLP's gradients
    dy = grad.reshape(B * T, hidden)
    d_product, down_grads = _project_grad(dy, product, d_down, down, cd, None, True, into[6])
    del product, d_down, down
    d_gate = u_out.mul_(d_product)  # SiluMul's backward, in gate's and up's buffers
    torch.ops.aten.silu_backward.grad_input(d_gate, g_out, grad_input=d_gate)
    d_up = F.silu(g_out, inplace=True).mul_(d_product)
    del d_product, u_out, g_out
    d_normed, gate_grads = _project_grad(d_gate, normed_post, g_down, gate, cg, None, True, into[4])
    d_normed, up_grads = _project_grad(d_up, normed_post, u_down, up, cu, d_normed, True, into[5])
    del d_gate, d_up, normed_post, g_down, u_down, gate, up
    d_mid = dy + rmsnorm.norm_input_grad(d_normed, w.post_norm, post_saved)
    del d_normed, post_saved
    # the attention's
    d_attended, o_grads = _project_grad(d_mid, attended.detach(), o_down, o, co, None, True, into[3])
    d_q, d_k, d_v = torch.autograd.grad(attended, leaves, d_attended)
    del attended, leaves, d_attended, q_rot, k_rot, v_out, o_down, o
    d_v = d_v.transpose(1, 2).reshape(B * T, -1)
    d_normed, v_grads = _project_grad(d_v, normed_in, v_down, v, cv, None, need_dh, into[2])
    del d_v
    d_normed, q_grads = _project_grad(_rotated_grad(d_q, w.q_norm, q_saved, cos, sin), normed_in, q_down, q, cq,
                                      d_normed, need_dh, into[0])
    del d_q
    d_normed, k_grads = _project_grad(_rotated_grad(d_k, w.k_norm, k_saved, cos, sin), normed_in, k_down, k, ck,
                                      d_normed, need_dh, into[1])
    del d_k, normed_in
    dh = d_mid.add_(rmsnorm.norm_input_grad(d_normed, w.input_norm, in_saved)).view(B, T, hidden) if need_dh else None
    return dh, q_grads + k_grads + v_grads + o_grads + gate_grads + up_grads + down_grads


def _adapters(w: LayerWeights) -> list[torch.Tensor]:
    """The layer's adapter matrices in PROJECTIONS' order, A then B: the node's inputs that take gradients."""
    return [t for p in w.projections if p.lora_a is not None for t in (p.lora_a, p.lora_b)]


class _RecomputedLayer(torch.autograd.Function):
    """One decoder layer as one autograd node: the forward keeps the layer's input (and the rotary's cos and sin),
    the backward recomputes the layer and differentiates it by hand."""

    @staticmethod
    def forward(ctx, h, cos, sin, w: LayerWeights, shape: LayerShape, *adapters):
        ctx.weights, ctx.shape = w, shape
        ctx.save_for_backward(h, cos, sin)
        return _forward(h, cos, sin, w, shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h, cos, sin = ctx.saved_tensors
        dh, adapter_grads = _backward(h, cos, sin, ctx.weights, ctx.shape, grad, ctx.needs_input_grad[0])
        return dh, None, None, None, None, *adapter_grads


def recomputed_layer(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: LayerWeights,
                     shape: LayerShape) -> torch.Tensor:
    """The layer over causal rows h (B, T, hidden), checkpointed: its input kept, recomputed in backward."""
    return _RecomputedLayer.apply(h, cos, sin, w, shape, *_adapters(w))


def _layer_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                   use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    weights = None
    grad = torch.is_grad_enabled()
    checkpointed = grad and getattr(self, "gradient_checkpointing", False) and self.training
    if ((checkpointed or not grad) and attention_mask is None and cache is None
            and kwargs.get("past_key_values") is None and position_embeddings is not None):
        weights = layer_weights(self)  # without grad: the reference pass's base layers (adapters off), else None
    if weights is None:  # the class's forward, which transformers checkpoints where the layer is
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if not grad:
        return _forward(hidden_states, *position_embeddings, weights, self.recomputed_shape)
    return recomputed_layer(hidden_states, *position_embeddings, weights, self.recomputed_shape)


def install(model: nn.Module) -> int:
    """Gives `model`'s decoder layers that the written-out layer reproduces (`compiled_layers.refusal`) the
    recomputed forward for their checkpointed training passes (a bound method on each layer). Returns how many
    layers changed."""
    layers = written_out_layers(model)
    for layer in layers:
        layer.recomputed_shape = layer_shape(layer)
        layer.forward = types.MethodType(_layer_forward, layer)
    return len(layers)
