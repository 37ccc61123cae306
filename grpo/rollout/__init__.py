"""Samplers behind one protocol: `native` (fast, in-process), `hf` (reference), `vllm` and `unsloth`
(external)."""

from __future__ import annotations

import torch

from grpo.rollout.base import Engine, Rollout, Sampling

__all__ = ["Engine", "Rollout", "Sampling", "build_engine", "resolve_engine_name", "unsloth_loads_the_model"]


def resolve_engine_name(name: str) -> str:
    if name == "auto":
        return "native" if torch.cuda.is_available() else "hf"
    return name


def unsloth_loads_the_model(name: str) -> bool:
    """--engine unsloth: Unsloth loads the model and its vLLM engine together
    (`grpo.model.load_unsloth_policy`), so that sampling and training share the base weights."""
    return name == "unsloth"


def build_engine(name: str, policy, *, pad_id: int, max_seq_len: int, max_batch: int, gemm: str = "auto",
                 **vllm_kwargs) -> Engine:
    """The engine `name` over `policy` (the PeftModel being trained; no weights are copied).
    `gemm`: the native engine's decode projections (NativeEngine's `gemm`). `vllm_kwargs` go to
    VLLMEngine (model_path, lora_rank, dtype, seed, work_dir) and are not used by the other engines."""
    name = resolve_engine_name(name)
    if name == "hf":
        from grpo.rollout.hf import HFEngine

        return HFEngine(policy, pad_id=pad_id)
    if name == "native":
        from grpo.rollout.native import NativeEngine

        return NativeEngine(policy, max_seq_len=max_seq_len, max_batch=max_batch, pad_id=pad_id, gemm=gemm)
    if name == "vllm":
        from grpo.rollout.vllm import VLLMEngine

        return VLLMEngine(policy, max_model_len=max_seq_len, pad_id=pad_id, **vllm_kwargs)
    if name == "unsloth":
        raise ValueError("--engine unsloth: Unsloth builds its engine as it loads the model "
                         "(grpo.model.load_unsloth_policy), not over a policy")
    raise ValueError(f"--engine {name!r} is unknown; choose auto, native, hf, vllm or unsloth")
