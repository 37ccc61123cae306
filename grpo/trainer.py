"""The GRPO loop, explicit, top to bottom: sample, score, advantages, loss, step; checkpoint and resume.

What it deliberately is not: a framework. No callbacks, no trainer subclasses, no hidden state. The
loss is `grpo.loss` and nothing else; the sampler is any `Engine`; the model is the PeftModel that
`grpo.model` loads. Read `run()` from its first line to its last to know what a run does.

Under `torchrun --nproc-per-node N` every rank runs the same loop on its own P prompts (a step trains
on N*P*G completions): the ranks meet in `grpo.distributed` to gather rewards, count tokens and sum
adapter gradients, and rank 0 alone prints, logs, evaluates and saves. A one-process run with
N*P prompts per step sees the same prompts and takes the same steps.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import resource
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo import data as grpo_data
from grpo import rewards as grpo_rewards
from grpo.config import Config
from grpo.distributed import World, init_world
from grpo.kernels.logprobs import token_logprobs
from grpo.loss import clipped_surrogate, group_advantages, importance_weights
from grpo.model import default_device, load_policy, model_summary
from grpo.rollout import Rollout, Sampling, build_engine, resolve_engine_name
from grpo.rollout.native import NativeEngine
from grpo.rollout.stops import stop_string_sequences

CHECKPOINT_PREFIX = "checkpoint-"


# --------------------------------------------------------------------------------------------------
# Log-probabilities of the completion tokens under the policy
# --------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """Prompt+completion rows, right-padded, on the device. Completion token t of row i sits at
    position start[i] + t, and is predicted by the hidden state at start[i] + t - 1."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    start: torch.Tensor  # (B,) prompt lengths
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) bool
    sampler_logp: torch.Tensor  # (B, T)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, sl: slice) -> "Batch":
        return Batch(*(t[sl] for t in (self.input_ids, self.attention_mask, self.start, self.completion_ids,
                                       self.mask, self.sampler_logp)))


def make_batch(rollout: Rollout, pad_id: int, device: torch.device) -> Batch:
    rows = [p for p in rollout.prompt_ids for _ in range(rollout.n)]
    B, T = rollout.completion_ids.shape
    width = max(len(p) for p in rows) + T
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(rows):
        n_tok = int(rollout.mask[i].sum())
        input_ids[i, :len(p)] = torch.tensor(p)
        input_ids[i, len(p):len(p) + T] = rollout.completion_ids[i]
        attention_mask[i, :len(p) + n_tok] = 1
    start = torch.tensor([len(p) for p in rows])
    parts = (input_ids, attention_mask, start, rollout.completion_ids, rollout.mask, rollout.sampler_logp.float())
    return Batch(*(t.to(device) for t in parts))


def sequence_logprobs(policy, batch: Batch, temperature: float) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens at `temperature`; 0 where mask is False.

    Runs the decoder to its final hidden states and hands only the masked completion positions to the
    fused `token_logprobs`, so a (tokens, vocab) logits tensor never exists whole.
    """
    base = policy.get_base_model()
    hidden = base.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        use_cache=False).last_hidden_state
    T = batch.completion_ids.shape[1]
    positions = batch.start[:, None] - 1 + torch.arange(T, device=hidden.device)  # (B, T)
    positions = positions.clamp(max=hidden.shape[1] - 1)
    h = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    lm_head = base.get_output_embeddings().weight
    logp = token_logprobs(h[batch.mask], lm_head, batch.completion_ids[batch.mask], temperature)
    return torch.zeros(batch.mask.shape, dtype=logp.dtype, device=logp.device).masked_scatter(batch.mask, logp)


# --------------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------------
def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kwargs = dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2))
    if cfg.optim == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ImportError("--optim adamw_8bit needs bitsandbytes: pip install bitsandbytes "
                              "(or use --optim adamw_torch)") from None
        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(math.ceil(cfg.warmup_ratio * cfg.max_steps))

    def factor(step: int) -> float:  # step counts finished optimizer steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, cfg.max_steps - warmup)
        if cfg.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------------------------------
# Checkpoints: everything needed to continue as if never stopped
# --------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def save_checkpoint(out: Path, step: int, policy, optimizer, scheduler, stream, state: dict, cfg: Config,
                    rngs: list[dict]) -> Path:
    """Written by rank 0 alone: the adapters, optimizer and stream are the same on every rank; `rngs`
    holds each rank's RNG state (only rank 0's when the others could not be asked, as on Ctrl-C)."""
    final = out / f"{CHECKPOINT_PREFIX}{step}"
    tmp = out / f".tmp-{CHECKPOINT_PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    for rank, rng in enumerate(rngs):
        torch.save(rng, tmp / rng_file(rank))
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "stream": stream.state_dict(), **state}))
    cfg.save(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # a crash mid-save never leaves a half-written checkpoint under the final name
    for old in list_checkpoints(out)[:-cfg.save_total_limit] if cfg.save_total_limit > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(out: Path) -> list[Path]:
    """checkpoint-N folders of `out`, oldest first (other names are left alone)."""
    found = [p for p in out.glob(f"{CHECKPOINT_PREFIX}*") if p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def find_checkpoint(resume: str, out: Path) -> Path:
    if resume == "latest":
        found = list_checkpoints(out)
        if not found:
            raise FileNotFoundError(f"--resume latest: no {CHECKPOINT_PREFIX}N folder in {out}; "
                                    "start without --resume")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"--resume {resume}: not a checkpoint folder (no trainer_state.json); "
                                f"pass one of {out}/{CHECKPOINT_PREFIX}N or 'latest'")
    return path


def load_checkpoint(path: Path, policy, optimizer, scheduler, stream, world: World) -> dict:
    """Every rank loads the same files; each takes its own RNG state where the checkpoint has it."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = json.loads((path / "trainer_state.json").read_text())
    saved_world = state.get("world_size", 1)
    if saved_world != world.size:
        raise ValueError(f"--resume {path}: the checkpoint was written by {saved_world} rank(s), this run has "
                         f"{world.size}; fix: resume on {saved_world} (torchrun --nproc-per-node {saved_world})")
    set_peft_model_state_dict(policy, load_file(path / "adapter_model.safetensors"))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    if (path / rng_file(world.rank)).is_file():  # absent for ranks > 0 after Ctrl-C: they keep their seed
        rng = torch.load(path / rng_file(world.rank), weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    stream.load_state_dict(state.pop("stream"))
    return state


# --------------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------------
class MetricsLog:
    """metrics.jsonl in the output directory, plus tensorboard or wandb when asked."""

    def __init__(self, out: Path, cfg: Config, resumed_step: int):
        self.path = out / "metrics.jsonl"
        if resumed_step == 0 and self.path.exists():
            self.path.unlink()
        elif resumed_step > 0 and self.path.exists():  # drop records past the checkpoint we resume from
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= resumed_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb = self.wandb = None
        if cfg.report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("--report-to tensorboard needs tensorboard: pip install tensorboard") from None
            self.tb = SummaryWriter(str(out / "tensorboard"))
        elif cfg.report_to == "wandb":
            try:
                import wandb
            except ImportError:
                raise ImportError("--report-to wandb needs wandb: pip install wandb") from None
            self.wandb = wandb.init(config=json.loads(cfg.to_json()), dir=str(out), resume="allow")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k.replace(".", "/"), v, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def make_progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=console)


def peak_memory_gib(device: torch.device) -> float:
    """This step's peak allocated GPU memory; on CPU, the process's peak resident size so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class NonFiniteLoss(RuntimeError):
    pass


class StopOnCtrlC:
    """The first Ctrl-C asks the loop to finish the step in flight, save and stop; the second stops at once.

    Finishing the step keeps a checkpoint exact: resuming from it continues as if never stopped.
    Only the main thread can own the handler; elsewhere Ctrl-C keeps Python's default behaviour.
    """

    def __init__(self, console):
        self.requested = False
        self.console = console
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.console.print("[bold yellow]Ctrl-C[/]: finishing this step, then saving (Ctrl-C again to stop now)")

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def synced_clock(device: torch.device):
    """A clock that first waits for the device, so each phase is charged with its own GPU work."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


KEEP_KV_BYTES = 2 * 2**30  # --engine-standby auto keeps a native KV cache up to this size


def keeps_memory_between_steps(standby: str, engine) -> bool:
    """--engine-standby: whether the engine keeps its KV cache and CUDA graphs from one step to the next.
    Re-capturing the graphs costs a fixed time per step; keeping them costs the KV cache's memory."""
    if standby == "auto":
        return isinstance(engine, NativeEngine) and engine.kv_cache_bytes() <= KEEP_KV_BYTES
    return standby == "keep"


def stop_token_ids(tokenizer, generation_config) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model's generation config (Llama 3 instruct has three)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return tuple(sorted(i for i in ids if i is not None))


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def train(cfg: Config) -> Path:
    """Run GRPO as `cfg` says; returns the folder of the final adapter. Under torchrun, every rank
    calls this; without it, the run is one process and makes no process group."""
    world = init_world()
    try:
        return run(cfg, world)
    finally:
        world.close()


def run(cfg: Config, world: World) -> Path:
    """The loop, as one rank of `world` runs it (the only rank without torchrun)."""
    from rich.console import Console

    from grpo.eval import evaluate, log_eval

    console = Console(quiet=not world.is_main)  # rank 0 prints for all
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if world.is_main:
        cfg.save(out)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = default_device()

    # Model, data, rewards, engine. With --engine vllm on CUDA and Unsloth installed, Unsloth loads the
    # model and its vLLM engine together, so that sampling and training share the base weights.
    engine_name = resolve_engine_name(cfg.engine)
    vllm_dir = out / "vllm" if world.size == 1 else out / "vllm" / f"rank{world.rank}"
    engine = None
    if engine_name == "vllm" and device.type == "cuda" and importlib.util.find_spec("unsloth") is not None:
        from grpo.rollout.vllm import load_unsloth_policy

        policy, tokenizer, engine = load_unsloth_policy(
            cfg.model, load_in_fp8=cfg.load_in_fp8, max_seq_length=cfg.max_seq_length, lora_rank=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora, target_modules=cfg.lora_targets,
            gpu_memory_utilization=0.35, seed=cfg.seed, work_dir=str(vllm_dir), lora_dropout=cfg.lora_dropout,
            use_gradient_checkpointing="unsloth" if cfg.gradient_checkpointing else False)
        model_dir = None
    else:
        policy, tokenizer, model_dir = load_policy(cfg, device)
    examples = grpo_data.load_examples(cfg.dataset, split="train", seed=cfg.seed)
    if cfg.num_train_examples is not None:
        examples = examples[:cfg.num_train_examples]
    prompts = grpo_data.build_prompts(tokenizer, examples, cfg.max_prompt_length)
    max_completion = (cfg.max_completion_length if cfg.max_completion_length is not None
                      else cfg.max_seq_length - prompts.max_prompt_length)
    eval_prompts = None
    if cfg.eval_size > 0:  # every held-out prompt that fits the sequence budget, none dropped by percentile
        held_out = grpo_data.load_examples(cfg.dataset, split="test", seed=cfg.seed)[:cfg.eval_size]
        eval_prompts = grpo_data.build_prompts(tokenizer, held_out, cfg.max_seq_length - max_completion)
    eval_lengths = [len(p) for p in eval_prompts.prompt_ids] if eval_prompts else []
    longest_prompt = max([prompts.max_prompt_length, *eval_lengths])  # sizes the engine's buffers
    reward_funcs = grpo_rewards.reward_functions(cfg.reward_preset, cfg.reward)
    pad_id = tokenizer.pad_token_id
    if engine is None:
        engine = build_engine(engine_name, policy, pad_id=pad_id, max_seq_len=longest_prompt + max_completion,
                              max_batch=max(cfg.batch_size, cfg.eval_samples), gemm=cfg.engine_gemm,
                              **({"model_path": str(model_dir), "lora_rank": cfg.lora_rank, "dtype": cfg.dtype,
                                  "seed": cfg.seed, "work_dir": str(vllm_dir)} if engine_name == "vllm" else {}))
    keep_engine = keeps_memory_between_steps(cfg.engine_standby, engine)
    stop_ids = stop_token_ids(tokenizer, policy.get_base_model().generation_config)
    sampling = Sampling(max_new_tokens=max_completion, temperature=cfg.temperature, top_p=cfg.top_p,
                        top_k=cfg.top_k, min_p=cfg.min_p, stop_token_ids=stop_ids,
                        stop_sequences=stop_string_sequences(tokenizer, cfg.stop), ignore_eos=cfg.ignore_eos)

    # Optimizer over the adapters only; the schedule counts optimizer steps.
    params = [p for p in policy.parameters() if p.requires_grad]
    world.broadcast_(params)  # every rank starts from rank 0's adapters
    if world.rank > 0:  # ... and from here draws its own dropout masks (sampling is seeded per step and rank)
        torch.manual_seed(cfg.seed + world.rank)
    optimizer = make_optimizer(cfg, params)
    scheduler = make_scheduler(cfg, optimizer)
    # One global stream of N*P prompts per step, the same on every rank; rank r takes the r-th P of them.
    stream = grpo_data.PromptStream(len(prompts), world.size * cfg.prompts_per_step, seed=cfg.seed)
    state = {"nonfinite_in_row": 0, "skipped_steps": 0, "world_size": world.size}
    step = 0
    if cfg.resume:
        ckpt = find_checkpoint(cfg.resume, out)
        state.update(load_checkpoint(ckpt, policy, optimizer, scheduler, stream, world))
        step = state.pop("step")
        console.print(f"[bold]resumed[/] from {ckpt} at step {step}")
    log = MetricsLog(out, cfg, step) if world.is_main else None
    summary = model_summary(policy)
    ranks = f" x {world.size} ranks" if world.size > 1 else ""
    kept = " (kept between steps)" if keep_engine else ""
    console.print(f"[bold]grpo[/] {cfg.model} on {device} | engine {engine_name}{kept} | {len(prompts)} prompts "
                  f"({prompts.dropped} over {prompts.max_prompt_length} tokens dropped) | P={cfg.prompts_per_step}"
                  f"{ranks} G={cfg.num_generations} | {summary['trainable_params']:,} trainable of "
                  f"{summary['total_params']:,} | completions up to {max_completion} tokens")

    def run_eval(at_step: int) -> None:
        if eval_prompts is None or not world.is_main:  # the others wait in their next collective
            return
        engine.release_memory()
        result = evaluate(engine, tokenizer, eval_prompts, sampling, k=cfg.eval_samples,
                          seed=cfg.seed + 7919 * at_step, max_rows=max(cfg.batch_size, cfg.eval_samples))
        engine.release_memory()
        log_eval(console, log, at_step, result)

    def checkpoint(at_step: int) -> Path:
        rngs = world.gather_objects(rng_state())
        if world.is_main:
            save_checkpoint(out, at_step, policy, optimizer, scheduler, stream, state, cfg, rngs)
        world.barrier()  # no rank runs ahead of a checkpoint
        return out / f"{CHECKPOINT_PREFIX}{at_step}"

    micro = cfg.micro_batch_size or cfg.batch_size
    clock = synced_clock(device)
    interrupted = False
    if step == 0 and cfg.eval_size > 0:
        run_eval(0)
    progress = make_progress(console)
    bar = progress.add_task("grpo", total=cfg.max_steps, completed=step, stats="")
    progress.start()
    stop = StopOnCtrlC(console)
    try:
        while step < cfg.max_steps:
            t_step = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            timings: dict[str, float] = {}
            give_up: NonFiniteLoss | None = None

            # 1. Sample P prompts x G completions with the current policy (this rank's P of the N*P).
            stream_at_start, updated = stream.state_dict(), False  # what a Ctrl-C mid-step saves
            idx = stream.next()[world.rank * cfg.prompts_per_step:(world.rank + 1) * cfg.prompts_per_step]
            batch_examples = [prompts.examples[i] for i in idx]
            t = clock()
            seed = cfg.seed * 100_003 + step + 1_000_003 * world.rank
            step_sampling = dataclasses.replace(sampling, seed=seed)
            rollout = engine.generate([prompts.prompt_ids[i] for i in idx], cfg.num_generations, step_sampling)
            if not keep_engine:
                engine.release_memory()
            timings["generate"] = clock() - t
            timings.update({f"generate/{k}": v for k, v in rollout.timings.items() if k != "decode_steps"})

            # 2. Score: one column per reward function, summed into one reward per completion. Every rank
            #    gathers all N*P*G rows (rank order is a one-process run's order): its advantages need only
            #    its own groups, but scale_rewards="batch" and the log use the whole batch.
            texts = tokenizer.batch_decode(rollout.completions(), skip_special_tokens=True)
            answers = [ex.answer for ex in batch_examples for _ in range(cfg.num_generations)]
            columns = grpo_data.batch_columns(batch_examples, repeat=cfg.num_generations)
            rewards, reward_names = grpo_rewards.score(texts, answers, reward_funcs, columns)  # (P*G, R)
            judged = [[grpo_rewards.is_correct(c, a), grpo_rewards.has_exact_format(c)] for c, a in zip(texts, answers)]
            table = world.gather_rows(torch.cat([rewards, torch.tensor(judged, dtype=rewards.dtype),
                                                 rollout.lengths[:, None].to("cpu", rewards.dtype),
                                                 rollout.finished[:, None].to("cpu", rewards.dtype)], dim=1))
            all_rewards, correct, formatted, lengths, finished = table.split([len(reward_names), 1, 1, 1, 1], dim=1)
            # A reward function may return None ("does not apply", NaN here): it adds nothing to the total.
            adv, adv_stats = group_advantages(all_rewards.nansum(-1), cfg.num_generations, scale=cfg.scale_rewards)
            adv = adv.view(world.size, -1)[world.rank]  # (P*G,) this rank's groups

            # 3. Reference and old log-probs, only when something uses them (eval mode: no dropout).
            policy.eval()
            batch = make_batch(rollout, pad_id, device)
            adv = adv.to(device)
            slices = [slice(i, i + micro) for i in range(0, len(batch), micro)]
            t = clock()
            ref_logp = old_logp = None
            if cfg.beta > 0:
                with torch.no_grad(), policy.disable_adapter():
                    ref_logp = torch.cat([sequence_logprobs(policy, batch.rows(s), cfg.temperature) for s in slices])
            timings["reference"] = clock() - t
            t = clock()
            if cfg.num_iterations > 1:
                with torch.no_grad():
                    old_logp = torch.cat([sequence_logprobs(policy, batch.rows(s), cfg.temperature) for s in slices])
            timings["old_logprobs"] = clock() - t

            # 4. mu passes of clipped-surrogate steps over the rollout, in micro-batches.
            policy.train()
            timings["train"] = timings["optimizer"] = 0.0  # loss forward+backward; clip and optimizer step
            n_rows = world.size * len(batch)  # completions in the whole step, over all ranks
            n_tokens = world.sum(batch.mask.sum()).clamp(min=1)
            agg: dict[str, float] = {}
            nonfinite = False
            for _ in range(cfg.num_iterations):
                t = clock()
                optimizer.zero_grad(set_to_none=True)
                for s in slices:
                    mb = batch.rows(s)
                    logp = sequence_logprobs(policy, mb, cfg.temperature)
                    mb_old = old_logp[s] if old_logp is not None else logp.detach()
                    is_w = None
                    if engine_name == "vllm" and cfg.is_correction != "none":
                        is_w, _ = importance_weights(mb_old, mb.sampler_logp, mb.mask, level=cfg.is_level,
                                                     mode=cfg.is_correction, cap=cfg.is_cap)
                    loss, stats = clipped_surrogate(
                        logp, mb_old, adv[s], mb.mask, ref_logp=None if ref_logp is None else ref_logp[s],
                        beta=cfg.beta, eps_low=cfg.epsilon, eps_high=cfg.epsilon_high, delta=cfg.delta,
                        ratio_level=cfg.ratio_level, norm=cfg.loss_norm, max_len=max_completion,
                        is_weights=is_w, kl=cfg.kl_estimator)
                    # Each micro-batch's loss is normalised within itself; weight it by its share of the
                    # whole step's batch so that the gradient, accumulated and summed over ranks, equals
                    # one pass over all N*P*G rows.
                    share = (mb.mask.sum() / n_tokens) if cfg.loss_norm == "token" else len(mb) / n_rows
                    if not torch.isfinite(loss):
                        nonfinite = True
                        break
                    (loss * share).backward()
                    stats["loss"] = loss.detach()
                    for k, v in stats.items():  # weighted means, but true extremes of the ratio
                        if k == "ratio_min":
                            agg[k] = min(agg.get(k, math.inf), float(v))
                        elif k == "ratio_max":
                            agg[k] = max(agg.get(k, -math.inf), float(v))
                        else:
                            agg[k] = agg.get(k, 0.0) + float(v) * float(share) / cfg.num_iterations
                nonfinite = world.sum_grads_(params, nonfinite)  # a bad loss on any rank skips the step on all
                timings["train"] += clock() - t
                if nonfinite:
                    break
                t = clock()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0
                                                           else float("inf"))
                if not torch.isfinite(grad_norm):
                    nonfinite = True
                    break
                optimizer.step()
                updated = True
                timings["optimizer"] += clock() - t
            if not nonfinite:  # every rank agrees on nonfinite, and then holds the same keys
                agg = world.reduce_stats(agg)
            if nonfinite:
                optimizer.zero_grad(set_to_none=True)
                state["nonfinite_in_row"] += 1
                state["skipped_steps"] += 1
                console.print(f"[yellow]step {step + 1}: non-finite loss or gradient, step skipped "
                              f"({state['nonfinite_in_row']} in a row)[/]")
                if state["nonfinite_in_row"] >= cfg.max_nonfinite_steps:
                    # A skipped step changes nothing (with mu > 1, passes before the bad one did update).
                    # Saved now, raised once this step's record is logged.
                    give_up = NonFiniteLoss(f"{state['nonfinite_in_row']} non-finite steps in a row; stopped with "
                                            f"the last good state in {checkpoint(step)} (try a lower "
                                            "--learning-rate)")
            else:
                state["nonfinite_in_row"] = 0
            scheduler.step()
            step += 1

            # 5. Log: the batch of all ranks; time and memory are rank 0's.
            last_step_time = time.perf_counter() - t_step
            total = all_rewards.nansum(-1)  # (N*P*G,)
            record = {
                "step": step, "reward": float(total.mean()), "reward_std": float(total.std()) if len(total) > 1 else 0.0,
                **{f"rewards/{name}": float(all_rewards[:, j].nanmean()) for j, name in enumerate(reward_names)},
                "accuracy": float(correct.double().mean()), "format": float(formatted.double().mean()),
                "completion_length": float(lengths.double().mean()), "frac_finished": float(finished.double().mean()),
                "frac_zero_std": float(adv_stats["frac_zero_std"]),
                "lr": scheduler.get_last_lr()[0], "grad_norm": None if nonfinite else float(grad_norm),
                "skipped": nonfinite, **{k: v for k, v in agg.items()},
                "step_time": last_step_time, **{f"time/{k}": v for k, v in timings.items()},
                "peak_mem_gib": peak_memory_gib(device),
            }
            if world.is_main:
                log.write(record)
            line = (f"reward {record['reward']:7.3f} ± {record['reward_std']:.3f} | acc {record['accuracy']:.2f} | "
                    f"fmt {record['format']:.2f} | kl {agg.get('kl', 0.0):.4f} | len {record['completion_length']:6.1f} | "
                    f"{last_step_time:6.2f} s | {record['peak_mem_gib']:.2f} GiB")
            progress.update(bar, completed=step, stats=line)
            console.print(f"step {step:>4}/{cfg.max_steps} | {line}")
            if give_up is not None:
                raise give_up
            if cfg.log_completions_steps and step % cfg.log_completions_steps == 0:
                for j in range(0, len(texts), cfg.num_generations)[:2]:  # rank 0's rows come first in total
                    console.print(f"  [dim]answer {answers[j]!r} reward {float(total[j]):.2f}:[/] {texts[j][:400]!r}")
            if cfg.save_steps and step % cfg.save_steps == 0 and step < cfg.max_steps:
                checkpoint(step)
            if cfg.eval_steps and step % cfg.eval_steps == 0 and step < cfg.max_steps:
                run_eval(step)
            if world.sum(torch.tensor(float(stop.requested))) > 0:  # all ranks stop after the same step
                interrupted = True
                break
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, saving the state before the step in flight
        progress.stop()
        if world.is_main and not updated:  # alone: the other ranks hold the same adapters and optimizer
            stream.load_state_dict(stream_at_start)
            path = save_checkpoint(out, step, policy, optimizer, scheduler, stream, state, cfg, [rng_state()])
            console.print(f"[bold yellow]interrupted[/]: saved {path}; continue with --resume latest")
        elif world.is_main:
            console.print("[bold yellow]interrupted[/] during an optimizer update: nothing saved; resume from the "
                          "last checkpoint")
        if log is not None:
            log.close()
        raise
    finally:
        progress.stop()
        stop.restore()
    if interrupted:
        path = checkpoint(step)
        console.print(f"[bold yellow]interrupted[/]: saved {path} after step {step}; continue with --resume latest")
        if log is not None:
            log.close()
        raise KeyboardInterrupt
    checkpoint(step)
    run_eval(step)
    final = out / "adapter"
    if world.is_main:
        from grpo.plots import plot_metrics

        policy.save_pretrained(final)
        log.close()
        plot_metrics(log.path, out / "metrics.png")
    world.barrier()
    console.print(f"[bold green]done[/]: {step} steps, {state['skipped_steps']} skipped; adapter in {final}")
    return final
