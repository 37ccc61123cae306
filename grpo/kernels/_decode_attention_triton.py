"""The Triton kernels behind `grpo.kernels.decode_attention` (imported only where triton is installed)."""

import triton
import triton.language as tl

from grpo.kernels._decode_gemm_triton import chain_in, rotated  # rotated: rope_store_kernel's rotary, for ROPE


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    # float32 operands (the CPU tests' caches): exact FMAs; bf16 ones: the tensor cores, float32 sums
    if EXACT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def attend_chunk_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_ptr, acc_ptr, stat_ptr, s_qb, s_ob, s_kb, s_kh, s_ks, scale,
                        kn_ptr, vn_ptr, s_nb, cos_ptr, sin_ptr, live_ptr,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                        CHUNK: tl.constexpr, SPLITS: tl.constexpr, EXACT: tl.constexpr, ROPE: tl.constexpr,
                        LIVE: tl.constexpr, CHAIN: tl.constexpr):
    # Program (row b, kv head h, chunk c): the G query heads of kv head h over the row's positions
    # [c * CHUNK, min((c + 1) * CHUNK, length)), a softmax that goes along (running max m and sum l, float32
    # scores). One chunk: the output itself; several: acc (G_PAD, D), m and l for attend_combine_kernel.
    # ROPE: q arrives unrotated, and the token's K and V (kn, vn: (rows, n_kv * D)) are not in the cache yet:
    # q and K are rotated here (cos, sin (rows, D)), rounded once as rope_store_kv rounds them, and the chunk
    # holding the token's position writes K and V there. The loop reads the cache only before that position
    # (its store may not be visible to the loop's loads), and the token joins the softmax after the loop from
    # registers: a select on each tile inside the loop sent K and V through registers and back to shared
    # memory. len_ptr then holds the positions (a row's length is its position + 1). s_qb, s_ob, s_nb: the
    # row strides of q, the output and the token's K/V (column slices of one q/k/v product:
    # packed.PackedGroup's stacked GEMM). LIVE (with ROPE): a row whose live flag is False (it has stopped: its output
    # is never read) reads none of its cache, attending to its token alone; its K/V are written all the same.
    # CHAIN: a launch in the decode's chain (`chain_in`), as the combine.
    if CHAIN:
        chain_in(True)
    b = tl.program_id(0).to(tl.int64)  # b * s_kb passes 2^31 for a layer's cache of 4 GiB
    h = tl.program_id(1)
    c = tl.program_id(2)
    n_kv = tl.num_programs(1)
    length = tl.load(len_ptr + b)
    if ROPE:  # the token's position, one before the row's length
        length += 1
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, length)
    cached = hi  # the loop's end: under ROPE, the token's own position is left to the end
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    cache = b * s_kb + h * s_kh
    if ROPE:
        cos = tl.load(cos_ptr + b * D + d).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + b * D + d).to(tl.float32)[None, :]
        q = rotated(q_ptr + b * s_qb, (h * G + g)[:, None], d[None, :], (g < G)[:, None], cos, sin, D)
        q = q.to(q_ptr.dtype.element_ty)
        new_at = length - 1
        k_new = rotated(kn_ptr + b * s_nb, h, d[None, :], d[None, :] < D, cos, sin, D)
        k_new = k_new.to(k_ptr.dtype.element_ty)  # (1, D)
        v_new = tl.load(vn_ptr + b * s_nb + h * D + d[None, :]).to(v_ptr.dtype.element_ty)
        if (lo <= new_at) & (new_at < hi):
            tl.store(k_ptr + cache + new_at * s_ks + d[None, :], k_new)
            tl.store(v_ptr + cache + new_at * s_ks + d[None, :], v_new)
        cached = tl.minimum(hi, new_at)
        if LIVE:
            if tl.load(live_ptr + b) == 0:
                cached = tl.minimum(cached, lo)  # (lo's int32 as cached's int64)
    else:
        q = tl.load(q_ptr + b * s_qb + (h * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    for start in tl.range(lo, cached, BLOCK_S):
        pos = start + tl.arange(0, BLOCK_S)
        inside = pos < cached
        at = cache + pos[:, None] * s_ks + d[None, :]
        k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0)
        scores = _dot(q, tl.trans(k), EXACT) * scale  # (G_PAD, BLOCK_S) float32
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: each step has a position inside
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, EXACT)
        m = m_new
    if ROPE:  # the token's own position, in this chunk: one more step of the softmax, K and V from registers
        if (lo <= new_at) & (new_at < hi):
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale  # (G_PAD,)
            m_new = tl.maximum(m, score)
            p = tl.exp(score - m_new)
            alpha = tl.exp(m - m_new)  # 0 where the loop read nothing (m = -inf)
            l = l * alpha + p
            acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
            m = m_new
    if SPLITS == 1:
        out = acc / l[:, None]
        tl.store(o_ptr + b * s_ob + (h * G + g)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])
    else:  # a chunk past the row's length leaves m = -inf, l = 0, acc = 0: the combine gives it no weight
        slot = (b * n_kv + h) * SPLITS + c
        tl.store(acc_ptr + slot * G_PAD * D + g[:, None] * D + d[None, :], acc)
        tl.store(stat_ptr + (slot * 2) * G_PAD + g, m)
        tl.store(stat_ptr + (slot * 2 + 1) * G_PAD + g, l)


@triton.jit
def attend_combine_kernel(o_ptr, acc_ptr, stat_ptr, s_ob, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                          SPLITS: tl.constexpr, CHAIN: tl.constexpr):
    # Program (row b, kv head h): sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M), M the chunks' largest m
    # (chunk 0 always holds position 0, so M is finite), chunks added in order: deterministic.
    if CHAIN:
        chain_in(True)
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = (b * tl.num_programs(1) + h) * SPLITS
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    top = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    for c in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(stat_ptr + ((first + c) * 2) * G_PAD + g))
    num = tl.zeros((G_PAD, D), dtype=tl.float32)
    den = tl.zeros((G_PAD,), dtype=tl.float32)
    for c in tl.static_range(SPLITS):
        w = tl.exp(tl.load(stat_ptr + ((first + c) * 2) * G_PAD + g) - top)  # 0 for an empty chunk
        den += w * tl.load(stat_ptr + ((first + c) * 2 + 1) * G_PAD + g)
        num += w[:, None] * tl.load(acc_ptr + (first + c) * G_PAD * D + g[:, None] * D + d[None, :])
    tl.store(o_ptr + b * s_ob + (h * G + g)[:, None] * D + d[None, :], (num / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=(g < G)[:, None])
