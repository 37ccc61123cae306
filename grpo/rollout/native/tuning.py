"""`EngineTuning`: how the native engine runs a step (graphs, compile, attention, streams, buckets).

Benchmarks and tests choose these; the product runs the defaults, but for `attention`, which a user may
choose (`--engine-attention`, through `grpo.rollout.build_engine`), and `fold_adapter`, which the trainer
turns on (`--engine-fold-adapter`, its default). They are kept off `NativeEngine`'s
constructor so that its arguments are what a user decides: the model, the cache's size, the pad id, and
`gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from grpo.kernels import decode_attention, decode_gemm

# An engine built for this many rows or more (a training step's P*G, an evaluation's batch) attends with the
# split-KV kernel under `--engine-attention auto`. On the H200 (2026-12-02) it took the Qwen preset's decode at
# 64 rows from 1.20 to 1.12 s a step (60-step runs side by side), the bench step's at 16 rows from 0.79 to
# 0.75 s (the step 1.27 -> 1.18 s) and the long config's from 3.04 to 2.73 s (suite processes on one machine).
# Fewer rows are untimed: sdpa there.
KERNEL_ATTENTION_ROWS = 16


def auto_attention(device: torch.device, rows: int) -> str:
    """What attention "auto" runs for an engine of up to `rows` rows on `device`: "kernel" on CUDA with
    triton from KERNEL_ATTENTION_ROWS rows, "sdpa" otherwise."""
    fast = device.type == "cuda" and rows >= KERNEL_ATTENTION_ROWS and decode_attention.can_run(device)
    return "kernel" if fast else "sdpa"


@dataclass(frozen=True)
class EngineTuning:
    """How the engine runs a step, for benchmarks and tests; the defaults are the product's (but for
    `attention` and `fold_adapter`: the module's docstring).

    use_cuda_graph: capture the one-token step in CUDA graphs; None is "on CUDA".
    compile: a torch.compile mode for the step ("default", "max-autotune-no-cudagraphs"), None for
        eager kernels, or "auto": "default" on CUDA, None elsewhere. The first generate compiles.
    compile_prefill: where `compile` is on, each layer of the prefill runs as one compiled function too
        (through peft's modules one op at a time, the bench's prefill took 54 ms on the H200 for ~2 ms of
        GEMMs; 12 ms without the adapter). Off: in the bench step on the H200 (2026-12-03) FP8's prefill took
        153 ms a step with it against 66 without (bf16 was not timed apart from the fold).
    kv_bucket: attention reads the cache in multiples of this many positions.
    prefill_graph_tokens: with use_cuda_graph, a prefill of up to this many prompt tokens (prompts x width)
        replays a CUDA graph, from the second time its shape is met (prompts, completions each, width) while
        the engine keeps its graphs (not under release_memory: a capture costs more than one eager prefill);
        0: never. Eager, the prefill is the host calling the layers' modules one op at a time (the bench step
        profiled on the H200, 2026-12-05: FP8's 161 ms of wall time under the profiler for 5.9 ms of GPU time).
        Replayed, the suite's bench step's prefill took 6.6 ms against 31.5-44.5 with FP8 weights and 17.1 ms
        against 33.4 in bf16 (the fold's launches inside), in one machine start. The graphs share the decode
        graphs' memory pool, which keeps the working memory of the largest prefill graphed.
    prefill_bucket: a graphed prefill's width is the longest prompt's rounded up to a multiple of this (and at
        most max_seq_len), so prompts of nearby lengths share a graph; the padding sits after every prompt's
        last token, where causal attention keeps it out of the prompt's K/V and logits.
    check_every: steps between host checks of "have all rows stopped".
    attention: "sdpa" (torch's fused attention), "matmul" (two batched matmuls, float32 scores and
        softmax: the K slice is upcast every step), "kernel" (`grpo.kernels.decode_attention`: Triton,
        each row's cache read to its own length in chunks) or "auto" (`auto_attention` for the engine's
        rows). On the Qwen preset (H200, 2026-12-01) "sdpa" decoded within 3% of the bf16-score "matmul"
        it replaced, whose rounded scores put tokens 13 nats off.
    streams: run q/k/v and gate/up projections on parallel CUDA streams, so their GEMMs overlap in the
        graph (on CPU: in sequence); None is "on CUDA, when every layer's MLP is a Llama MLP".
    kernel_rows: with gemm="kernels", steps of at most this many rows run the decode GEMM kernels
        (up to decode_gemm.MAX_ROWS, where they were measured faster); more rows call the modules.
    rope_in_attention: where a layer runs on the decode kernels and attends with the kernel, the rotary
        embeddings of q and K and the K/V write happen inside the attention's launch
        (`decode_attention.rope_store_attend`): three launches a layer fewer (q's rotary, the K/V write, the
        attention's own), which took the bench's token step from 1.447 to 1.384 ms in its CUDA graph (H200,
        2026-12-02). Qwen3's q/k norms keep the launches apart.
    fold_adapter: where every layer runs on the decode kernels (or, wider, packed: packed_layers) with an
        adapter and dense weights, fold the adapters into the base weights for the prefill and the decode and
        take them out after, exactly (`fold.py`): no adapter work in a token step or the prefill, the sampler
        sampling from W + scale * B A rounded (which drops the adapter's smallest changes, so the trainer
        corrects for the sampler). On the H200 (2026-12-03) the bench step took 1.032 s against 1.075 and the
        long one 3.487 against 3.715; the sampler-trainer gap with a random B ~ N(0, 1e-3) rose from 0.022 to
        0.026 nats a token. Off for an engine built alone; the trainer folds by default (--engine-fold-adapter,
        since 2026-12-04: the Qwen preset's 60 steps learned as well folded, and the bench step took 0.975 s
        against 1.107), and weights its tokens by pi_trainer/pi_sampler where a generate folded.
    fold_kernel: fold and restore with one Triton launch a weight each way, D computed inside the tiles
        (`fold._KernelFolds`), where triton runs; else torch's ops, which write D and two float32 sums of each
        weight and wait on the GPU once a weight. On the H200 (2026-12-04, `native_engine.py --plan bench`) the
        bench engine's prefill with the fold took 35.5 ms this way against 95.8 (25.2 without folding), its
        restores bit for bit (the CUDA test of the folded engine, both ways).
    packed_layers: steps the decode kernels do not run (more rows than kernel_rows, or gemm="modules") run
        each layer's dense projections as torch's GEMMs on their own weights, with the adapters' A matrices
        of one input stacked and A, B copied into the activations' dtype once a generate (`packed.py`), in
        place of peft's modules (per LoRA matrix a cast and a GEMM every token step); with fold_adapter the
        adapters are folded there too. None (auto): where the engine runs the decode kernels, for the steps
        wider than they take (gemm="modules" keeps the modules). On the H200 (2026-12-04, one run of the
        sampler sweep) 256 rows took 2.056 s a generate this way against 2.134 through the modules (-3.7%),
        folded 1.714 s (-20%); folded 1.496 s against 1.666 in one start once q/k/v became one GEMM and the
        residuals were added in place (`packed.py`).
    sample_kernel: sample with `grpo.kernels.race_sample` (three Triton launches that draw the race's Exp(1)
        noise themselves, only where min_p keeps a token) where the sampling has no top-k or top-p, in place of
        torch's ops on a (rows, V) float32 noise tensor drawn before each step (131 MB at 256 rows). Another
        random stream than torch's for the same seed. Off: on the H200 (2026-12-05, the folded sampler at 16 /
        64 / 256 rows) it took 0.634 / 0.795 / 1.424 s a generate against 0.664 / 0.792 / 1.412 with torch's.
    """

    use_cuda_graph: bool | None = None
    compile: str | None = "auto"
    compile_prefill: bool = False
    kv_bucket: int = 256
    prefill_graph_tokens: int = 4096
    prefill_bucket: int = 64
    check_every: int = 16
    attention: str = "auto"
    streams: bool | None = None
    kernel_rows: int = decode_gemm.MAX_ROWS
    rope_in_attention: bool = True
    fold_adapter: bool = False
    fold_kernel: bool = True
    packed_layers: bool | None = None
    sample_kernel: bool = False

    def __post_init__(self) -> None:
        if self.kv_bucket < 1 or self.check_every < 1 or self.prefill_bucket < 1:
            raise ValueError(f"kv_bucket={self.kv_bucket}, check_every={self.check_every}, prefill_bucket="
                             f"{self.prefill_bucket}: each must be >= 1")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens={self.prefill_graph_tokens}: use 0 (never) or more")
        if self.attention not in ("auto", "matmul", "sdpa", "kernel"):
            raise ValueError(f"attention={self.attention!r}: use 'auto', 'matmul', 'sdpa' or 'kernel'")
        if not 1 <= self.kernel_rows <= decode_gemm.MAX_ROWS:
            raise ValueError(f"kernel_rows={self.kernel_rows}: the kernels take 1 to {decode_gemm.MAX_ROWS} rows")

    def resolved(self, device: torch.device, llama_mlp: bool, rows: int) -> EngineTuning:
        """The same choices with every "auto"/None made concrete for an engine of up to `rows` rows over a
        model on `device`, but packed_layers, which the engine's plan reads with its gemm."""
        cuda = device.type == "cuda"
        tuning = replace(self, use_cuda_graph=cuda if self.use_cuda_graph is None else self.use_cuda_graph,
                         compile=("default" if cuda else None) if self.compile == "auto" else self.compile,
                         streams=cuda and llama_mlp if self.streams is None else self.streams,
                         attention=auto_attention(device, rows) if self.attention == "auto" else self.attention)
        if tuning.use_cuda_graph and not cuda:
            raise ValueError(f"use_cuda_graph=True but the model is on {device}; CUDA graphs need a CUDA "
                             "model (leave use_cuda_graph None or False)")
        if tuning.attention == "kernel" and not decode_attention.can_run(device):
            raise ValueError(f"attention='kernel' needs triton and a CUDA model (or TRITON_INTERPRET=1 on CPU); "
                             f"the model is on {device}: use 'sdpa'")
        if tuning.sample_kernel and not decode_attention.can_run(device):
            raise ValueError(f"sample_kernel=True needs triton and a CUDA model (or TRITON_INTERPRET=1 on CPU); "
                             f"the model is on {device}: leave it False")
        if tuning.streams and not llama_mlp:
            raise ValueError("streams=True needs Llama MLPs (gate/up/down_proj and act_fn) in every layer; pass "
                             "streams=False")
        return tuning
