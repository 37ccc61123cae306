"""The Triton kernels behind `grpo.kernels.race_sample` (imported only where triton is installed)."""

import triton
import triton.language as tl


@triton.jit
def block_stats_kernel(x_ptr, stat_ptr, s_xb, V, temperature, NB: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row b, block j): the block's largest scaled logit m and sum(exp(s - m)), s = logits / T (float32)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(x_ptr + b * s_xb + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
    m = tl.max(s, axis=0)
    tl.store(stat_ptr + (b * NB + j) * 2, m)
    tl.store(stat_ptr + (b * NB + j) * 2 + 1, tl.sum(tl.exp(s - m), axis=0))


@triton.jit
def race_kernel(x_ptr, stat_ptr, key_ptr, idx_ptr, seed_ptr, step_ptr, s_xb, V, ROWS, temperature, log_min_p,
                NB: tl.constexpr, NB_PAD: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row b, block j): the exponential race over the block's tokens that min_p keeps, weights
    # exp(s - top) (top: the row's largest s), each divided by its own Exp(1) draw -log(u), u = tl.rand(seed,
    # (step * ROWS + b) * V + token): the block's best key and its token. Only a block holding a kept token
    # draws (min_p 0.1 keeps a few tokens of 128k); the others give key -1, below any kept token's.
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    blocks = tl.arange(0, NB_PAD)
    top = tl.max(tl.load(stat_ptr + (b * NB + blocks) * 2, mask=blocks < NB, other=float("-inf")), axis=0)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(x_ptr + b * s_xb + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
    kept = (s >= top + log_min_p) & (cols < V)  # log_min_p -inf without min_p: every token
    best = tl.full((), -1.0, tl.float32)
    at = tl.full((), 0, tl.int32)
    if tl.max(kept.to(tl.int32), axis=0) > 0:
        step = tl.load(step_ptr)
        u = tl.rand(tl.load(seed_ptr), (step * ROWS + b) * V + cols)  # [0, 1): u = 0 draws E = inf, key 0
        key = tl.where(kept, tl.exp(s - top), 0.0) / -tl.log(u)
        best = tl.max(key, axis=0)
        at = tl.argmax(key, axis=0)  # the first on ties
    tl.store(key_ptr + b * NB + j, best)
    tl.store(idx_ptr + b * NB + j, j * BLOCK + at)


@triton.jit
def pick_kernel(x_ptr, stat_ptr, key_ptr, idx_ptr, tok_ptr, logp_ptr, s_xb, temperature, NB: tl.constexpr,
                NB_PAD: tl.constexpr):
    # Program (row b): the token of the best key over the blocks (the first block on ties), and its log-prob
    # under softmax(s): s[token] - (top + log(sum_j sum_j' exp(m_j - top)))
    b = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, NB_PAD)
    inside = blocks < NB
    keys = tl.load(key_ptr + b * NB + blocks, mask=inside, other=-2.0)
    token = tl.load(idx_ptr + b * NB + tl.argmax(keys, axis=0)).to(tl.int64)
    m = tl.load(stat_ptr + (b * NB + blocks) * 2, mask=inside, other=float("-inf"))
    e = tl.load(stat_ptr + (b * NB + blocks) * 2 + 1, mask=inside, other=0.0)
    top = tl.max(m, axis=0)
    total = tl.sum(e * tl.exp(m - top), axis=0)
    s = tl.load(x_ptr + b * s_xb + token).to(tl.float32) / temperature
    tl.store(tok_ptr + b, token)
    tl.store(logp_ptr + b, s - (top + tl.log(total)))
