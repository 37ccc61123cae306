"""The Triton kernels behind `grpo.kernels.decode_gemm` (imported only where triton is installed).

Module level on purpose: Triton resolves the helpers a kernel calls through the module's globals.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Products of float32 operands: "tf32" on the tensor cores, or "ieee" (exact float32 FMAs) where the
# model itself is float32 (EXACT). The LoRA products of a bf16 model run in TF32: their result is a small
# correction to the base output, which is rounded to 16 bits anyway, and "ieee" there costs several times the
# time (benchmarks/RESULTS.md, "The measured defaults").


@triton.jit
def _tf32(x):
    # float32 -> the nearest TF32 value (10 mantissa bits, ties to even), kept in float32. The tensor cores
    # read a float32 operand's upper 19 bits and drop the rest: truncation shrinks every product by 2^-11 on
    # average, a bias that adds up over a sum and shows in fp16 outputs. Integer ops, a few per element.
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot32(a, b, EXACT: tl.constexpr):
    if EXACT:
        return tl.dot(a, b, input_precision="ieee")
    if a.dtype == tl.float32:  # rounded here, so that the tensor cores' truncation leaves them as they are
        a = _tf32(a)
        b = _tf32(b)
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def chain_in(WAIT: tl.constexpr):
    # A launch in the decode's chain (decode_gemm.Tuning.chain), launched dependently on the one before it:
    # wait (WAIT) until that one has ended and its writes are visible, before this one reads or writes memory,
    # then let the launch after this one be scheduled; its programs wait in turn. Also the norm's and the
    # attention's kernels.
    if WAIT:
        gdc_wait()
    gdc_launch_dependents()

# E4M3 codes to bf16 by moving bits, four codes (one 32-bit register) per instance: PRMT spreads the bytes
# into the high halves of two registers' 16-bit lanes, AND drops each sign, SHF moves exponent and mantissa
# under bf16's low exponent bits, LOP3 puts the sign back at bit 15. The result is code * 2^-120 exactly
# (the exponent biases differ by 120; E4M3 subnormals land on bf16 subnormals), all on the integer pipes;
# the hardware's conversion (E4M3 -> f16 -> bf16, two instructions per code) would bound the FP8 kernels.
_E4M3_BITS = tl.constexpr("""{
        .reg .b32 t0, t1, m0, m1;
        prmt.b32 t0, $2, 0, 0x1404;
        prmt.b32 t1, $2, 0, 0x3424;
        and.b32 m0, t0, 0x7F007F00;
        and.b32 m1, t1, 0x7F007F00;
        shr.b32 m0, m0, 4;
        shr.b32 m1, m1, 4;
        lop3.b32 $0, m0, t0, 0x80008000, 0xF8;
        lop3.b32 $1, m1, t1, 0x80008000, 0xF8;
        }""")


@triton.jit
def _e4m3_bits_bf16(w):
    # float8_e4m3fn codes -> bf16 code * 2^-120 (_E4M3_BITS); CUDA only (the interpreter runs no PTX)
    return tl.inline_asm_elementwise(_E4M3_BITS, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)

@triton.jit
def _base_tile(x_ptr, stride_xm, M, K, k_lo, k_hi, w_ptr, s_ptr, N, rn, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, HAS_SCALE: tl.constexpr, STAGES: tl.constexpr,
               EXACT: tl.constexpr, UNPACK: tl.constexpr, W_FIRST: tl.constexpr):
    # (BLOCK_M, BLOCK_N) float32 = x (M, K) times rows rn of W (N, K) over columns [k_lo, k_hi) (k_lo a
    # multiple of BLOCK_K); FP8 codes scaled per 128 block. W_FIRST: W's rows the product's first operand,
    # W x^T, transposed at the end (`decode_gemm._w_first` says where)
    rm = tl.arange(0, BLOCK_M)
    if W_FIRST:
        acc = tl.zeros((rn.shape[0], BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, rn.shape[0]), dtype=tl.float32)
    kb = tl.cdiv(K, 128)
    row_block = tl.min(rn, axis=0) // 128  # the tile's rows lie in one 128-row block of scales
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        for j in tl.static_range(BLOCK_K // SUB_K):
            rk = k0 + j * SUB_K + tl.arange(0, SUB_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < k_hi), other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < k_hi),
                        other=0.0)
            if UNPACK:
                w = _e4m3_bits_bf16(w)
            else:
                w = w.to(x.dtype)
            if W_FIRST:
                part = _dot32(w, tl.trans(x), EXACT)
            else:
                part = _dot32(x, tl.trans(w), EXACT)
            if HAS_SCALE:  # SUB_K is 128 and BLOCK_N divides 128: one block scale for the whole tile
                k_sub = k0 + j * SUB_K  # past the end (a partial last step) there is no scale to read
                scale = tl.load(s_ptr + row_block * kb + k_sub // 128, mask=k_sub < k_hi, other=0.0)
                if UNPACK:
                    scale = scale * 1.329227995784916e36  # 2^120: the bit moves left it out
                part = part * scale
            acc += part
    if W_FIRST:
        acc = tl.trans(acc)
    return acc

# A tile's epilogue operands (LoRA's B, the bias, the residual) are loaded before its K loop, whose weight stream
# hides their latency, and x A^T right after it: the finish then waits on no load of its own (split K: only on
# the other slices' partial sums).

@triton.jit
def _lora_b(b_ptr, R, N, rn, BLOCK_R: tl.constexpr):
    # B's rows rn, float32 (BLOCK_N, BLOCK_R)
    rr = tl.arange(0, BLOCK_R)
    return tl.load(b_ptr + rn[:, None] * R + rr[None, :], mask=(rn[:, None] < N) & (rr[None, :] < R),
                   other=0.0).to(tl.float32)

@triton.jit
def _lora_term(xa_ptr, b, scale, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, EXACT: tl.constexpr,
               PDL: tl.constexpr):
    # scale * (x A^T) B^T (BLOCK_M, BLOCK_N) float32; x A^T arrives whole, (BLOCK_M, BLOCK_R), from lora_down_kernel
    if PDL:  # launched while lora_down still ran: its x A^T is complete and visible after this
        gdc_wait()
    rm = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    xa = tl.load(xa_ptr + rm[:, None] * BLOCK_R + rr[None, :])
    return _dot32(xa, tl.trans(b), EXACT) * scale

@triton.jit
def _bias(bias_ptr, N, rn):
    # the projection's bias at features rn, float32 (1, BLOCK_N)
    return tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]

@triton.jit
def _finish_tile(acc, lora, bias, res, rn, M, N, y_ptr, BLOCK_M: tl.constexpr, HAS_LORA: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    # the whole K's sums in: LoRA's up-projection, the bias, the residual (each loaded or made before, read
    # only where its flag is set), one rounding, the store
    rm = tl.arange(0, BLOCK_M)
    if HAS_LORA:
        acc = acc + lora
    if HAS_BIAS:
        acc = acc + bias
    if HAS_RES:
        acc += res
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))

@triton.jit
def _split_k_sum(part, at, stride, count_ptr, SPLIT: tl.constexpr):
    # Split K: this program (K slice program_id(1) of SPLIT) leaves its partial sums at `at` + slice * `stride`;
    # the slice that arrives last adds all of them in slice order (so the result does not depend on which
    # one that is) and re-arms the counter. Returns (the whole sums there, else this slice's; last or not).
    tl.store(at + tl.program_id(1) * stride, part)
    tl.debug_barrier()  # all of this program's partial sums are written before the count says so
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    total = part
    if last:
        total = tl.load(at, cache_modifier=".cg")  # .cg: from L2, where the other slices wrote
        for s in tl.static_range(1, SPLIT):
            total += tl.load(at + s * stride, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
    return total, last

@triton.jit
def _one_proj(tile, slot, x_ptr, stride_xm, M, K, w_ptr, s_ptr, y_ptr, N, b_ptr, xa_ptr, R, lora_scale, bias_ptr,
              res_ptr, part_ptr, count_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SUB_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
              EXACT: tl.constexpr, UNPACK: tl.constexpr, W_FIRST: tl.constexpr, SPLIT_K: tl.constexpr,
              PDL: tl.constexpr, CHAIN: tl.constexpr):
    # tile `tile` of this projection over K slice program_id(1); `slot` numbers the tile in the launch
    if CHAIN:  # beside lora_down (PDL), x is complete already (lora_down waited for it): only the LoRA term waits
        chain_in(not PDL)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    b = rn  # stand-ins for what the flags leave out (never read)
    bias = rn
    res = rn
    lora = rn
    if HAS_LORA:
        b = _lora_b(b_ptr, R, N, rn, BLOCK_R)
    if HAS_BIAS:
        bias = _bias(bias_ptr, N, rn)
    if HAS_RES:  # residual (M, N), contiguous
        res = tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N),
                      other=0.0).to(tl.float32)
    per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * per
    acc = _base_tile(x_ptr, stride_xm, M, K, k_lo, tl.minimum(K, k_lo + per), w_ptr, s_ptr, N, rn, BLOCK_M,
                     BLOCK_K, SUB_K, HAS_SCALE, STAGES, EXACT, UNPACK, W_FIRST)
    if HAS_LORA:  # every K slice makes it (a small product), so the last one's finish waits on no load for it
        lora = _lora_term(xa_ptr, b, lora_scale, BLOCK_M, BLOCK_R, EXACT, PDL)
    if SPLIT_K > 1:  # the K slice that arrives last finishes the tile
        at = part_ptr + (slot * SPLIT_K * BLOCK_M + rm[:, None]) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc, last = _split_k_sum(acc, at, BLOCK_M * BLOCK_N, count_ptr + slot, SPLIT_K)
        if last:
            _finish_tile(acc, lora, bias, res, rn, M, N, y_ptr, BLOCK_M, HAS_LORA, HAS_BIAS, HAS_RES)
    else:
        _finish_tile(acc, lora, bias, res, rn, M, N, y_ptr, BLOCK_M, HAS_LORA, HAS_BIAS, HAS_RES)

@triton.jit
def proj_kernel(x_ptr, stride_xm, M, K,
                w0, s0, y0, b0, e0, N0, c0, w1, s1, y1, b1, e1, N1, c1, w2, s2, y2, b2, e2, N2, c2,
                xa_ptr, R, res_ptr, part_ptr, count_ptr,
                NUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SUB_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_RES: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
                EXACT: tl.constexpr, UNPACK: tl.constexpr, W_FIRST: tl.constexpr, SPLIT_K: tl.constexpr,
                PDL: tl.constexpr, CHAIN: tl.constexpr):
    # programs [0, t0) make y0's tiles, [t0, t0 + t1) y1's, the rest y2's; program_id(1) is the K slice.
    # Per projection i: weight w, FP8 scales s, output y, LoRA B b, bias e, features N, LoRA scale c.
    # CHAIN: in the chain of dependent launches (`chain_in`, in _one_proj).
    pid = tl.program_id(0)
    t0 = tl.cdiv(N0, BLOCK_N)
    xa_stride = BLOCK_M * BLOCK_R
    if pid < t0:
        _one_proj(pid, pid, x_ptr, stride_xm, M, K, w0, s0, y0, N0, b0, xa_ptr, R, c0, e0, res_ptr, part_ptr,
                  count_ptr, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, HAS_SCALE, HAS_LORA, HAS_BIAS, HAS_RES, BLOCK_R,
                  STAGES, EXACT, UNPACK, W_FIRST, SPLIT_K, PDL, CHAIN)
    else:
        if NUM >= 2:
            t1 = tl.cdiv(N1, BLOCK_N)
            if pid < t0 + t1:
                _one_proj(pid - t0, pid, x_ptr, stride_xm, M, K, w1, s1, y1, N1, b1, xa_ptr + xa_stride, R, c1, e1,
                          res_ptr, part_ptr, count_ptr, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, HAS_SCALE, HAS_LORA,
                          HAS_BIAS, HAS_RES, BLOCK_R, STAGES, EXACT, UNPACK, W_FIRST, SPLIT_K, PDL, CHAIN)
            else:
                if NUM == 3:
                    _one_proj(pid - t0 - t1, pid, x_ptr, stride_xm, M, K, w2, s2, y2, N2, b2,
                              xa_ptr + 2 * xa_stride, R, c2, e2, res_ptr, part_ptr, count_ptr, BLOCK_M, BLOCK_N,
                              BLOCK_K, SUB_K, HAS_SCALE, HAS_LORA, HAS_BIAS, HAS_RES, BLOCK_R, STAGES, EXACT,
                              UNPACK, W_FIRST, SPLIT_K, PDL, CHAIN)

@triton.jit
def gated_kernel(x_ptr, stride_xm, M, K, wg, sg, bg, cg, wu, su, bu, cu, y_ptr, N, xa_ptr, R, eg, eu,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                 STAGES: tl.constexpr, EXACT: tl.constexpr, UNPACK: tl.constexpr, W_FIRST: tl.constexpr,
                 PDL: tl.constexpr, CHAIN: tl.constexpr):
    # y = silu(x Wg^T + eg) * (x Wu^T + eu) for one tile of N (LoRA B bg/bu, scales cg/cu, biases eg/eu)
    if CHAIN:  # as in _one_proj
        chain_in(not PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    if HAS_LORA:  # loaded before the K loops, as in _one_proj
        b_g = _lora_b(bg, R, N, rn, BLOCK_R)
        b_u = _lora_b(bu, R, N, rn, BLOCK_R)
    if HAS_BIAS:
        bias_g = _bias(eg, N, rn)
        bias_u = _bias(eu, N, rn)
    g = _base_tile(x_ptr, stride_xm, M, K, 0, K, wg, sg, N, rn, BLOCK_M, BLOCK_K, SUB_K, HAS_SCALE, STAGES,
                   EXACT, UNPACK, W_FIRST)
    u = _base_tile(x_ptr, stride_xm, M, K, 0, K, wu, su, N, rn, BLOCK_M, BLOCK_K, SUB_K, HAS_SCALE, STAGES,
                   EXACT, UNPACK, W_FIRST)
    if HAS_LORA:
        g = g + _lora_term(xa_ptr, b_g, cg, BLOCK_M, BLOCK_R, EXACT, PDL)
        u = u + _lora_term(xa_ptr + BLOCK_M * BLOCK_R, b_u, cu, BLOCK_M, BLOCK_R, EXACT, False)  # (waited above)
    if HAS_BIAS:
        g = g + bias_g
        u = u + bias_u
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))

@triton.jit
def _down_part(x_ptr, stride_xm, M, K, a_ptr, R, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < k_hi),
                    other=0.0)
        a = tl.load(a_ptr + rr[:, None] * K + rk[None, :], mask=(rr[:, None] < R) & (rk[None, :] < k_hi),
                    other=0.0)
        acc += _dot32(x.to(tl.float32), tl.trans(a.to(tl.float32)), EXACT)
    return acc

@triton.jit
def lora_down_kernel(x_ptr, stride_xm, M, K, a0, a1, a2, out_ptr, part_ptr, count_ptr, R, BLOCK_M: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EXACT: tl.constexpr,
                     PDL: tl.constexpr, CHAIN: tl.constexpr):
    # out[i] = x A_i^T, over SPLIT slices of K in programs of their own, added by _split_k_sum.
    # Summed once here, not in every tile that reads it (those re-read SPLIT partial sums a tile: half as
    # many bytes again as the weights, 27 MB, for the gate/up launch of Qwen2.5-1.5B at 64 rows and r=32).
    if CHAIN:  # (which lets the projection launch start too)
        chain_in(True)
    elif PDL:  # the projection launch that reads out_ptr may start now: it waits for this one before reading
        gdc_launch_dependents()
    i = tl.program_id(0)
    per = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * per
    k_hi = tl.minimum(K, k_lo + per)
    if i == 0:
        acc = _down_part(x_ptr, stride_xm, M, K, a0, R, k_lo, k_hi, BLOCK_M, BLOCK_R, BLOCK_K, EXACT)
    elif i == 1:
        acc = _down_part(x_ptr, stride_xm, M, K, a1, R, k_lo, k_hi, BLOCK_M, BLOCK_R, BLOCK_K, EXACT)
    else:
        acc = _down_part(x_ptr, stride_xm, M, K, a2, R, k_lo, k_hi, BLOCK_M, BLOCK_R, BLOCK_K, EXACT)
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + i * BLOCK_M * BLOCK_R + tile, acc)
    else:
        at = part_ptr + i * SPLIT * BLOCK_M * BLOCK_R + tile
        total, last = _split_k_sum(acc, at, BLOCK_M * BLOCK_R, count_ptr + i, SPLIT)
        if last:
            tl.store(out_ptr + i * BLOCK_M * BLOCK_R + tile, total)


@triton.jit
def rotated(x_ptr, heads, cols, mask, cos, sin, D: tl.constexpr):
    # heads `heads` of x (head after head, D each; cols: all D of a head) with the rotary embedding
    # (rotate_half convention), float32; also the attention kernel's (rope_store_attend)
    half = D // 2
    x = tl.load(x_ptr + heads * D + cols, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(x_ptr + heads * D + (cols + half) % D, mask=mask, other=0.0).to(tl.float32)
    return x * cos + tl.where(cols < half, -partner, partner) * sin


@triton.jit
def rope_store_kernel(k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, s_b, s_h, s_s, N_KV,
                      D: tl.constexpr, BLOCK_H: tl.constexpr):
    # one row: K rotated (rotate_half convention) and V, both (N_KV, D), written at the row's position
    b = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    hmask = (h < N_KV)[:, None]
    src = b * N_KV * D + h[:, None] * D
    cos = tl.load(cos_ptr + b * D + d).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + b * D + d).to(tl.float32)[None, :]
    k = rotated(k_ptr + b * N_KV * D, h[:, None], d[None, :], hmask, cos, sin, D)
    v = tl.load(v_ptr + src + d[None, :], mask=hmask, other=0.0)
    p = tl.load(pos_ptr + b)
    dst = b * s_b + h[:, None] * s_h + p * s_s + d[None, :]
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=hmask)
    tl.store(vc_ptr + dst, v, mask=hmask)
