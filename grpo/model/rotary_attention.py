"""The attention modules' forward with q's and k's rotary in one Triton launch each way (`grpo.kernels.rotary`).

transformers' attention rotates q and k in ten eager elementwise kernels forward and as many backward, over
the whole pass's tokens: in the bench's training pass a visible share of its GPU time, where the kernel reads
and writes each tensor once (benchmarks/RESULTS.md, "The measured defaults"). `install` gives the attention
modules of `ATTENTION_CLASSES` a forward that is their class's but for the rotary: the projections (and Qwen3's
head norms) as the modules, the attention through transformers' interface for the model's implementation,
then o_proj. Values within a rounding of the class's (the kernel's arithmetic).

Only the calls the training and reference passes make: no KV cache, no sliding window, the position embeddings
given. Every other call (transformers' generate, a model with a window), and every call where the kernel does
not run (the CPU without Triton's interpreter), takes the class's own forward. The native engine never calls
these modules' forward.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grpo.kernels import rotary
from grpo.kernels.decode_gemm import can_run

# Attention modules whose forward `_forward` reproduces: q/k/v projections viewed as heads (Qwen3's normalised
# each), the rotary, transformers' attention interface, o_proj.
ATTENTION_CLASSES = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")


def sliding_window(module: nn.Module) -> int | None:
    """The window the class's forward passes its attention (Mistral's from the config, Qwen's the layer's)."""
    if type(module).__name__ == "MistralAttention":
        return getattr(module.config, "sliding_window", None)
    return getattr(module, "sliding_window", None)


def _eager_attention(module: nn.Module):
    """The eager attention of the module's own modeling file, which its class falls back on; None if it has none."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _attention_function(module: nn.Module):
    """The attention the class's forward calls for the model's implementation (sdpa, flash, eager, ...)."""
    implementation, eager = module.config._attn_implementation, _eager_attention(module)
    lookup = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)  # (older transformers: a plain lookup)
    if lookup is not None:
        return lookup(implementation, eager)
    return eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]


def _forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    caches = ("cache", "past_key_values")  # (transformers' older name for it: past_key_values)
    if (any(kwargs.get(n) is not None for n in caches) or position_embeddings is None
            or not can_run(hidden_states.device)):
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **kwargs)
    kwargs = {n: v for n, v in kwargs.items() if n not in caches}  # the class's signature takes them
    heads = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k = self.q_proj(hidden_states).view(heads), self.k_proj(hidden_states).view(heads)
    if hasattr(self, "q_norm"):  # Qwen3: each head normalised before the rotary
        q, k = self.q_norm(q), self.k_norm(k)
    v = self.v_proj(hidden_states).view(heads).transpose(1, 2)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, T, head_dim)
    cos, sin = position_embeddings
    rotate = rotary.rotary if rotary.kernel_runs(q, k, cos, sin) else rotary.rotary_ref
    q, k = rotate(q, k, cos, sin)
    dropout = self.attention_dropout if self.training else 0.0
    attended, weights = _attention_function(self)(self, q, k, v, attention_mask, dropout=dropout,
                                                  scaling=self.scaling, **kwargs)
    return self.o_proj(attended.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def install(model: nn.Module) -> int:
    """Gives `model`'s attention modules of `ATTENTION_CLASSES` without a sliding window (whose modeling file has
    the eager attention their class falls back on) the forward with the rotary kernel: a bound method on each
    module, as `lean_activations.install` does. Returns how many changed."""
    changed = 0
    for module in model.modules():
        if (type(module).__name__ in ATTENTION_CLASSES and sliding_window(module) is None
                and _eager_attention(module) is not None):
            module.forward = types.MethodType(_forward, module)
            changed += 1
    return changed
