"""`NativeEngine`: an in-process sampler that runs on the policy model itself, gpt-fast style.

It decodes with the very modules the trainer trains: the embedding, each layer's norms, the q/k/v/o
and gate/up/down projections (whatever they are: nn.Linear, an FP8Linear subclass, a peft LoRA
wrapper with its adapters active), the final norm and the lm_head are *called*, or their tensors read
by the decode kernels, never copied, so the sampler always samples the current policy (with the adapters
folded in, `EngineTuning.fold_adapter`, that policy's weights rounded once: the trainer weights its tokens
for the difference). What the package writes by hand is the rest of a Llama decoder (`layer.py`: rotary
embeddings, the attention over its own static KV cache) and the loop here.

One `generate(prompt_ids, num_generations, sampling)`:

1. allocates the KV cache once, `(max_batch, kv_heads, max_seq_len, head_dim)` per layer, and the
   per-row state beside it (`state.py`);
2. plans the step: each layer's one-token forward, the decode GEMM kernels where they can stand in for
   its projections (`plan.py`, at most `EngineTuning.kernel_rows` rows); past those rows torch's GEMMs with
   the adapters packed (`packed.py`); its modules otherwise;
3. on CUDA, captures the one-token step in a CUDA graph per KV-length bucket (`kv_bucket` tokens; the
   attention reads only the bucket, not the whole cache), the step `torch.compile`d per layer;
4. prefills each of the P prompts once (right-padded, causal; a shape met before replays a CUDA graph, up to
   `PREFILL_GRAPH_TOKENS`), writing its KV straight into its n rows;
5. replays the step: sample a token per row from the last logits (`grpo.rollout.sampling`, noise
   drawn outside the graph from a seeded generator), record token, sampler logp and mask, update
   the stop flags on the device, run the forward of that token into the next logits. The host looks
   at the flags only every `check_every` steps, to stop early once every row has finished. With
   `EngineTuning.fold_adapter` the prefill and the decode read the adapters folded into the base weights
   (`fold.py`), taken out exactly when the decode ends.

Episodes of several turns (`turns(prompt_ids, num_generations, sampling)`, `turns.py`): the same prefill, then
the decode in blocks of `turn_block` steps from graphs of the episodes' step (`_episode_step`: a stopped row keeps
its position; a row fed the tokens of its reply, queued on the device by `_force`, takes them one a step in place
of the sampled ones) while the other rows decode on.

Rows of one prompt have their own positions: prompts of different lengths need no left padding and
get the positions and numerics of an unpadded forward.

Standby: `release_memory()` drops the KV cache, the state and the graphs (whose addresses point into
that cache), so between generations training can reuse that memory; the next `generate` allocates
and captures again (`Rollout.timings['capture']`). Keeping them instead saves the capture but pins
`standby_bytes()` plus the graph pool through the training phase (benchmarks/RESULTS.md, "The measured
defaults").

What it deliberately is not: a server (no paging, no continuous batching, no prefix cache), and not
a general transformers runner: Llama-style decoders only, with or without peft adapters.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from grpo.kernels import decode_gemm
from grpo.model.load import adapters_off
from grpo.rollout.base import GenerationProgress, Rollout, Sampling, pad_rows
from grpo.rollout.native import fold
from grpo.rollout.native.packed import packs_for
from grpo.rollout.native.layer import ModelDims, PackedLayer, StepFunctions, TokenRows, build_layer, causal_lm
from grpo.rollout.native.plan import layer_projections
from grpo.rollout.native.state import DecodeState, StopRule
from grpo.rollout.native.tuning import EngineTuning
from grpo.rollout.native.turns import NativeTurns
from grpo.rollout.sampling import sample_with_noise

# A prefill of up to this many prompt tokens (prompts x width) replays a CUDA graph from the second time its
# shape is met: host time saved against the graph pool's memory, which keeps the largest graphed prefill's
# working memory (benchmarks/RESULTS.md, "The measured defaults").
PREFILL_GRAPH_TOKENS = 4096
# EngineTuning.fp8_activations="auto" gives FP8 projections fp16 in steps of up to this many rows: where their W x^T
# tiles were swept and the step timed (the table's 16-row entries serve launches of up to 32); wider steps keep
# the model's dtype and the table's 64-row tiles (benchmarks/RESULTS.md, "The measured defaults").
FP16_ACTIVATIONS_ROWS = 32


def feed_replies(token: torch.Tensor, logp: torch.Tensor, alive: torch.Tensor, at: torch.Tensor, end: torch.Tensor,
                 queue: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, ...]:
    """An episodes' step's token of each row (B,): the next of its reply's tokens (`queue` (B, Q), read at `at`
    up to `end`) where it has some left, the sampled `token` where it samples, pad_id where it has stopped.
    Returns (token, logp: 0 but where sampled, sampled, forcing: the rows fed a reply's token)."""
    forcing = alive & (at < end)
    sampled = alive & ~forcing
    queued = queue.gather(1, at.clamp(max=queue.shape[1] - 1)[:, None])[:, 0]
    token = torch.where(forcing, queued, torch.where(sampled, token, pad_id))
    return token, torch.where(sampled, logp, 0.0), sampled, forcing


class NativeEngine:
    """Samples from `model` in-process, sharing its weights. See the module docstring.

    model: a LlamaForCausalLM, or a peft PeftModel around one (adapters active). Its train/eval mode
        is left as found; generation runs in eval mode under no_grad.
    max_seq_len: prompt plus completion tokens per row at most (the KV cache's length).
    max_batch: rows (prompts times n) per generate at most (the KV cache's batch).
    pad_id: fills completion_ids after a row stops.
    gemm: how a step of at most 64 rows (decode_gemm.MAX_ROWS) runs the projections. "kernels": the
        decode GEMM kernels (`grpo.kernels.decode_gemm`: q/k/v in one launch, LoRA, FP8 and the residual
        or SiLU product fused), for every layer whose projections they support (the others call their
        modules); "modules": call each projection module; "auto": kernels on CUDA when triton is
        installed. Under "kernels", steps with more rows run torch's GEMMs on the projections' tensors with
        the adapters packed (`packed.py`).
    tuning: how a step runs (graphs, compile, attention, streams, ...); benchmarks and tests set it.
    """

    @property
    def needs_importance_correction(self) -> bool:
        """Whether the trainer weights tokens by pi_trainer/pi_sampler: not where the sampler's log-probs come
        from the trainer's own modules, but where the last generate folded the adapters into the weights
        (EngineTuning.fold_adapter, where it decodes on its kernels), whose rounding drops the adapter's changes
        smaller than half a weight's last bit: early in training much of its change (`fold.py`)."""
        return self._fold

    def __init__(self, model: nn.Module, *, max_seq_len: int, max_batch: int, pad_id: int, gemm: str = "auto",
                 tuning: EngineTuning = EngineTuning()) -> None:
        self.model = model
        self.lm = causal_lm(model)
        self.dims = ModelDims.of(self.lm)
        embed_weight = self.lm.model.embed_tokens.weight  # only for its device and dtype
        self.device, self.dtype = embed_weight.device, embed_weight.dtype
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len}: needs room for a prompt token and a completion token")
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: use 1 or more")
        if not 0 <= pad_id < self.dims.vocab_size:
            raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {self.dims.vocab_size}); finished rows "
                             "feed it to the model, so pick an id the embedding has (e.g. the tokenizer's pad id)")
        self.max_seq_len, self.max_batch, self.pad_id = max_seq_len, max_batch, pad_id
        self.progress: GenerationProgress | None = None  # told rows x steps done; the trainer sets it
        llama_mlp = all(hasattr(layer.mlp, a) for layer in self.lm.model.layers
                        for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        self.tuning = tuning.resolved(self.device, llama_mlp, max_batch)
        if gemm not in ("auto", "kernels", "modules"):
            raise ValueError(f"gemm={gemm!r}: use 'auto', 'kernels' or 'modules'")
        if gemm == "auto":
            gemm = "kernels" if self.device.type == "cuda" and decode_gemm.have_triton() else "modules"
        if gemm == "kernels" and not decode_gemm.can_run(self.device):
            raise ValueError(f"gemm='kernels' needs triton and a CUDA model (or TRITON_INTERPRET=1 on CPU); "
                             f"the model is on {self.device}: pass gemm='modules'")
        self.gemm = gemm
        self._streams = None
        if self.tuning.streams:  # on CPU the pieces run one after another (what the CPU tests check)
            cuda = self.device.type == "cuda"
            self._streams = [torch.cuda.Stream(self.device) if cuda else None for _ in range(3)]
        mode = self.tuning.compile
        self._fns = StepFunctions.build(mode)
        self._sample = sample_with_noise if mode is None else torch.compile(sample_with_noise, mode=mode)
        self._feed = feed_replies if mode is None else torch.compile(feed_replies, mode=mode)  # one kernel, not 8
        self._state: DecodeState | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # prefill graphs by (prompts, n, width, folded), with the ids and lengths buffers each reads; a shape is
        # captured the second time it is met, so one met once (and every shape under release_memory) runs eager
        self._prefill_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._prefill_seen: set[tuple] = set()
        self._graph_pool = None
        # captures warm up and capture on one stream of the engine's own: cuBLAS keeps a workspace for each
        # stream it has run on and torch's pool has 32 streams, so a new warm-up stream per capture held one
        # workspace more after each generate under release_memory
        self._capture_stream: torch.cuda.Stream | None = None
        self._fingerprint: tuple | None = None
        self._projections: list = []  # per layer, the kernels' view or None; planned by each generate
        self._fold = False  # whether this generate folds the adapters in (EngineTuning.fold_adapter)
        self._layers: list = []  # per layer, its one-token forward; planned by each generate
        self._packs: list = []  # per layer, the adapters laid out for torch's GEMMs (packed.py), kept
        self._warned_fallback = False

    # ----------------------------------------------------------------------------------------------
    # memory
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this engine allocates (whether allocated now or not)."""
        d = self.dims
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * d.n_layers * self.max_batch * d.n_kv_heads * self.max_seq_len * d.head_dim * elem

    def standby_bytes(self) -> int | None:
        """Bytes kept between steps when `release_memory()` is not called: the KV cache."""
        return self.kv_cache_bytes()

    def held_bytes(self) -> int:
        """Bytes of tensors the engine holds right now (0 after `release_memory`); graph pools not counted."""
        if self._state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._state.tensors())

    def release_memory(self) -> None:
        """Drop the KV cache, the state buffers and the CUDA graphs; `generate` rebuilds them."""
        self._clear_graphs()
        self._graph_pool = None
        self._state = None
        self._fingerprint = None
        self._packs = []  # (the graphs that read them are gone)

    def _clear_graphs(self) -> None:
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._prefill_seen.clear()

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
    # plan and step
    def _plan(self, rows: int) -> None:
        """Each layer's one-token forward for steps of `rows` rows: the decode kernels where they can
        stand in for all its projections (past their rows, torch's GEMMs on the dense ones), its modules
        elsewhere."""
        layers = self.lm.model.layers
        projections = [None] * len(layers)
        on_kernels = self.gemm == "kernels" and rows <= self.tuning.kernel_rows
        packed = self.gemm == "kernels" and not on_kernels
        if packed:  # torch's GEMMs take dense weights only: FP8 layers call their modules
            projections = [p if p is not None and not p.has_fp8 else None
                           for p in (layer_projections(layer, self.dtype) for layer in layers)]
        elif on_kernels:
            projections = [layer_projections(layer, self.dtype) for layer in layers]
            covered = sum(p is not None for p in projections)
            if covered < len(layers) and not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn(f"NativeEngine: the decode GEMM kernels cover {covered} of {len(layers)} layers; "
                              "the others call their modules (slower). The kernels need nn.Linear or FP8Linear "
                              "projections (biases on all or none of q/k/v, and of gate/up), LoRA with one rank on "
                              "q/k/v and one on gate/up (or none), no DoRA, and weights in the activations' dtype",
                              stacklevel=4)
        self._projections = projections
        self._fold = self.tuning.fold_adapter and fold.can_fold(projections)
        read = [fold.without_adapters(p) for p in projections] if self._fold else projections
        packs = [None] * len(layers)
        if packed:  # kept between generates of other widths: the graphs captured on them read them in place
            self._packs = packs = packs_for(read, self.dtype, self._packs)
        activations = self.tuning.fp8_activations
        fp16 = activations == "fp16" or (activations == "auto" and self.dtype == torch.bfloat16
                                         and rows <= FP16_ACTIVATIONS_ROWS)
        inputs = torch.float16 if fp16 else None  # what FP8 projections read (EngineTuning.fp8_activations)
        self._layers = [build_layer(layer, proj, self._fns, self.dims, self.tuning.attention, self._streams, pack,
                                    inputs) for layer, proj, pack in zip(layers, read, packs)]

    def _forward(self, rows: int, kv_len: int, pos: torch.Tensor | None = None) -> None:
        """The tokens in state.tok through the decoder at positions `pos` (B,) (None: state.pos), reading the
        first kv_len cache positions, their logits into state.logits (B, V)."""
        st, decoder = self._state, self.lm.model
        pos, kv_range = st.pos[:rows] if pos is None else pos, st.kv_range[:kv_len]
        k_views = [c[:rows, :, :kv_len] for c in st.k_caches]
        v_views = [c[:rows, :, :kv_len] for c in st.v_caches]
        if self.tuning.compile is not None:  # one compiled step for every KV bucket, not one per bucket
            for view in (*k_views, *v_views):
                torch._dynamo.maybe_mark_dynamic(view, 2)
            torch._dynamo.maybe_mark_dynamic(kv_range, 0)
        x, cos, sin, valid = self._fns.prelude(decoder.embed_tokens, st.tok[:rows], pos, st.cos, st.sin, kv_range)
        at = TokenRows(cos, sin, valid, pos, st.alive[:rows])
        for layer, k_cache, v_cache in zip(self._layers, k_views, v_views):
            x = layer(x, at, k_cache, v_cache)
        head, logits = self.lm.lm_head, st.logits[:rows]
        if type(head) is nn.Linear and head.bias is None:  # the GEMM writes the state's logits: no copy of them
            torch.mm(self._fns.norm(decoder.norm, x).view(rows, -1), head.weight.t(), out=logits)
        else:
            logits.copy_(self._fns.head(decoder.norm, head, x))

    def _step(self, rows: int, kv_len: int, sampling: Sampling, stop: StopRule, turns: bool = False) -> None:
        """Sample from state.logits, record, update stop flags, forward the new token: all on device
        (`turns`: the episodes' step, `_episode_step`)."""
        if turns:
            return self._episode_step(rows, kv_len, sampling, stop)
        st = self._state
        token, logp = self._sample(st.logits[:rows], sampling.temperature, sampling.top_k, sampling.top_p,
                                   sampling.min_p, st.noise_rows(rows) if sampling.temperature > 0 else None)
        alive = st.alive[:rows]
        token = torch.where(alive, token, self.pad_id)  # (B,)
        logp = torch.where(alive, logp, 0.0)
        st.record(rows, token, logp)
        stop.apply(st, rows, token)
        st.tok[:rows].copy_(token)
        self._forward(rows, kv_len)
        st.pos[:rows] += 1
        st.step += 1

    def _episode_step(self, rows: int, kv_len: int, sampling: Sampling, stop: StopRule) -> None:
        """The step of episodes (`turns.py`), all on device. A row with a reply queued (state.forced) takes its
        next token instead of the sampled one: not counted (mask False, logp 0), never a stop, its K/V written as
        any step's, its stop window emptied (a stop sequence lies within a turn); once the queue is spent the row
        samples again, from the reply's last logits. A row that stops keeps its position, so that its reply
        continues right after its last token, and a row stops at its budget (state.end_pos) too; a stopped row's
        forward writes at its own position (overwritten when it goes on), or at its last for a row without room."""
        st = self._state
        token, logp = self._sample(st.logits[:rows], sampling.temperature, sampling.top_k, sampling.top_p,
                                   sampling.min_p, st.noise_rows(rows) if sampling.temperature > 0 else None)
        alive, at = st.alive[:rows], st.forced_at[:rows]
        token, logp, sampled, forcing = self._feed(token, logp, alive, at, st.forced_end[:rows], st.forced[:rows],
                                                   self.pad_id)
        st.record(rows, token, logp, sampled)
        moved = alive.clone()  # the rows this token belongs to, before the stops below
        stop.apply(st, rows, token, sampled)
        for tail in st.tails.values():
            tail[:rows].masked_fill_(forcing[:, None], -1)
        at += forcing
        pos, end = st.pos[:rows], st.end_pos[:rows]
        alive &= pos + 1 < end  # the row's last token of its budget
        st.tok[:rows].copy_(token)
        self._forward(rows, kv_len, torch.minimum(pos, end - 1))
        pos += moved
        st.step += 1

    def _graph_for(self, rows: int, kv_len: int, sampling: Sampling, stop: StopRule,
                   turns: bool = False) -> torch.cuda.CUDAGraph:
        key = (rows, kv_len, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, stop, turns)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        # warm up (cuBLAS handles, compilation), then capture, on the engine's capture stream; both write
        # garbage into the state, which generate resets before the prefill. Positions start at 0 so the
        # warm-up writes stay inside the cache.
        st = self._state
        st.pos[:rows] = 0
        st.end_pos[:rows] = self.max_seq_len
        st.forced_end[:rows] = 0
        st.step.zero_()
        graph = self._captured(lambda: self._step(rows, kv_len, sampling, stop, turns), warmups=2)
        self._graphs[key] = graph
        return graph

    def _captured(self, run, warmups: int) -> torch.cuda.CUDAGraph:
        """`run` warmed up `warmups` times, then captured, on the engine's capture stream, into the one memory pool
        of all its graphs (they replay one at a time)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture checks this thread's calls only, so a training pass that another thread runs
        # meanwhile (grpo.rollout.ahead) neither breaks it nor is broken by it
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=side, capture_error_mode="thread_local"):
            run()
        return graph

    # ----------------------------------------------------------------------------------------------
    # prefill
    def _prefill(self, prompt_ids: list[list[int]], n: int) -> None:
        """Run every prompt once; write its K/V into its n rows and its last logits into state.logits. A prompt
        shape met a second time while the engine keeps its graphs replays a CUDA graph
        (up to PREFILL_GRAPH_TOKENS), at the width rounded up to `prefill_bucket`."""
        P, L = len(prompt_ids), max(len(p) for p in prompt_ids)
        bucket = self.tuning.prefill_bucket
        width = min(-(-L // bucket) * bucket, self.max_seq_len)
        graphed = self.tuning.use_cuda_graph and P * width <= PREFILL_GRAPH_TOKENS
        width = width if graphed else L
        # (P, width) right-padded: causal attention keeps padding out of real tokens
        ids = pad_rows(prompt_ids, self.pad_id, width=width, dtype=torch.long).to(self.device)
        lengths = torch.tensor([len(p) for p in prompt_ids], device=self.device)  # (P,)
        key = (P, n, width, self._fold)
        if graphed and key in self._prefill_seen:
            self._prefill_graph_for(key, ids, lengths, n).replay()
        else:  # a shape met once has no capture yet
            if graphed:
                self._prefill_seen.add(key)
            self._prefill_rows(ids, lengths, n)

    def _prefill_rows(self, ids: torch.Tensor, lengths: torch.Tensor, n: int) -> None:
        """The prefill of right-padded prompts ids (P, W) of `lengths` (P,) tokens, on the device alone (no host
        sync, so that a CUDA graph can hold it): their K/V into rows [0, P * n) of the cache, positions [0, W),
        each prompt's n rows side by side."""
        st, lm = self._state, self.lm
        decoder = lm.model
        (P, W), rows = ids.shape, ids.shape[0] * n
        x = decoder.embed_tokens(ids)  # (P, W, H)
        cos, sin = st.cos[:W][None, None], st.sin[:W][None, None]  # (1, 1, W, D)
        for i, layer in enumerate(decoder.layers):
            x, k, v = self._fns.prefill(layer, x, cos, sin, self.dims)
            for cache, kv in ((st.k_caches[i], k), (st.v_caches[i], v)):  # (P, n_kv, W, D) into each prompt's n rows
                cache[:rows].view(P, n, *cache.shape[1:])[:, :, :, :W] = kv[:, None]
        last = x[torch.arange(P, device=self.device), lengths - 1]  # (P, H) each prompt's last token
        logits = lm.lm_head(decoder.norm(last[:, None]))[:, 0]  # (P, V)
        if logits.shape[-1] != self.dims.vocab_size:
            raise ValueError(f"lm_head gives {logits.shape[-1]} logits but config.vocab_size is "
                             f"{self.dims.vocab_size}")
        st.logits[:rows].view(P, n, -1).copy_(logits[:, None])
        st.pos[:rows].view(P, n).copy_(lengths[:, None])

    def _prefill_graph_for(self, key: tuple, ids: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
        """The prefill's graph for `key`, its inputs ids and lengths copied into the buffers it reads; captured
        (after a warm-up run) where there is none yet."""
        if key in self._prefill_graphs:
            graph, ids_in, lengths_in = self._prefill_graphs[key]
            ids_in.copy_(ids)
            lengths_in.copy_(lengths)
            return graph
        graph = self._captured(lambda: self._prefill_rows(ids, lengths, n), warmups=1)
        self._prefill_graphs[key] = (graph, ids, lengths)  # ids and lengths stay the graph's input buffers
        return graph

    # ----------------------------------------------------------------------------------------------
    # generate
    def _check(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> None:
        if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; pass a list of prompts, each a non-empty list of token ids")
        if n < 1:
            raise ValueError(f"num_generations={n}: completions per prompt must be at least 1")
        if len(prompt_ids) * n > self.max_batch:
            raise ValueError(f"{len(prompt_ids)} prompts x num_generations={n} = {len(prompt_ids) * n} rows exceed "
                             f"max_batch={self.max_batch}; build the engine with a larger max_batch")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.dims.vocab_size:
                raise ValueError(f"prompt_ids[{i}] has a token id outside [0, {self.dims.vocab_size})")
            if len(p) + sampling.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt_ids[{i}] has {len(p)} tokens; with max_new_tokens="
                                 f"{sampling.max_new_tokens} that exceeds max_seq_len={self.max_seq_len}")
        for s in sampling.stop_sequences:
            if len(s) == 0:
                raise ValueError("Sampling.stop_sequences holds an empty sequence; remove it")

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Rollout:
        """P prompts times num_generations (G) completions, sampled from the model as it is now. See `Rollout`."""
        self._check(prompt_ids, num_generations, sampling)
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad():
                return self._generate(prompt_ids, num_generations, sampling)
        finally:
            for m, mode in modes:
                m.training = mode

    def _kv_bucket(self, max_prompt: int, i: int) -> int:
        """The KV length decode step i (0-based) reads: it writes at max_prompt + i, rounded up to a bucket."""
        bucket = self.tuning.kv_bucket
        return min(-(-(max_prompt + i + 1) // bucket) * bucket, self.max_seq_len)

    def _decode(self, rows: int, max_new: int, max_prompt: int, sampling: Sampling, stop: StopRule, graphs: dict,
                generator: torch.Generator) -> int:
        """Up to max_new steps (graphs replayed where captured), until every row has stopped; returns the
        steps taken."""
        st, steps = self._state, 0
        for i in range(max_new):
            if sampling.temperature > 0:
                st.noise_rows(rows).exponential_(generator=generator)
            kv_len = self._kv_bucket(max_prompt, i)
            if self.tuning.use_cuda_graph:
                graphs[kv_len].replay()
            else:
                self._step(rows, kv_len, sampling, stop)
            steps += 1
            if steps % self.tuning.check_every == 0:
                if self.progress is not None:
                    self.progress(rows * steps, rows * max_new)
                if stop.active and not bool(st.alive[:rows].any()):
                    break
        return steps

    def _set_up(self, prompt_ids: list[list[int]], n: int, sampling: Sampling, turns: bool = False
                ) -> tuple[StopRule, dict, torch.Generator]:
        """The state allocated (once), the step planned for the rows, its graphs captured for every KV bucket
        the decode can reach (`turns`: the episodes' step), the state reset after the captures: (the stop
        rule, the graphs by KV length, the seeded noise generator)."""
        if self._state is None:
            self._state = DecodeState.allocate(self.dims, self.max_batch, self.max_seq_len, self.pad_id,
                                               self.lm.model.rotary_emb, self.lm.model.embed_tokens.weight)
        st = self._state
        rows, max_new = len(prompt_ids) * n, sampling.max_new_tokens
        max_prompt = max(len(p) for p in prompt_ids)
        stop = StopRule.of(sampling)
        stop.prepare(st, self.max_batch)
        if sampling.temperature > 0:
            st.noise_rows(self.max_batch)  # allocated here, before a capture points a graph at it
        self._plan(rows)
        graphs = {}
        if self.tuning.use_cuda_graph:
            fingerprint = self._model_fingerprint()
            if fingerprint != self._fingerprint:  # parameters moved or adapters switched: recapture
                self._clear_graphs()
                self._fingerprint = fingerprint
            for kv_len in sorted({self._kv_bucket(max_prompt, i) for i in range(max_new)}):
                graphs[kv_len] = self._graph_for(rows, kv_len, sampling, stop, turns)

        # reset the state the warm-up and capture wrote
        st.step.zero_()
        st.alive[:rows] = True
        st.finished[:rows] = False
        st.out_ids[:rows] = self.pad_id
        st.out_logp[:rows] = 0.0
        st.out_mask[:rows] = False
        st.forced_at[:rows] = 0
        st.forced_end[:rows] = 0
        if stop.window:
            st.tails[stop.window][:rows] = -1
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return stop, graphs, generator

    def _refresh_packs(self) -> None:
        """The adapters' copies and the stacked weights of the packed layers, as this generate has them."""
        for layer in self._layers:
            if isinstance(layer, PackedLayer):
                layer.pack.refresh()

    def _sync(self) -> None:
        """Waits for this generate's work: the current stream's (the layers' side streams join it), not the
        device's, so that work another thread queued on another stream does not hold the generate up."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        t0 = time.perf_counter()
        rows, max_new = len(prompt_ids) * n, sampling.max_new_tokens
        max_prompt = max(len(p) for p in prompt_ids)
        stop, graphs, generator = self._set_up(prompt_ids, n, sampling)
        st = self._state
        self._sync()
        t1 = time.perf_counter()
        # where self._fold the weights hold the adapters for the prefill and the decode both (the prefill's
        # modules with peft's adapters off, the decode's plan reads none); they come out exactly after
        with fold.folded(self._projections) if self._fold else nullcontext():
            self._refresh_packs()
            with adapters_off(self.model) if self._fold else nullcontext():
                self._prefill(prompt_ids, n)
            self._sync()
            t2 = time.perf_counter()
            steps = self._decode(rows, max_new, max_prompt, sampling, stop, graphs, generator)
            self._sync()
        t3 = time.perf_counter()
        if self.progress is not None:
            self.progress(rows * max_new, rows * max_new)

        used = st.out_mask[:rows, :steps]  # (B, steps)
        width = int(used.any(0).nonzero().max().item()) + 1 if bool(used.any()) else 1
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=st.out_ids[:rows, :width].clone(),
            mask=st.out_mask[:rows, :width].clone(),
            sampler_logp=st.out_logp[:rows, :width].clone(),
            finished=st.finished[:rows].clone(),
            num_generations=n,
            timings={"capture": t1 - t0, "prefill": t2 - t1, "decode": t3 - t2, "decode_steps": float(steps)},
        )

    # ----------------------------------------------------------------------------------------------
    # episodes: rows continued in place after a reply
    @contextmanager
    def turns(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Iterator[NativeTurns]:
        """P prompts times num_generations rows played turn after turn (`grpo.rollout.base.Turns`), each reply
        fed into its row's KV cache after the row's last token by the decode steps, never its context again: see
        `turns.py`.
        `sampling.max_new_tokens` bounds each row's whole transcript, so a prompt plus it must fit max_seq_len.
        Inside, the model is in eval mode under no_grad (with the adapters folded in where the engine folds); the
        engine serves nothing else until the block ends."""
        for i, p in enumerate(prompt_ids):  # (before `_check`, whose words are a single completion's)
            if isinstance(p, (list, tuple)) and len(p) + sampling.max_new_tokens > self.max_seq_len:
                raise ValueError(f"episode prompt {i} has {len(p)} tokens and its transcript (turns and replies) "
                                 f"may take {sampling.max_new_tokens} more: {len(p) + sampling.max_new_tokens} "
                                 f"exceed the engine's max_seq_len={self.max_seq_len}; fix: an engine whose "
                                 "max_seq_len holds both (train.py: --max-seq-length), or a smaller completion "
                                 "budget (--max-completion-length)")
        self._check(prompt_ids, num_generations, sampling)
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                stop, graphs, generator = self._set_up(prompt_ids, num_generations, sampling, turns=True)
                rows = len(prompt_ids) * num_generations
                ends = [len(p) + sampling.max_new_tokens for p in prompt_ids for _ in range(num_generations)]
                self._state.end_pos[:rows].copy_(torch.tensor(ends))
                self._sync()
                t1 = time.perf_counter()
                with fold.folded(self._projections) if self._fold else nullcontext():
                    self._refresh_packs()
                    with adapters_off(self.model) if self._fold else nullcontext():
                        self._prefill(prompt_ids, num_generations)
                    self._sync()
                    timings = {"capture": t1 - t0, "prefill": time.perf_counter() - t1}
                    yield NativeTurns(self, prompt_ids, num_generations, sampling, stop, graphs, generator, timings)
        finally:
            for m, mode in modes:
                m.training = mode

    def _decode_turns(self, rows: int, steps: int, top: int, ceiling: int, sampling: Sampling, stop: StopRule,
                      graphs: dict, generator: torch.Generator) -> None:
        """`steps` episodes' steps (`_step` with turns), without a host sync. `top` is the highest position of a
        row now, so step i writes below top + i + 1; `ceiling` the KV length that holds every row's end (the
        longest prompt's bucket with the budget: the last captured)."""
        st = self._state
        for i in range(steps):
            if sampling.temperature > 0:
                st.noise_rows(rows).exponential_(generator=generator)
            kv_len = min(self._kv_bucket(top, i), ceiling)
            if self.tuning.use_cuda_graph:
                graphs[kv_len].replay()
            else:
                self._step(rows, kv_len, sampling, stop, turns=True)

    def _force(self, rows: list[int], starts: list[int], replies: list[list[int]]) -> None:
        """Each reply (non-empty) queued as its row's next tokens (`_episode_step` feeds them), the row alive
        again from position `starts[j]`: one copy to the device and a few indexed writes, queued after the work
        already queued, without a host sync."""
        st = self._state
        packed = pad_rows([[r, s, len(t), *t] for r, s, t in zip(rows, starts, replies)], self.pad_id,
                          dtype=torch.long)  # (R, 3 + W): row, start, length, tokens
        if self.device.type == "cuda":  # (from pinned memory the copy is queued, not waited for)
            packed = packed.pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        index, width = packed[:, 0], packed.shape[1] - 3
        st.forced[:, :width].index_copy_(0, index, packed[:, 3:])
        st.forced_end.index_copy_(0, index, packed[:, 2])
        st.forced_at.index_fill_(0, index, 0)
        st.pos.index_copy_(0, index, packed[:, 1])
        st.alive.index_fill_(0, index, True)
        st.finished.index_fill_(0, index, False)
