"""Token filters and sampling shared by the engines, with the semantics of vLLM's SamplingParams.

The order of operations is vLLM v1's sampler (`vllm/v1/sample/sampler.py`):

1. greedy (`temperature == 0`): argmax of the raw logits; no filter runs (none of them can remove
   the most likely token, so they could not change the result);
2. temperature: `logits / temperature`, in float32;
3. min_p (an argmax-invariant logits processor in vLLM): drop tokens whose probability is below
   `min_p` times the most likely token's, on the temperature-scaled distribution;
4. top-k and top-p together (`apply_top_k_top_p`): one sort; top-k keeps every token whose logit is
   at least the k-th largest (ties at the boundary are kept), then top-p keeps, on the distribution
   renormalized over what survived, the smallest prefix of the descending order whose mass reaches
   `top_p` (at least one token);
5. sample by the exponential race: `argmax(probs / E)` with `E ~ Exp(1)` per token picks token i with
   probability `probs[i]`, and needs no host sync (torch.multinomial does).

`logp` of the sampled token is `log_softmax(logits / temperature)` before any filter (step 2), the
quantity the trainer recomputes; for greedy it is taken at temperature 1.

Every function works on a batch `(B, V)` of logits, returns new tensors (never edits its input) and
runs inside a CUDA graph: no `.item()`, no data-dependent shapes. This module deliberately holds no
model code and no stop-string logic (that is the engine's).
"""

from __future__ import annotations

import math

import torch

from grpo.rollout.base import Sampling

_NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature` in float32. (B, V) -> (B, V)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 here; temperature 0 is greedy, use argmax")
    return logits.float() / temperature


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask tokens with `p < min_p * p_max` to -inf. (B, V) -> (B, V).

    Done in logit space: `p_i < min_p * p_max` is `logit_i < logit_max + log(min_p)` (the softmax
    denominators cancel), which saves a softmax over the vocabulary.
    """
    if min_p <= 0.0:
        return logits
    threshold = logits.amax(-1, keepdim=True) + math.log(min_p)  # (B, 1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep tokens whose logit is at least the k-th largest (ties kept). (B, V) -> (B, V)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`. (B, V) -> (B, V)."""
    return apply_top_k_top_p(logits, 0, top_p)


@torch.compiler.disable
def _cumulative_probs(sorted_logits: torch.Tensor) -> torch.Tensor:
    """softmax then cumsum along the vocabulary, eagerly: inductor (torch 2.11) fails to generate code
    for its split scan over a 128k vocabulary ("Error in codegen ... SplitScan")."""
    return sorted_logits.softmax(-1).cumsum(-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's joint top-k/top-p: one ascending sort, top-k, then top-p on the renormalized rest."""
    vocab = logits.shape[-1]
    use_k = 0 < top_k < vocab
    use_p = top_p < 1.0
    if not use_p:
        return apply_top_k(logits, top_k) if use_k else logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # (B, V) ascending
    if use_k:
        kth = sorted_logits[..., vocab - top_k : vocab - top_k + 1]  # (B, 1) the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    cum = _cumulative_probs(sorted_logits)  # (B, V) mass of this token and every smaller one
    drop_sorted = cum <= 1.0 - top_p
    drop_sorted[..., -1] = False  # the most likely token always stays
    if use_k:
        drop_sorted = drop_sorted | (sorted_logits == _NEG_INF)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, _NEG_INF)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> torch.Tensor:
    """Temperature, then min_p, then top-k/top-p: the float32 logits the sampler draws from."""
    scaled = apply_temperature(logits, temperature)
    scaled = apply_min_p(scaled, min_p)
    return apply_top_k_top_p(scaled, top_k, top_p)


def sample_with_noise(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                      noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from `logits` (B, V), given `noise` (B, V) drawn from Exp(1).

    Returns `(token (B,) long, logp (B,) float32)`, logp under softmax(logits / T) before filters.
    `noise` is unused (may be None) when `temperature == 0`. Graph-safe: the randomness comes in as a
    tensor, so the caller fills it from its own generator outside any captured region.

    Without top-k or top-p (no sort) the race runs on `exp(logit - row max)`, the probabilities times a
    constant of the row, so no normalising sum is needed, and every reduction over the vocabulary goes
    through `row_chunks`: a decode step has few rows, and one program a row left most of the GPU idle.
    """
    if temperature == 0:
        logits32 = logits.float()
        token = argmax_rows(logits32)  # (B,)
        logp = logits32.gather(-1, token[:, None])[:, 0] - logsumexp_rows(logits32)
        return token, logp
    if noise is None:
        raise ValueError("noise is None with temperature > 0: pass Exp(1) noise of the logits' shape")
    scaled = apply_temperature(logits, temperature)  # (B, V)
    top = _row_max(scaled)  # (B, 1)
    shifted = torch.exp(scaled - top)  # (B, V): the probabilities times a constant of each row
    if top_k <= 0 and top_p >= 1.0:
        weights = shifted
        if min_p > 0.0:  # apply_min_p's rule, its row max already at hand
            weights = shifted.masked_fill(scaled < top + math.log(min_p), 0.0)
    else:
        weights = apply_top_k_top_p(apply_min_p(scaled, min_p), top_k, top_p).softmax(-1)  # (B, V)
    # clamp: an Exp(1) draw of exactly 0 would make 0/0 = NaN on a dropped token, which argmax picks
    token = argmax_rows(weights / noise.clamp_min(1e-20))  # (B,)
    logp = scaled.gather(-1, token[:, None])[:, 0] - _log_sum(shifted, top)
    return token, logp


def row_chunks(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, C, V / C), a view: C the most chunks, up to 256, of at least 256 entries that divide V
    (Llama 3's 128,256: 256 of 501; a prime V: one). Reducing each chunk first gives a reduction of B rows
    B x C programs on a GPU."""
    rows, vocab = x.shape
    chunks = next(c for c in range(min(256, max(vocab // 256, 1)), 0, -1) if vocab % c == 0)
    return x.view(rows, chunks, vocab // chunks)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over (B, V), the first index on ties as torch.argmax: each chunk's first maximum,
    then the first chunk holding the row's. (B,) long."""
    chunks = row_chunks(x)
    best, at = chunks.max(-1)  # (B, C)
    chunk = best.argmax(-1, keepdim=True)  # (B, 1)
    return (chunk * chunks.shape[-1] + at.gather(-1, chunk))[:, 0]


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) of each row of finite (B, V), summed chunk by chunk. (B,)."""
    top = _row_max(x)
    return _log_sum(torch.exp(x - top), top)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's maximum over (B, V), chunk by chunk. (B, 1)."""
    return row_chunks(x).amax(-1).amax(-1, keepdim=True)


def _log_sum(shifted: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) of each row from shifted = exp(x - top) (B, V) and top (B, 1). (B,)."""
    return (top + torch.log(row_chunks(shifted).sum(-1).sum(-1, keepdim=True)))[:, 0]


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Exp(1) draws of `shape` (float32) for `sample_with_noise`."""
    if generator is not None and device is None:
        device = generator.device
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)


def sample_next(logits: torch.Tensor, sampling: Sampling,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` (B, V) as `sampling` says: `(token (B,), logp (B,))`."""
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected (B, V)")
    noise = None
    if sampling.temperature > 0:
        noise = exponential_noise(tuple(logits.shape), generator, logits.device)
    return sample_with_noise(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                             noise)
