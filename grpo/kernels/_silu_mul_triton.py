"""The Triton kernels behind `grpo.kernels.silu_mul` (imported only where triton is installed).

Elementwise over gate and up (contiguous, one shape and dtype), BLOCK elements a program, float32 arithmetic with
eager's roundings: SiLU's output and the product's gradient each rounded to the dtype where eager writes a tensor.
  forward   y = rn(silu(g)) * u
  backward  d_gate = rn(grad * u) * s * (1 + g (1 - s)), s = sigmoid(g) (aten's silu_backward);
            d_up = rn(silu(g)) * grad
"""

import triton
import triton.language as tl


@triton.jit
def _silu_rounded(g32, dtype: tl.constexpr):
    # eager's F.silu(gate): in float32, written in gate's dtype
    return (g32 * tl.sigmoid(g32)).to(dtype).to(tl.float32)


@triton.jit
def silu_mul_forward_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    g = tl.load(g_ptr + i, mask=inside, other=0.0)
    u = tl.load(u_ptr + i, mask=inside, other=0.0).to(tl.float32)
    y = _silu_rounded(g.to(tl.float32), g.dtype) * u
    tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def silu_mul_backward_kernel(grad_ptr, g_ptr, u_ptr, d_gate_ptr, d_up_ptr, n, BLOCK: tl.constexpr):
    # d_gate_ptr may be u_ptr and d_up_ptr g_ptr (the caller's temporaries, consumed): each element is read
    # before it is written, by the same program
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    grad = tl.load(grad_ptr + i, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + i, mask=inside, other=0.0)
    u = tl.load(u_ptr + i, mask=inside, other=0.0).to(tl.float32)
    g32 = g.to(tl.float32)
    s = tl.sigmoid(g32)
    grad_silu = (grad * u).to(g.dtype).to(tl.float32)  # eager: the product's gradient for SiLU, in its dtype
    d_gate = grad_silu * s * (1.0 + g32 * (1.0 - s))
    d_up = _silu_rounded(g32, g.dtype) * grad
    tl.store(d_gate_ptr + i, d_gate.to(d_gate_ptr.dtype.element_ty), mask=inside)
    tl.store(d_up_ptr + i, d_up.to(d_up_ptr.dtype.element_ty), mask=inside)
