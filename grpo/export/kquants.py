"""Q4_K, Q5_K and Q6_K block quantizers in numpy: the k-quants that the `gguf` library reads back but
does not write.

    data = quantize_k(weights, GGMLQuantizationType.Q4_K)   # (rows, cols) float32 -> (rows, cols/256*144) uint8

A super-block holds 256 weights of one row. The formats (byte layout as llama.cpp's `block_q*_K`):

    Q4_K (144 B)  d, dmin (fp16); 12 bytes of 6-bit scale and min for 8 sub-blocks of 32; 128 B of 4-bit codes
                  x ~ d*sc[j]*q - dmin*m[j],  q in 0..15
    Q5_K (176 B)  as Q4_K, with the fifth bit of every code in 32 bytes qh: q in 0..31
    Q6_K (210 B)  128 B low 4 bits, 64 B high 2 bits, 16 int8 scales for sub-blocks of 16, d (fp16)
                  x ~ d*sc[j]*(q - 32),  q in 0..63

How the scales are chosen follows llama.cpp's quantizer (ggml-quants.c). Without an importance matrix, the
path `llama-quantize` runs when it is given none:
- Q4_K/Q5_K: per sub-block of 32, a weighted least-squares fit of scale and min (weights |x| + rms(x))
  over a small grid of trial inverse scales (`_fit_scale_min`, llama.cpp's make_qkx2_quants); the 8
  scales and 8 mins are then quantized to 6 bits against the largest of each, stored as fp16 d and dmin,
  and every code is recomputed from the stored (rounded) scales.
- Q6_K: per sub-block of 16, a symmetric fit weighted by x^2 over 18 trial scales around the one that
  maps the largest |x| to -32 (`_fit_symmetric`, llama.cpp's make_qx_quants); the 16 scales are int8
  against the largest, and codes are recomputed from them.

With an importance matrix (`importance`: per column of the matrix, the mean squared activation that
feeds it, llama.cpp's imatrix semantics), as `quantize_row_q*_K_impl` with `quant_weights`:
- Q4_K/Q5_K: each weight's importance is imatrix[col] * sqrt(sigma2 + x^2), sigma2 = 2*mean(x^2) over the
  super-block; the same fit, over a finer grid (make_qkx3_quants: 37 trials from nmax - 0.9 in steps of
  0.05); the 8 scales and the 8 mins are then fitted to 6 bits by a weighted search of their own
  (`_fit_positive`, llama.cpp's make_qp_quants, weighted by each sub-block's total importance) rather
  than against the largest.
- Q6_K: the symmetric fit weighted by imatrix[col] in place of x^2.

Vectorised over blocks; the element axis comes first (`(n, blocks)`) so that every sum runs element by
element in float32, in the order the C loops add: blocks equal a one-block transcription of the C byte
for byte (tests/test_kquants.py), and 99.8% of the Q4_K blocks that llama.cpp wrote in the packaged Qwen
re-quantize to themselves (docs/measurements.md). Rounding is to nearest, ties to even, as `nearest_int`. Not
here: the other k-quants (Q2_K, Q3_K, IQ*), dequantizing (the `gguf` library does that), choosing a type per
tensor (grpo/export/gguf.py), where importance matrices come from (grpo/export/imatrix.py).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from itertools import repeat

import numpy as np

QK_K = 256  # weights in a super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# Super-blocks quantized at once: working arrays of 128 KiB stay in cache, traded against numpy's cost per call
# (the fastest of the sizes tried).
_CHUNK_BLOCKS = 128
_PIECE_BLOCKS = 16 * _CHUNK_BLOCKS  # a pool worker's unit: small, so that the cores finish together
_GROUP_MAX_EPS = np.float32(1e-15)  # below this a sub-block counts as all zero (llama.cpp's GROUP_MAX_EPS)
_F0, _F1 = np.float32(0), np.float32(1)


def quantize_k(weights: np.ndarray, qtype, pool: ProcessPoolExecutor | None = None,
               importance: np.ndarray | None = None) -> np.ndarray:
    """`weights` (..., cols) with cols a multiple of 256, quantized row-wise to `qtype` (a
    gguf.GGMLQuantizationType: Q4_K, Q5_K or Q6_K); returns uint8 (..., cols // 256 * block bytes).
    `importance` (cols,): llama.cpp's imatrix for this matrix, the same for every row (None: the path
    without one). With a `pool`, its workers quantize pieces of the blocks side by side (the same bytes:
    blocks are independent)."""
    name = getattr(qtype, "name", str(qtype))
    if name not in BLOCK_BYTES:
        raise ValueError(f"{name}: grpo.export.kquants writes {', '.join(BLOCK_BYTES)} only")
    if weights.shape[-1] % QK_K:
        raise ValueError(f"{name}: rows of {weights.shape[-1]} weights are not a whole number of {QK_K}-blocks")
    blocks = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1, QK_K)
    block_importance = None
    if importance is not None:
        importance = np.asarray(importance, dtype=np.float32)
        if importance.shape != (weights.shape[-1],):
            raise ValueError(f"{name}: an importance of shape {importance.shape} for rows of {weights.shape[-1]} "
                             "weights; it needs one value per column")
        per_row = importance.reshape(1, -1, QK_K)  # block b of the flat blocks is column block b % (cols/256)
        block_importance = np.broadcast_to(per_row, (blocks.shape[0] // per_row.shape[1], *per_row.shape[1:]))
        block_importance = block_importance.reshape(-1, QK_K)
    if pool is None:
        out = _quantize_blocks(blocks, name, block_importance)
    else:
        starts = range(0, blocks.shape[0], _PIECE_BLOCKS)
        pieces = [blocks[start:start + _PIECE_BLOCKS] for start in starts]
        weights_of = [None if block_importance is None else block_importance[start:start + _PIECE_BLOCKS]
                      for start in starts]
        out = np.concatenate(list(pool.map(_quantize_blocks, pieces, repeat(name), weights_of)))
    return out.reshape(*weights.shape[:-1], weights.shape[-1] // QK_K * BLOCK_BYTES[name])


def _quantize_blocks(blocks: np.ndarray, name: str, importance: np.ndarray | None = None) -> np.ndarray:
    """(B, 256) float32 (and their (B, 256) importance, or None) -> (B, block bytes) uint8, a cache-sized
    chunk at a time (a pool's unit of work)."""
    quantize_blocks = {"Q4_K": quantize_q4_k_blocks, "Q5_K": quantize_q5_k_blocks, "Q6_K": quantize_q6_k_blocks}[name]
    out = np.empty((blocks.shape[0], BLOCK_BYTES[name]), dtype=np.uint8)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = slice(start, start + _CHUNK_BLOCKS)
        out[chunk] = quantize_blocks(blocks[chunk], None if importance is None else importance[chunk])
    return out


# --------------------------------------------------------------------------------------------------
# Fits for one sub-block (vectorised over sub-blocks: arrays are (n, S), S sub-blocks side by side)
# --------------------------------------------------------------------------------------------------
def _fit_scale_min(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Codes L in 0..nmax, scale s > 0 and offset m <= 0 with x ~ s*L + m, least squares weighted by w,
    searched over the inverse scales (rmin + rdelta*k + nmax) / (max - m), k = 0..nstep, m the best offset so far.
    x, w: (n, S) float32. Returns (s (S,), -m (S,), L (n, S) uint8); s = 0 where the sub-block is flat."""
    lo = np.minimum(x.min(axis=0), _F0)  # the offset never goes above zero
    hi = x.max(axis=0)
    flat = hi == lo
    span = np.where(flat, _F1, hi - lo)
    sum_w = w.sum(axis=0)
    sum_x = (w * x).sum(axis=0)

    iscale = np.float32(nmax) / span
    codes = _codes(iscale * (x - lo), nmax)
    scale = _F1 / iscale
    offset = lo
    diff = scale * codes + offset - x
    best = (w * (diff * diff)).sum(axis=0)
    trial, wl, tmp = np.empty_like(x), np.empty_like(x), np.empty_like(x)  # in place: this loop is the cost
    for k in range(nstep + 1):
        # As in llama.cpp, each trial starts from the best offset so far, not from min(x).
        trial_span = hi - offset
        usable = trial_span > 0
        trial_iscale = ((np.float32(rmin) + np.float32(rdelta) * np.float32(k) + np.float32(nmax))
                        / np.where(usable, trial_span, _F1))
        np.subtract(x, offset, out=trial)
        trial *= trial_iscale
        np.rint(trial, out=trial)
        np.clip(trial, 0, nmax, out=trial)
        np.multiply(w, trial, out=wl)
        sum_l = wl.sum(axis=0)
        sum_l2 = np.multiply(wl, trial, out=tmp).sum(axis=0)
        sum_xl = np.multiply(wl, x, out=tmp).sum(axis=0)
        det = sum_w * sum_l2 - sum_l * sum_l
        fits = (det > 0) & usable
        det = np.where(fits, det, _F1)
        t_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        t_offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = t_offset > 0  # an offset above zero is refitted as a pure scale
        t_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, _F1), t_scale)
        t_offset = np.where(positive, _F0, t_offset)
        np.multiply(trial, t_scale, out=tmp)  # the weighted squared error of this trial
        tmp += t_offset
        tmp -= x
        np.multiply(tmp, tmp, out=tmp)
        tmp *= w
        err = tmp.sum(axis=0)
        better = fits & (err < best)
        np.copyto(codes, trial, where=better)
        best = np.where(better, err, best)
        scale = np.where(better, t_scale, scale)
        offset = np.where(better, t_offset, offset)
    codes = np.where(flat, _F0, codes)
    scale = np.where(flat, _F0, scale)
    offset = np.where(flat, lo, offset)  # a flat sub-block is all offset (the trials above fit noise)
    return scale, -offset, codes.astype(np.uint8)


def _fit_symmetric(x: np.ndarray, nmax: int, w: np.ndarray | None = None):
    """Codes l in -nmax..nmax-1 and a scale s with x ~ s*l, least squares weighted by w (x^2 when None),
    searched over the inverse scales -(nmax + 0.1*k) / x_maxabs, k = -9..9 (x_maxabs signed: the extreme
    weight gets -nmax). x: (n, S) float32. Returns (s (S,), l + nmax (n, S) uint8); s = 0 for an all-zero
    sub-block."""
    cols = np.arange(x.shape[1])
    extreme = x[np.abs(x).argmax(axis=0), cols]  # the first weight of largest magnitude, with its sign
    zero = np.abs(extreme) < _GROUP_MAX_EPS
    extreme = np.where(zero, _F1, extreme)
    w = x * x if w is None else w

    def trial(iscale):
        lv = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        wx = w * x
        return lv, (wx * lv).sum(axis=0), ((w * lv) * lv).sum(axis=0)

    codes, sum_lx, sum_l2 = trial(np.float32(-nmax) / extreme)
    scale = np.where(sum_l2 != 0, sum_lx / np.where(sum_l2 != 0, sum_l2, _F1), _F0)
    best = scale * sum_lx
    for k in (*range(-9, 0), *range(1, 10)):
        t_codes, t_lx, t_l2 = trial(-(np.float32(nmax) + np.float32(0.1) * np.float32(k)) / extreme)
        better = (t_l2 > 0) & (t_lx * t_lx > best * t_l2)
        t_scale = t_lx / np.where(t_l2 > 0, t_l2, _F1)
        codes = np.where(better, t_codes, codes)
        scale = np.where(better, t_scale, scale)
        best = np.where(better, t_scale * t_lx, best)
    codes = np.where(zero, _F0, codes + np.float32(nmax))
    scale = np.where(zero, _F0, scale)
    return scale, codes.astype(np.uint8)


def _fit_positive(x: np.ndarray, w: np.ndarray, nmax: int):
    """Codes L in 0..nmax and a scale s with x ~ s*L for x >= 0, least squares weighted by w (llama.cpp's
    make_qp_quants): the best of the inverse scales (nmax + 0.1*k) / max(x), k = -4..4, then up to five
    passes that move one code at a time while the fit improves. x, w: (n, S) float32. Returns (s (S,),
    L (n, S) uint8); s = 0 where max(x) is below GROUP_MAX_EPS."""
    top = np.maximum(x.max(axis=0), _F0)
    zero = top < _GROUP_MAX_EPS
    top = np.where(zero, _F1, top)
    nmax_f = np.float32(nmax)
    iscale = nmax_f / top
    first = (np.rint(iscale * x).astype(np.int64) & 0xFF).astype(np.float32)  # uint8 L[i] in C, unclipped
    diff = x - (_F1 / iscale) * first
    best = ((w * diff) * diff).sum(axis=0)
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial_iscale = (np.float32(0.1) * np.float32(k) + nmax_f) / top
        codes = np.minimum(nmax_f, np.rint(trial_iscale * x))
        diff = x - (_F1 / trial_iscale) * codes
        err = ((w * diff) * diff).sum(axis=0)
        better = err < best
        best = np.where(better, err, best)
        iscale = np.where(better, trial_iscale, iscale)
    codes = np.minimum(nmax_f, np.rint(iscale * x))
    sum_lx = ((w * x) * codes).sum(axis=0)
    sum_l2 = ((w * codes) * codes).sum(axis=0)
    codes = (codes.astype(np.int64) & 0xFF).astype(np.float32)  # stored as uint8, as the passes read it
    for _ in range(5):  # a block with nothing left to move stays as it is, as C's early exit leaves it
        for i in range(x.shape[0]):
            wx = w[i] * x[i]
            slx = sum_lx - wx * codes[i]
            sl2 = sum_l2 - (w[i] * codes[i]) * codes[i]
            movable = (slx > 0) & (sl2 > 0)
            moved = np.minimum(nmax_f, np.rint((x[i] * sl2) / np.where(movable, slx, _F1)))
            slx = slx + wx * moved
            sl2 = sl2 + (w[i] * moved) * moved
            take = movable & (moved != codes[i]) & ((slx * slx) * sum_l2 > (sum_lx * sum_lx) * sl2)
            codes[i] = np.where(take, (moved.astype(np.int64) & 0xFF), codes[i])
            sum_lx = np.where(take, slx, sum_lx)
            sum_l2 = np.where(take, sl2, sum_l2)
    scale = np.where(sum_l2 > 0, sum_lx / np.where(sum_l2 > 0, sum_l2, _F1), _F0)
    return np.where(zero, _F0, scale), np.where(zero, _F0, codes).astype(np.uint8)


def _codes(v: np.ndarray, nmax: int) -> np.ndarray:
    return np.clip(np.rint(v), 0, nmax)


def _fp16(v: np.ndarray) -> np.ndarray:
    """The fp16 value stored (round to nearest even), and that value back in float32."""
    half = v.astype(np.float16)
    return half, half.astype(np.float32)


def _clip63(v: np.ndarray) -> np.ndarray:
    """llama.cpp's `uint8_t l = nearest_int(v); l = MIN(63, l)`: a negative code wraps before the clip."""
    return np.minimum(np.rint(v).astype(np.int64) & 0xFF, 63).astype(np.uint8)


# --------------------------------------------------------------------------------------------------
# Q4_K and Q5_K: 8 sub-blocks of 32 with a 6-bit scale and min each
# --------------------------------------------------------------------------------------------------
def _scale_min_blocks(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                      importance: np.ndarray | None = None):
    """The shared part of Q4_K and Q5_K: returns (d fp16 (B,), dmin fp16 (B,), the 12 packed scale bytes
    (B, 12), codes (B, 256) uint8 in 0..nmax recomputed from the stored scales). With `importance` (B, 256)
    the fit is llama.cpp's weighted one (module docstring) and rmin, rdelta, nstep are not used."""
    n_blocks = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(n_blocks * 8, 32).T)  # (32, B*8): element axis first
    if importance is None:
        rms = np.sqrt((x * x).sum(axis=0) / np.float32(32))
        w = rms + np.abs(x)
        scales, mins, codes = _fit_scale_min(x, w, nmax, rmin, rdelta, nstep)
        scales, mins = scales.reshape(n_blocks, 8), mins.reshape(n_blocks, 8)
        max_scale = np.maximum(scales.max(axis=1), _F0)
        max_min = np.maximum(mins.max(axis=1), _F0)
        inv_scale = np.where(max_scale > 0, np.float32(63) / np.where(max_scale > 0, max_scale, _F1), _F0)
        inv_min = np.where(max_min > 0, np.float32(63) / np.where(max_min > 0, max_min, _F1), _F0)
        ls = _clip63(inv_scale[:, None] * scales)  # (B, 8)
        lm = _clip63(inv_min[:, None] * mins)
        d_block, m_block = max_scale / np.float32(63), max_min / np.float32(63)
    else:
        flat = np.ascontiguousarray(blocks.T)  # (256, B): the super-block's sum of squares, element by element
        sigma2 = np.float32(2) * (flat * flat).sum(axis=0) / np.float32(QK_K)
        qw = np.ascontiguousarray(importance.reshape(n_blocks * 8, 32).T)
        w = qw * np.sqrt(np.repeat(sigma2, 8) + x * x)
        sub_weight = w.sum(axis=0).reshape(n_blocks, 8).T  # (8, B)
        scales, mins, codes = _fit_scale_min(x, w, nmax, -0.9, 0.05, 36)
        d_block, ls = _fit_positive(np.ascontiguousarray(scales.reshape(n_blocks, 8).T), sub_weight, 63)
        m_block, lm = _fit_positive(np.ascontiguousarray(mins.reshape(n_blocks, 8).T), sub_weight, 63)
        ls, lm = np.minimum(ls.T, 63), np.minimum(lm.T, 63)  # (B, 8); Q5_K clips, Q4_K never needs to
    d_half, d = _fp16(d_block)
    dmin_half, dmin = _fp16(m_block)

    # Codes again, from the scales as stored; a sub-block whose stored scale is 0 keeps the fit's codes.
    sub_d = (d[:, None] * ls).reshape(-1)  # (B*8,)
    sub_m = (dmin[:, None] * lm).reshape(-1)
    live = sub_d != 0
    again = np.clip(np.rint((x + sub_m) / np.where(live, sub_d, _F1)), 0, nmax).astype(np.uint8)
    codes = np.where(live, again, codes).T.reshape(n_blocks, QK_K)

    packed = np.empty((n_blocks, 12), dtype=np.uint8)  # 6-bit pairs: see gguf's Q4_K.get_scale_min
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return d_half, dmin_half, packed, codes


def _low_nibbles(codes: np.ndarray) -> np.ndarray:
    """(B, 256) codes -> (B, 128): in each 64-run, byte l holds code l (low nibble) and code l+32 (high)."""
    runs = codes.reshape(-1, 4, 2, 32) & 0x0F
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(codes.shape[0], 128)


def quantize_q4_k_blocks(blocks: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """(B, 256) float32 -> (B, 144) uint8 Q4_K blocks."""
    d, dmin, scales, codes = _scale_min_blocks(blocks, 15, -1.0, 0.1, 20, importance)
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, _low_nibbles(codes)], axis=1)


def quantize_q5_k_blocks(blocks: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """(B, 256) float32 -> (B, 176) uint8 Q5_K blocks."""
    d, dmin, scales, codes = _scale_min_blocks(blocks, 31, -0.5, 0.1, 15, importance)
    high = (codes >> 4).reshape(-1, 8, 32)  # bit 4 of sub-block j's codes goes to bit j of qh[l]
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, qh, _low_nibbles(codes)], axis=1)


# --------------------------------------------------------------------------------------------------
# Q6_K: 16 sub-blocks of 16 with an int8 scale each
# --------------------------------------------------------------------------------------------------
def quantize_q6_k_blocks(blocks: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """(B, 256) float32 -> (B, 210) uint8 Q6_K blocks."""
    n_blocks = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(n_blocks * 16, 16).T)  # (16, B*16)
    w = None if importance is None else np.ascontiguousarray(importance.reshape(n_blocks * 16, 16).T)
    scales, codes = _fit_symmetric(x, 32, w)
    scales = scales.reshape(n_blocks, 16)

    rows = np.arange(n_blocks)
    max_scale = scales[rows, np.abs(scales).argmax(axis=1)]  # signed, the first of largest magnitude
    empty = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = np.float32(-128) / np.where(empty, _F1, max_scale)
    d_half, d = _fp16(_F1 / iscale)
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)  # (B, 16)

    sub_d = (d[:, None] * sc).reshape(-1)  # (B*16,)
    live = sub_d != 0
    again = (np.clip(np.rint(x / np.where(live, sub_d, _F1)), -32, 31) + 32).astype(np.uint8)
    codes = np.where(live, again, codes).T.reshape(n_blocks, QK_K)

    runs = codes.reshape(n_blocks, 2, 4, 32)  # two halves of 128, each four runs of 32
    ql = np.concatenate([(runs[:, :, 0] & 0x0F) | ((runs[:, :, 2] & 0x0F) << 4),
                         (runs[:, :, 1] & 0x0F) | ((runs[:, :, 3] & 0x0F) << 4)], axis=2)  # (B, 2, 64)
    qh = (runs[:, :, 0] >> 4) | ((runs[:, :, 1] >> 4) << 2) | ((runs[:, :, 2] >> 4) << 4) | ((runs[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(n_blocks, 128), qh.reshape(n_blocks, 64), sc.view(np.uint8),
                          _half_bytes(d_half)], axis=1)
    out[empty] = 0  # an all-zero block is stored as zeros, d included
    return out


def _half_bytes(half: np.ndarray) -> np.ndarray:
    return half.astype("<f2").view(np.uint8).reshape(-1, 2)
