"""`NativeEngine`: an in-process sampler that runs on the policy model itself, gpt-fast style.

It decodes with the very modules the trainer trains: the embedding, each layer's norms, the q/k/v/o
and gate/up/down projections (whatever they are: nn.Linear, an FP8Linear subclass, a peft LoRA
wrapper with its adapters active), the final norm and the lm_head are *called*, never read, so there
is no second copy of any weight and the sampler always samples the current policy. What this module
writes by hand is the rest of a Llama decoder: rotary embeddings, its own static KV cache and the
attention over it, and the loop.

One `generate(prompt_ids, n, sampling)`:

1. allocates the KV cache once, `(max_batch, kv_heads, max_seq_len, head_dim)` per layer, and the
   per-row state (current token, position, alive/finished flags, output columns) beside it;
2. on CUDA, captures the one-token step in a CUDA graph per KV-length bucket (`kv_bucket` tokens;
   the attention reads only the bucket, not the whole cache). By default on CUDA the step is
   `torch.compile`d per layer (one compiled layer serves all layers: seconds of compile, not a
   minute). With at most 64 rows the projections run as the decode GEMM kernels of
   `grpo.kernels.decode_gemm` (q/k/v in one launch, LoRA and FP8 fused, the K/V write with K's
   rotary in one kernel), reading the modules' own tensors; otherwise the modules are called, and the
   projections that share an input run on parallel streams inside the graph;
3. prefills each of the P prompts once (right-padded, causal), writing its KV straight into its n rows;
4. replays the step: sample a token per row from the last logits (`grpo.rollout.sampling`, noise
   drawn outside the graph from a seeded generator), record token, sampler logp and mask, update
   the stop flags on the device, run the forward of that token into the next logits. The host looks
   at the flags only every `check_every` steps, to stop early once every row has finished.

Rows of one prompt have their own positions: prompts of different lengths need no left padding and
get the positions and numerics of an unpadded forward.

Standby: `release_memory()` drops the KV cache, the state and the graphs (whose addresses point into
that cache), so between generations training can reuse that memory; the next `generate` allocates
and captures again (0.1-0.5 s on the H200 for Llama-3.2-1B shapes, in `Rollout.timings['capture']`,
against seconds of generation). Keeping them instead saves the capture but pins `kv_cache_bytes()`
plus the graph pool through the training phase. Measured numbers: benchmarks/RESULTS.md.

What it deliberately is not: a server (no paging, no continuous batching, no prefix cache), and not
a general transformers runner: Llama-style decoders only (LlamaForCausalLM and the models that share
its module layout), with or without peft adapters.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grpo.kernels import decode_gemm
from grpo.kernels.decode_gemm import DecodeProj
from grpo.kernels.fp8 import FP8Linear
from grpo.model import LinearInInputDtype
from grpo.rollout.base import Rollout, Sampling
from grpo.rollout.sampling import sample_with_noise


def _causal_lm(model: nn.Module) -> nn.Module:
    """The LlamaForCausalLM inside `model` (itself, or the one a peft PeftModel wraps)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not hasattr(lm, "lm_head") or not all(hasattr(decoder, a) for a in needed):
        raise ValueError(f"model is a {type(model).__name__}; NativeEngine needs a Llama-style causal LM "
                         "(model.embed_tokens/layers/norm/rotary_emb and lm_head), bare or wrapped by peft")
    for i, layer in enumerate(decoder.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"model layer {i} has no self_attn.q/k/v/o_proj; NativeEngine supports Llama-style "
                             "decoder layers only")
        if getattr(attn, "sliding_window", None):
            raise ValueError(f"model layer {i} uses sliding-window attention, which NativeEngine does not do")
    return lm


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it (rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _decode_prelude(embed: nn.Module, tok: torch.Tensor, pos: torch.Tensor, cos_table: torch.Tensor,
                    sin_table: torch.Tensor, kv_len: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Embedding, rotary cos/sin at each row's position, and the attention mask over the KV bucket."""
    x = embed(tok[:, None])  # (B, 1, H)
    cos = cos_table[pos][:, None, None, :]  # (B, 1, 1, D)
    sin = sin_table[pos][:, None, None, :]
    valid = kv_len[None, :] <= pos[:, None]  # (B, S) True where attended; kv_len is arange(S)
    return x, cos, sin, valid


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, valid: torch.Tensor, n_kv: int,
            head_dim: int, attention: str) -> torch.Tensor:
    """Grouped-query attention of one new token per row over its cache: q (B, nh, 1, D) -> (B, 1, nh*D).

    No K/V repeat: the g = nh / n_kv query heads of a kv head act as g queries of one (B, n_kv) problem.
    "matmul" is two batched matmuls and a float32 softmax; "sdpa" hands the same problem, with the mask,
    to torch's scaled_dot_product_attention (one fused kernel on CUDA).
    """
    rows, n_heads = q.shape[0], q.shape[1]
    qg = q.view(rows, n_kv, n_heads // n_kv, head_dim)  # (B, n_kv, g, D): head h reads kv head h // g
    if attention == "sdpa":
        out = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=valid[:, None, None, :],
                                             scale=head_dim**-0.5)  # (B, n_kv, g, D)
    else:
        scores = torch.matmul(qg, k_cache.transpose(-1, -2)).float() * head_dim**-0.5  # (B, n_kv, g, S)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(-1).to(v_cache.dtype), v_cache)  # (B, n_kv, g, D)
    return out.reshape(rows, 1, n_heads * head_dim)


@torch.compiler.disable
def _store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """Write each row's new K/V (B, n_kv, 1, D) into its cache view at `pos`, in place.

    Kept out of torch.compile on purpose: inductor functionalizes an in-place scatter into a graph
    input that is a strided view, so the compiled layer wrote a full new copy of the cache view and
    copied it back, twice per layer per token (~0.4 ms of a 2.1 ms step on the H200). Eagerly it is
    one small scatter kernel per tensor, captured in the CUDA graph like the rest.
    """
    write_at = pos[:, None, None, None].expand(k.shape[0], k.shape[1], 1, k.shape[3])  # (B, n_kv, 1, D)
    k_cache.scatter_(2, write_at, k)
    v_cache.scatter_(2, write_at, v)


def _write_kv(q, k, v, cos, sin, pos, k_cache, v_cache):
    """Rotary on q and k, then the new K/V into the cache at each row's position."""
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    _store_kv(k_cache, v_cache, pos, k, v)
    return q


def _decode_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, valid: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                  head_dim: int, attention: str = "matmul") -> torch.Tensor:
    """One decoder layer for one token per row; writes the token's K/V into the cache at `pos`.

    x: (B, 1, H); k_cache, v_cache: (B, n_kv, S, D) views of the cache with S > max(pos).
    The projections, norms and MLP are the layer's own modules, called.
    """
    rows = x.shape[0]
    attn = layer.self_attn
    h = layer.input_layernorm(x)  # (B, 1, H)
    q = attn.q_proj(h).view(rows, n_heads, 1, head_dim)  # (B, nh, 1, D)
    k = attn.k_proj(h).view(rows, n_kv, 1, head_dim)  # (B, n_kv, 1, D)
    v = attn.v_proj(h).view(rows, n_kv, 1, head_dim)
    q = _write_kv(q, k, v, cos, sin, pos, k_cache, v_cache)
    x = x + attn.o_proj(_attend(q, k_cache, v_cache, valid, n_kv, head_dim, attention))
    return x + layer.mlp(layer.post_attention_layernorm(x))


# The same layer in pieces, for `streams=True`: the projections that read the same input (q/k/v, then
# gate/up) run on separate CUDA streams, so in the captured graph their GEMMs (and LoRA chains) overlap.
def _piece_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


def _piece_proj(proj: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return proj(h)


def _piece_attention(layer: nn.Module, x, q, k, v, cos, sin, valid, pos, k_cache, v_cache, n_heads: int,
                     n_kv: int, head_dim: int, attention: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    q = _write_kv(q.view(rows, n_heads, 1, head_dim), k.view(rows, n_kv, 1, head_dim),
                  v.view(rows, n_kv, 1, head_dim), cos, sin, pos, k_cache, v_cache)
    x = x + layer.self_attn.o_proj(_attend(q, k_cache, v_cache, valid, n_kv, head_dim, attention))
    return x, layer.post_attention_layernorm(x)


def _piece_mlp_out(mlp: nn.Module, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return x + mlp.down_proj(mlp.act_fn(gate) * up)  # LlamaMLP.forward after its gate/up products


def _on_streams(fn, modules: list[nn.Module], h: torch.Tensor, streams: list) -> list[torch.Tensor]:
    """fn(module, h) for each module, each on its own stream, joined back into the current stream."""
    if not h.is_cuda:
        return [fn(module, h) for module in modules]
    main = torch.cuda.current_stream()
    outs = []
    for module, stream in zip(modules, streams):
        stream.wait_stream(main)  # after h exists (and after every earlier use of this stream's memory)
        with torch.cuda.stream(stream):
            outs.append(fn(module, h))
    for stream in streams[: len(modules)]:
        main.wait_stream(stream)
    return outs


def _decode_layer_streams(layer: nn.Module, x, cos, sin, valid, pos, k_cache, v_cache, n_heads: int, n_kv: int,
                          head_dim: int, attention: str, fns: dict, streams: list) -> torch.Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    h = fns["norm"](layer.input_layernorm, x)
    q, k, v = _on_streams(fns["proj"], [attn.q_proj, attn.k_proj, attn.v_proj], h, streams)
    x, h = fns["attention"](layer, x, q, k, v, cos, sin, valid, pos, k_cache, v_cache, n_heads, n_kv, head_dim,
                            attention)
    gate, up = _on_streams(fns["proj"], [mlp.gate_proj, mlp.up_proj], h, streams)
    return fns["mlp_out"](mlp, x, gate, up)


# The same layer with the decode GEMM kernels (`grpo.kernels.decode_gemm`, M <= 64 rows): q/k/v in one
# launch, o_proj and down_proj with the residual add fused, gate/up with the SiLU product fused; LoRA
# and FP8 inside the kernels; K's rotary and the K/V write in one kernel. Norms, q's rotary and the
# attention stay compiled pieces.
@dataclass(frozen=True)
class _LayerPlan:
    q: DecodeProj
    k: DecodeProj
    v: DecodeProj
    o: DecodeProj
    gate: DecodeProj
    up: DecodeProj
    down: DecodeProj


# LoRA A/B layers whose forward is a plain x @ W^T: peft's nn.Linear, and the class `--lora-compute base`
# swaps in (the same product in the input's dtype; the kernels compute it in float32/TF32 either way).
_PLAIN_LORA_LINEARS = (nn.Linear, LinearInInputDtype)


def _decode_proj(module: nn.Module, dtype: torch.dtype) -> DecodeProj | None:
    """The tensors a decode kernel needs to act as `module`, or None when the kernels cannot (then the
    module is called). Handles nn.Linear, FP8Linear, and peft's LoRA Linear around either (one active
    plain adapter: no DoRA or other variants, not merged, no bias)."""
    lora_a = lora_b = None
    scale = 1.0
    base = module
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a peft LoRA layer
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            return None
        active = [a for a in getattr(module, "active_adapters", ()) if a in module.lora_A]
        if len(active) > 1:
            return None
        if active:
            name = active[0]
            if (getattr(module, "use_dora", {}).get(name) or name in getattr(module, "lora_variant", {})
                    or getattr(module, "lora_bias", {}).get(name)):
                return None
            if not all(type(m[name]) in _PLAIN_LORA_LINEARS for m in (module.lora_A, module.lora_B)):
                return None  # adapter layers with their own forward
            lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name].weight
            scale = float(module.scaling[name])
            if not (lora_a.is_contiguous() and lora_b.is_contiguous()):
                return None
        base = module.base_layer
    if type(base) not in (nn.Linear, FP8Linear) or base.bias is not None:
        return None  # a subclass may override forward: call it instead
    weight = base.weight
    scale_inv = getattr(base, "weight_scale_inv", None)
    if scale_inv is None and weight.dtype != dtype:
        return None
    if scale_inv is not None and (weight.dtype != torch.float8_e4m3fn or not decode_gemm.can_run_fp8(weight.device)):
        return None
    if not weight.is_contiguous():
        return None
    return DecodeProj(weight, scale_inv, lora_a, lora_b, scale)


def _layer_plan(layer: nn.Module, dtype: torch.dtype) -> _LayerPlan | None:
    attn, mlp = layer.self_attn, layer.mlp
    act = getattr(mlp, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):  # transformers' own SiLU
        return None
    mods = dict(q=attn.q_proj, k=attn.k_proj, v=attn.v_proj, o=attn.o_proj, gate=getattr(mlp, "gate_proj", None),
                up=getattr(mlp, "up_proj", None), down=getattr(mlp, "down_proj", None))
    projs = {name: None if m is None else _decode_proj(m, dtype) for name, m in mods.items()}
    if any(p is None for p in projs.values()):
        return None
    groups = ([projs["q"], projs["k"], projs["v"]], [projs["gate"], projs["up"]])
    for group in groups:  # one launch per group: one LoRA rank and one weight format
        if len({p.rank for p in group}) != 1 or len({p.scale_inv is None for p in group}) != 1:
            return None
    return _LayerPlan(**projs)


def _piece_attend(q, cos, sin, valid, k_cache, v_cache, n_heads: int, n_kv: int, head_dim: int,
                  attention: str) -> torch.Tensor:
    """Rotary on q, then attention over the cache (this token's K/V already written)."""
    rows = q.shape[0]
    q = _rope(q.view(rows, n_heads, 1, head_dim), cos, sin)
    return _attend(q, k_cache, v_cache, valid, n_kv, head_dim, attention).view(rows, n_heads * head_dim)


def _decode_layer_kernels(layer: nn.Module, plan: _LayerPlan, x, cos, sin, valid, pos, k_cache, v_cache,
                          n_heads: int, n_kv: int, head_dim: int, attention: str, fns: dict) -> torch.Tensor:
    rows, hidden = x.shape[0], x.shape[-1]
    h = fns["norm"](layer.input_layernorm, x).view(rows, hidden)
    q, k, v = decode_gemm.project(h, [plan.q, plan.k, plan.v])
    decode_gemm.rope_store_kv(k, v, cos.view(rows, head_dim), sin.view(rows, head_dim), pos, k_cache, v_cache)
    out = fns["attend"](q, cos, sin, valid, k_cache, v_cache, n_heads, n_kv, head_dim, attention)
    x = decode_gemm.project(out, [plan.o], residual=x.view(rows, hidden))[0].view(rows, 1, hidden)
    h = fns["norm"](layer.post_attention_layernorm, x).view(rows, hidden)
    m = decode_gemm.project_gated(h, plan.gate, plan.up)
    return decode_gemm.project(m, [plan.down], residual=x.view(rows, hidden))[0].view(rows, 1, hidden)


def _decode_head(norm: nn.Module, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lm_head(norm(x))[:, 0].float()  # (B, V)


def _decode_forward(lm: nn.Module, tok: torch.Tensor, pos: torch.Tensor, k_caches: list[torch.Tensor],
                    v_caches: list[torch.Tensor], cos_table: torch.Tensor, sin_table: torch.Tensor,
                    kv_range: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, fns: dict,
                    attention: str = "matmul", streams: list | None = None,
                    plans: list[_LayerPlan | None] | None = None) -> torch.Tensor:
    """One token per row through the decoder; returns logits (B, V) float32. What a CUDA graph captures.

    tok, pos: (B,); k_caches[l], v_caches[l]: (B, n_kv, S, D) cache views; kv_range: arange(S).
    `fns` holds the parts, compiled or not: one compiled layer serves every layer (the layers'
    parameters are inputs of the compiled graph, not constants), which keeps compile time short.
    `plans[i]`, where given, runs layer i with the decode GEMM kernels instead of its modules.
    """
    decoder = lm.model
    x, cos, sin, valid = fns["prelude"](decoder.embed_tokens, tok, pos, cos_table, sin_table, kv_range)
    for i, layer in enumerate(decoder.layers):
        if plans is not None and plans[i] is not None:
            x = _decode_layer_kernels(layer, plans[i], x, cos, sin, valid, pos, k_caches[i], v_caches[i], n_heads,
                                      n_kv, head_dim, attention, fns)
        elif streams:
            x = _decode_layer_streams(layer, x, cos, sin, valid, pos, k_caches[i], v_caches[i], n_heads, n_kv,
                                      head_dim, attention, fns, streams)
        else:
            x = fns["layer"](layer, x, cos, sin, valid, pos, k_caches[i], v_caches[i], n_heads, n_kv, head_dim,
                             attention)
    return fns["head"](decoder.norm, lm.lm_head, x)


@dataclass
class _State:
    """Static buffers of one engine, allocated once for `max_batch` rows (graphs use views [:B])."""

    k_caches: list[torch.Tensor]  # per layer (max_batch, n_kv, max_seq_len, D)
    v_caches: list[torch.Tensor]
    cos: torch.Tensor  # (max_seq_len, D) model dtype
    sin: torch.Tensor
    kv_range: torch.Tensor  # (max_seq_len,) arange: key positions
    logits: torch.Tensor  # (max_batch, V) float32: next-token logits of every row
    noise: torch.Tensor  # (max_batch, V) float32: Exp(1) draws for the next sample
    tok: torch.Tensor  # (max_batch,) long: the token the next forward consumes
    pos: torch.Tensor  # (max_batch,) long: its position
    step: torch.Tensor  # (1,) long: output column of the next sample
    alive: torch.Tensor  # (max_batch,) bool: the row has not stopped yet
    finished: torch.Tensor  # (max_batch,) bool: stopped by a stop token or sequence
    out_ids: torch.Tensor  # (max_batch, max_seq_len) long
    out_logp: torch.Tensor  # (max_batch, max_seq_len) float32
    out_mask: torch.Tensor  # (max_batch, max_seq_len) bool
    tails: dict[int, torch.Tensor]  # window length -> (max_batch, W) long: last W sampled tokens
    consts: dict[tuple, torch.Tensor]  # stop ids and sequences as device tensors (graphs keep pointers)

    def tensors(self) -> list[torch.Tensor]:
        out = [*self.k_caches, *self.v_caches, self.cos, self.sin, self.kv_range, self.logits, self.noise, self.tok, self.pos,
               self.step, self.alive, self.finished, self.out_ids, self.out_logp, self.out_mask]
        return out + list(self.tails.values()) + list(self.consts.values())


class NativeEngine:
    """Samples from `model` in-process, sharing its weights. See the module docstring.

    model: a LlamaForCausalLM, or a peft PeftModel around one (adapters active). Its train/eval mode
        is left as found; generation runs in eval mode under no_grad.
    max_seq_len: prompt plus completion tokens per row at most (the KV cache's length).
    max_batch: rows (prompts times n) per generate at most (the KV cache's batch).
    pad_id: fills completion_ids after a row stops.
    use_cuda_graph: capture the one-token step in CUDA graphs; None is "on CUDA".
    compile: a torch.compile mode for the step ("default", "max-autotune-no-cudagraphs"), None for
        eager kernels, or "auto": "default" on CUDA, None elsewhere. The first generate compiles.
    kv_bucket: attention reads the cache in multiples of this many positions.
    check_every: steps between host checks of "have all rows stopped".
    attention: "matmul" (two batched matmuls, float32 softmax) or "sdpa" (torch's fused attention).
    streams: run q/k/v and gate/up projections on parallel CUDA streams, so their GEMMs overlap in the
        graph; the layer then runs as compiled pieces around the projections (on CPU: in sequence).
        None is "on CUDA, when every layer's MLP is a Llama MLP".
    gemm: how a step with at most 64 rows (decode_gemm.MAX_ROWS) runs the projections. "kernels": the decode GEMM kernels
        (`grpo.kernels.decode_gemm`: q/k/v in one launch, LoRA, FP8 and the residual or SiLU product
        fused), for every layer whose projections they support (the others call their modules);
        "modules": call each projection module; "auto": kernels on CUDA when triton is installed.
        Steps with more rows always call the modules.
    """

    def __init__(self, model: nn.Module, *, max_seq_len: int, max_batch: int, pad_id: int,
                 use_cuda_graph: bool | None = None, compile: str | None = "auto", kv_bucket: int = 256,
                 check_every: int = 16, attention: str = "matmul", streams: bool | None = None,
                 gemm: str = "auto") -> None:
        self.model = model
        self.lm = _causal_lm(model)
        cfg = self.lm.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.n_layers = len(self.lm.model.layers)
        self.vocab_size = cfg.vocab_size
        embed_weight = self.lm.model.embed_tokens.weight  # only for its device and dtype
        self.device = embed_weight.device
        self.dtype = embed_weight.dtype
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len}: needs room for a prompt token and a completion token")
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: use 1 or more")
        if kv_bucket < 1 or check_every < 1:
            raise ValueError(f"kv_bucket={kv_bucket}, check_every={check_every}: both must be >= 1")
        if not 0 <= pad_id < self.vocab_size:
            raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {self.vocab_size}); finished rows feed "
                             "it to the model, so pick an id the embedding has (e.g. the tokenizer's pad id)")
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True but the model is on {self.device}; CUDA graphs need a CUDA "
                             "model (pass use_cuda_graph=None or False)")
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.pad_id = pad_id
        self.use_cuda_graph = use_cuda_graph
        self.kv_bucket = kv_bucket
        self.check_every = check_every
        if attention not in ("matmul", "sdpa"):
            raise ValueError(f"attention={attention!r}: use 'matmul' or 'sdpa'")
        llama_mlp = all(hasattr(layer.mlp, a) for layer in self.lm.model.layers
                        for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        if streams is None:
            streams = self.device.type == "cuda" and llama_mlp
        if streams and not llama_mlp:
            raise ValueError("streams=True needs Llama MLPs (gate/up/down_proj and act_fn) in every layer; pass "
                             "streams=False")
        if compile == "auto":
            compile = "default" if self.device.type == "cuda" else None
        self.compile_mode = compile
        self.attention = attention
        self._streams = None
        if streams:  # on CPU the pieces run one after another (what the CPU tests check)
            self._streams = [torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
                             for _ in range(3)]
        if gemm not in ("auto", "kernels", "modules"):
            raise ValueError(f"gemm={gemm!r}: use 'auto', 'kernels' or 'modules'")
        if gemm == "auto":
            gemm = "kernels" if self.device.type == "cuda" and decode_gemm.have_triton() else "modules"
        if gemm == "kernels" and not decode_gemm.can_run(self.device):
            raise ValueError(f"gemm='kernels' needs triton and a CUDA model (or TRITON_INTERPRET=1 on CPU); "
                             f"the model is on {self.device}: pass gemm='modules'")
        self.gemm = gemm
        self._fns = {"prelude": _decode_prelude, "layer": _decode_layer, "head": _decode_head, "norm": _piece_norm,
                     "attention": _piece_attention, "mlp_out": _piece_mlp_out,
                     "proj": _piece_proj, "attend": _piece_attend}
        self._sample = sample_with_noise
        if compile is not None:
            self._fns = {name: torch.compile(fn, mode=compile) for name, fn in self._fns.items()}
            self._sample = torch.compile(sample_with_noise, mode=compile)
        self._state: _State | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        self._fingerprint: tuple | None = None
        self._plans: list[_LayerPlan | None] | None = None  # per layer, rebuilt by each generate
        self._warned_fallback = False

    # ----------------------------------------------------------------------------------------------
    # memory
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this engine allocates (whether allocated now or not)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.max_batch * self.n_kv * self.max_seq_len * self.head_dim * elem

    def held_bytes(self) -> int:
        """Bytes of tensors the engine holds right now (0 after `release_memory`); graph pools not counted."""
        if self._state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._state.tensors())

    def release_memory(self) -> None:
        """Drop the KV cache, the state buffers and the CUDA graphs; `generate` rebuilds them."""
        self._graphs.clear()
        self._graph_pool = None
        self._state = None
        self._fingerprint = None

    def _allocate(self) -> _State:
        dev, dt, B, S = self.device, self.dtype, self.max_batch, self.max_seq_len
        cache_shape = (B, self.n_kv, S, self.head_dim)
        positions = torch.arange(S, device=dev)[None, :]  # (1, S)
        probe = torch.empty(1, 1, self.head_dim, device=dev, dtype=dt)
        cos, sin = self.lm.model.rotary_emb(probe, position_ids=positions)  # (1, S, D) each, model dtype
        return _State(
            k_caches=[torch.zeros(cache_shape, device=dev, dtype=dt) for _ in range(self.n_layers)],
            v_caches=[torch.zeros(cache_shape, device=dev, dtype=dt) for _ in range(self.n_layers)],
            cos=cos[0].contiguous(), sin=sin[0].contiguous(), kv_range=positions[0],
            logits=torch.zeros(B, self.vocab_size, device=dev), noise=torch.ones(B, self.vocab_size, device=dev),
            tok=torch.full((B,), self.pad_id, device=dev, dtype=torch.long),
            pos=torch.zeros(B, device=dev, dtype=torch.long), step=torch.zeros(1, device=dev, dtype=torch.long),
            alive=torch.ones(B, device=dev, dtype=torch.bool), finished=torch.zeros(B, device=dev, dtype=torch.bool),
            out_ids=torch.full((B, S), self.pad_id, device=dev, dtype=torch.long),
            out_logp=torch.zeros(B, S, device=dev), out_mask=torch.zeros(B, S, device=dev, dtype=torch.bool),
            tails={}, consts={},
        )

    def _model_fingerprint(self) -> tuple:
        """What a captured graph depends on: parameter addresses and the adapters' switches and scales."""
        ptrs = tuple(p.data_ptr() for p in self.model.parameters())
        switches = tuple(  # peft tuner layers carry a bool `disable_adapters` (HF models a method of that name)
            (id(m), m.disable_adapters, bool(getattr(m, "merged", False)), tuple(getattr(m, "active_adapters", ())),
             tuple(sorted(getattr(m, "scaling", {}).items())))
            for m in self.model.modules() if isinstance(getattr(m, "disable_adapters", None), bool)
        )
        return ptrs, switches

    # ----------------------------------------------------------------------------------------------
    # one step
    def _step(self, rows: int, kv_len: int, sampling: Sampling, stop_key: tuple) -> None:
        """Sample from state.logits, record, update stop flags, forward the new token: all on device."""
        st = self._state
        token, logp = self._sample(st.logits[:rows], sampling.temperature, sampling.top_k, sampling.top_p,
                                   sampling.min_p, st.noise[:rows] if sampling.temperature > 0 else None)
        alive = st.alive[:rows]
        token = torch.where(alive, token, self.pad_id)  # (B,)
        logp = torch.where(alive, logp, 0.0)
        column = st.step.expand(rows)[:, None]  # (B, 1)
        st.out_ids[:rows].scatter_(1, column, token[:, None])
        st.out_logp[:rows].scatter_(1, column, logp[:, None])
        st.out_mask[:rows].scatter_(1, column, alive[:, None])
        stop_ids, stop_seqs, window = stop_key
        if stop_ids or stop_seqs:
            stop = torch.zeros_like(alive)
            if stop_ids:
                stop = stop | (token[:, None] == st.consts[("ids", stop_ids)][None, :]).any(-1)
            if stop_seqs:
                tail = st.tails[window][:rows]  # (B, W) the last W tokens, oldest first, -1 before the start
                tail.copy_(torch.cat([tail[:, 1:], token[:, None]], dim=1))
                for length in sorted({len(seq) for seq in stop_seqs}):  # one compare per length, not per sequence
                    want = st.consts[("seqs", stop_seqs, length)]  # (S, length)
                    stop = stop | (tail[:, None, window - length:] == want[None]).all(-1).any(-1)
            stop = stop & alive
            st.finished[:rows] |= stop
            st.alive[:rows] &= ~stop
        st.tok[:rows].copy_(token)
        k_views = [c[:rows, :, :kv_len] for c in st.k_caches]
        v_views = [c[:rows, :, :kv_len] for c in st.v_caches]
        kv_range = st.kv_range[:kv_len]
        if self.compile_mode is not None:  # one compiled step for every KV bucket, not one per bucket
            for view in (*k_views, *v_views):
                torch._dynamo.maybe_mark_dynamic(view, 2)
            torch._dynamo.maybe_mark_dynamic(kv_range, 0)
        logits = _decode_forward(self.lm, st.tok[:rows], st.pos[:rows], k_views, v_views, st.cos, st.sin,
                                 kv_range, self.n_heads, self.n_kv, self.head_dim, self._fns, self.attention,
                                 self._streams, self._plans)
        st.logits[:rows].copy_(logits)
        st.pos[:rows] += 1
        st.step += 1

    def _graph_for(self, rows: int, kv_len: int, sampling: Sampling, stop_key: tuple) -> torch.cuda.CUDAGraph:
        key = (rows, kv_len, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, stop_key)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        # warm up on a side stream (cuBLAS handles, compilation), then capture; both write garbage into
        # the state, which generate resets before the prefill. Positions start at 0 so the warm-up
        # writes stay inside the cache.
        st = self._state
        st.pos[:rows] = 0
        st.step.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(rows, kv_len, sampling, stop_key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._step(rows, kv_len, sampling, stop_key)
        self._graphs[key] = graph
        return graph

    # ----------------------------------------------------------------------------------------------
    # prefill
    def _prefill(self, prompt_ids: list[list[int]], n: int) -> None:
        """Run every prompt once; write its K/V into its n rows and its last logits into state.logits."""
        st, lm = self._state, self.lm
        decoder = lm.model
        P, L = len(prompt_ids), max(len(p) for p in prompt_ids)
        rows = P * n
        ids = torch.full((P, L), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)  # (P, L) right-padded: causal attention keeps padding out of real tokens
        lengths = torch.tensor([len(p) for p in prompt_ids], device=self.device)  # (P,)
        x = decoder.embed_tokens(ids)  # (P, L, H)
        cos, sin = st.cos[:L][None, None], st.sin[:L][None, None]  # (1, 1, L, D)
        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(P, L, self.n_heads, self.head_dim).transpose(1, 2)  # (P, nh, L, D)
            k = attn.k_proj(h).view(P, L, self.n_kv, self.head_dim).transpose(1, 2)  # (P, n_kv, L, D)
            v = attn.v_proj(h).view(P, L, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            st.k_caches[i][:rows, :, :L] = k.repeat_interleave(n, dim=0)  # each prompt's KV into its n rows
            st.v_caches[i][:rows, :, :L] = v.repeat_interleave(n, dim=0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5,
                                                 enable_gqa=self.n_kv != self.n_heads)  # (P, nh, L, D)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(P, L, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(P, device=self.device), lengths - 1]  # (P, H) each prompt's last token
        logits = lm.lm_head(decoder.norm(last[:, None]))[:, 0].float()  # (P, V)
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"lm_head gives {logits.shape[-1]} logits but config.vocab_size is {self.vocab_size}")
        st.logits[:rows] = logits.repeat_interleave(n, dim=0)
        st.pos[:rows] = lengths.repeat_interleave(n)

    # ----------------------------------------------------------------------------------------------
    def _check(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> None:
        if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; pass a list of prompts, each a non-empty list of token ids")
        if n < 1:
            raise ValueError(f"n={n}: completions per prompt must be at least 1")
        if len(prompt_ids) * n > self.max_batch:
            raise ValueError(f"{len(prompt_ids)} prompts x n={n} = {len(prompt_ids) * n} rows exceed "
                             f"max_batch={self.max_batch}; build the engine with a larger max_batch")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt_ids[{i}] has a token id outside [0, {self.vocab_size})")
            if len(p) + sampling.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt_ids[{i}] has {len(p)} tokens; with max_new_tokens="
                                 f"{sampling.max_new_tokens} that exceeds max_seq_len={self.max_seq_len}")
        for s in sampling.stop_sequences:
            if len(s) == 0:
                raise ValueError("Sampling.stop_sequences holds an empty sequence; remove it")

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        """P prompts times n completions, sampled from the model as it is now. See `Rollout`."""
        self._check(prompt_ids, n, sampling)
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad():
                return self._generate(prompt_ids, n, sampling)
        finally:
            for m, mode in modes:
                m.training = mode

    def _generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda *a: None)
        t0 = time.perf_counter()
        if self._state is None:
            self._state = self._allocate()
        st = self._state
        rows, max_new = len(prompt_ids) * n, sampling.max_new_tokens
        max_prompt = max(len(p) for p in prompt_ids)
        stop_ids = () if sampling.ignore_eos else tuple(sorted(set(sampling.stop_token_ids)))
        stop_seqs = () if sampling.ignore_eos else tuple(tuple(s) for s in sampling.stop_sequences)
        window = max((len(s) for s in stop_seqs), default=0)
        stop_key = (stop_ids, stop_seqs, window)
        if stop_ids and ("ids", stop_ids) not in st.consts:
            st.consts[("ids", stop_ids)] = torch.tensor(stop_ids, device=self.device, dtype=torch.long)
        for length in {len(seq) for seq in stop_seqs}:
            if ("seqs", stop_seqs, length) not in st.consts:
                st.consts[("seqs", stop_seqs, length)] = torch.tensor(
                    [seq for seq in stop_seqs if len(seq) == length], device=self.device, dtype=torch.long)
        if window and window not in st.tails:
            st.tails[window] = torch.full((self.max_batch, window), -1, device=self.device, dtype=torch.long)

        def bucket(i: int) -> int:  # KV length that step i (0-based) needs: it writes at max_prompt + i
            need = max_prompt + i + 1
            return min(-(-need // self.kv_bucket) * self.kv_bucket, self.max_seq_len)

        self._plans = None
        if self.gemm == "kernels" and rows <= decode_gemm.MAX_ROWS:
            plans = [_layer_plan(layer, self.dtype) for layer in self.lm.model.layers]
            covered = sum(plan is not None for plan in plans)
            if covered < len(plans) and not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn(f"NativeEngine: the decode GEMM kernels cover {covered} of {len(plans)} layers; "
                              "the others call their modules (slower). The kernels need nn.Linear or FP8Linear "
                              "projections without bias, LoRA with one rank on q/k/v and one on gate/up (or none), "
                              "no DoRA, and weights in the activations' dtype", stacklevel=3)
            self._plans = plans
        elif self.gemm == "kernels":  # past the row limit every layer calls its modules: there they were measured faster
            self._plans = [None] * len(self.lm.model.layers)
        graphs = {}
        if self.use_cuda_graph:
            fingerprint = self._model_fingerprint()
            if fingerprint != self._fingerprint:  # parameters moved or adapters switched: recapture
                self._graphs.clear()
                self._fingerprint = fingerprint
            for kv_len in sorted({bucket(i) for i in range(max_new)}):
                graphs[kv_len] = self._graph_for(rows, kv_len, sampling, stop_key)
        sync()
        t1 = time.perf_counter()

        # reset the state the warm-up and capture wrote, then prefill
        st.step.zero_()
        st.alive[:rows] = True
        st.finished[:rows] = False
        st.out_ids[:rows] = self.pad_id
        st.out_logp[:rows] = 0.0
        st.out_mask[:rows] = False
        if window:
            st.tails[window][:rows] = -1
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self._prefill(prompt_ids, n)
        sync()
        t2 = time.perf_counter()

        steps = 0
        for i in range(max_new):
            if sampling.temperature > 0:
                st.noise[:rows].exponential_(generator=generator)
            kv_len = bucket(i)
            if self.use_cuda_graph:
                graphs[kv_len].replay()
            else:
                self._step(rows, kv_len, sampling, stop_key)
            steps += 1
            if stop_key != ((), (), 0) and steps % self.check_every == 0 and not bool(st.alive[:rows].any()):
                break
        sync()
        t3 = time.perf_counter()

        used = st.out_mask[:rows, :steps]  # (B, steps)
        width = int(used.any(0).nonzero().max().item()) + 1 if bool(used.any()) else 1
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=st.out_ids[:rows, :width].clone(),
            mask=st.out_mask[:rows, :width].clone(),
            sampler_logp=st.out_logp[:rows, :width].clone(),
            finished=st.finished[:rows].clone(),
            n=n,
            timings={"capture": t1 - t0, "prefill": t2 - t1, "decode": t3 - t2, "decode_steps": float(steps)},
        )
