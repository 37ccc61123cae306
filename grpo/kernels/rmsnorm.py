"""The training pass's RMSNorm as one Triton launch each way, where torch's ops take seven passes over the rows;
and the decode step's (`norm_rows`).

transformers' Llama/Qwen RMSNorm (`rms_norm_ref`) is a float32 copy of x, its square, a mean, a product with
rstd, a cast back and the weight's product: each a kernel reading and writing the whole (tokens, hidden)
activation, and autograd's backward more of them (`lean_activations.RMSNormFn` saves less but runs the same
ops): a visible share of the training pass's GPU time, which these kernels cut (benchmarks/RESULTS.md, "The
measured defaults"). `rms_norm` reads x once and writes y once, keeping one float32 rstd per row for backward,
which reads x and the gradient once and writes dx once. The weight must be frozen (it is under LoRA); a trainable
weight takes `lean_activations.RMSNormFn`.

The arithmetic is the module's (float32, the normalized row rounded to x's dtype before the weight multiplies
it) with the row's sum in Triton's order: values within a rounding of x's dtype of the module's, not bit for
bit. Where it runs: CUDA, or the CPU under TRITON_INTERPRET=1 (the tests, against `rms_norm_ref` and its
autograd gradients); a row of at most MAX_COLS features. `lean_activations.install` gives it to the model's
norms (the trainer's default; `norm_kernel=False` keeps torch's ops).
"""

from __future__ import annotations

import torch

from grpo.kernels.decode_gemm import can_run, chained

MAX_COLS = 16384  # one program holds a row: Llama's and Qwen's hidden sizes are 896-8192


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: weight * (x32 * rsqrt(mean(x32^2) + eps)) rounded to x's dtype."""
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def kernel_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` can take x and weight: triton runs on their device, the weight is frozen and fits
    one program's row."""
    return (can_run(x.device) and not weight.requires_grad and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] <= MAX_COLS)


def _launch(n: int) -> dict:
    """One row of n columns a program: the block a power of two, 16 columns a thread up to 2048, then more warps
    (16 at most)."""
    block = 1 << (n - 1).bit_length()
    return {"BLOCK": block, "num_warps": min(16, max(4, block // 512))}


class _RMSNormKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from grpo.kernels import _rmsnorm_triton as k

        n = x.shape[-1]
        rows = x.reshape(-1, n)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        if rows.shape[0]:
            k.rmsnorm_forward_kernel[(rows.shape[0],)](rows, weight, y, rstd, n, rows.stride(0), y.stride(0), eps,
                                                       SAVE_RSTD=True, CHAIN=False, **_launch(n))
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(*x.shape[:-1], n)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        from grpo.kernels import _rmsnorm_triton as k

        rows, weight, rstd = ctx.saved_tensors
        n = rows.shape[-1]
        g = grad.reshape(-1, n)
        if g.stride(-1) != 1:
            g = g.contiguous()
        dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        if rows.shape[0]:
            k.rmsnorm_backward_kernel[(rows.shape[0],)](g, rows, weight, rstd, dx, n, g.stride(0), rows.stride(0),
                                                        dx.stride(0), **_launch(n))
        return dx.view(grad.shape[:-1] + (n,)), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref` in one launch (and one in backward); the caller checks `kernel_runs(x, weight)`."""
    if not kernel_runs(x, weight):
        raise ValueError(f"rms_norm: no kernel for x {tuple(x.shape)} on {x.device} with a weight of "
                         f"{tuple(weight.shape)} (requires_grad={weight.requires_grad}); use rms_norm_ref")
    return _RMSNormKernel.apply(x, weight, eps)


def norm_rows(x2: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """`rms_norm_ref` of each row of x2 (rows, n) in one launch, without autograd: the decode step's norms, in
    its chain of dependent launches (`decode_gemm.Tuning.chain`). The caller checks that the kernel runs on x2's
    device and takes the weight's width (`native.plan.decode_norm`); the weight may be trainable (no gradient).
    `out_dtype`: the output's (default x2's and the weight's), fp16 for FP8 projections that read it
    (`EngineTuning.fp8_activations`)."""
    from grpo.kernels import _rmsnorm_triton as k

    rows, n = x2.shape
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    y = torch.empty((rows, n), dtype=out_dtype or torch.promote_types(x2.dtype, weight.dtype), device=x2.device)
    chain = chained(x2.device)
    k.rmsnorm_forward_kernel[(rows,)](x2, weight, y, y, n, x2.stride(0), y.stride(0), eps, SAVE_RSTD=False,
                                      CHAIN=chain, launch_pdl=chain, **_launch(n))
    return y
