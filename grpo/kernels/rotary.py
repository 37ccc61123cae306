"""The training and reference passes' rotary embedding of q and k, one Triton launch each way.

Eager, transformers' `apply_rotary_pos_emb` takes five elementwise kernels for each of q and k forward (cos's
and sin's broadcast products, a negation, a cat, the sum), torch's strided kernels over (B, heads, T, D) views,
and autograd's backward as many again; under gradient checkpointing the forward runs twice. `rotary` reads q,
k, cos and sin once and writes the rotated q and k once, a token a program (benchmarks/RESULTS.md, "The
measured defaults").

The arithmetic is float32 rounded once to the dtype, where eager rounds each product and their sum: values
within a rounding of eager's, not bit for bit. The outputs are (B, heads, T, D) views of (B, T, heads, D)
memory, the layout eager's products give the projections' transposed views. Where it runs: CUDA, or the CPU
under TRITON_INTERPRET=1 (the tests, against `rotary_ref`'s values and gradients); cos and sin without
gradients. `grpo.model.rotary_attention` gives it to the attention modules.
"""

from __future__ import annotations

import torch

from grpo.kernels.decode_gemm import can_run, rope

MAX_HEADS = 128  # a program holds a token's heads: Llama's and Qwen's have at most 64


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb (its ops in their order): q (B, heads, T, D), k (B, kv_heads, T, D),
    cos and sin (B or 1, T, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rope(q, cos, sin), rope(k, cos, sin)


def kernel_runs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` can take these: triton runs on their device; q and k (B, heads, T, D) of one floating
    dtype, each head's D contiguous, D even; cos and sin (B or 1, T, D) of that dtype without gradients."""
    if not (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3):
        return False
    B, _, T, D = q.shape
    dtypes = {q.dtype, k.dtype, cos.dtype, sin.dtype}
    return (can_run(q.device) and len(dtypes) == 1 and q.is_floating_point() and D % 2 == 0
            and k.shape[0] == B and k.shape[2:] == (T, D) and max(q.shape[1], k.shape[1]) <= MAX_HEADS
            and cos.shape == sin.shape and cos.shape[0] in (1, B) and cos.shape[1:] == (T, D)
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and not (cos.requires_grad or sin.requires_grad))


def _heads_last(x: torch.Tensor) -> torch.Tensor:
    """An empty (B, heads, T, D) tensor laid out as (B, T, heads, D)."""
    B, H, T, D = x.shape
    return torch.empty((B, T, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _rotate(q, k, cos, sin, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch: q's and k's rotaries forward, or their transposes on the gradients (`backward`)."""
    from grpo.kernels import _rotary_triton as kernels

    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    q_out, k_out = _heads_last(q), _heads_last(k)
    (B, H, T, D), kv_heads = q.shape, k.shape[1]
    cos_sb, sin_sb = (0 if x.shape[0] == 1 else x.stride(0) for x in (cos, sin))  # broadcast over the rows
    if B * T:
        kernels.rotary_kernel[(B * T,)](
            q, k, cos, sin, q_out, k_out, T, H, kv_heads, D // 2, *q.stride()[:3], *k.stride()[:3],
            cos_sb, cos.stride(1), sin_sb, sin.stride(1), *q_out.stride()[:3], *k_out.stride()[:3],
            HEADS=_pow2(H), KV_HEADS=_pow2(kv_heads), HALF=_pow2(D // 2), BACKWARD=backward)
    return q_out, k_out


class _RotaryKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(q, k, cos, sin, backward=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_q, d_k):
        cos, sin = ctx.saved_tensors
        d_q, d_k = _rotate(d_q, d_k, cos, sin, backward=True)
        return d_q, d_k, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_ref` in one launch (and one in backward); the caller checks `kernel_runs(q, k, cos, sin)`."""
    if not kernel_runs(q, k, cos, sin):
        raise ValueError(f"rotary: no kernel for q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, cos "
                         f"{tuple(cos.shape)} {cos.dtype} on {q.device} (see kernel_runs); use rotary_ref")
    return _RotaryKernel.apply(q, k, cos, sin)
