"""The Triton kernel behind `grpo.kernels.rotary` (imported only where triton is installed).

A token a program: its cos and sin rows, then q's heads and k's heads as (heads, half) tiles of each half, float32
arithmetic rounded once to the output's dtype. x = [x1, x2], cos = [c1, c2], sin = [s1, s2]:
  forward   y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2       (x * cos + rotate_half(x) * sin)
  backward  d1 = g1 c1 + g2 s2,  d2 = g2 c2 - g1 s1       (its transpose)
"""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, x_head_stride, y_ptr, y_head_stride, heads, half, c1, c2, s1, s2,
                  HEADS: tl.constexpr, HALF: tl.constexpr, BACKWARD: tl.constexpr):
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HALF)[None, :]
    inside = (h < heads) & (d < half)
    x1 = tl.load(x_ptr + h * x_head_stride + d, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * x_head_stride + half + d, mask=inside, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_ptr + h * y_head_stride + d, y1.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(y_ptr + h * y_head_stride + half + d, y2.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, T, heads, kv_heads, half,
                  q_sb, q_sh, q_st, k_sb, k_sh, k_st, cos_sb, cos_st, sin_sb, sin_st,
                  qo_sb, qo_sh, qo_st, ko_sb, ko_sh, ko_st,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, BACKWARD: tl.constexpr):
    # q, k and the outputs (B, heads, T, D) with their own strides, the last 1; cos, sin (B or 1, T, D), a batch
    # stride 0 where broadcast
    token = tl.program_id(0).to(tl.int64)
    b, t = token // T, token % T
    d = tl.arange(0, HALF)[None, :]
    row = d < half
    c1 = tl.load(cos_ptr + b * cos_sb + t * cos_st + d, mask=row, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * cos_sb + t * cos_st + half + d, mask=row, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * sin_sb + t * sin_st + d, mask=row, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * sin_sb + t * sin_st + half + d, mask=row, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + b * q_sb + t * q_st, q_sh, q_out_ptr + b * qo_sb + t * qo_st, qo_sh, heads, half,
                  c1, c2, s1, s2, HEADS, HALF, BACKWARD)
    _rotate_heads(k_ptr + b * k_sb + t * k_st, k_sh, k_out_ptr + b * ko_sb + t * ko_st, ko_sh, kv_heads, half,
                  c1, c2, s1, s2, KV_HEADS, HALF, BACKWARD)
