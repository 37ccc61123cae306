"""Per-token log-probabilities (and entropy) through a frozen LM head, never holding all the logits.

For hidden states h (N, H), the LM head W (V, H), targets t (N,) and temperature T:

    z      = (h W^T) / T                      # (N, V), as the sampler scales its logits
    logp_i = z[i, t_i] - logsumexp(z[i])      # (N,)  float32
    ent_i  = logsumexp(z[i]) - sum_j p_ij z_ij

and the gradient with respect to h, with g = dLoss/dlogp (N,):

    dh = g * ((onehot(t) - softmax(z)) / T) W  # (N, H)

At Llama's V = 128,256 the fp32 logits for 32k tokens are 16.8 GB, so rows are processed in chunks
of `chunk_size` and only one chunk of logits exists at a time. Two matmuls per chunk are
unavoidable (h W^T, then dz W). When the caller needs a gradient, the second one runs in the
forward pass, right after the chunk's logits, and only the (N, H) product (onehot - p) W / T is kept
for backward, which scales its rows by g. That is the same size as h (which is then not saved) and
avoids recomputing the logits in backward, a third matmul as large as the others.
`recompute=True` gives the classic variant instead (save nothing but h, redo each chunk in backward).

The softmax statistics and the gradient of each chunk come from either plain PyTorch (CPU, and
the reference semantics) or, on CUDA, a Triton kernel that makes two passes over each row of the
bf16 logits (online max/sum/entropy, then p) and writes (onehot - p) / T over the logits in place.

The logits are computed in the weight's dtype (bf16 on GPU: fp32 accumulation, bf16 result), then
all softmax arithmetic is float32, as `token_logprobs_ref` does. The entropy is a diagnostic and
carries no gradient; the LM head is frozen (no gradient for W; passing a W that requires grad is an
error). What this module is not: no sampling, no masking (the caller masks with `mask`), no vocab
parallelism.
"""

from __future__ import annotations

import math

import torch

from grpo.kernels._triton import have_triton

_CHUNK_BUDGET = 512 * 2**20  # bytes of per-chunk temporaries to aim for
_TRITON_KERNEL = None


def token_logprobs_ref(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0, *, return_entropy: bool = False):
    """The plain path: all logits at once, float32 log_softmax, gather. Differentiable by autograd."""
    logits = hidden @ lm_head_weight.t()  # (N, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # fp32 (fp64 stays)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.long()[:, None]).squeeze(-1)  # (N,)
    if not return_entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


# --- one chunk ------------------------------------------------------------------------------------


def _chunk_torch(logits, targets, inv_t, logp_out, ent_out, want_grad):
    """Softmax statistics of one chunk of logits (c, V); returns (onehot - p) / T in logits' dtype or None."""
    z = logits.float() * inv_t  # (c, V) fp32, a fresh buffer we may overwrite
    lse = torch.logsumexp(z, dim=-1)  # (c,)
    logp_all = z.sub_(lse[:, None])  # log-softmax, in place
    logp_out.copy_(logp_all.gather(1, targets[:, None]).squeeze(1))
    if ent_out is None and not want_grad:
        return None
    p = logp_all.exp()
    if ent_out is not None:
        ent_out.copy_(-logp_all.mul_(p).sum(-1))  # in place: logp_all is not needed any more
    if not want_grad:
        return None
    del logp_all, z
    grad = p.neg_()
    grad.scatter_add_(1, targets[:, None], torch.ones_like(grad[:, :1]))
    return grad.mul_(inv_t).to(logits.dtype)


def _triton_kernel():
    global _TRITON_KERNEL
    if _TRITON_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _logprob_rows_kernel(logits_ptr, stride_row, targets_ptr, logp_ptr, ent_ptr, V, inv_t,
                                 WANT_ENT: tl.constexpr, WANT_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            base = logits_ptr + row * stride_row
            target = tl.load(targets_ptr + row).to(tl.int64)
            m = float("-inf")  # running max of z
            s = 0.0  # sum exp(z - m)
            t = 0.0  # sum exp(z - m) * z   (for the entropy)
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                live = cols < V
                z = tl.load(base + cols, mask=live, other=float("-inf")).to(tl.float32) * inv_t
                m_new = tl.maximum(m, tl.max(z, axis=0))
                alpha = tl.exp(m - m_new)
                e = tl.exp(z - m_new)
                s = s * alpha + tl.sum(e, axis=0)
                if WANT_ENT:
                    t = t * alpha + tl.sum(tl.where(live, e * z, 0.0), axis=0)
                m = m_new
            lse = m + tl.log(s)
            z_t = tl.load(base + target).to(tl.float32) * inv_t
            tl.store(logp_ptr + row, z_t - lse)
            if WANT_ENT:
                tl.store(ent_ptr + row, lse - t / s)
            if WANT_GRAD:  # second pass: overwrite the logits with (onehot - p) / T
                for start in range(0, V, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    live = cols < V
                    z = tl.load(base + cols, mask=live, other=0.0).to(tl.float32) * inv_t
                    p = tl.exp(z - lse)
                    d = tl.where(cols == target, 1.0 - p, -p) * inv_t
                    tl.store(base + cols, d.to(logits_ptr.dtype.element_ty), mask=live)

        _TRITON_KERNEL = (triton, _logprob_rows_kernel)
    return _TRITON_KERNEL


# The Triton kernel's launch: vocabulary columns per loop step and warps per row. The choice matters little:
# 2048/4 to 16384/16 run about as fast (benchmarks/RESULTS.md, "The measured defaults").
BLOCK_V, NUM_WARPS = 8192, 16


def _chunk_triton(logits, targets, inv_t, logp_out, ent_out, want_grad):
    """Same contract as `_chunk_torch`; overwrites `logits` (a buffer it owns) with the gradient."""
    _, kernel = _triton_kernel()
    c, v = logits.shape
    ent = ent_out if ent_out is not None else logp_out  # a valid pointer, never written
    kernel[(c,)](logits, logits.stride(0), targets, logp_out, ent, v, inv_t,
                 WANT_ENT=ent_out is not None, WANT_GRAD=want_grad, BLOCK_V=BLOCK_V,
                 num_warps=NUM_WARPS)
    return logits if want_grad else None


def _chunk(hidden_c, weight, targets_c, inv_t, logp_out, ent_out, want_grad, impl):
    """One chunk: logits, statistics, and the gradient factor (onehot - p) W / T (c, H) or None."""
    logits = hidden_c @ weight.t()  # (c, V) in the weight's dtype, fp32 accumulation
    if impl == "triton":
        dz = _chunk_triton(logits, targets_c, inv_t, logp_out, ent_out, want_grad)
    else:
        dz = _chunk_torch(logits, targets_c, inv_t, logp_out, ent_out, want_grad)
    return None if dz is None else dz @ weight  # (c, H)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunk, impl, recompute, want_entropy, want_grad):
        # want_grad comes from the caller: inside forward grad mode is always off, and needs_input_grad
        # is True under torch.no_grad() too, which would compute an unused gradient factor.
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        grad_factor = torch.empty_like(hidden) if want_grad and not recompute else None  # (N, H)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            g = _chunk(hidden[s:e], weight, targets[s:e], inv_t, logp[s:e], ent[s:e] if want_entropy else None,
                       grad_factor is not None, impl)
            if g is not None:
                grad_factor[s:e] = g
        ctx.inv_t, ctx.chunk, ctx.impl, ctx.recompute = inv_t, chunk, impl, recompute
        if want_grad:
            ctx.save_for_backward(*((hidden, weight, targets) if recompute else (grad_factor,)))
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        saved = ctx.saved_tensors
        grad_logp = grad_logp.float()
        if ctx.recompute:
            hidden, weight, targets = saved
            grad_hidden = torch.empty_like(hidden)
            scratch = torch.empty(min(ctx.chunk, hidden.shape[0]), dtype=torch.float32, device=hidden.device)
        else:
            (grad_factor,) = saved
            grad_hidden = torch.empty_like(grad_factor)
        n = grad_hidden.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(s + ctx.chunk, n)
            if ctx.recompute:
                factor = _chunk(hidden[s:e], weight, targets[s:e], ctx.inv_t, scratch[: e - s], None, True, ctx.impl)
            else:
                factor = grad_factor[s:e]
            grad_hidden[s:e] = factor.float() * grad_logp[s:e, None]  # rows scaled by dLoss/dlogp
        return grad_hidden, None, None, None, None, None, None, None, None


def default_chunk_size(n: int, vocab: int, dtype: torch.dtype, impl: str) -> int:
    """Rows per chunk so that a chunk's temporaries stay near 512 MiB (at least 16 rows)."""
    elem = torch.finfo(dtype).bits // 8
    per_row = vocab * (elem if impl == "triton" else elem * 2 + 12)  # triton works in place
    rows = max(16, _CHUNK_BUDGET // per_row)
    rows = 1 << int(math.log2(rows))  # a power of two: friendly to the matmul
    return max(1, min(rows, n))


def token_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, *, return_entropy: bool = False, chunk_size: int | None = None,
                   impl: str = "auto", recompute: bool = False):
    """log p(targets | hidden) through a frozen LM head, chunked over rows; float32 (N,) [and entropy (N,)].

    hidden (N, H) and lm_head_weight (V, H) share a dtype; targets (N,) are ids in [0, V); the logits
    are divided by `temperature` before the softmax, as the sampler does. Gradients flow to `hidden`
    only. `impl`: auto (Triton on CUDA when installed, else torch), torch or triton.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(f"token_logprobs: hidden (N, H) and lm_head_weight (V, H) must share H; got "
                         f"{tuple(hidden.shape)} and {tuple(lm_head_weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.is_floating_point():
        raise ValueError(f"token_logprobs: targets must be integer ids of shape ({hidden.shape[0]},), got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"token_logprobs: hidden is {hidden.dtype} but lm_head_weight is {lm_head_weight.dtype}; "
                         "cast one to the other")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"token_logprobs: temperature {temperature} must be > 0 (greedy sampling has no "
                         "log-probs; score greedy samples at temperature 1.0)")
    if lm_head_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("token_logprobs: lm_head_weight requires grad, but the LM head is treated as frozen; "
                         "pass lm_head_weight.detach() or freeze it")
    if impl == "auto":
        impl = "triton" if hidden.is_cuda and have_triton() else "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"token_logprobs: impl {impl!r} must be auto, torch or triton")
    if impl == "triton" and not hidden.is_cuda:
        raise ValueError("token_logprobs: impl='triton' needs CUDA tensors; use impl='torch' on the CPU")
    n = hidden.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n, lm_head_weight.shape[0], hidden.dtype, impl)
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size {chunk_size} must be >= 1")
    targets = targets.to(torch.int64).contiguous()
    want_grad = hidden.requires_grad and torch.is_grad_enabled()
    logp, ent = _TokenLogprobs.apply(hidden, lm_head_weight.detach(), targets, 1.0 / temperature, max(1, chunk_size),
                                     impl, recompute, return_entropy, want_grad)
    return (logp, ent) if return_entropy else logp
