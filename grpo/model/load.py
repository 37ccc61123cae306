"""Loading the policy: a local or cached checkpoint in bf16/fp32, an FP8-Block checkpoint, or a bf16
checkpoint quantized to FP8 at load; rsLoRA adapters through peft; gradient checkpointing. Or, for
--engine unsloth, Unsloth's loading (`load_unsloth_policy`), which builds its vLLM engine with the model.

Helpers it owns: `grpo/model/fp8_checkpoint.py` (telling FP8 checkpoints apart, loading FP8-Block ones).
Not here: the FP8 format and kernels themselves (`grpo/kernels/fp8.py`), and any second copy of the
model. The reference policy is this same model with its adapters disabled.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from grpo.model import lean_activations
from grpo.model import lora_addmm
from grpo.batch import head_refusal
from grpo.config import DTYPES, LORA_TARGETS, Config
from grpo.model.fp8_checkpoint import is_fp8_checkpoint, load_fp8_block_model
from grpo.model.packaged import PACKAGED_MODELS, packaged_model_dir


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype for a dtype flag's short name (bf16, fp16, fp32: `grpo.config.DTYPES`)."""
    return getattr(torch, DTYPES[name])


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(name)


def default_device() -> torch.device:
    """The GPU if there is one (cuda:LOCAL_RANK under torchrun: one GPU per rank), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local_rank)) if local_rank is not None else torch.device("cuda")


def resolve_model_dir(name: str) -> Path:
    """A local directory for `--model`: the path itself, a packaged model's conversion (`--model
    smollm2-135m-instruct`, `qwen2.5-coder-1.5b-instruct`: grpo/model/packaged.py), or the HF cache."""
    if name in PACKAGED_MODELS:
        return packaged_model_dir(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {name}: the directory has no config.json; point it at a "
                                    "Hugging Face checkpoint folder")
        return path
    if name.startswith(("/", ".", "~")) and not path.exists():  # a path, not a hub id (owner/name)
        raise FileNotFoundError(f"--model {name}: no such folder; fix: check the path, or pass a hub id such as "
                                "owner/name")
    if path.exists() or name.count("/") != 1:
        raise FileNotFoundError(f"--model {name}: not a directory holding a checkpoint; pass a local "
                                f"checkpoint folder or a hub id such as owner/name")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        return Path(snapshot_download(name, local_files_only=offline))
    except (LocalEntryNotFoundError, OSError, ValueError) as err:
        raise FileNotFoundError(
            f"--model {name}: cannot be reached {'offline ' if offline else ''}({type(err).__name__}); pass "
            f"a local checkpoint folder instead, or --preset quickstart for the offline model"
            + (" (./dev sets HF_HUB_OFFLINE=1 unless you set it: HF_HUB_OFFLINE=0 ./dev train ... goes online)"
               if offline else "")
        ) from None


@contextmanager
def attention_without_cudnn() -> Iterator[None]:
    """Within the block, torch's scaled_dot_product_attention leaves cuDNN's backend out (flash or
    memory-efficient attention take its place); leaving it restores what was enabled before.

    torch puts cuDNN's attention first on Hopper, and cuDNN builds a plan for every new shape: on the H200
    (torch 2.11, 2026-12-02) a forward and backward at a new sequence length took 164 ms, the same call
    once planned 0.70 ms, flash's 0.73 ms with no plan. A run never repeats its shapes (each step's
    prompts and micro-batches have new widths): the Qwen preset's training pass on new widths took 1.39 s
    with cuDNN, 1.03 s without (benchmarks/RESULTS.md, "New widths"). cuDNN's backward was also the
    one that returned NaN under a padding mask (`grpo.batch.sequence_logprobs`)."""
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    vllm_before = "vllm" in sys.modules
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:  # vLLM turns cuDNN's attention off for the process when imported: a run that imported it keeps that
        if not ("vllm" in sys.modules and not vllm_before):
            torch.backends.cuda.enable_cudnn_sdp(was_enabled)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(cfg: Config, device: torch.device):
    """The frozen base model on `device`: FP8-Block checkpoints and --load-in-fp8 give FP8 linears."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from grpo.kernels.fp8 import quantize_linears_

    model_dir = resolve_model_dir(cfg.model)
    dtype = resolve_dtype(cfg.dtype, device)
    if is_fp8_checkpoint(model_dir):
        model = load_fp8_block_model(model_dir, dtype).to(device)
        if (model_dir / "generation_config.json").is_file():  # built from config.json alone: add its stop ids
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        if cfg.load_in_fp8:  # the 7 projections, as FP8-Block checkpoints have them, whatever LoRA targets
            quantize_linears_(model, LORA_TARGETS)
    model.requires_grad_(False)
    return model, model_dir


class LinearInInputDtype(nn.Linear):
    """An adapter matrix that stays float32, the precision the optimizer updates, but multiplies in its
    input's dtype: a bf16 activation is neither copied to float32 nor saved a second time for backward.

    `compute_adapters_in_base_dtype` (--lora-compute base) gives peft's LoRA A and B layers this class;
    its product is still x @ W^T, so the native engine's decode kernels take these layers as they take
    nn.Linear (`grpo.rollout.native.plan`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def compute_adapters_in_base_dtype(policy) -> int:
    """--lora-compute base: peft's LoRA layers stop casting their input to the adapters' float32 and
    their A and B matrices multiply in the activations' dtype. Parameters, state_dict keys and saved
    adapters are unchanged. Returns how many adapter matrices were switched."""
    from peft.tuners.lora import LoraLayer

    switched = 0
    for module in policy.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False
            for linear in (*module.lora_A.values(), *module.lora_B.values()):
                if type(linear) is nn.Linear:
                    linear.__class__ = LinearInInputDtype  # same parameters, another forward
                    switched += 1
    return switched


def add_lora(model, cfg: Config):
    """rsLoRA adapters on `cfg.lora_targets`; everything else stays frozen."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        use_rslora=cfg.use_rslora, target_modules=list(cfg.lora_targets), bias="none",
        task_type="CAUSAL_LM",
    )
    policy = get_peft_model(model, lora)
    if cfg.lora_compute == "base":
        compute_adapters_in_base_dtype(policy)
        lora_addmm.install(policy)  # in training, the adapter's product added inside one GEMM
    if cfg.lean_activations:
        lean_activations.install(model)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: gradients reach the adapters without inputs requiring grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_fp8_gemm(model, cfg)
    return policy


def set_fp8_gemm(model, cfg: Config) -> int:
    """Every FP8Linear multiplies as --fp8-gemm says (see its help); returns how many there are.
    auto is dense only with checkpointing: without it autograd would keep every layer's dense weight."""
    from grpo.kernels.fp8 import FP8Linear

    dense = cfg.fp8_gemm == "dense" or (cfg.fp8_gemm == "auto" and cfg.gradient_checkpointing)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for layer in layers:
        layer.gemm = "dense" if dense else "auto"  # FP8Linear's auto: scaled_mm where it runs
    return len(layers)


def save_lora(policy, folder) -> None:
    """The adapter in PEFT's format (adapter_config.json, adapter_model.safetensors): its LoRA weights only.
    PEFT's default ("auto") also saves the whole input and output embeddings when the model's vocabulary
    differs from its base checkpoint's, as it does after Unsloth grows it to its tokenizer's length: layers
    we never train, hundreds of MB on a real model, which then no longer load into the base checkpoint
    (and "auto" asks the hub for the base's config on every save)."""
    policy.save_pretrained(str(folder), save_embedding_layers=False)


def model_positions(policy) -> int | None:
    """The most positions (prompt plus completion tokens) the model holds, where its config says."""
    return getattr(policy.get_base_model().config, "max_position_embeddings", None)


def load_policy(cfg: Config, device: torch.device | None = None):
    """(policy, tokenizer, model_dir): the PeftModel being trained and its tokenizer."""
    device = device or default_device()
    model, model_dir = load_base_model(cfg, device)
    refused = head_refusal(model)  # the trainer's log-probs must be this model's
    if refused is not None:
        raise ValueError(f"--model {cfg.model}: {refused}")
    tokenizer = load_tokenizer(model_dir)
    policy = add_lora(model, cfg)
    return policy, tokenizer, model_dir


def load_unsloth_policy(model_name: str, *, load_in_fp8: bool, max_seq_length: int, lora_rank: int,
                        lora_alpha: int, use_rslora: bool, target_modules: tuple[str, ...] | list[str],
                        seed: int, rows: int, gpu_memory_utilization: float | None = None,
                        work_dir: str = "outputs/unsloth", enforce_eager: bool = False,
                        lora_dropout: float = 0.0, use_gradient_checkpointing: Any = "unsloth"):
    """Unsloth's shared-weight setup: (model, tokenizer, engine). CUDA and unsloth+vLLM only.

    Loads with `fast_inference=True` (vLLM inside, standby on) and `max_lora_rank`; FP8 as the
    checkpoint's own quantization_config says, or quantized at load when `load_in_fp8` asks it of a
    bf16 checkpoint; then adds the same rsLoRA adapter as `load_policy` through
    `FastLanguageModel.get_peft_model`. The returned model is the policy the trainer trains.
    `rows`: the most sequences the engine generates at once (P x G, or the evaluation's), vLLM's
    max_num_seqs. `gpu_memory_utilization`: vLLM's share of the GPU, standby or not; None sizes it for `rows`
    sequences of `max_seq_length` tokens (grpo.rollout.vllm's `unsloth_share_for`). `enforce_eager` skips
    vLLM's torch.compile and CUDA graphs (minutes of start-up).
    """
    from grpo.rollout.vllm import (INSTALL_HINT, UNSLOTH_HINT, UnslothEngine, check_fp8_supported,
                                   unsloth_share_for, vllm_available, vllm_lora_rank)

    if not torch.cuda.is_available():
        raise RuntimeError(f"{UNSLOTH_HINT}; no CUDA GPU here (use --engine hf or native, or plain vLLM)")
    if gpu_memory_utilization is None:
        from transformers import AutoConfig

        model_dir = resolve_model_dir(model_name)
        gpu_memory_utilization = unsloth_share_for(
            model_dir, AutoConfig.from_pretrained(model_dir), rows=rows, max_model_len=max_seq_length,
            total_bytes=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    # A pre-quantized FP8-Block checkpoint brings its own quantization_config, which decides; Unsloth's
    # load_in_fp8 asks vLLM for per-channel FP8 on top of it, which vLLM refuses. So load_in_fp8 only
    # ever quantizes a bf16 checkpoint.
    prequantized = is_fp8_checkpoint(model_name)
    check_fp8_supported(bool(load_in_fp8) or prequantized)
    # Unsloth reads these at import: standby shares one memory pool between vLLM and training, and
    # our trainer needs the forward pass to return logits.
    os.environ["UNSLOTH_VLLM_STANDBY"] = "1"
    # Under standby Unsloth replaces gpu_memory_utilization by its own share for the GPU (0.925 x 0.95 of
    # a GPU of 40 GB or more with vLLM >= 0.11: unsloth_zoo.vllm_utils.load_vllm); this keeps the user's.
    os.environ["UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE"] = "1"
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    try:
        from unsloth import FastLanguageModel
    except ImportError as err:
        raise ImportError(f"{UNSLOTH_HINT} ({err})") from None
    if not vllm_available():
        raise ImportError(INSTALL_HINT)
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_name,
        max_seq_length=max_seq_length,
        load_in_4bit=False,
        load_in_fp8=bool(load_in_fp8) and not prequantized,
        fast_inference=True,
        max_lora_rank=vllm_lora_rank(lora_rank),
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=rows,  # Unsloth would pick 8-256 by the memory its share leaves for the KV cache
        enforce_eager=enforce_eager,  # one of the load_vllm arguments Unsloth passes on
        # load_vllm's training=True (the default) builds vLLM with processed_logprobs, renormalised over
        # what min_p keeps; False gives raw ones, the trainer's quantity at temperature 1. (It also leaves
        # the gradients out of Unsloth's estimate of vLLM's batch size; vLLM's share is ours either way.)
        training=False,
        random_state=seed,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        bias="none",
        use_gradient_checkpointing=use_gradient_checkpointing,
        random_state=seed,
    )
    engine = UnslothEngine(model, work_dir=work_dir, seed=seed, max_model_len=max_seq_length,
                           gpu_memory_utilization=gpu_memory_utilization)
    return model, tokenizer, engine


def model_summary(policy) -> dict:
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    return {"trainable_params": trainable, "total_params": total}
