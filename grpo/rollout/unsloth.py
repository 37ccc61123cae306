"""Unsloth's engine (`--engine unsloth`): Unsloth loads the model with vLLM inside it (`fast_inference`), and
the trainer trains that same model, so sampling and training share the (FP8 or bf16) base weights; only the
LoRA tensors go across each step, through `model.load_lora(..., load_tensors=True)`.

Unlike the other engines it is not built over a policy: it loads its own (`load_unsloth`), and says so
(`UnslothEngine.loads_policy`); the trainer then trains `engine.policy` with `engine.tokenizer`.

Unsloth builds its vLLM engine for training with "processed_logprobs" (renormalised over what
min_p/top-k/top-p keep, off from the trainer's by log(kept mass)); `load_unsloth` asks it for raw log-probs
instead (`training=False`), so the engine is exact at temperature 1 (the recipe's) and 0, and refuses others
(`grpo.rollout.vllm.VLLMRollout`).

Not here: what every vLLM-backed engine shares (`grpo/rollout/vllm.py`). Nothing happens at import: unsloth
and vllm are imported inside the functions that need them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoConfig

from grpo.model.fp8_checkpoint import is_fp8_checkpoint
from grpo.model.load import resolve_model_dir
from grpo.rollout.vllm import (GPU_MEMORY_UTILIZATION, INSTALL_HINT, VLLMRollout, check_fp8_supported,
                               engine_logprobs_mode, kv_cache_bytes_for, vllm_available, vllm_lora_rank)

UNSLOTH_HINT = "Unsloth's fast_inference needs unsloth and vLLM on a CUDA GPU: pip install 'grpo[unsloth,vllm]'"
# What Unsloth's engine needs beside the weights and the KV cache (CUDA graphs, the profiling pass's
# activations, the adapter's slots, CUDA's workspaces) when its share is sized for the run. It trades some
# GPU memory for never starving vLLM at start-up (benchmarks/RESULTS.md, "The measured defaults").
UNSLOTH_ENGINE_OVERHEAD_BYTES = 5 * 2**30


@dataclass(frozen=True)
class UnslothOptions:
    """What Unsloth's engine needs to load the policy it samples from: the checkpoint, the rsLoRA adapter
    the trainer trains on it (as `grpo.model.load.add_lora` would add it), and vLLM's settings."""

    model: str  # --model: a hub id or a checkpoint folder
    lora_rank: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    seed: int
    work_dir: str  # where the adapter's config is written for vLLM
    load_in_fp8: bool = False  # quantize a bf16 checkpoint at load (an FP8 checkpoint is FP8 anyway)
    use_rslora: bool = True
    lora_dropout: float = 0.0
    gradient_checkpointing: bool = True  # Unsloth's own checkpointing
    # vLLM's share of the GPU, standby or not; None: sized for the engine's rows (`unsloth_share_for`)
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False  # no torch.compile or CUDA graphs in vLLM (a long start-up)


def unsloth_share_for(model_dir: str | Path, config: Any, *, rows: int, max_model_len: int,
                      total_bytes: int) -> float:
    """vLLM's share of a GPU of `total_bytes` for the engine Unsloth builds, sized for the run, since its
    `load_vllm` takes a share and no KV cache size: the checkpoint's weights (its safetensors files: a bf16
    checkpoint quantized at load needs less), the KV cache of `rows` sequences of `max_model_len` tokens
    (`kv_cache_bytes_for`, bf16 as Unsloth's engine keeps it), and UNSLOTH_ENGINE_OVERHEAD_BYTES, rounded up
    to a hundredth. Raises ValueError, naming the flag, where that is not below the whole GPU."""
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    kv = kv_cache_bytes_for(config, rows=rows, max_model_len=max_model_len, dtype="bf16")
    need = weights + kv + UNSLOTH_ENGINE_OVERHEAD_BYTES
    share = -(-100 * need // total_bytes) / 100
    if share >= 1:
        raise ValueError(f"--engine unsloth: vLLM needs {need / 2**30:.1f} "
                         f"GiB for {rows} rows of {max_model_len} tokens, more than this GPU's "
                         f"{total_bytes / 2**30:.1f} GiB; lower --max-seq-length or the rows (P x G), or set "
                         "--vllm-gpu-memory-utilization")
    return share


def load_unsloth(options: UnslothOptions, *, max_seq_length: int, rows: int) -> UnslothEngine:
    """Unsloth's shared-weight setup: the engine, holding the policy it loaded (`policy`, the PeftModel the
    trainer trains) and its tokenizer. CUDA and unsloth+vLLM only.

    Loads with `fast_inference=True` (vLLM inside, standby on) and `max_lora_rank`; FP8 as the checkpoint's
    own quantization_config says, or quantized at load when `load_in_fp8` asks it of a bf16 checkpoint; then
    adds the rsLoRA adapter through `FastLanguageModel.get_peft_model`. `rows`: the most sequences the engine
    generates at once (P x G, or the evaluation's), vLLM's max_num_seqs; `max_seq_length`: a prompt and its
    completion, at most.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(f"{UNSLOTH_HINT}; no CUDA GPU here (use --engine hf or native, or plain vLLM)")
    share = options.gpu_memory_utilization
    if share is None:
        model_dir = resolve_model_dir(options.model)
        share = unsloth_share_for(
            model_dir, AutoConfig.from_pretrained(model_dir), rows=rows, max_model_len=max_seq_length,
            total_bytes=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    # A pre-quantized FP8-Block checkpoint brings its own quantization_config, which decides; Unsloth's
    # load_in_fp8 asks vLLM for per-channel FP8 on top of it, which vLLM refuses. So load_in_fp8 only
    # ever quantizes a bf16 checkpoint.
    prequantized = is_fp8_checkpoint(options.model)
    check_fp8_supported(options.load_in_fp8 or prequantized)
    # Unsloth reads these at import: standby shares one memory pool between vLLM and training, and
    # our trainer needs the forward pass to return logits.
    os.environ["UNSLOTH_VLLM_STANDBY"] = "1"
    # Under standby Unsloth replaces gpu_memory_utilization by its own share for the GPU
    # (unsloth_zoo.vllm_utils.load_vllm); this keeps the user's.
    os.environ["UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE"] = "1"
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    try:
        from unsloth import FastLanguageModel
    except ImportError as err:
        raise ImportError(f"{UNSLOTH_HINT} ({err})") from None
    if not vllm_available():
        raise ImportError(INSTALL_HINT)
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=options.model,
        max_seq_length=max_seq_length,
        load_in_4bit=False,
        load_in_fp8=options.load_in_fp8 and not prequantized,
        fast_inference=True,
        max_lora_rank=vllm_lora_rank(options.lora_rank),
        gpu_memory_utilization=share,
        max_num_seqs=rows,  # Unsloth would pick 8-256 by the memory its share leaves for the KV cache
        enforce_eager=options.enforce_eager,  # one of the load_vllm arguments Unsloth passes on
        # load_vllm's training=True (the default) builds vLLM with processed_logprobs, renormalised over
        # what min_p keeps; False gives raw ones, the trainer's quantity at temperature 1. (It also leaves
        # the gradients out of Unsloth's estimate of vLLM's batch size; vLLM's share is ours either way.)
        training=False,
        random_state=options.seed,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=options.lora_rank,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        target_modules=list(options.target_modules),
        use_rslora=options.use_rslora,
        bias="none",
        use_gradient_checkpointing="unsloth" if options.gradient_checkpointing else False,
        random_state=options.seed,
    )
    return UnslothEngine(model, tokenizer, work_dir=options.work_dir, seed=options.seed,
                         max_model_len=max_seq_length, gpu_memory_utilization=share)


class UnslothEngine(VLLMRollout):
    """Unsloth's fast_inference engine: vLLM shares the (FP8 or bf16) base weights with training.

    policy: the PeftModel from `load_unsloth`, with `vllm_engine`, `fast_generate` and `load_lora`; the
    trainer trains it. Each call hands vLLM the current LoRA tensors (`load_lora(..., load_tensors=True)`, a
    new id each time); nothing is written but the adapter config, once.
    """

    loads_policy: ClassVar[bool] = True  # the trainer takes `policy` and `tokenizer` from it

    def __init__(self, policy: Any, tokenizer: Any = None, *, work_dir: str, seed: int,
                 max_model_len: int | None = None, pad_id: int = 0, sleep_mode: bool | None = None,
                 gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION) -> None:
        super().__init__()
        self.policy = policy
        self.tokenizer = tokenizer
        self.gpu_memory_utilization = gpu_memory_utilization  # what was asked; pool_bytes() reads vLLM's own
        self.llm = policy.vllm_engine
        self.seed = seed
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.adapter_dir = Path(work_dir) / "unsloth-adapter"
        if sleep_mode is None:  # sleep when Unsloth built the engine for it (UNSLOTH_VLLM_STANDBY=1)
            config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
            sleep_mode = bool(getattr(config, "enable_sleep_mode", False))
        self.sleep_mode = sleep_mode
        mode = engine_logprobs_mode(self.llm)
        self.logprob_semantics = {"processed_logits": "exact", "processed_logprobs": "processed"}.get(mode, "raw")

    def _lora_request(self) -> Any:
        return self.policy.load_lora(str(self.adapter_dir), load_tensors=True)

    def _generate(self, prompts: list[dict], params: list[Any], lora_request: Any) -> list[Any]:
        return self.policy.fast_generate(prompts, sampling_params=params, lora_request=lora_request,
                                         use_tqdm=False)
