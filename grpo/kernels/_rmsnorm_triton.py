"""The Triton kernels behind `grpo.kernels.rmsnorm` (imported only where triton is installed).

One row (a token's hidden vector, at most BLOCK wide) per program, float32 arithmetic:
  forward   rstd = 1 / sqrt(mean(x^2) + eps); y = w * rn_x(x * rstd), the normalized row rounded to x's dtype
            before the weight multiplies it, as transformers' Llama/Qwen RMSNorm does; rstd kept for backward
  backward  with the weight frozen: g_n = rn_x(g * w); dx = rstd * g_n - x * rstd^3 * sum(g_n * x) / n
"""

import triton
import triton.language as tl

from grpo.kernels._decode_gemm_triton import chain_in


@triton.jit
def rmsnorm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                           SAVE_RSTD: tl.constexpr, CHAIN: tl.constexpr):
    # SAVE_RSTD: keep rstd for backward (training); CHAIN: a launch in the decode's chain (`chain_in`)
    if CHAIN:
        chain_in(True)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    if SAVE_RSTD:
        tl.store(rstd_ptr + row, rstd)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def rmsnorm_backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, n, stride_g, stride_x, stride_dx,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    x32 = x.to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    g_normed = (g * w).to(x.dtype).to(tl.float32)  # eager's product of the gradient and the weight, in x's dtype
    d_rstd = tl.sum(g_normed * x32, axis=0)
    dx = g_normed * rstd - x32 * (rstd * rstd * rstd) * (d_rstd / n)
    tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
