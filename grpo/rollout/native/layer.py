"""How a Llama decoder layer runs in the native engine: one new token per row, or whole prompts.

Every way calls the layer's own modules or reads their tensors (never a copy), applies the rotary
embedding at each row's own position and writes the token's K/V into the engine's cache:

- `ModuleLayer`: the layer's norms, projections and MLP are called; the whole layer is one compiled
  function that serves every layer (the layers' parameters are inputs of the compiled graph, not
  constants, which keeps compile time short);
- `StreamLayer`: the same modules in compiled pieces around the projections, the projections that read
  one input (q/k/v, then gate/up) each on its own CUDA stream, so in the captured graph their GEMMs
  (and LoRA chains) overlap;
- `KernelLayer`: the decode GEMM kernels of `grpo.kernels.decode_gemm` in place of the projections
  (q/k/v in one launch, o_proj and down_proj with the residual add fused, gate/up with the SiLU
  product fused, LoRA and FP8 inside), the norms one launch each (`rmsnorm.norm_rows`; else compiled
  pieces), so that each launch of a step goes dependently on the one before (`decode_gemm.Tuning.chain`).
  With the attention kernel both rotaries and the K/V write happen in the attention's launch (but for
  Qwen3, whose head norms come first: K's rotary and the K/V write in one kernel, q's rotary compiled);
- `PackedLayer`: KernelLayer with torch's GEMMs (cuBLAS) for the projections and the adapters packed for
  them (`packed.py`), for steps wider than the kernels take (`EngineTuning.kernel_rows`).

`build_layer` picks one per layer when the engine plans a generate; a step then calls
`layer(x, at, k_cache, v_cache)` for each. `prefill_layer` runs a layer over right-padded prompts, eagerly
(a graphed prefill replays it: `engine.py`). The model's shapes travel as one `ModelDims`; `StepFunctions`
holds the functions, compiled once.

Not here: the engine's buffers, graphs and loop (`engine.py`), which projections the kernels can take
(`plan.py`). The decoder families in `MODEL_TYPES` only (`causal_lm` says why a model is refused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from grpo.kernels import decode_gemm
from grpo.kernels.decode_attention import decode_attention, rope_store_attend
from grpo.kernels.decode_gemm import rope
from grpo.kernels.rmsnorm import norm_rows
from grpo.rollout.native.packed import LayerPack
from grpo.rollout.native.plan import DecodeNorm, LayerProjections, decode_norm


# The decoder families (config.model_type) whose layers this module reproduces, each checked against
# transformers' generate by tests/test_native_engine.py: Llama's layer, Mistral's (without a sliding window),
# Qwen2's (its q/k/v biases live in the projections) and Qwen3's (RMS norms over each head of q and k:
# `head_norms`). Other families differ in ways a step here would miss without a sound (Granite's multipliers,
# SmolLM3's layers without rotary, OLMo2's norms after each block), so they are refused, never run.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_OTHER_ENGINES = "sample with --engine hf (transformers' generate, slower) or --engine vllm"


def refusal(model: nn.Module) -> str | None:
    """Why NativeEngine cannot sample from `model` (bare or wrapped by peft), or None when it can."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = getattr(getattr(lm, "config", None), "model_type", None)
    if kind not in MODEL_TYPES:
        return (f"the model is {kind or type(lm).__name__!r}; NativeEngine reproduces the decoder layers of "
                f"{', '.join(MODEL_TYPES)} only: {_OTHER_ENGINES}")
    decoder = getattr(lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not hasattr(lm, "lm_head") or not all(hasattr(decoder, a) for a in needed):
        return (f"model is a {type(model).__name__}; NativeEngine needs a causal LM with model.embed_tokens/"
                f"layers/norm/rotary_emb and lm_head: {_OTHER_ENGINES}")
    head_dim = ModelDims.of(lm).head_dim
    for i, layer in enumerate(decoder.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"model layer {i} has no self_attn.q/k/v/o_proj: {_OTHER_ENGINES}"
        if getattr(attn, "sliding_window", None):
            return f"model layer {i} uses sliding-window attention, which NativeEngine does not do: {_OTHER_ENGINES}"
        norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None and getattr(n, "weight", torch.empty(0)).shape != (head_dim,) for n in norms):
            return f"model layer {i} normalizes q or k other than per head: {_OTHER_ENGINES}"
    return None


def causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM inside `model` (itself, or the one a peft PeftModel wraps); ValueError with `refusal`'s
    reason for a model NativeEngine cannot sample from."""
    reason = refusal(model)
    if reason is not None:
        raise ValueError(reason)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class ModelDims:
    """The shapes of a Llama-style decoder that the cache, the attention and the kernels need."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, lm: nn.Module) -> ModelDims:
        cfg = lm.config
        n_heads = cfg.num_attention_heads
        return cls(n_layers=len(lm.model.layers), hidden=cfg.hidden_size, n_heads=n_heads,
                   n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads, vocab_size=cfg.vocab_size)


class TokenRows(NamedTuple):
    """What every layer of one decode step shares: rotary cos/sin (B, 1, 1, D) at each row's position,
    the attention mask over the KV bucket (B, S), the positions (B,) the new K/V go to, and the rows still
    sampling (B,) bool (the others' outputs are never read: the attention kernel skips their caches). The
    compiled functions take its fields one by one: passed whole, the tuple made the compiled layer guard on
    the mask's length before its first graph break, and compile again at the next KV bucket."""

    cos: torch.Tensor
    sin: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    live: torch.Tensor


# --- the functions a step is made of (compiled once each by StepFunctions) -----------------------


def decode_prelude(embed: nn.Module, tok: torch.Tensor, pos: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, kv_range: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Embedding, rotary cos/sin at each row's position, and the attention mask over the KV bucket."""
    x = embed(tok[:, None])  # (B, 1, H)
    cos = cos_table[pos][:, None, None, :]  # (B, 1, 1, D)
    sin = sin_table[pos][:, None, None, :]
    valid = kv_range[None, :] <= pos[:, None]  # (B, S) True where attended; kv_range is arange(S)
    return x, cos, sin, valid


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor,
           dims: ModelDims, attention: str) -> torch.Tensor:
    """Grouped-query attention of one new token per row over its cache: q (B, nh, 1, D) -> (B, 1, nh*D).
    Row b attends to its positions up to pos[b]: `valid` (B, S) marks them for the masked ways.

    No K/V repeat: the g = nh / n_kv query heads of a kv head act as g queries of one (B, n_kv) problem.
    "sdpa" hands the problem, with the mask, to torch's scaled_dot_product_attention (one fused kernel on
    CUDA, float32 scores inside); "kernel" is `grpo.kernels.decode_attention` (Triton, float32 scores, each
    row read to its own length).

    Both keep the scores in float32: Qwen2.5-Coder-1.5B's reach ~12,700 in layer 0 (a GSM8K prompt), where
    bf16 keeps only multiples of 32, and rounded scores put the sampler's log-probs nats off the trainer's.
    """
    rows, n_kv, d = q.shape[0], dims.n_kv_heads, dims.head_dim
    if attention == "kernel":
        out = decode_attention(q.reshape(rows, dims.n_heads, d), k_cache, v_cache, pos + 1, d**-0.5)
        return out.view(rows, 1, dims.n_heads * d)
    qg = q.view(rows, n_kv, dims.n_heads // n_kv, d)  # (B, n_kv, g, D): head h reads kv head h // g
    out = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=valid[:, None, None, :],
                                         scale=d**-0.5)  # (B, n_kv, g, D)
    return out.reshape(rows, 1, dims.n_heads * d)


@torch.compiler.disable
def _store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """Write each row's new K/V (B, n_kv, 1, D) into its cache view at `pos`, in place.

    Kept out of torch.compile on purpose: inductor functionalizes an in-place scatter into a graph
    input that is a strided view, so the compiled layer wrote a full new copy of the cache view and
    copied it back, twice per layer per token. Eagerly it is one small scatter kernel per tensor, captured
    in the CUDA graph like the rest.
    """
    write_at = pos[:, None, None, None].expand(k.shape[0], k.shape[1], 1, k.shape[3])  # (B, n_kv, 1, D)
    k_cache.scatter_(2, write_at, k)
    v_cache.scatter_(2, write_at, v)


def head_norms(attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's RMS norms over each head of q and k (..., D), before the rotary embedding; Llama has none."""
    if getattr(attn, "q_norm", None) is None:
        return q, k
    return attn.q_norm(q), attn.k_norm(k)


def _write_kv(q, k, v, cos, sin, pos, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Rotary on q and k (B, heads, 1, D), then the new K/V into the cache at each row's position."""
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    _store_kv(k_cache, v_cache, pos, k, v)
    return q


def decode_layer(layer: nn.Module, x: torch.Tensor, cos, sin, valid, pos, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, dims: ModelDims, attention: str) -> torch.Tensor:
    """One decoder layer for one token per row through its modules: x (B, 1, H) -> (B, 1, H).
    cos, sin, valid, pos: a `TokenRows`' fields; k_cache, v_cache: (B, n_kv, S, D) views of the cache
    with S > max(pos)."""
    rows, d = x.shape[0], dims.head_dim
    attn = layer.self_attn
    h = layer.input_layernorm(x)  # (B, 1, H)
    q = attn.q_proj(h).view(rows, dims.n_heads, 1, d)  # (B, nh, 1, D)
    k = attn.k_proj(h).view(rows, dims.n_kv_heads, 1, d)  # (B, n_kv, 1, D)
    v = attn.v_proj(h).view(rows, dims.n_kv_heads, 1, d)
    q, k = head_norms(attn, q, k)
    q = _write_kv(q, k, v, cos, sin, pos, k_cache, v_cache)
    x = x + attn.o_proj(attend(q, k_cache, v_cache, valid, pos, dims, attention))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def decode_head(norm: nn.Module, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return lm_head(norm(x))[:, 0]  # (B, V) in the model's dtype, as the state keeps them


def piece_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


def piece_proj(proj: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return proj(h)


def piece_attention(layer: nn.Module, x, q, k, v, cos, sin, valid, pos, k_cache, v_cache, dims: ModelDims,
                    attention: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of a layer after its q/k/v projections: the new x and the MLP's input."""
    rows, d = x.shape[0], dims.head_dim
    q, k = head_norms(layer.self_attn, q.view(rows, dims.n_heads, 1, d), k.view(rows, dims.n_kv_heads, 1, d))
    q = _write_kv(q, k, v.view(rows, dims.n_kv_heads, 1, d), cos, sin, pos, k_cache, v_cache)
    x = x + layer.self_attn.o_proj(attend(q, k_cache, v_cache, valid, pos, dims, attention))
    return x, layer.post_attention_layernorm(x)


def piece_mlp_out(mlp: nn.Module, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return x + mlp.down_proj(mlp.act_fn(gate) * up)  # LlamaMLP.forward after its gate/up products


def piece_gate_product(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up; compiled, one kernel in float32 rounded once, as the decode kernels' gated launch
    (eagerly: two kernels, two roundings)."""
    return mlp.act_fn(gate) * up


def piece_attend(q: torch.Tensor, q_norm: nn.Module | None, cos, sin, valid, pos, k_cache, v_cache, dims: ModelDims,
                 attention: str) -> torch.Tensor:
    """q's head norm (Qwen3's; None: none) and rotary on q (B, nh*D), then attention over the cache (this
    token's K/V already written)."""
    rows = q.shape[0]
    q = q.view(rows, dims.n_heads, 1, dims.head_dim)
    q = rope(q if q_norm is None else q_norm(q), cos, sin)
    return attend(q, k_cache, v_cache, valid, pos, dims, attention).view(rows, dims.n_heads * dims.head_dim)


@dataclass(frozen=True)
class StepFunctions:
    """The functions a decode step and a prefill are made of, each compiled once (or not at all) for every
    layer."""

    prelude: Callable
    layer: Callable
    head: Callable
    norm: Callable
    proj: Callable
    attention: Callable
    mlp_out: Callable
    gate_product: Callable
    attend: Callable
    prefill: Callable

    @classmethod
    def build(cls, compile_mode: str | None) -> StepFunctions:
        """Plain functions, or the decode step's each `torch.compile`d with `compile_mode` (compiled on its
        first call). The prefill stays eager: compiled, each new prompt shape compiled again, slower than the
        graphed prefill it would save (benchmarks/RESULTS.md, "The measured defaults")."""
        step = (decode_prelude, decode_layer, decode_head, piece_norm, piece_proj, piece_attention, piece_mlp_out,
                piece_gate_product, piece_attend)
        if compile_mode is not None:
            step = tuple(torch.compile(fn, mode=compile_mode) for fn in step)
        return cls(*step, prefill_layer)


# --- one layer, four ways ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ModuleLayer:
    """A decoder layer through its own modules, the whole layer one compiled function."""

    layer: nn.Module
    fns: StepFunctions
    dims: ModelDims
    attention: str

    def __call__(self, x: torch.Tensor, at: TokenRows, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.fns.layer(self.layer, x, at.cos, at.sin, at.valid, at.pos, k_cache, v_cache, self.dims,
                              self.attention)


def _on_streams(fn: Callable, modules: list[nn.Module], h: torch.Tensor, streams: list) -> list[torch.Tensor]:
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


@dataclass(frozen=True, eq=False)
class StreamLayer(ModuleLayer):
    """A decoder layer through its modules, in pieces: q/k/v, then gate/up, on parallel streams."""

    streams: list  # three CUDA streams (None each on the CPU, where the pieces run in sequence)

    def __call__(self, x: torch.Tensor, at: TokenRows, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        fns, layer = self.fns, self.layer
        attn, mlp = layer.self_attn, layer.mlp
        h = fns.norm(layer.input_layernorm, x)
        q, k, v = _on_streams(fns.proj, [attn.q_proj, attn.k_proj, attn.v_proj], h, self.streams)
        x, h = fns.attention(layer, x, q, k, v, at.cos, at.sin, at.valid, at.pos, k_cache, v_cache, self.dims,
                             self.attention)
        gate, up = _on_streams(fns.proj, [mlp.gate_proj, mlp.up_proj], h, self.streams)
        return fns.mlp_out(mlp, x, gate, up)


@dataclass(frozen=True, eq=False)
class KernelLayer(ModuleLayer):
    """A decoder layer with the decode GEMM kernels reading its projections' tensors (`plan.py`), and its norms'
    (`norms`: input and post-attention, None each where the module is called)."""

    proj: LayerProjections
    norms: tuple[DecodeNorm | None, DecodeNorm | None] = (None, None)
    inputs: torch.dtype | None = None  # what the projections read (EngineTuning.fp8_activations); None: x's dtype

    def norm(self, which: int, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's norm `which` (0: input, 1: post-attention) of x (B, 1, H): (B, H), in `inputs`."""
        tensors = self.norms[which]
        if tensors is None:
            h = self.fns.norm(module, x).view(x.shape[0], self.dims.hidden)
            return h if self.inputs is None else h.to(self.inputs)
        return norm_rows(x.view(x.shape[0], self.dims.hidden), tensors.weight, tensors.eps, self.inputs)

    def __call__(self, x: torch.Tensor, at: TokenRows, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        fns, layer, dims = self.fns, self.layer, self.dims
        rows = x.shape[0]
        attn = layer.self_attn
        h = self.norm(0, layer.input_layernorm, x)
        q, k, v = self.qkv(h)
        q_norm = getattr(attn, "q_norm", None)
        cos, sin = at.cos.view(rows, dims.head_dim), at.sin.view(rows, dims.head_dim)
        if self.attention == "kernel" and q_norm is None:  # three launches in one: rotaries, K/V write, attention
            out = rope_store_attend(q, k, v, cos, sin, at.pos, k_cache, v_cache, dims.head_dim**-0.5, at.live,
                                    out_dtype=self.inputs)
            out = out.view(rows, dims.n_heads * dims.head_dim)
        else:
            if q_norm is not None:  # Qwen3: k's head norm before its rotary (q's in attend)
                k = fns.norm(attn.k_norm, k.view(rows, dims.n_kv_heads, dims.head_dim)).view(rows, -1)
            self.rope_store_kv(k, v, cos, sin, at.pos, k_cache, v_cache)
            out = fns.attend(q, q_norm, at.cos, at.sin, at.valid, at.pos, k_cache, v_cache, dims, self.attention)
        x = self.o(out, x.view(rows, dims.hidden)).view(rows, 1, dims.hidden)
        h = self.norm(1, layer.post_attention_layernorm, x)
        return self.down(self.gated(h), x.view(rows, dims.hidden)).view(rows, 1, dims.hidden)

    # the projections, on the decode kernels (PackedLayer: on torch's GEMMs)
    def qkv(self, h: torch.Tensor) -> list[torch.Tensor]:  # (q, k and v in the cache's dtype)
        return decode_gemm.project(h, [self.proj.q, self.proj.k, self.proj.v], out_dtype=self.layer_dtype)

    def o(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return decode_gemm.project(out.to(self.inputs or out.dtype), [self.proj.o], residual=residual,
                                   out_dtype=residual.dtype)[0]

    def gated(self, h: torch.Tensor) -> torch.Tensor:  # (in `inputs`: down's input)
        return decode_gemm.project_gated(h, self.proj.gate, self.proj.up)

    def down(self, m: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return decode_gemm.project(m, [self.proj.down], residual=residual, out_dtype=residual.dtype)[0]

    @property
    def layer_dtype(self) -> torch.dtype:
        return self.layer.input_layernorm.weight.dtype

    def rope_store_kv(self, *args) -> None:
        decode_gemm.rope_store_kv(*args)


@dataclass(frozen=True, eq=False)
class PackedLayer(KernelLayer):
    """KernelLayer with its projections as torch's GEMMs and the adapters packed (`packed.py`): the layer
    for steps wider than the kernels take (EngineTuning.kernel_rows)."""

    pack: LayerPack | None = None

    def qkv(self, h: torch.Tensor) -> list[torch.Tensor]:
        return self.pack.qkv(h)

    def o(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.pack.o(out, residual)[0]

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.pack.gate_up(h)
        return self.fns.gate_product(self.layer.mlp, gate, up)

    def down(self, m: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.pack.down(m, residual)[0]

    def rope_store_kv(self, k, *args) -> None:  # the kernel where Triton runs, its reference elsewhere
        (decode_gemm.rope_store_kv if decode_gemm.can_run(k.device) else decode_gemm.rope_store_kv_ref)(k, *args)


def build_layer(layer: nn.Module, proj: LayerProjections | None, fns: StepFunctions, dims: ModelDims,
                attention: str, streams: list | None, pack: LayerPack | None = None,
                fp8_activations: torch.dtype | None = None) -> ModuleLayer:
    """The one-token forward of `layer`: torch's GEMMs with `pack`'s adapters where it is given, else the
    kernels where `proj` is given (FP8 projections reading `fp8_activations`, None: the model's dtype), else its
    modules (on parallel streams when `streams` is given)."""
    norms = (decode_norm(layer.input_layernorm), decode_norm(layer.post_attention_layernorm))
    if pack is not None:
        return PackedLayer(layer, fns, dims, attention, proj, norms, pack=pack)
    if proj is not None:
        fp8 = proj.q.scale_inv is not None
        return KernelLayer(layer, fns, dims, attention, proj, norms, fp8_activations if fp8 else None)
    if streams:
        return StreamLayer(layer, fns, dims, attention, streams)
    return ModuleLayer(layer, fns, dims, attention)


def prefill_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  dims: ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer over right-padded prompts x (P, L, H), causal (padding stays out of real
    tokens); cos, sin (1, 1, L, D). Returns the new x and the layer's K, V (P, n_kv, L, D), K rotated."""
    P, L, _ = x.shape
    attn, d = layer.self_attn, dims.head_dim
    h = layer.input_layernorm(x)
    q, k = head_norms(attn, attn.q_proj(h).view(P, L, dims.n_heads, d), attn.k_proj(h).view(P, L, dims.n_kv_heads, d))
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (P, nh, L, D), (P, n_kv, L, D)
    v = attn.v_proj(h).view(P, L, dims.n_kv_heads, d).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5,
                                         enable_gqa=dims.n_kv_heads != dims.n_heads)  # (P, nh, L, D)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(P, L, dims.n_heads * d))
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v

