"""The decode step's sampler in three Triton launches, its Exp(1) draws made where they are used.

`grpo.rollout.sampling.sample_with_noise` races `exp(s - top) / E` over the vocabulary with E ~ Exp(1)
drawn beforehand into a (rows, V) float32 tensor: at 256 rows of Llama's 128,256 tokens, 131 MB written by
the draw and read back by the race every token step, on top of the logits. Here the race draws its own
uniforms, u = Philox4x32-10 at (seed, (step * rows + row) * V + token) (`tl.rand`), E = -log(u), and only in
the blocks of the vocabulary holding a token that min_p keeps: with the recipe's min_p 0.1, a few blocks a
row. What it computes is `sample_with_noise` with those draws (`race_sample_ref`): temperature, min_p, the
race, and the log-prob under softmax(logits / T); without top-k and top-p (`can_sample`).

1. `block_stats_kernel` (rows, blocks): each block's largest scaled logit and its sum of exponentials;
2. `race_kernel` (rows, blocks): each block's best key among the tokens min_p keeps, and its token;
3. `pick_kernel` (rows): the best block's token and the log-prob, from the blocks' sums.

`race_noise_ref` draws the same uniforms as `tl.rand` in numpy, so that the CPU tests (TRITON_INTERPRET=1)
compare tokens exactly with `sample_with_noise`; on a GPU `tl.exp` and `tl.log` are approximate, so a near
tie may go the other way. The draws are not torch's: an engine sampling here samples another stream than
with `sample_with_noise` for the same seed (`EngineTuning.sample_kernel`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BLOCK = 2048  # tokens a program reads: 63 blocks of Llama's vocabulary


def can_sample(temperature: float, top_k: int, top_p: float) -> bool:
    """The kernels take this sampling: temperature above 0, and neither top-k nor top-p (they need a sort)."""
    return temperature > 0 and top_k <= 0 and top_p >= 1.0


def _mulhi_lo(a: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The high and low 32 bits of the 64-bit product of uint32 constant `a` and uint32 array `b`."""
    product = np.uint64(a) * b.astype(np.uint64)
    return (product >> np.uint64(32)).astype(np.uint32), (product & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def philox_uniform_ref(seed: int, offsets: np.ndarray) -> np.ndarray:
    """`tl.rand(seed, offsets)` for int64 offsets, in numpy: Philox4x32-10 keyed by the seed's two halves, on the
    counter (offset low, offset high, 0, 0); its first word as int32, negatives folded (-x - 1), times 2^-31."""
    key = [np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)]
    offsets = offsets.astype(np.uint64)
    c = [(offsets & np.uint64(0xFFFFFFFF)).astype(np.uint32), (offsets >> np.uint64(32)).astype(np.uint32)]
    c += [np.zeros_like(c[0]), np.zeros_like(c[0])]
    with np.errstate(over="ignore"):
        for _ in range(10):
            hi_b, lo_b = _mulhi_lo(0xCD9E8D57, c[2])
            hi_a, lo_a = _mulhi_lo(0xD2511F53, c[0])
            c = [hi_b ^ c[1] ^ key[0], lo_b, hi_a ^ c[3] ^ key[1], lo_a]
            key = [key[0] + np.uint32(0x9E3779B9), key[1] + np.uint32(0xBB67AE85)]
    x = c[0].view(np.int32)
    x = np.where(x < 0, -x - 1, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def race_noise_ref(seed: int, step: int, rows: int, vocab: int) -> torch.Tensor:
    """The Exp(1) draws `race_sample` makes at `step` for `rows` rows of `vocab` tokens: -log(u), (rows, vocab)
    float32."""
    offsets = (step * rows + np.arange(rows, dtype=np.int64)[:, None]) * vocab + np.arange(vocab, dtype=np.int64)
    with np.errstate(divide="ignore"):  # u = 0: E = inf, that token's key 0
        return torch.from_numpy(-np.log(philox_uniform_ref(seed, offsets)))


def race_sample_ref(logits: torch.Tensor, temperature: float, min_p: float, seed: int,
                    step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`race_sample` in plain PyTorch: `sample_with_noise` with `race_noise_ref`'s draws."""
    from grpo.rollout.sampling import sample_with_noise

    noise = race_noise_ref(seed, step, *logits.shape).to(logits.device)
    return sample_with_noise(logits, temperature, 0, 1.0, min_p, noise)


def race_sample(logits: torch.Tensor, temperature: float, min_p: float, seed: torch.Tensor,
                step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` (B, V), rows contiguous, and its log-prob: `(token (B,) int64, logp (B,)
    float32)`. `seed` and `step` are one-element int64 tensors on the logits' device, read by the kernels (a
    CUDA graph replays the step with the values they hold then)."""
    from grpo.kernels import _race_sample_triton as kernels

    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"race_sample: logits of shape {tuple(logits.shape)} with stride {logits.stride()}: "
                         "pass (B, V) with contiguous rows")
    if temperature <= 0:
        raise ValueError(f"race_sample: temperature={temperature}; greedy sampling is an argmax")
    rows, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    blocks_pad = 1 << (blocks - 1).bit_length()
    stats = torch.empty((rows, blocks, 2), dtype=torch.float32, device=logits.device)
    keys = torch.empty((rows, blocks), dtype=torch.float32, device=logits.device)
    at = torch.empty((rows, blocks), dtype=torch.int32, device=logits.device)
    token = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    log_min_p = math.log(min_p) if min_p > 0 else float("-inf")
    kernels.block_stats_kernel[(rows, blocks)](logits, stats, logits.stride(0), vocab, temperature, NB=blocks,
                                               BLOCK=BLOCK)
    kernels.race_kernel[(rows, blocks)](logits, stats, keys, at, seed, step, logits.stride(0), vocab, rows,
                                        temperature, log_min_p, NB=blocks, NB_PAD=blocks_pad, BLOCK=BLOCK)
    kernels.pick_kernel[(rows,)](logits, stats, keys, at, token, logp, logits.stride(0), temperature, NB=blocks,
                                 NB_PAD=blocks_pad)
    return token, logp
