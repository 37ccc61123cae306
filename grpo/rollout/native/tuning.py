"""`EngineTuning`: how the native engine runs a step, where that is not decided by the device alone.

The product runs the defaults but for `attention`, which a user may choose (`--engine-attention`, through
`grpo.rollout.build_engine`), and `fold_adapter`, which the trainer turns on (`--engine-fold-adapter`, its
default). The sizes (`kv_bucket`, `prefill_bucket`, `check_every`, `kernel_rows`) are the product's; tests
shrink them to reach several buckets or wide steps on tiny models. They are kept off `NativeEngine`'s
constructor so that its arguments are what a user decides: the model, the cache's size, the pad id, and
`gemm`. The figures behind the defaults are in benchmarks/RESULTS.md, "The measured defaults".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from grpo.kernels import decode_attention, decode_gemm

# An engine built for this many rows or more (a training step's P*G, an evaluation's batch) attends with the
# split-KV kernel under `--engine-attention auto`: faster decoding from here, fewer rows untimed
# (benchmarks/RESULTS.md, "The measured defaults").
KERNEL_ATTENTION_ROWS = 16


def auto_attention(device: torch.device, rows: int) -> str:
    """What attention "auto" runs for an engine of up to `rows` rows on `device`: "kernel" on CUDA with
    triton from KERNEL_ATTENTION_ROWS rows, "sdpa" otherwise."""
    fast = device.type == "cuda" and rows >= KERNEL_ATTENTION_ROWS and decode_attention.can_run(device)
    return "kernel" if fast else "sdpa"


@dataclass(frozen=True)
class EngineTuning:
    """How the engine runs a step; each default is the product's (figures: benchmarks/RESULTS.md, "The
    measured defaults").

    use_cuda_graph: capture the one-token step (and prefills met twice) in CUDA graphs; None is "on CUDA".
        False is the eager step that tests compare the graphs against.
    compile: a torch.compile mode for the step's pieces, None for eager kernels, or "auto": "default" on
        CUDA, None elsewhere. The first generate compiles.
    kv_bucket: attention reads the cache in multiples of this many positions (one CUDA graph a bucket): a
        step reads little past its rows' lengths while a generate captures few graphs.
    prefill_bucket: a graphed prefill's width is the longest prompt's rounded up to a multiple of this (at
        most max_seq_len), so prompts of nearby lengths share a graph; the padding sits after every prompt's
        last token, where causal attention keeps it out of the prompt's K/V and logits.
    check_every: decode steps between host checks of "have all rows stopped": a sync costs a step's launches.
    turn_block: episodes (`turns.py`): decode steps between the host's looks at which rows ended their turns. A
        row that stops waits for the rest of its block and one more before its reply goes in; the host's look
        costs the device nothing while the host's work of a block (reading it, the replies) takes less than the
        block's steps, since the next block is queued before it. Fewer steps a block, less idling, more looks:
        2 measured fastest of 2, 4 and 8 (benchmarks/RESULTS.md, "The measured defaults").
    attention: "sdpa" (torch's fused attention over the KV bucket), "kernel" (`grpo.kernels.decode_attention`:
        Triton, each row's cache read to its own length in chunks) or "auto" (`auto_attention` for the
        engine's rows).
    streams: run q/k/v and gate/up projections on parallel CUDA streams, so their GEMMs overlap in the
        graph (on CPU: in sequence, which tests turn on to check the pieces); None is "on CUDA, when every
        layer's MLP is a Llama MLP".
    kernel_rows: with gemm="kernels", steps of at most this many rows run the decode GEMM kernels (up to
        decode_gemm.MAX_ROWS, where they beat cuBLAS); wider steps run the packed layers (`packed.py`).
    fold_adapter: where every layer runs on the decode kernels or packed, with an adapter and dense weights,
        fold the adapters into the base weights for the prefill and the decode and take them out after,
        exactly (`fold.py`): no adapter work in a token step, for a sampler that samples W + scale * B A
        rounded (the trainer corrects for it). Off for an engine built alone; the trainer folds by default.
    fp8_activations: the dtype the decode kernels' FP8 projections read their activations in: "bf16" (the model's), or
        "fp16": the norms, the attention and the SiLU product write fp16 for them, which E4M3 codes become in one
        instruction a pair (`decode_gemm._w_first`); the residual stream and q/k/v stay in the model's dtype. "auto":
        fp16 for a bf16 model in steps of up to `engine.FP16_ACTIVATIONS_ROWS` rows (the same bytes, a shorter FP8 token
        step: benchmarks/RESULTS.md, "The measured defaults"), the model's own dtype else (float32 models, as the CPU
        tests run, keep their exact sums). fp16 holds up to 65,504, with three more bits of mantissa than bf16; the
        largest such input found in real models is far below (RESULTS, the same row).
    """

    use_cuda_graph: bool | None = None
    compile: str | None = "auto"
    kv_bucket: int = 256
    prefill_bucket: int = 64
    check_every: int = 16
    turn_block: int = 2
    attention: str = "auto"
    streams: bool | None = None
    kernel_rows: int = decode_gemm.MAX_ROWS
    fold_adapter: bool = False
    fp8_activations: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_bucket < 1 or self.check_every < 1 or self.prefill_bucket < 1 or self.turn_block < 1:
            raise ValueError(f"kv_bucket={self.kv_bucket}, check_every={self.check_every}, prefill_bucket="
                             f"{self.prefill_bucket}, turn_block={self.turn_block}: each must be >= 1")
        if self.fp8_activations not in ("auto", "bf16", "fp16"):
            raise ValueError(f"fp8_activations={self.fp8_activations!r}: use 'auto', 'bf16' or 'fp16'")
        if self.attention not in ("auto", "sdpa", "kernel"):
            raise ValueError(f"attention={self.attention!r}: use 'auto', 'sdpa' or 'kernel'")
        if not 1 <= self.kernel_rows <= decode_gemm.MAX_ROWS:
            raise ValueError(f"kernel_rows={self.kernel_rows}: the kernels take 1 to {decode_gemm.MAX_ROWS} rows")

    def resolved(self, device: torch.device, llama_mlp: bool, rows: int) -> EngineTuning:
        """The same choices with every "auto"/None made concrete for an engine of up to `rows` rows over a
        model on `device`."""
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
        if tuning.streams and not llama_mlp:
            raise ValueError("streams=True needs Llama MLPs (gate/up/down_proj and act_fn) in every layer; pass "
                             "streams=False")
        return tuning
