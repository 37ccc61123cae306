"""Decode attention: one new token per row over its own KV cache, in chunks of the sequence (split-KV).

A decode step's attention reads each row's cache once: K and V, (rows, kv heads, positions, head_dim).
torch's fused attention takes the engine's mask over the whole KV bucket, so it reads every row to the
bucket's end; this kernel reads each row only to its own length, and splits the positions into chunks,
one program each, so that a few rows still fill the GPU (flash-decoding). The g = heads / kv heads query
heads of a kv head share its program, so K and V are read once for all of them (grouped-query attention).

Scores and the softmax's running max and sum are float32 (bf16 scores put single tokens 13 nats off on
Qwen2.5: `grpo.rollout.native.layer.attend`); the probabilities meet V rounded to V's dtype, as the
reference does. Chunks are combined in a second launch, in chunk order (deterministic).

`decode_attention_ref` is the plain-PyTorch definition the tests compare with (under TRITON_INTERPRET=1
on the CPU). `decode_attention` is a torch custom op, so that a `torch.compile`d step calls it as one
opaque op and a CUDA graph captures its launches. `rope_store_attend` also takes over what comes before it
in a decode layer, the rotary embeddings of q and K and the K/V write (`rope_store_attend_ref`).
"""

from __future__ import annotations

import torch

from grpo.kernels._triton import have_triton
from grpo.kernels.decode_gemm import can_run as gemm_can_run
from grpo.kernels.decode_gemm import chained
from grpo.kernels.decode_gemm import rope, rope_store_kv_ref
from grpo.kernels.tiles import AttentionTiles, device_table


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q (B, nh, D), caches (B, n_kv, S, D), lengths (B,): row b attends to its positions [0, lengths[b]).
    float32 scores and softmax, probabilities rounded to V's dtype; (B, nh, D) in q's dtype."""
    rows, heads, dim = q.shape
    n_kv, seq = k_cache.shape[1], k_cache.shape[2]
    qg = q.view(rows, n_kv, heads // n_kv, dim).float()
    scores = torch.matmul(qg, k_cache.float().transpose(-1, -2)) * scale  # (B, n_kv, g, S)
    inside = torch.arange(seq, device=q.device)[None, :] < lengths[:, None]  # (B, S)
    scores = scores.masked_fill(~inside[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(v_cache.dtype)
    return torch.matmul(probs.float(), v_cache.float()).view(rows, heads, dim).to(q.dtype)


def chunking(rows: int, n_kv: int, seq: int, block_s: int, programs: int) -> tuple[int, int]:
    """(positions a chunk, chunks a row): chunks of whole loop steps, as many as bring rows x kv heads x
    chunks to about `programs` (`launch_programs`), at least one."""
    wanted = max(1, -(-programs // (rows * n_kv)))
    steps = -(-seq // block_s)
    chunk = -(-steps // min(wanted, steps)) * block_s
    return chunk, -(-seq // chunk)


def launch_programs(device: torch.device, tiles: AttentionTiles) -> int:
    """The programs a chunk launch on `device` aims for: `tiles.programs_per_sm` on each of the device's SMs."""
    return tiles.programs_per_sm * device_table(device).sm_count


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors, or None."""
    rows, heads, dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[0] != rows:
        return "the K and V caches need one shape and layout, a row per q row"
    if dim & (dim - 1) or dim < 16 or k_cache.shape[3] != dim or k_cache.stride(3) != 1:
        return f"head_dim {dim}: the kernel takes a power of 2 from 16, contiguous in the caches"
    if heads % k_cache.shape[1]:
        return f"{heads} query heads are not a multiple of the {k_cache.shape[1]} kv heads"
    return None


@torch.library.custom_op("grpo::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`decode_attention_ref` in Triton: a launch over (rows, kv heads, chunks), and one to combine the
    chunks where there are several. The caches may be views (strided in row, head and position)."""
    problem = check_shapes(q, k_cache, v_cache)
    if problem is not None:
        raise ValueError(f"decode_attention: {problem}")
    q = q.contiguous()  # (a compiled caller may hand over another layout)
    out = q.new_empty(q.shape)
    _launch(q, k_cache, v_cache, lengths, scale, out)
    return out


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float,
            out: torch.Tensor, new_kv: tuple[torch.Tensor, ...] | None = None,
            tiles: AttentionTiles | None = None, live: torch.Tensor | None = None) -> None:
    """The chunk launch and, where there are several chunks, the combine; `new_kv` = (k, v, cos, sin): the
    token's K/V to rotate and write, and q to rotate (`rope_store_attend`), `lengths` then the positions; `live`
    (with new_kv): the rows that read their caches (`rope_store_attend`).
    `tiles`: the probe's sweep; else the device's table (`grpo.kernels.tiles`)."""
    from grpo.kernels import _decode_attention_triton as kernels  # triton: imported on first use

    rows, heads, dim = q.shape
    n_kv, seq = k_cache.shape[1], k_cache.shape[2]
    group = heads // n_kv
    g_pad = max(16, 1 << (group - 1).bit_length())  # tl.dot's smallest M
    tiles = tiles or device_table(q.device).attention
    chunk, splits = chunking(rows, n_kv, seq, tiles.block_s, launch_programs(q.device, tiles))
    if splits > 1:
        acc = torch.empty((rows * n_kv * splits, g_pad, dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((rows * n_kv * splits, 2, g_pad), dtype=torch.float32, device=q.device)
    else:
        acc = stats = out
    k_new, v_new, cos, sin = new_kv if new_kv is not None else (q, q, q, q)  # unread without ROPE
    chain = chained(q.device)
    kernels.attend_chunk_kernel[(rows, n_kv, splits)](
        q, k_cache, v_cache, lengths, out, acc, stats, q.stride(0), out.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), scale, k_new, v_new, k_new.stride(0), cos, sin,
        lengths if live is None else live, G=group, G_PAD=g_pad, D=dim, BLOCK_S=tiles.block_s, CHUNK=chunk,
        SPLITS=splits, EXACT=q.dtype == torch.float32, ROPE=new_kv is not None, LIVE=live is not None,
        CHAIN=chain, launch_pdl=chain, num_warps=tiles.num_warps, num_stages=tiles.stages)
    if splits > 1:
        kernels.attend_combine_kernel[(rows, n_kv)](out, acc, stats, out.stride(0), G=group, G_PAD=g_pad, D=dim,
                                                    SPLITS=splits, CHAIN=chain, launch_pdl=chain, num_warps=4)


def rope_store_attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                          live: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention from its projections' outputs: K rotated and K/V written at each row's position
    (`decode_gemm.rope_store_kv_ref`), q rotated (float32, rounded once), then `decode_attention_ref` up to and
    including that position. q (B, nh * D), k and v (B, n_kv * D), cos and sin (B, D); returns (B, nh, D).
    `live` (B,) bool: a row where it is False attends to its own token alone, so its output is its token's V."""
    rows, dim = q.shape[0], cos.shape[-1]
    rope_store_kv_ref(k, v, cos, sin, pos, k_cache, v_cache)
    q_rot = rope(q.float().view(rows, -1, dim), cos.float()[:, None], sin.float()[:, None]).to(q.dtype)
    out = decode_attention_ref(q_rot, k_cache, v_cache, pos + 1, scale)
    if live is None:
        return out
    n_kv = k_cache.shape[1]
    own_v = v.view(rows, n_kv, 1, dim).expand(rows, n_kv, out.shape[1] // n_kv, dim).reshape(out.shape)
    return torch.where(live[:, None, None], out, own_v.to(out.dtype))


def rope_store_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                      live: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`rope_store_attend_ref` in the attention's own launches: the rotary embeddings of q and K and the K/V
    write, two launches a layer before (a compiled rotary for q, `decode_gemm.rope_store_kv`), happen inside the
    chunk kernel (the native engine's kernel layer, where it attends with this kernel). Called eagerly (it
    writes the caches: in a compiled graph inductor would copy the cache views whole), captured in the engine's
    CUDA graph like the rest. `live` (B,) bool, the engine's rows still sampling: a stopped row's output is never
    read, so it reads none of its cache (a step of the qwen1.5b-gsm8k preset spends much of its attention on
    rows that have stopped: benchmarks/RESULTS.md, "The measured defaults"). `out_dtype`: the output's (default
    q's), fp16 for an FP8 projection that reads it (`EngineTuning.fp8_activations`)."""
    rows, dim = q.shape[0], cos.shape[-1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # rows may be strided: column
    if k.stride(0) != v.stride(0):  # slices of one q/k/v product (packed.PackedGroup's stacked GEMM)
        k, v = k.contiguous(), v.contiguous()
    q3 = q.view(rows, -1, dim)
    problem = check_shapes(q3, k_cache, v_cache)
    kv_shape, rot_shape = (rows, k_cache.shape[1] * dim), (rows, dim)
    if problem is None and (k.shape != kv_shape or v.shape != kv_shape or cos.shape != rot_shape
                            or sin.shape != rot_shape or pos.shape != (rows,)):
        problem = (f"k and v need {kv_shape}, cos and sin {rot_shape}, pos ({rows},); got {tuple(k.shape)}, "
                   f"{tuple(v.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}, {tuple(pos.shape)}")
    if problem is None and live is not None and (live.shape != (rows,) or live.dtype != torch.bool):
        problem = f"live needs ({rows},) bools; got {tuple(live.shape)} {live.dtype}"
    if problem is not None:
        raise ValueError(f"rope_store_attend: {problem}")
    out = q3.new_empty(q3.shape, dtype=out_dtype or q3.dtype)
    new_kv = (k, v, cos.contiguous(), sin.contiguous())  # k, v: each row's heads one after another
    _launch(q3, k_cache, v_cache, pos, scale, out, new_kv, live=live)  # the kernel adds 1: no launch for pos + 1
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, lengths, scale):
    return q.new_empty(q.shape)  # contiguous, as the kernel's


def can_run(device: torch.device) -> bool:
    """Triton runs on `device`: CUDA (Ampere or newer), or the CPU under TRITON_INTERPRET=1 (tests)."""
    return have_triton() and gemm_can_run(device)
