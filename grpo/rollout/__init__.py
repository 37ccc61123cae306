"""Samplers behind one protocol: `native` (fast, in-process), `hf` (reference), `vllm` and `unsloth`
(external). `options.py` holds the sampling numbers' ranges, torch-free, for the command line too."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo.rollout.base import Engine

__all__ = ["Engine", "Rollout", "Sampling", "VLLMOptions", "auto_refusal", "build_engine", "resolve_engine_name",
           "unsloth_loads_the_model"]


def __getattr__(name: str):
    # The types load on first use (`from grpo.rollout import Sampling` works as usual), so that importing
    # grpo.rollout.options, as the command line does, does not import torch.
    if name in ("Engine", "Rollout", "Sampling"):
        return getattr(importlib.import_module("grpo.rollout.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_engine_name(name: str, policy=None) -> str:
    """The engine `name` stands for: "auto" is the native engine on CUDA where it can sample from `policy`
    (`auto_refusal`), else hf; any other name is itself."""
    import torch

    if name == "auto":
        return "native" if torch.cuda.is_available() and auto_refusal(policy) is None else "hf"
    return name


def auto_refusal(policy) -> str | None:
    """Why --engine auto does not take the native engine for `policy` (a model family it does not
    reproduce), or None (no policy given: not asked)."""
    if policy is None:
        return None
    from grpo.rollout.native.layer import refusal

    return refusal(policy)


def unsloth_loads_the_model(name: str) -> bool:
    """--engine unsloth: Unsloth loads the model and its vLLM engine together
    (`grpo.model.load.load_unsloth_policy`), so that sampling and training share the base weights."""
    return name == "unsloth"


@dataclass(frozen=True)
class VLLMOptions:
    """What only the vLLM engine needs: it loads the base checkpoint itself and is sent the adapter."""

    model_path: str  # the base checkpoint's folder
    lora_rank: int  # the adapter's rank (vLLM reserves room for it)
    dtype: str  # a dtype flag's value (auto, bf16, fp32, ...)
    seed: int
    work_dir: str  # where each step's adapter is written for vLLM to read
    # vLLM's share of the GPU; None: a KV cache sized for the engine's rows at full length instead
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False  # no torch.compile or CUDA graphs in vLLM (tests, tiny models)


def build_engine(name: str, policy, *, pad_id: int, max_seq_len: int, max_batch: int, gemm: str = "auto",
                 attention: str = "auto", fold_adapter: bool = False, vllm: VLLMOptions | None = None) -> Engine:
    """The engine `name` over `policy` (the PeftModel being trained; no weights are copied).
    `gemm`: the native engine's decode projections (NativeEngine's `gemm`); `attention`: its attention over
    the KV cache ("sdpa", "kernel", or "auto": `EngineTuning`'s, by the engine's `max_batch` rows);
    `fold_adapter`: its adapters folded into the weights for each generation (`EngineTuning.fold_adapter`).
    `vllm`: what the vLLM engine needs besides (required for name "vllm", not used by the others)."""
    name = resolve_engine_name(name, policy)
    if name == "hf":
        from grpo.rollout.hf import HFEngine

        return HFEngine(policy, pad_id=pad_id)
    if name == "native":
        from grpo.rollout.native import EngineTuning, NativeEngine

        tuning = EngineTuning(attention=attention, fold_adapter=fold_adapter)  # it checks the name
        return NativeEngine(policy, max_seq_len=max_seq_len, max_batch=max_batch, pad_id=pad_id, gemm=gemm,
                            tuning=tuning)
    if name == "vllm":
        from grpo.rollout.vllm import VLLMEngine, kv_cache_bytes_for

        if vllm is None:
            raise ValueError("--engine vllm: build_engine needs vllm=VLLMOptions(...) (the base checkpoint's "
                             "folder, the adapter's rank, dtype, seed and a work folder)")
        if vllm.gpu_memory_utilization is None:  # the KV cache this run's rows need, and no more
            memory = {"kv_cache_bytes": kv_cache_bytes_for(policy.config, rows=max_batch,
                                                           max_model_len=max_seq_len, dtype=vllm.dtype)}
        else:
            memory = {"gpu_memory_utilization": vllm.gpu_memory_utilization}
        return VLLMEngine(policy, vllm.model_path, lora_rank=vllm.lora_rank, max_model_len=max_seq_len,
                          dtype=vllm.dtype, seed=vllm.seed, work_dir=vllm.work_dir, pad_id=pad_id,
                          enforce_eager=vllm.enforce_eager, **memory)
    if name == "unsloth":
        raise ValueError("--engine unsloth: Unsloth builds its engine as it loads the model "
                         "(grpo.model.load.load_unsloth_policy), not over a policy")
    raise ValueError(f"--engine {name!r} is unknown; choose auto, native, hf, vllm or unsloth")
