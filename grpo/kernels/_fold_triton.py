"""The Triton kernel behind `grpo.rollout.native.fold` on CUDA (imported only where triton is installed).

One tile of a weight W (N, K) per program, with the adapter's D = scale * B A computed in the tile from B's
rows and A's columns (rank R, float32 FMAs: "ieee", so every launch computes the same D bit for bit), never
written out. MODE picks what the tile does with W + D rounded into W's dtype:
  COUNT   count the elements whose round trip, rn(rn(W + D) - D), would not give W back
  FOLD    write rn(W + D) into W, and each such element's flat index and old value into the kept lists,
          at a place reserved with one atomic add per tile
  UNFOLD  write rn(W - D) into W (the caller then puts the kept values back)
"""

import triton
import triton.language as tl

COUNT, FOLD, UNFOLD = 0, 1, 2
INT_OF_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # a weight's bits, by its element size


@triton.jit
def fold_kernel(w_ptr, a_ptr, b_ptr, scale, n, k, r, counter_ptr, index_ptr, kept_ptr,
                MODE: tl.constexpr, INT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_R: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    in_n, in_k, in_r = offs_n < n, offs_k < k, offs_r < r
    b = tl.load(b_ptr + offs_n[:, None] * r + offs_r[None, :], mask=in_n[:, None] & in_r[None, :], other=0.0)
    a = tl.load(a_ptr + offs_r[:, None] * k + offs_k[None, :], mask=in_r[:, None] & in_k[None, :], other=0.0)
    d = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee") * scale
    flat = offs_n[:, None] * k + offs_k[None, :]
    inside = in_n[:, None] & in_k[None, :]
    w = tl.load(w_ptr + flat, mask=inside, other=0.0)
    if MODE == 2:  # UNFOLD (module globals are not constexpr inside a kernel)
        tl.store(w_ptr + flat, (w.to(tl.float32) - d).to(w.dtype), mask=inside)
    else:
        summed = (w.to(tl.float32) + d).to(w.dtype)
        back = (summed.to(tl.float32) - d).to(w.dtype)
        lost = (back.to(INT, bitcast=True) != w.to(INT, bitcast=True)) & inside
        count = tl.sum(tl.sum(lost.to(tl.int32), axis=1), axis=0)
        if MODE == 0:  # COUNT
            tl.atomic_add(counter_ptr, count)
        else:
            start = tl.atomic_add(counter_ptr, count)  # this tile's places in the kept lists
            lost_flat = tl.reshape(lost, [BLOCK_N * BLOCK_K]).to(tl.int32)
            place = start + tl.cumsum(lost_flat, axis=0) - 1
            is_lost = lost_flat != 0
            tl.store(index_ptr + place, tl.reshape(flat, [BLOCK_N * BLOCK_K]), mask=is_lost)
            tl.store(kept_ptr + place, tl.reshape(w, [BLOCK_N * BLOCK_K]), mask=is_lost)
            tl.store(w_ptr + flat, summed, mask=inside)
