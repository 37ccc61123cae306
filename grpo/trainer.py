"""The GRPO run: setup, then the explicit loop, top to bottom; checkpoint and resume.

What it deliberately is not: a framework. No callbacks, no trainer subclasses, no hidden state. Read
`run()` from its first line to its last to know what a run does: its setup as named steps (the folder
and seeds; what every step reads, and the banner; start or resume), then the loop, then recovery.
Each phase it calls lives in its own room: one GRPO step in `grpo.step` (sample, score and keep in
`grpo.groups`, the batch's log-probs in `grpo.batch`), the optimizer and schedule in `grpo.optim`,
checkpoints in `grpo.run.checkpoint`, metrics, progress and clocks in `grpo.run.log`, signals in
`grpo.run.signals`, held-out accuracy in `grpo.eval`; what every step reads is built once here
(`grpo.step_setup.StepSetup`). The loss is `grpo.loss` and nothing else; the sampler
is any `Engine`, and what the loop must know of it the engine says itself; the model is the PeftModel
that `grpo.model.load` loads.

Every stop saves. The output folder is claimed before anything is written (one run per folder). A
first Ctrl-C, SIGTERM or SIGHUP finishes the step in flight and saves it; a second one, or any error,
saves the last consistent state: the finished step's between steps, or the state before the step in
flight (its stream position and RNG states, snapshotted when it began) if no optimizer update has
happened in it yet. The error then carries a note saying where the run can continue.

Under `torchrun --nproc-per-node N` every rank runs the same loop on its own P prompts (a step trains
on N*P*G completions): the ranks meet in `grpo.distributed` to gather rewards, count tokens and sum
adapter gradients, and rank 0 alone prints, logs, evaluates and saves. A one-process run with
N*P prompts per step sees the same prompts and takes the same steps.
"""

from __future__ import annotations

import gc
import math
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch

from grpo import data as grpo_data
from grpo import rewards as grpo_rewards
from grpo.agents.settings import EpisodeSettings, first_prompt
from grpo.answer_format import SYSTEM_PROMPT
from grpo.cli import make_console
from grpo.config import Config
from grpo.distributed import World, init_world
from grpo.eval.accuracy import evaluate, log_eval
from grpo.kernels.fp8 import FP8Linear
from grpo.model import compiled_layers
from grpo.model.load import attention_without_cudnn, default_device, load_policy, model_positions, model_summary
from grpo.optim import make_optimizer, make_scheduler, optimizer_line
from grpo.rollout import (Engine, SampleAhead, Sampling, UnslothOptions, VLLMOptions, auto_refusal, build_engine,
                          loads_its_own_policy, resolve_engine_name)
from grpo.rollout.stops import stop_string_sequences, stop_token_ids
from grpo.run.checkpoint import (CheckpointWriteError, Resumable, RunState, checkpoint_path, claim_output_dir,
                                 new_run_id, resume_checkpoint, rng_state, save_adapter, save_checkpoint,
                                 save_from_every_rank, schedule_note)
from grpo.run.claim import RunClaim
from grpo.run.failures import add_note, describe
from grpo.run.log import (GcClock, MetricsLog, ProgressBar, print_completions, reset_peak_memory, step_line,
                          step_memory_gib, synced_clock)
from grpo.run.plots import plot_metrics
from grpo.run.signals import StopOnSignal, Stopped
from grpo.step import InFlight, StepResult, grpo_step
from grpo.step_setup import StepSetup

KEEP_KV_BYTES = 2 * 2**30  # --engine-standby auto keeps an engine that holds at most this between steps


class NonFiniteLoss(RuntimeError):
    pass


def freeze_alive() -> None:
    """Collects this process's garbage, then moves every object still alive out of the collector's reach
    (`gc.freeze`): later collections walk only what was made after it."""
    gc.collect()
    gc.freeze()


def freezes_after_first_step(device: torch.device) -> bool:
    """Whether the trainer freezes what is alive once the first step is done: on a GPU, where a full collection
    stalls a short step (benchmarks/RESULTS.md, "The measured defaults"); not on the CPU, where steps are long
    and the collection before the freeze would lengthen every short run."""
    return device.type == "cuda"


def train(cfg: Config) -> Path:
    """Run GRPO as `cfg` says; returns the folder of the final adapter. Under torchrun, every rank
    calls this; without it, the run is one process and makes no process group."""
    world = init_world()
    try:
        with attention_without_cudnn():  # its plan for every new width cost more than its kernels save
            return run(cfg, world)
    finally:
        world.close()


def run(cfg: Config, world: World) -> Path:
    """The loop, as one rank of `world` runs it (the only rank without torchrun)."""
    console = make_console(quiet=not world.is_main)  # rank 0 prints for all; wrapped only on a terminal
    out = Path(cfg.output_dir)
    # Setup, step by step: the run's folder and seeds; what every step reads (model, data, rewards, sampler,
    # optimizer); where the run starts (a checkpoint's state with --resume).
    device, claim = claim_and_seed(cfg, world, out, console)  # claim: rank 0's hold on the folder, till the end
    try:
        setup, scheduler, held_out = set_up_steps(cfg, world, device, out, console)
        parts = Resumable(setup.policy, setup.optimizer, scheduler, setup.stream)
        state, saved = start_or_resume(cfg, world, out, parts, console)  # saved: the checkpoint holding the state
    except BaseException:  # a setup that fails leaves the folder free, not claimed by a run that never ran
        if claim is not None:
            claim.release()
        raise

    # The loop. Opened here, closed in the `finally`: the log, the progress bar, the signal handlers.
    log = open_metrics_log(out, cfg, world, state.step, console)  # rank 0's; None on the others
    progress = ProgressBar(console, cfg.max_steps, state.step)
    setup.engine.progress = progress.generation  # tokens generated, shown while the engine samples (if it says)
    stop: StopOnSignal | None = None
    in_flight: InFlight | None = None  # the step being run; None between steps (the state is a finished step's)
    stopped = False  # a first signal on some rank: the step in flight finished, then the run stops
    # Python's full collections walk every object the process holds, most of them set-up's and the first step's
    # (modules, compiled code, graphs), alive till the run ends: on a GPU those are frozen out of their reach once
    # the first step is done, for one collection first (benchmarks/RESULTS.md, "The measured defaults"). An engine
    # that collects every step (Unsloth's: vLLM's sleep and wake) gets set-up's frozen before the first step too.
    first_step, frozen = state.step, getattr(setup.engine, "full_gc_each_step", False)
    if frozen:
        freeze_alive()
    gc_clock = GcClock()
    try:
        progress.start()
        if state.step == 0 and cfg.eval_size > 0:
            held_out_eval(setup, held_out, 0, console, log, progress)
        stop = StopOnSignal(console)
        while state.step < cfg.max_steps:
            t_step, gc_at_start = time.perf_counter(), gc_clock.seconds
            reset_peak_memory(device)
            in_flight = InFlight(stream_at_start=setup.stream.state_dict(), rng_at_start=rng_state())
            result = grpo_step(setup, state.step, in_flight)
            if state.step == first_step and freezes_after_first_step(device):
                freeze_alive()  # charged to this step (its time, its gc_time)
                frozen = True
            scheduler.step()
            state.step += 1
            in_flight = None  # from here the run's state is the finished step's
            # A skipped step changes nothing (with mu > 1, passes before the bad one did update).
            state.nonfinite_in_row = state.nonfinite_in_row + 1 if result.skipped else 0
            state.skipped_steps += int(result.skipped)
            give_up = skipped_step_verdict(cfg, state, console) if result.skipped else None
            record = result.log_record(state.step, scheduler.get_last_lr()[0], time.perf_counter() - t_step,
                                       *step_memory_gib(device, setup.engine),  # the batch of all ranks
                                       gc_time=gc_clock.seconds - gc_at_start)
            report_step(cfg, record, result, console, log, progress)
            if give_up is not None:  # every rank gives up after the same step: save with every rank's RNG
                saved = save_from_every_rank(out, state, parts, cfg, world)
                raise give_up
            if cfg.save_steps and state.step % cfg.save_steps == 0 and state.step < cfg.max_steps:
                saved = save_from_every_rank(out, state, parts, cfg, world)
            if cfg.eval_steps and state.step % cfg.eval_steps == 0 and state.step < cfg.max_steps:
                held_out_eval(setup, held_out, state.step, console, log, progress)
            if world.sum(torch.tensor(float(stop.requested))) > 0:  # all ranks stop after the same step
                stopped = True
                break

        # The end, or a first signal: save. From here a signal stops at once.
        progress.stop()
        stop.restore()
        if saved != checkpoint_path(out, state.step):
            saved = save_from_every_rank(out, state, parts, cfg, world)
        if stopped:  # said where it saved in `recover` below
            raise Stopped(stop.signum or signal.SIGINT)
        final = evaluate_and_save_adapter(setup, held_out, state.step, console, log, progress, out)
    except BaseException as err:  # a second signal, a failed write, any error: rank 0 says where to continue
        if world.is_main:
            recover(err, out, cfg, state, parts, in_flight, saved, console, progress)
        raise
    finally:
        gc_clock.stop()
        if frozen:
            gc.unfreeze()  # the rest of the process collects them again
        progress.stop()
        if stop is not None:
            stop.restore()
        if log is not None:
            log.close()
        if claim is not None:
            claim.release()
    if world.is_main:
        plot_metrics(log.path, out / "metrics.png")
    world.barrier()
    console.print(f"[bold green]done[/]: {state.step} steps, {state.skipped_steps} skipped; adapter in {final}")
    return final


# --------------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------------
def claim_and_seed(cfg: Config, world: World, out: Path, console) -> tuple[torch.device, RunClaim | None]:
    """Claims the output folder (one run per folder: refused before anything is written, and while another
    live run holds it), seeds Python's and torch's RNGs; returns the device (with --cpu-threads on CPU) and
    rank 0's claim, which the run releases when it ends."""
    moved, claim = claim_output_dir(cfg, world)
    if moved is not None:
        console.print(f"--overwrite: the previous run in {out} is now in {moved}")
    if claim is not None and claim.note:
        console.print(f"[yellow]{claim.note}[/]")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = default_device()
    if device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    return device, claim


def set_up_steps(cfg: Config, world: World, device: torch.device, out: Path, console
                 ) -> tuple[StepSetup, Any, grpo_data.PromptSet | None]:
    """(what every step reads, the schedule, the held-out prompts or None): the policy and tokenizer, the
    prompts and the completion budget they leave (`load_prompt_sets`, resolved once here), the engine and the
    run's sampling, the reward functions, the optimizer over the adapters and the prompt stream. Prints the
    run's banner."""
    work_dir = out / "vllm" if world.size == 1 else out / "vllm" / f"rank{world.rank}"  # an external engine's files
    rows = max(cfg.batch_size, cfg.eval_samples)  # the most rows the engine generates at once
    policy, tokenizer, model_dir, engine = load_model(cfg, device, work_dir, rows)
    episodes = EpisodeSettings.load(cfg.tools, cfg.environment, cfg.max_turns, cfg.tool_timeout,
                                    SYSTEM_PROMPT if cfg.system_prompt is None else cfg.system_prompt,
                                    cfg.system_prompt_turn)
    prompts, held_out, max_completion_length = load_prompt_sets(cfg, tokenizer, model_positions(policy), episodes)
    engine_name = resolve_engine_name(cfg.engine, policy)
    if engine is None:  # sized for the longest prompt of either set and its completion
        held_out_lengths = [len(p) for p in held_out.prompt_ids] if held_out is not None else []
        longest_prompt = max([prompts.max_prompt_length, *held_out_lengths])
        vllm = VLLMOptions(model_path=str(model_dir), lora_rank=cfg.lora_rank, dtype=cfg.dtype, seed=cfg.seed,
                           work_dir=str(work_dir), gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                           enforce_eager=cfg.vllm_enforce_eager)
        max_seq_len = longest_prompt + max_completion_length
        if cfg.tools or cfg.environment:  # an episode's prompt is not the dataset's (tool definitions, an
            max_seq_len = max(max_seq_len, cfg.max_seq_length)  # environment's first observation): room for more

        def build(model) -> Engine:
            return build_engine(engine_name, model, pad_id=tokenizer.pad_token_id, max_seq_len=max_seq_len,
                                max_batch=rows, gemm=cfg.engine_gemm, attention=cfg.engine_attention,
                                fold_adapter=cfg.engine_fold_adapter, vllm=vllm)

        native_ahead = cfg.sample_ahead and engine_name == "native"
        engine = SampleAhead(policy, build, fold=cfg.engine_fold_adapter) if native_ahead else build(policy)
    sampling = Sampling(max_new_tokens=max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                        top_k=cfg.top_k, min_p=cfg.min_p,
                        stop_token_ids=stop_token_ids(tokenizer, policy.get_base_model().generation_config),
                        stop_sequences=stop_string_sequences(tokenizer, cfg.stop))
    reward_funcs = grpo_rewards.reward_functions(cfg.reward_preset, cfg.reward)
    if cfg.overlong_penalty is not None:  # LEN, where omitted, is the completion budget resolved above
        length, cache = cfg.overlong_penalty
        reward_funcs = [*reward_funcs, grpo_rewards.overlong_penalty(
            max_completion_length if length is None else length, cache)]
    params, optimizer, scheduler = make_optimizer_over_adapters(cfg, world, policy)
    # One global stream of N*P prompts per step, the same on every rank; rank r takes the r-th P of them.
    stream = grpo_data.PromptStream(len(prompts), world.size * cfg.prompts_per_step, seed=cfg.seed)
    ahead = isinstance(engine, SampleAhead)  # its engine generates again right after each step's: it keeps
    setup = StepSetup(cfg=cfg, world=world, device=device, policy=policy, params=params, optimizer=optimizer,
                      tokenizer=tokenizer, engine=engine, engine_rows=rows, sample_ahead=ahead,
                      keep_engine=ahead or keeps_memory_between_steps(cfg.engine_standby, engine), sampling=sampling,
                      max_completion_length=max_completion_length, prompts=prompts, stream=stream,
                      reward_funcs=reward_funcs, clock=synced_clock(device), episodes=episodes,
                      width_multiple=math.lcm(cfg.pad_to_multiple_of, compiled_layers.width_multiple(policy)))
    print_banner(console, setup, engine_name)
    console.print(optimizer_line(cfg, optimizer, params))  # one call a step over a flat buffer, or one per tensor
    return setup, scheduler, held_out


def make_optimizer_over_adapters(cfg: Config, world: World, policy
                                 ) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, Any]:
    """(the adapters, the optimizer over them only, the schedule counting optimizer steps). Every rank
    starts from rank 0's adapters."""
    params = [p for p in policy.parameters() if p.requires_grad]
    world.broadcast_(params)
    if world.rank > 0:  # from here each rank draws its own dropout masks (sampling is seeded per step and rank)
        torch.manual_seed(cfg.seed + world.rank)
    optimizer = make_optimizer(cfg, params)
    return params, optimizer, make_scheduler(cfg, optimizer)


def start_or_resume(cfg: Config, world: World, out: Path, parts: Resumable, console) -> tuple[RunState, Path | None]:
    """(the run's state, the checkpoint that holds it): a new run's, or with --resume the checkpoint's,
    loaded into `parts`, with its notes printed."""
    state = RunState(world_size=world.size, run_id=world.gather_objects(new_run_id())[0])
    if not cfg.resume:
        return state, None
    saved, state, notes = resume_checkpoint(cfg.resume, out, parts, world)
    for note in [*notes, schedule_note(saved, cfg)]:
        if note:
            console.print(f"[yellow]{note}[/]")
    console.print(f"[bold]resumed[/] from {saved} at step {state.step}")
    return state, saved


def print_banner(console, setup: StepSetup, engine_name: str) -> None:
    """One line: the model, device, engine (`engine_name`: --engine resolved), prompts, P x ranks and G,
    trainable parameters, completion budget; and a warning where an engine choice did not go as asked."""
    cfg, world, device, engine = setup.cfg, setup.world, setup.device, setup.engine
    summary = model_summary(setup.policy)
    prompts = setup.prompts
    ranks = f" x {world.size} ranks" if world.size > 1 else ""
    # how the engine runs where that was a choice: kept between steps or not, the native engine's attention
    # (--engine-attention auto picks it by the rows)
    native = engine_name == "native"
    folds = (native and engine.tuning.fold_adapter and device.type == "cuda"  # FP8 weights never fold
             and not any(isinstance(m, FP8Linear) for m in setup.policy.modules()) and not setup.sample_ahead)
    notes = [*(["kept between steps"] if setup.keep_engine else []),
             *([f"{engine.tuning.attention} attention"] if native else []),
             *(["adapters folded where it decodes on its kernels"] if folds else []),
             *(["a step ahead, on a copy with the adapters folded"] if setup.sample_ahead else [])]
    engine_notes = f" ({', '.join(notes)})" if notes else ""
    if cfg.engine == "auto" and device.type == "cuda" and engine_name == "hf":  # slow: say why
        console.print(f"[yellow]--engine auto took hf[/]: {auto_refusal(setup.policy)}")
    if cfg.sample_ahead and not setup.sample_ahead:  # --engine auto took hf: its sampling reseeds torch's RNGs
        console.print(f"[yellow]--sample-ahead is not used[/]: it samples with the native engine, and this run "
                      f"samples with {engine_name}: each step samples its own completions")
    if cfg.engine_attention != "auto" and engine_name != "native":  # a choice that would do nothing
        console.print(f"[yellow]--engine-attention {cfg.engine_attention} is not used[/]: it picks the native "
                      f"engine's attention, and this run samples with {engine_name}")
    console.print(f"[bold]grpo[/] {cfg.model} on {device} | engine {engine_name}{engine_notes} | "
                  f"{len(prompts)} prompts ({prompts.dropped} over {prompts.max_prompt_length} tokens dropped) | "
                  f"P={cfg.prompts_per_step}"
                  f"{ranks} G={cfg.num_generations} | {summary['trainable_params']:,} trainable of "
                  f"{summary['total_params']:,} | completions up to {setup.max_completion_length} tokens")


def load_model(cfg: Config, device: torch.device, work_dir: Path, rows: int):
    """(policy, tokenizer, model_dir, engine). An engine that loads its own policy (`loads_its_own_policy`:
    Unsloth's, whose vLLM shares the base weights with training) is built here, for --max-seq-length tokens and
    `rows` rows, and model_dir is None; otherwise engine is None (it is built once the prompts are known) and
    model_dir is the base checkpoint's folder."""
    if loads_its_own_policy(cfg.engine):
        unsloth = UnslothOptions(
            model=cfg.model, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_targets,
            seed=cfg.seed, work_dir=str(work_dir), load_in_fp8=cfg.load_in_fp8, use_rslora=cfg.use_rslora,
            lora_dropout=cfg.lora_dropout, gradient_checkpointing=cfg.gradient_checkpointing,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enforce_eager=cfg.vllm_enforce_eager)
        engine = build_engine(cfg.engine, None, pad_id=0, max_seq_len=cfg.max_seq_length, max_batch=rows,
                              unsloth=unsloth)
        return engine.policy, engine.tokenizer, None, engine
    policy, tokenizer, model_dir = load_policy(cfg, device)
    return policy, tokenizer, model_dir, None


def load_prompt_sets(cfg: Config, tokenizer, positions: int | None = None, episodes: EpisodeSettings | None = None
                     ) -> tuple[grpo_data.PromptSet, grpo_data.PromptSet | None, int]:
    """(training prompts, held-out prompts or None, completion tokens at most). A prompt and its completion
    fit --max-seq-length and the model's `positions`: longer prompts are dropped and counted. With `episodes`,
    a prompt is an episode's first (`grpo.agents.settings.first_prompt`: the tools' definitions and an
    environment's first observation counted)."""
    examples = grpo_data.load_examples(cfg.dataset, split="train", seed=cfg.seed)
    if cfg.num_train_examples is not None:
        examples = examples[:cfg.num_train_examples]
    system_prompt = SYSTEM_PROMPT if cfg.system_prompt is None else cfg.system_prompt
    room = grpo_data.prompt_room(cfg.max_seq_length, cfg.max_completion_length, positions)
    prompt_text = None if episodes is None else (lambda example: first_prompt(tokenizer, example, episodes))
    prompts = grpo_data.build_prompts(tokenizer, examples, cfg.max_prompt_length, system_prompt, room=room,
                                      prompt_text=prompt_text, system_prompt_turn=cfg.system_prompt_turn)
    sequence = room.tokens + (cfg.max_completion_length or 1)  # --max-seq-length, or the model's positions
    max_completion_length = (cfg.max_completion_length if cfg.max_completion_length is not None
                             else sequence - prompts.max_prompt_length)
    eval_prompts = None
    if cfg.eval_size > 0:  # every held-out prompt that fits the sequence budget, none dropped by percentile
        held_out = grpo_data.load_examples(cfg.dataset, split="test", seed=cfg.seed)[:cfg.eval_size]
        eval_prompts = grpo_data.build_prompts(tokenizer, held_out, sequence - max_completion_length, system_prompt,
                                               prompt_text=prompt_text, system_prompt_turn=cfg.system_prompt_turn)
    return prompts, eval_prompts, max_completion_length


def keeps_memory_between_steps(standby: str, engine: Engine) -> bool:
    """--engine-standby: whether the engine keeps its memory (a native engine: its KV cache and CUDA
    graphs) from one step to the next. Re-capturing the graphs costs a fixed time per step; keeping
    them costs the memory. auto keeps an engine that would hold at most KEEP_KV_BYTES."""
    if standby == "auto":
        held = engine.standby_bytes()
        return held is not None and held <= KEEP_KV_BYTES
    return standby == "keep"


# --------------------------------------------------------------------------------------------------
# Phases of the run besides the step
# --------------------------------------------------------------------------------------------------
def open_metrics_log(out: Path, cfg: Config, world: World, step: int, console) -> MetricsLog | None:
    """Rank 0's metrics log, continued from `step` (its note, where it dropped torn lines, printed); None on
    the other ranks."""
    if not world.is_main:
        return None
    log = MetricsLog(out, cfg, step)
    if log.note:
        console.print(f"[yellow]{log.note}[/]")
    return log


def skipped_step_verdict(cfg: Config, state: RunState, console) -> NonFiniteLoss | None:
    """Says that the step just counted was skipped (a non-finite loss or gradient); returns the error that
    stops the run once --max-nonfinite-steps came in a row (raised once the step is logged and saved), else None."""
    console.print(f"[yellow]step {state.step}: non-finite loss or gradient, step skipped "
                  f"({state.nonfinite_in_row} in a row)[/]")
    if state.nonfinite_in_row >= cfg.max_nonfinite_steps:
        return NonFiniteLoss(f"{state.nonfinite_in_row} non-finite steps in a row; stopped "
                             "(try a lower --learning-rate)")
    return None


def report_step(cfg: Config, record: dict, result: StepResult, console, log: MetricsLog | None,
                progress: ProgressBar) -> None:
    """The step's record in metrics.jsonl (rank 0), its line on the console, the progress bar moved on, and
    with --log-completions-steps the completions."""
    if log is not None:
        log.write(record)
    progress.update(record["step"])
    console.print(step_line(record, cfg.max_steps, gap_warn=cfg.gap_warn), soft_wrap=True)
    if cfg.log_completions_steps and record["step"] % cfg.log_completions_steps == 0:
        print_completions(console, result)


def evaluate_and_save_adapter(setup: StepSetup, held_out: grpo_data.PromptSet | None, at_step: int, console,
                              log: MetricsLog | None, progress: ProgressBar, out: Path) -> Path:
    """The run's end: the final held-out evaluation, then rank 0 saves the adapter; returns its folder."""
    if held_out is not None:
        progress.start()  # again, for the final evaluation
    held_out_eval(setup, held_out, at_step, console, log, progress)
    progress.stop()
    final = out / "adapter"
    if setup.world.is_main:
        save_adapter(setup.policy, final)
    return final


def held_out_eval(setup: StepSetup, eval_prompts: grpo_data.PromptSet | None, at_step: int, console,
                  log: MetricsLog | None, progress: ProgressBar) -> None:
    """Rank 0 measures held-out accuracy and logs it; the other ranks wait in their next collective."""
    if eval_prompts is None or not setup.world.is_main:
        return
    cfg, engine = setup.cfg, setup.engine
    engine.release_memory()
    result = evaluate(engine, setup.tokenizer, eval_prompts, setup.sampling, k=cfg.eval_samples,
                      seed=cfg.seed + 7919 * at_step, max_rows=setup.engine_rows,
                      progress=progress.evaluation, episodes=setup.episodes)
    engine.release_memory()
    log_eval(console, log, at_step, result)


def recover(err: BaseException, out: Path, cfg: Config, state: RunState, parts: Resumable,
            in_flight: InFlight | None, saved: Path | None, console, progress: ProgressBar) -> None:
    """Rank 0, as the run stops on `err`: after a second signal (or Ctrl-C outside the loop), saves what is
    consistent and says where; on a failed checkpoint write, notes the last checkpoint (saving again would fail
    the same way); on any other error, saves what every rank agreed on (the others may not answer now) and
    notes where the run can continue."""
    if isinstance(err, KeyboardInterrupt):
        where = save_consistent_state(out, cfg, state, parts, in_flight, saved)  # first: after SIGHUP even
        progress.stop()  # printing may fail
        console.print(f"[bold yellow]interrupted[/]: {where}")
    elif isinstance(err, CheckpointWriteError):
        add_note(err, f"the last checkpoint is {saved}; continue with --resume latest" if saved is not None
                 else "no checkpoint was saved")
    elif isinstance(err, Exception):
        add_note(err, save_consistent_state(out, cfg, state, parts, in_flight, saved))


def save_consistent_state(out: Path, cfg: Config, state: RunState, parts: Resumable, in_flight: InFlight | None,
                          saved: Path | None) -> str:
    """After a second signal or an error, rank 0 alone (the others hold the same adapters and optimizer,
    but may not answer) saves the last consistent state with its own RNG state: between steps, the
    finished step's; inside a step that has not updated the adapters yet, the state before it
    (stream and RNG as the step found them). Returns a sentence saying where the run can continue."""
    if in_flight is not None and in_flight.updated:
        where = f"; the last checkpoint is {saved}" if saved is not None else ""
        return f"nothing saved: step {state.step + 1} stopped during its optimizer update{where}"
    if saved == checkpoint_path(out, state.step):
        return f"step {state.step} is saved in {saved}; continue with --resume latest"
    if state.step == 0:
        return "no step had finished: nothing to save"
    rng = rng_state()
    if in_flight is not None:
        parts.stream.load_state_dict(in_flight.stream_at_start)
        rng = in_flight.rng_at_start
    try:
        path = save_checkpoint(out, state, parts, cfg, [rng])
    except CheckpointWriteError as err:
        where = f"; the last checkpoint is {saved}" if saved is not None else ""
        return f"saving step {state.step} failed too: {describe(err)}{where}"
    return f"saved {path} (step {state.step}); continue with --resume latest"
