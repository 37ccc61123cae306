"""Loading the policy: a local or cached checkpoint in bf16/fp32, an FP8-Block checkpoint, or a bf16
checkpoint quantized to FP8 at load; rsLoRA adapters through peft; gradient checkpointing; and the check that
the trainer's fused log-probs are the model's own (`head_refusal`).

Helpers it owns: `grpo/model/fp8_checkpoint.py` (telling FP8 checkpoints apart, loading FP8-Block ones).
Not here: the FP8 format and kernels themselves (`grpo/kernels/fp8.py`), any second copy of the model (the
reference policy is this same model with its adapters disabled), and Unsloth's loading, which builds the model
with its vLLM engine (`grpo/rollout/unsloth.py`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo.config import DTYPES, LORA_TARGETS, Config
from grpo.kernels.fp8 import FP8Linear, quantize_linears_
from grpo.model import compiled_layers, lean_activations, lora_addmm, rotary_attention
from grpo.model.fp8_checkpoint import is_fp8_checkpoint, load_fp8_block_model
from grpo.model.lora_addmm import LinearInInputDtype
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

    torch puts cuDNN's attention first on Hopper, and cuDNN builds a plan for every new shape, which costs far
    more than the call it plans. A run never repeats its shapes (each step's prompts and micro-batches have new
    widths), so it trades cuDNN's planned kernel for flash's unplanned one, the same speed without a plan
    (benchmarks/RESULTS.md, "The measured defaults"). cuDNN's backward was also the one that returned NaN under
    a padding mask (`grpo.batch.sequence_logprobs`)."""
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    vllm_before = "vllm" in sys.modules
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:  # vLLM turns cuDNN's attention off for the process when imported: a run that imported it keeps that
        if not ("vllm" in sys.modules and not vllm_before):
            torch.backends.cuda.enable_cudnn_sdp(was_enabled)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block the LoRA layers of `model` (peft's) compute their base layer alone, and after it, however it
    ends, they come back as they were, requires_grad included (peft's switch sets the adapters' requires_grad): the
    reference policy of the KL term, and the native engine's folded prefill (its weights hold the adapters, which
    peft's layers must not add again). Each layer is switched by itself, not through peft's `disable_adapter()`,
    which on every entry asks for the model's status (every module walked many times over, each adapter layer
    formatted as text: Python calls by the ten thousand for the bench's 112 adapted projections, on the host
    between the step's phases; benchmarks/probes/train_ops.py counts them)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.disable_adapters]
    grads = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    try:
        for m in layers:
            m.enable_adapters(False)
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)


def load_tokenizer(model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(cfg: Config, device: torch.device):
    """The frozen base model on `device`: FP8-Block checkpoints and --load-in-fp8 give FP8 linears."""
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


def compute_adapters_in_base_dtype(policy) -> int:
    """--lora-compute base: peft's LoRA layers stop casting their input to the adapters' float32 and
    their A and B matrices multiply in the activations' dtype. Parameters, state_dict keys and saved
    adapters are unchanged. Returns how many adapter matrices were switched."""
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
    rotary_attention.install(model)  # the rotary in one launch each way where its kernel runs
    on_cuda = next(model.parameters()).device.type == "cuda"
    if on_cuda and cfg.compile_layers == "auto" and not cfg.gradient_checkpointing:
        compiled_layers.install(model)  # after the modules' own changes: the layers it refuses keep them
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: gradients reach the adapters without inputs requiring grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_fp8_gemm(model, cfg)
    return policy


def set_fp8_gemm(model, cfg: Config) -> int:
    """Every FP8Linear multiplies as --fp8-gemm says (see its help); returns how many there are.
    auto is dense only with checkpointing: without it autograd would keep every layer's dense weight."""
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


def head_refusal(model) -> str | None:
    """Why the trainer's log-probs (`grpo.batch.sequence_logprobs`) would not give `model`'s own log-probs, or None when it does.

    It runs the decoder (`model.model`) and multiplies by the output embedding's weight itself. That is
    the model only where its forward does nothing after that product: Granite divides the logits by
    `logits_scaling`, Gemma 2 and 3 soft-cap them, Cohere scales them, some heads add a bias. So this
    compares, on a few tokens, the model's logits with that product (a rounding apart at most)."""
    decoder, head = getattr(model, "model", None), model.get_output_embeddings()
    name = getattr(model.config, "model_type", type(model).__name__)
    if decoder is None or head is None:
        return f"model {name!r} has no .model decoder or no output embedding, which the trainer's log-probs read"
    if getattr(head, "bias", None) is not None:
        return f"model {name!r}'s output layer has a bias, which the trainer's fused log-probs leave out"
    ids = torch.arange(1, 9, device=head.weight.device)[None] % head.weight.shape[0]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        product = (decoder(input_ids=ids, use_cache=False).last_hidden_state @ head.weight.t()).float()
    if not torch.allclose(logits, product, rtol=1e-2, atol=1e-2):
        off = (logits - product).abs().max().item()
        return (f"model {name!r} changes its logits after the output layer (by up to {off:.3g} on 8 tokens: "
                "a scaling, a soft cap), which the trainer's fused log-probs leave out; train a model whose "
                "logits are the output layer's product (Llama, Mistral, Qwen2, Qwen3, SmolLM2, ...)")
    return None


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


def model_summary(policy) -> dict:
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    return {"trainable_params": trainable, "total_params": total}
