"""What the benchmark suite is built from: the model, the prompts, the configs, the TRL peer, the results.

- `build_model_dir`: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32/8 heads, vocab 128256,
  tied embeddings, llama3 rope), randomly initialised, saved with the real Llama 3.2 tokenizer
  (`grpo.assets`). There is no model hub here; the step's cost depends on shapes, not on weights.
- `write_prompts`: a JSONL whose every question makes a chat prompt (`grpo.data.chat_prompt`) of
  exactly `prompt_len` tokens, so prompt and completion lengths (with `fixed_lengths`) are fixed.
- `step_config`: the `grpo.config.Config` of one shape: rsLoRA r=32 on the 7 projections, beta 0.04,
  8-bit AdamW, gradient checkpointing, the native engine, in bf16 or FP8; `fixed_lengths`: the trainer's
  sampling with EOS ignored, so that every completion runs to the shape's length.
- `summarize_steps`: steady-state medians of the trainer's per-step records (metrics.jsonl).
- `run_trl`: the peer, TRL's GRPOTrainer on the same model, prompts, lengths and hyperparameters (sampling
  with transformers or with vLLM colocated); `run_unsloth_grpo`: Unsloth's own GRPO, the seed recipe's way.
- `Results`: the records of one run, written to `benchmarks/results/<date>-<gpu>.json` as they come.

What it deliberately is not: a second trainer. The step measured is `grpo.trainer.train`; nothing here
reimplements a phase of it, and the one thing changed is its sampling's `ignore_eos` (`fixed_lengths`).
Nothing happens at import.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import platform
import random
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from grpo.config import LORA_TARGETS, VLLM_GPU_MEMORY_UTILIZATION

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration: P prompts x G completions of fixed lengths."""

    name: str
    prompts: int  # P
    generations: int  # G
    prompt_len: int
    completion_len: int

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len


# The bench config (16 rows of 128 + 512 tokens), and the seed's long config (recipe B: 288 + 1760 = 2048 tokens).
BENCH = Shape("bench", 4, 4, 128, 512)
LONG = Shape("long", 4, 4, 288, 1760)
# Plumbing check on a CPU (--bench-smoke): the same code paths on a tiny model.
SMOKE_BENCH = Shape("bench", 2, 2, 96, 6)
SMOKE_LONG = Shape("long", 2, 2, 112, 10)
# Users outgrow 16 rows: the bench config's lengths at 16, 64 and 256 rows (G=4), for the sampler sweep and
# the GRPO step at more rows; the smoke run's at 4, 8 and 16.
SCALE = {16: BENCH, 64: Shape("rows64", 16, 4, 128, 512), 256: Shape("rows256", 64, 4, 128, 512)}
SMOKE_SCALE = {16: Shape("rows16", 2, 2, 96, 6), 64: Shape("rows64", 4, 2, 96, 6),
               256: Shape("rows256", 8, 2, 96, 6)}

# Measured on this project's H200 (benchmarks/RESULTS.md): TRL 1.16 GRPOTrainer, same random-init model,
# forced lengths. The long config is too slow to rerun in every lease, so it is quoted, marked as such.
TRL_QUOTED = {
    "bench": {"step_time_s": 14.6, "peak_alloc_gib": 4.54, "peak_reserved_gib": None},
    "long": {"step_time_s": 67.6, "peak_alloc_gib": 9.55, "peak_reserved_gib": 14.1},
}
QUOTE_NOTE = "quoted: TRL 1.16 on this project's H200, same random-init model, forced lengths"
# The peers that sample with vLLM, and ours on Unsloth's engine, take the same share of the GPU (our share
# for Unsloth's engine; Unsloth's standby would take 0.88, TRL's default is 0.3). Ours with --engine vllm runs
# at its default: a KV cache sized for the step's rows, which is what sets it apart in nvidia-smi's peak.
VLLM_SHARE = VLLM_GPU_MEMORY_UTILIZATION
# The peer that the engines of ours that sample with vLLM aim at: Unsloth's own GRPO (the seed's way).
ENGINE_PEER = "unsloth-grpo"


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------
def model_config(size: str = "1b"):
    """LlamaConfig of Llama-3.2-1B ("1b"), or a tiny one with the same vocabulary ("tiny")."""
    from transformers import LlamaConfig

    if size == "1b":
        dims = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072)
    elif size == "tiny":
        dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    else:
        raise ValueError(f"model size {size!r}: use '1b' or 'tiny'")
    common = dict(vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=128000,
                  eos_token_id=[128001, 128008, 128009], pad_token_id=128004, **dims)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    try:  # transformers 5 spells it rope_parameters
        return LlamaConfig(rope_parameters=rope, **common)
    except TypeError:
        return LlamaConfig(rope_theta=500000.0, rope_scaling=rope, **common)


def build_model_dir(path: str | Path, size: str = "1b", device: str = "cuda", seed: int = 0) -> Path:
    """Save a randomly initialised Llama (bf16) and the real Llama 3.2 tokenizer into `path`."""
    import torch
    from transformers import LlamaForCausalLM

    from grpo.assets import llama_tokenizer_dir

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16 directly: no fp32 copy of 1.2B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(model_config(size))
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = [128001, 128008, 128009]
    model.generation_config.bos_token_id = 128000
    model.generation_config.pad_token_id = 128004
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(partial)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # as shipped: save_pretrained's copy loads slower
        shutil.copy(llama_tokenizer_dir() / name, partial / name)
    del model
    free_memory()
    partial.rename(path)
    return path


# --------------------------------------------------------------------------------------------------
# Prompts of an exact length
# --------------------------------------------------------------------------------------------------
_WORDS = ("apple", "river", "stone", "green", "seven", "table", "light", "music", "cloud", "paper", "house",
          "bread", "train", "glass", "chair", "water", "field", "north", "metal", "story", "plant", "night")


def fixed_length_question(tokenizer, prompt_len: int, rng: random.Random, index: int) -> tuple[str, str]:
    """A question whose chat prompt is exactly `prompt_len` tokens, and its answer."""
    from grpo.data import chat_prompt

    a, b = rng.randint(10, 999), rng.randint(10, 999)
    words = [rng.choice(_WORDS) for _ in range(4 * prompt_len)]

    def question(k: int) -> str:
        return f"Note {index}: {' '.join(words[:k])}. What is {a} plus {b}?"

    def length(k: int) -> int:
        return len(tokenizer(chat_prompt(tokenizer, question(k)), add_special_tokens=False)["input_ids"])

    base = length(0)
    if base > prompt_len:
        raise ValueError(f"prompt_len {prompt_len}: the chat template alone takes {base} tokens; use more")
    k = prompt_len - base  # each filler word is about one token
    for _ in range(20):
        n = length(k)
        if n == prompt_len:
            return question(k), str(a + b)
        k = max(0, k + prompt_len - n)
    raise RuntimeError(f"could not make a prompt of exactly {prompt_len} tokens (last {n})")


def write_prompts(path: str | Path, tokenizer, prompt_len: int, n: int = 64, seed: int = 0) -> Path:
    """A JSONL of `n` question/answer rows whose chat prompts are all `prompt_len` tokens long."""
    rng = random.Random(f"bench-prompts:{seed}:{prompt_len}")
    path = Path(path)
    with path.open("w") as f:
        for i in range(n):
            q, a = fixed_length_question(tokenizer, prompt_len, rng, i)
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# Our step
# --------------------------------------------------------------------------------------------------
def step_config(model_dir: str | Path, dataset: str | Path, shape: Shape, *, fp8: bool, steps: int,
                output_dir: str | Path, cuda: bool = True, **overrides: Any):
    """The recipe at `shape`: rsLoRA r=32 alpha=64 on the 7 projections, beta 0.04, 8-bit AdamW,
    gradient checkpointing, the native engine; bf16 or FP8 base weights. Train it inside `fixed_lengths`."""
    from grpo.config import Config

    values = dict(
        model=str(model_dir), dataset=str(dataset), load_in_fp8=fp8, dtype="bf16" if cuda else "auto",
        lora_rank=32, lora_alpha=64, use_rslora=True, lora_targets=LORA_TARGETS, gradient_checkpointing=True,
        max_prompt_length=shape.prompt_len, max_completion_length=shape.completion_len,
        max_seq_length=shape.seq_len, prompts_per_step=shape.prompts, num_generations=shape.generations,
        beta=0.04, optim="adamw_8bit", engine="native", temperature=1.0, min_p=0.1,
        max_steps=steps, save_steps=0, eval_size=0, log_completions_steps=0, output_dir=str(output_dir),
        seed=3407,
    )
    values.update(overrides)
    return Config(**values)


def policy_with_random_b(model_dir: str | Path, dataset: str | Path, shape: Shape, *, root: str | Path,
                         cuda: bool):
    """(policy, tokenizer): the bench model in bf16 with the recipe's rsLoRA adapter, its B matrices random
    (seeded, N(0, 1e-3)) so that the adapter changes what is sampled."""
    import torch

    from grpo.model.load import load_policy

    cfg = step_config(model_dir, dataset, shape, fp8=False, steps=1, output_dir=Path(root) / "unused", cuda=cuda)
    policy, tokenizer, _ = load_policy(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 1e-3).to(p.device, p.dtype))
    return policy, tokenizer


@contextmanager
def fixed_lengths() -> Iterator[None]:
    """Inside, `grpo.trainer.train` samples with EOS ignored (`Sampling.ignore_eos`, the engines' switch for
    benchmarks): every completion runs to max-completion-length, so step times compare at fixed lengths (a
    random-init model would stop at an EOS by chance). The trainer's Config has no such flag: no user wants it."""
    from grpo import trainer  # torch and the model stack, only where a step runs: collection stays light

    set_up = trainer.set_up_steps

    def set_up_at_fixed_lengths(*args, **kwargs):
        setup, *rest = set_up(*args, **kwargs)
        return (replace(setup, sampling=replace(setup.sampling, ignore_eos=True)), *rest)

    trainer.set_up_steps = set_up_at_fixed_lengths
    try:
        yield
    finally:
        trainer.set_up_steps = set_up


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_steps(records: list[dict], warmup: int, rows: int | None = None) -> dict:
    """Steady state of a run: medians over the records after the first `warmup` steps.

    `phases_s` holds the trainer's own phase timers; `other_s` is the rest of the step (scoring,
    batching, logging). Peak memory is the largest of the steady steps' peaks.
    """
    if not records:
        raise ValueError("summarize_steps: no step records; did the run write metrics.jsonl?")
    steady = records[warmup:] if len(records) > warmup else records[-1:]
    step_time = statistics.median(r["step_time"] for r in steady)
    phase_keys = [k for k in steady[0] if k.startswith("time/")]
    phases = {k[len("time/"):]: statistics.median(r[k] for r in steady) for k in phase_keys}
    out = {
        "steps": len(records), "steady_steps": len(steady), "step_time_s": step_time,
        "step_times_s": [round(r["step_time"], 4) for r in records],
        # each step's seconds in Python's garbage collector (inside its phases): a slow step's collection shows here
        **({"step_gc_s": [round(r["gc_time"], 4) for r in records]} if all("gc_time" in r for r in records) else {}),
        # Top-level phases are disjoint; "generate/capture" and the like are parts of "generate".
        "phases_s": phases, "other_s": max(0.0, step_time - sum(v for k, v in phases.items() if "/" not in k)),
        "peak_alloc_gib": max(r["peak_mem_gib"] for r in steady),
        **({"engine_pool_gib": steady[0]["engine_pool_gib"]} if "engine_pool_gib" in steady[0] else {}),
        "completion_length": statistics.median(r["completion_length"] for r in steady),
        # The sampler-trainer gap (|log pi_train - log pi_sampler| over the completion tokens), per engine
        "gap": {k[len("gap/"):]: statistics.median(r[k] for r in steady) for k in steady[0] if k.startswith("gap/")},
    }
    if rows is not None:
        out["completion_tokens_per_s"] = rows * out["completion_length"] / step_time
    return out


# --------------------------------------------------------------------------------------------------
# The peer: TRL's GRPOTrainer
# --------------------------------------------------------------------------------------------------
def trl_dataset_rows(tokenizer, dataset: str | Path, shape: Shape) -> list[dict]:
    """Our prompts of a JSONL file at `shape`'s prompt length, as TRL reads them (`trl_prompt_rows`)."""
    from grpo.data import build_prompts, load_jsonl

    return trl_prompt_rows(tokenizer, build_prompts(tokenizer, load_jsonl(dataset), shape.prompt_len))


def trl_prompt_rows(tokenizer, prompt_set, order: list[int] | None = None) -> list[dict]:
    """The prompts of a `grpo.data.PromptSet` (in `order`, repeats allowed; default: as they stand) as rows
    of plain-text prompts with their answers. TRL tokenizes a plain-text prompt with the tokenizer's
    default special tokens, which prepend BOS, so the text goes without ours; every prompt is checked to
    reach the model as exactly our ids."""
    bos = tokenizer.bos_token or ""
    rows, checked = [], set()
    for i in range(len(prompt_set)) if order is None else order:
        text, example = prompt_set.prompts[i], prompt_set.examples[i]
        plain = text[len(bos):] if bos and text.startswith(bos) else text
        if i not in checked:
            if tokenizer(plain)["input_ids"] != prompt_set.prompt_ids[i]:
                raise RuntimeError(f"prompt {i}: TRL would see other token ids than ours, and the comparison would "
                                   "be unfair; fix: a tokenizer whose default special tokens are only a BOS")
            checked.add(i)
        rows.append({"prompt": plain, "answer": example.answer})
    return rows


def _trl_peer_parts(tokenizer, dataset: str | Path, shape: Shape, cuda: bool):
    """What every TRL-based peer shares: the prompts as a datasets.Dataset, our four-tier reward as a TRL
    reward function, and a callback that times each optimizer step (synchronized) with its peak memory."""
    import datasets

    from grpo import rewards as grpo_rewards

    train_set = datasets.Dataset.from_list(trl_dataset_rows(tokenizer, dataset, shape))
    funcs = grpo_rewards.reward_functions("dapo")

    def four_tier(completions, answer, **_):
        columns = [fn(list(completions), list(answer)) for fn in funcs]
        return [float(sum(vals)) for vals in zip(*columns)]

    return train_set, four_tier, step_clock(cuda)


def step_clock(cuda: bool):
    """A TrainerCallback that times each optimizer step (generation included; synchronized on CUDA) and
    reads its peak memory: one record per step in its `records`, printed as it comes."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.records: list[dict] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec = {"step": state.global_step, "step_time": time.perf_counter() - self.t0}
            if cuda:
                rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / GiB
                rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
            else:
                rec["peak_mem_gib"] = 0.0
            print(f"[peer] step {rec['step']}: {rec['step_time']:.3f} s", flush=True)  # a run cut short still reports
            self.records.append(rec)

    return StepClock()


def _grpo_config_values(shape: Shape, *, steps: int, output_dir: str | Path, cuda: bool, seed: int) -> dict:
    """Our recipe in GRPOConfig's terms (TRL 1.15 and 1.16 alike)."""
    import torch

    return dict(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=shape.rows,
        gradient_accumulation_steps=1, num_generations=shape.generations,
        max_completion_length=shape.completion_len,
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.1, beta=0.04, loss_type="grpo", scale_rewards="group",
        num_iterations=1, epsilon=0.2, learning_rate=5e-6, weight_decay=0.001, warmup_steps=0.1,
        lr_scheduler_type="linear", optim="adamw_8bit", adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, seed=seed, dataloader_num_workers=0,
    )


def _finish_trl_run(trainer, clock) -> list[dict]:
    trainer.train()
    lengths = [r["completions/min_length"] for r in trainer.state.log_history if "completions/min_length" in r]
    for rec, length in zip(clock.records, lengths):
        rec["completion_length"] = length  # the shortest completion of the step
    return clock.records


def run_trl(model_dir: str | Path, dataset: str | Path, shape: Shape, *, steps: int, output_dir: str | Path,
            cuda: bool = True, seed: int = 3407, vllm_share: float | None = None) -> list[dict]:
    """TRL's GRPOTrainer at `shape` with our recipe; one record per optimizer step (time, peak memory).

    Same model (bf16, rsLoRA r=32 alpha=64 on the 7 projections, reference = adapters disabled),
    same prompts, completions forced to `shape.completion_len`, the same four-tier reward, beta 0.04, the
    GRPO sequence-mean loss, 8-bit AdamW, gradient checkpointing. `vllm_share`: sample with vLLM colocated
    in this process (`use_vllm=True, vllm_mode="colocate"`, sleeping while training) holding that share of
    the GPU; None samples with transformers' generate.
    """
    try:
        import datasets  # noqa: F401  (the prompts go to TRL as a datasets.Dataset)
        import trl
    except ImportError:
        raise ImportError("the TRL peer needs trl and datasets: pip install trl datasets") from None
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_set, four_tier, clock = _trl_peer_parts(tokenizer, dataset, shape, cuda)
    values = _grpo_config_values(shape, steps=steps, output_dir=output_dir, cuda=cuda, seed=seed)
    values["model_init_kwargs"] = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if vllm_share is None:
        values["generation_kwargs"] = {"min_new_tokens": shape.completion_len}  # EOS ignored: fixed lengths
    else:
        values.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=vllm_share,
                      vllm_enable_sleep_mode=True, vllm_max_model_length=shape.seq_len,
                      generation_kwargs={"ignore_eos": True})
    lora = LoraConfig(r=32, lora_alpha=64, use_rslora=True, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=four_tier, args=trl.GRPOConfig(**values),
                              train_dataset=train_set, processing_class=tokenizer, peft_config=lora, callbacks=[clock])
    records = _finish_trl_run(trainer, clock)
    del trainer
    free_memory()
    return records


def run_unsloth_grpo(model_dir: str | Path, dataset: str | Path, shape: Shape, *, steps: int,
                     output_dir: str | Path, seed: int = 3407, vllm_share: float = VLLM_SHARE) -> list[dict]:
    """Unsloth's own GRPO as the seed recipe runs it: Unsloth loads the checkpoint (FP8-Block: its own
    quantization_config decides) with its vLLM engine inside (`fast_inference=True`, standby on), adds the
    same rsLoRA adapter with Unsloth's gradient checkpointing, and TRL's GRPOTrainer (the TRL Unsloth
    supports) trains with our recipe, sampling through vLLM with min_p 0.1 and EOS ignored. Importing
    unsloth patches transformers and TRL for the whole process: run it alone. vLLM gets `vllm_share` of the
    GPU, as ours does: standby would raise it to its own (0.88 on an H200) without the override."""
    import os

    os.environ["UNSLOTH_VLLM_STANDBY"] = "1"  # read at import
    os.environ["UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE"] = "1"  # read as Unsloth builds vLLM
    try:
        from unsloth import FastLanguageModel
    except ImportError:
        raise ImportError("the Unsloth peer needs unsloth and vLLM: pip install unsloth vllm") from None
    import trl
    from vllm import SamplingParams

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(model_dir), max_seq_length=shape.seq_len, load_in_4bit=False, load_in_fp8=False,
        fast_inference=True, max_lora_rank=32, gpu_memory_utilization=vllm_share, random_state=seed)
    model = FastLanguageModel.get_peft_model(
        model, r=32, lora_alpha=64, use_rslora=True, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
        bias="none", use_gradient_checkpointing="unsloth", random_state=seed)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_set, four_tier, clock = _trl_peer_parts(tokenizer, dataset, shape, cuda=True)
    values = _grpo_config_values(shape, steps=steps, output_dir=output_dir, cuda=True, seed=seed)
    values.update(use_vllm=True, vllm_sampling_params=SamplingParams(min_p=0.1, ignore_eos=True,
                                                                     max_tokens=shape.completion_len))
    values.pop("gradient_checkpointing_kwargs")  # Unsloth's own checkpointing is on the model
    trainer = trl.GRPOTrainer(model=model, reward_funcs=four_tier, args=trl.GRPOConfig(**values),
                              train_dataset=train_set, processing_class=tokenizer, callbacks=[clock])
    return _finish_trl_run(trainer, clock)


# --------------------------------------------------------------------------------------------------
# Memory, environment, results
# --------------------------------------------------------------------------------------------------
def free_memory() -> None:
    """Collect garbage and return cached device memory, so the next measurement starts clean.

    Compiled code (the native engine's torch.compile'd step) can hold tensors of a model that is
    otherwise gone; dropping dynamo's caches releases them (the next engine compiles anew anyway).
    """
    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def memory_info() -> dict:
    """Peak allocated and reserved device memory since the last reset, GiB (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {"peak_alloc_gib": 0.0, "peak_reserved_gib": 0.0}
    return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB}


class GpuUsedMemory:
    """Peak GPU memory in use while the block runs, as nvidia-smi reads it, less what was in use when it
    began: the one reading that sees every engine alike, vLLM's pool included, which torch's counters do
    not. `peak_gib` is None where nvidia-smi is missing. Polled every 0.5 s: each reading starts a process,
    and the step being timed is partly host-bound; the pools it reads (torch's cache, vLLM's) are held for
    seconds, not milliseconds."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak_gib: float | None = None
        self._baseline = self._peak = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def read_mib() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", "0"], capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _poll(self) -> None:
        while not self._stop.is_set():
            used = self.read_mib()
            if used is not None:
                self._peak = used if self._peak is None else max(self._peak, used)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "GpuUsedMemory":
        self._baseline = self.read_mib()
        if self._baseline is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._baseline is None:
            return
        self._stop.set()
        self._thread.join()
        self.peak_gib = max(0.0, (self._peak or self._baseline) - self._baseline) / 1024


def weight_bytes(model) -> int:
    """Bytes of parameters a decode step reads: every unique parameter storage once (the tied
    embedding is read as the lm_head; its embedding lookup of one token per row is negligible)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def environment() -> dict:
    """The GPU and the versions that matter to the numbers."""
    import importlib.metadata

    import torch

    versions = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "triton", "trl", "accelerate", "datasets",
                "pytest-benchmark", "vllm", "unsloth"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        versions["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(0)
        device = {"gpu": gpu, "capability": f"{props.major}.{props.minor}",
                  "memory_gib": round(props.total_memory / GiB, 1)}
    else:
        device = {"gpu": "cpu", "capability": None, "memory_gib": None}
    return {**device, "versions": versions}


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200'; used in the results file name."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    return slug or "unknown"


def ratio_to_peer(ours: float | None, peer: float | None) -> float | None:
    if ours is None or peer is None or peer <= 0 or not math.isfinite(ours):
        return None
    return ours / peer


class Results:
    """The records of one suite run; `add` rewrites the whole JSON file, so a run cut short keeps
    everything it finished."""

    def __init__(self, directory: str | Path, command: str, smoke: bool = False, date: str | None = None,
                 join: str | Path | None = None):
        env = environment()
        if join is not None and Path(join).exists():  # one suite run over several processes: add to it
            self._join(Path(join), command, env)
            return
        self.meta = {
            "date": date or datetime.date.today().isoformat(), **env, "command": command, "smoke": smoke,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),  # orders runs of one day
        }
        stem = f"{self.meta['date']}-{gpu_slug(env['gpu'])}{'-smoke' if smoke else ''}"
        self.path = Path(directory) / f"{stem}.json"
        run = 2
        while self.path.exists():  # a second run the same day gets its own file, never the first one's
            self.path = Path(directory) / f"{stem}-run{run}.json"
            run += 1
        if join is not None:  # the first process of a joined run names the file the others add to
            self.path = Path(join)
        self.records: list[dict] = []
        self.process = 0  # which process of a joined run made a record: 0 is the first

    def _join(self, path: Path, command: str, env: dict) -> None:
        """Continue the run in `path`: its records and meta stay; this process's command and versions are
        listed under "joined", and its records say which process made them ("process": 1, 2, ...)."""
        payload = json.loads(path.read_text())
        self.records = payload.pop("records")
        for key in ("comparisons", "engine_comparisons"):
            payload.pop(key, None)
        self.meta = payload
        joined = self.meta.setdefault("joined", [])
        joined.append({"command": command, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                       "versions": env["versions"]})
        self.process = len(joined)
        self.path = path

    def add(self, benchmark, *, group: str, config: str | None = None, impl: str | None = None,
            dtype: str | None = None) -> dict:
        stats = getattr(getattr(benchmark, "stats", None), "stats", None)
        timing = None
        if stats is not None:
            timing = {k: getattr(stats, k) for k in ("median", "min", "max", "mean", "stddev", "rounds")}
        rec = {"name": benchmark.name, "group": group, "config": config, "impl": impl, "dtype": dtype,
               "measured": True, "timing_s": timing, "extra_info": dict(benchmark.extra_info),
               "process": self.process}
        self.records.append(rec)
        self.write()
        return rec

    def step_rows(self) -> list[dict]:
        """One row per (config, impl, dtype) step record, plus TRL's quoted figures."""
        return step_rows(self.records)

    def write(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {**self.meta, "records": self.records, "comparisons": comparisons(self.records),
                   "engine_comparisons": engine_comparisons(self.records)}
        self.path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")
        return self.path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)


def step_rows(records: list[dict]) -> list[dict]:
    """Step records as flat rows: config, impl, dtype, step time, peak memory, quoted or measured."""
    rows = []
    for rec in records:
        if rec.get("group") != "step":
            continue
        info = rec.get("extra_info", {})
        peak = info.get("peak_alloc_gib")
        if peak is not None:  # what the run itself needed: less what the process held before it started
            peak -= info.get("baseline_alloc_gib") or 0.0
        rows.append({"config": rec["config"], "impl": rec["impl"], "dtype": rec["dtype"],
                     "step_time_s": info.get("step_time_s"), "peak_alloc_gib": peak,
                     "peak_reserved_gib": info.get("peak_reserved_gib"), "measured": rec.get("measured", True),
                     "peak_gpu_used_gib": info.get("peak_gpu_used_gib"), "engine_pool_gib": info.get("engine_pool_gib"),
                     "phases_s": info.get("phases_s", {}), "other_s": info.get("other_s"),
                     "completion_tokens_per_s": info.get("completion_tokens_per_s"),
                     "note": info.get("note")})
    for config, quoted in TRL_QUOTED.items():  # always beside the measured ones, for reference
        rows.append({"config": config, "impl": "trl", "dtype": "bf16", **quoted, "measured": False,
                     "phases_s": {}, "other_s": None, "completion_tokens_per_s": None, "note": QUOTE_NOTE})
    return rows


def trl_peer(rows: list[dict], config: str) -> dict | None:
    """TRL's row for `config`: measured in this run if it was, else the quoted one."""
    peers = [r for r in rows if r["impl"] == "trl" and r["config"] == config and r["step_time_s"] is not None]
    return next((r for r in peers if r["measured"]), peers[0] if peers else None)


def comparisons(records: list[dict]) -> list[dict]:
    """Ours over TRL, per config and dtype: step time and peak allocated memory (below 1 is better).
    TRL's figures from the same run when it ran, else the quoted ones."""
    rows = step_rows(records)
    out = []
    for ours in (r for r in rows if r["impl"] == "ours"):
        peer = trl_peer(rows, ours["config"])
        if peer is None:
            continue
        t = ratio_to_peer(ours["step_time_s"], peer["step_time_s"])
        m = ratio_to_peer(ours["peak_alloc_gib"], peer["peak_alloc_gib"])
        out.append({"config": ours["config"], "dtype": ours["dtype"], "time_ratio": t, "memory_ratio": m,
                    "speedup": None if not t else 1.0 / t, "trl_measured": peer["measured"]})
    return out


def engine_comparisons(records: list[dict]) -> list[dict]:
    """Each of our step rows at the bench config over Unsloth's own GRPO (ENGINE_PEER) measured in the same
    run: step time and nvidia-smi's peak GPU memory (below 1 is better; the goal is at most 1)."""
    rows = [r for r in step_rows(records) if r["measured"] and r["config"] == "bench"]
    peer = next((r for r in rows if r["impl"] == ENGINE_PEER and r["step_time_s"]), None)
    if peer is None:
        return []
    return [{"impl": r["impl"], "dtype": r["dtype"], "peer": ENGINE_PEER,
             "time_ratio": ratio_to_peer(r["step_time_s"], peer["step_time_s"]),
             "gpu_used_ratio": ratio_to_peer(r["peak_gpu_used_gib"], peer["peak_gpu_used_gib"])}
            for r in rows if r["impl"].startswith("ours") and r["step_time_s"]]
