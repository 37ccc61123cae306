"""Samplers behind one protocol (`base.py`: `Sampling`, `Rollout`, `Engine`): `native` (fast, in-process),
`hf` (reference), `vllm` and `unsloth` (external). `build_engine` builds any of them by its `--engine` name.

An engine is built over the policy being trained, except one that loads its own (`loads_its_own_policy`:
Unsloth's, whose vLLM shares the base weights with training); the trainer then trains the engine's `policy`.
"""

from __future__ import annotations

import torch

from grpo.rollout.ahead import SampleAhead
from grpo.rollout.base import Engine, Rollout, Sampling
from grpo.rollout.hf import HFEngine
from grpo.rollout.native import EngineTuning, NativeEngine
from grpo.rollout.native.layer import refusal
from grpo.rollout.unsloth import UnslothEngine, UnslothOptions, load_unsloth
from grpo.rollout.vllm import VLLMEngine, VLLMOptions, kv_cache_bytes_for

__all__ = ["ENGINES", "Engine", "Rollout", "SampleAhead", "Sampling", "UnslothOptions", "VLLMOptions",
           "auto_refusal", "build_engine", "loads_its_own_policy", "resolve_engine_name"]

# Every engine by its --engine name ("auto" resolves to native or hf: `resolve_engine_name`).
ENGINES: dict[str, type] = {"native": NativeEngine, "hf": HFEngine, "vllm": VLLMEngine, "unsloth": UnslothEngine}


def resolve_engine_name(name: str, policy=None) -> str:
    """The engine `name` stands for: "auto" is the native engine on CUDA where it can sample from `policy`
    (`auto_refusal`), else hf; any other name is itself."""
    if name == "auto":
        return "native" if torch.cuda.is_available() and auto_refusal(policy) is None else "hf"
    return name


def auto_refusal(policy) -> str | None:
    """Why --engine auto does not take the native engine for `policy` (a model family it does not
    reproduce), or None (no policy given: not asked)."""
    return None if policy is None else refusal(policy)


def loads_its_own_policy(name: str) -> bool:
    """Whether engine `name` loads the policy itself (its class says so with `loads_policy`): build it with
    policy None, then train its `policy` with its `tokenizer`. Unsloth's does, so that sampling and training
    share the base weights."""
    return bool(getattr(ENGINES.get(name), "loads_policy", False))


def build_engine(name: str, policy, *, pad_id: int, max_seq_len: int, max_batch: int, gemm: str = "auto",
                 attention: str = "auto", fold_adapter: bool = False, vllm: VLLMOptions | None = None,
                 unsloth: UnslothOptions | None = None) -> Engine:
    """The engine `name` over `policy` (the PeftModel being trained; no weights are copied), or, for an engine
    that loads its own policy (`loads_its_own_policy`), with policy None.
    `max_seq_len`: a prompt and its completion, at most; `max_batch`: the most rows it generates at once.
    `gemm`: the native engine's decode projections (NativeEngine's `gemm`); `attention`: its attention over
    the KV cache ("sdpa", "kernel", or "auto": `EngineTuning`'s, by the engine's `max_batch` rows);
    `fold_adapter`: its adapters folded into the weights for each generation (`EngineTuning.fold_adapter`).
    `vllm`: what the vLLM engine needs besides (required for name "vllm"); `unsloth`: what Unsloth's engine
    needs to load its policy (required for name "unsloth"). Neither is used by the others."""
    name = resolve_engine_name(name, policy)
    if name == "hf":
        return HFEngine(policy, pad_id=pad_id)
    if name == "native":
        tuning = EngineTuning(attention=attention, fold_adapter=fold_adapter)  # it checks the name
        return NativeEngine(policy, max_seq_len=max_seq_len, max_batch=max_batch, pad_id=pad_id, gemm=gemm,
                            tuning=tuning)
    if name == "vllm":
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
        if unsloth is None or policy is not None:
            raise ValueError("--engine unsloth: build_engine needs unsloth=UnslothOptions(...) (the model, its "
                             "adapter, seed and a work folder) and policy None: the engine loads the policy "
                             "itself, and the trainer trains engine.policy")
        return load_unsloth(unsloth, max_seq_length=max_seq_len, rows=max_batch)
    raise ValueError(f"--engine {name!r} is unknown; choose auto, {', '.join(ENGINES)}")
