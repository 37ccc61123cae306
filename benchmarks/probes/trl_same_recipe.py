"""TRL 1.16's GRPOTrainer on one of our presets' recipes: the peer of docs/learning.md's side by side.

    python benchmarks/probes/trl_same_recipe.py [--vllm-share 0.3] [--time-budget-s 540] -- \\
        --preset qwen1.5b-gsm8k --max-steps 60 --save-steps 10 --output-dir /tmp/trl-qwen
    python benchmarks/probes/trl_same_recipe.py --smoke -- --preset qwen1.5b-gsm8k --output-dir /tmp/trl-smoke
    python benchmarks/probes/trl_same_recipe.py -- --preset qwen1.5b-gsm8k-calculator --max-steps 60  # TRL's tools

The flags after `--` are train.py's, parsed into the same `Config`: the recipe has one source. TRL is told all
of it that it can express (`grpo_config_values`); what it cannot is refused in one line naming the flag.

| ours (Config) | TRL 1.16 |
|---|---|
| model, rsLoRA r/alpha/targets/dropout, gradient checkpointing | the PeftModel of `grpo.model.load.load_policy`: the same folder, adapters and their initialisation (seeded as train.py seeds) |
| training split, chat template, system prompt, prompt-length filter | `grpo.trainer.load_prompt_sets`, in `PromptStream`'s order for max-steps steps, `shuffle_dataset=False`: every step gets the prompts ours gets; each prompt's ids checked to be ours |
| reward preset (+ --reward) | one reward function per column, under its name (TRL logs `rewards/<name>/mean`); the answer and format functions also log `accuracy` and `format` |
| P, G, micro-batch | `num_generations=G`, `per_device_train_batch_size` = micro-batch (default P*G), `gradient_accumulation_steps` = P*G / micro-batch: one generation batch of P*G per optimizer step |
| learning rate, warmup, schedule, optimizer, betas, weight decay | our own `make_optimizer` and `make_scheduler`, handed over as `optimizers=`: the same 8-bit AdamW and the same lr at every step (HF's own linear warmup would start at lr 0) |
| max-completion-length, max-seq-length | `max_completion_length`, `vllm_max_model_length` (TRL 1.16 has no prompt truncation: prompts are filtered before) |
| temperature, top-p, top-k, min-p | the same; stop strings: vLLM's `stop` with `include_stop_str_in_output` (not passed to transformers' generate, which needs a tokenizer for them: the smoke run ignores them) |
| beta (k3 KL), epsilon, epsilon-high, delta, ratio-level, num-iterations, scale-rewards | the same fields; `use_bias_correction_kl=False` (our KL term is not importance-weighted) |
| loss-norm sequence / token / constant | `loss_type` grpo / dapo / dr_grpo (per-row mean then batch mean; tokens of the generation batch; B x max-completion-length) |
| is-correction, is-level, is-cap (the sampler-trainer correction, for samplers of other numerics) | `vllm_importance_sampling_correction`, `_mode` `<level>_<truncate or mask>`, `_clip_max` |
| seed, max-steps, save-steps, max-grad-norm | the same; bf16 on CUDA |
| --tools file.py:f,g | `tools=` the same functions (`grpo.agents.tools.load_tools`); the prompts become conversations (`grpo.data.task_messages`) that TRL renders with the tools' definitions and `chat_template_kwargs` Llama 3's fixed date, checked to be our first prompts' text; a tool result enters as a tool message, its tokens masked out of the loss (TRL's `tool_mask`), as ours |
| --max-turns T (model turns at most; a call in the last turn is not run) | `max_tool_calling_iterations = T - 1` (tool rounds after the first generation: TRL's turns are 1 + iterations) |
| the reward functions on an episode | the same functions on the same text: each transcript's ids (model and tool tokens) decoded without special tokens, as our trainer decodes them; `tool_calls` and `tool_errors` counted from TRL's tool messages (a failed call's is `{'error': ...}`) |
| episodes/tool_calls, episodes/tool_errors | TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` x it (a tool that raised, and a call neither could read: `read_calls_as_ours`) |

Mismatches that remain, by TRL's design (the adapters' matmuls run in bf16 in both: TRL's Trainer autocasts with
`bf16=True`, ours under --lora-compute base, the default): TRL's vLLM log-probs are "processed"
ones, renormalised over what min-p keeps, so its sampler-trainer difference and its importance weights carry
log(kept mass) on every token (huggingface/trl#6789; ours are exact, docs/internals.md): they are logged as
TRL's `sampling/*` keys, never as our `gap/*`.
Without sleep mode vLLM's KV cache comes from torch's allocator, so `peak_mem_gib` includes vLLM's share of
the GPU: compare step times and learning, not memory.
With --tools, where our first prompt ends with `<start_working_out>` (the recipe's system prompt asks for it), TRL's
does not: TRL renders a conversation with the generation prompt and nothing after it, so its model opens the turn
bare. TRL's trainer reads a reply's tool calls with our parser (`read_calls_as_ours`): its own reads only tags, and
Qwen2.5-Coder writes its calls in code blocks, which ours runs.
Our --tool-timeout has no counterpart (TRL runs a call without a time limit), nor our `episodes/turns` and
`episodes/frac_cut_by_max_turns`. A reply closed by a stop string (the answer's) ends our episode without running
its calls; TRL runs every call it reads in a reply and generates again.
Refused: dynamic sampling, loss types cispo and sapo (TRL's cispo caps another quantity), KL estimators other
than k3, FP8 loading, and --environment: TRL 1.16's environment (`environment_factory`) reaches the model only
through tool calls (its public methods are the tools, `reset(**row)` appends to the question, `get_reward` scores
the rollout, and the episode ends when a turn calls no tool), while ours reads the model's plain reply each turn
and answers as a user turn until it says done; an adapter would change the game the model plays.

Outputs in the run's --output-dir: config.json (our Config), trl_args.json, metrics.jsonl (a line per step in our
keys where they mean the same: step, reward, reward_std, rewards/<name>, accuracy, format, completion_length,
frac_finished, frac_zero_std, lr, grad_norm, loss, kl, clip_frac*, episodes/tool_*, step_time, peak_mem_gib;
TRL's own keys beside them as trl/<key>), checkpoint-N/ (PEFT adapter, optimizer, schedule; `--resume latest` continues), adapter/ at
the end. `python -m grpo.run.plots OUT/metrics.jsonl OUT/metrics.png` draws it; `python -m grpo.eval --adapter
OUT/checkpoint-N --per-problem F.jsonl` evaluates it as ours is evaluated.

`--time-budget-s S`: after a step, when less than 1.5 median steps of S (counted from the start) remain, save a
checkpoint and stop; `--resume latest` continues, so a 10-minute command limit runs the schedule in parts.
`--smoke`: on the CPU, transformers' generate (no vLLM), a tiny random Llama with the real Llama 3.2 tokenizer,
2 steps of 1 prompt x 2 completions of 8 tokens; the plumbing, as CI runs it. With --tools the tokenizer gets
Llama 3.2's own chat template (as TRL ships it): the packaged tokenizer has none.

What it deliberately is not: a trainer of ours (the loop is TRL's, unpatched) or an evaluation. Nothing happens
at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# TRL 1.16's log key -> ours (grpo/run/log.py's metrics.jsonl), where both mean the same thing.
TRL_TO_OURS = {
    "reward": "reward", "reward_std": "reward_std", "frac_reward_zero_std": "frac_zero_std",
    "completions/mean_length": "completion_length", "learning_rate": "lr", "grad_norm": "grad_norm",
    "loss": "loss", "kl": "kl", "entropy": "entropy", "clip_ratio/region_mean": "clip_frac",
    "clip_ratio/low_mean": "clip_frac_low", "clip_ratio/high_mean": "clip_frac_high",
    "accuracy": "accuracy", "format": "format",
}
LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}  # our --loss-norm -> TRL's loss_type
SMOKE = dict(max_steps=2, prompts_per_step=1, num_generations=2, max_completion_length=8, micro_batch_size=None,
             eval_size=0, num_train_examples=16, save_steps=1)


def refusal(cfg) -> str | None:
    """What of `cfg` TRL 1.16 cannot be told, as one line naming the flag; None when it can be told all."""
    if cfg.environment:
        return (f"--environment {cfg.environment}: TRL 1.16's environments reach the model only through tool calls "
                "(an episode ends at a turn without one), ours reads each plain reply and answers as the user; "
                "compare the --tools presets")
    if cfg.dynamic_sampling:
        return "--dynamic-sampling: TRL 1.16's GRPOTrainer has no dynamic sampling; run without it"
    if cfg.policy_term.name != "clip":
        return (f"--loss-type {cfg.policy_term.name}: only clip maps onto TRL unchanged (its cispo caps another "
                "quantity)")
    if cfg.kl_estimator != "k3":
        return f"--kl-estimator {cfg.kl_estimator}: TRL's KL term is k3; use --kl-estimator k3"
    if cfg.load_in_fp8:
        return "--load-in-fp8: vLLM colocated would load the bf16 checkpoint; compare in bf16"
    if cfg.batch_size % (cfg.micro_batch_size or cfg.batch_size):
        return f"--micro-batch-size {cfg.micro_batch_size}: must divide P*G = {cfg.batch_size}"
    return None


def grpo_config_values(cfg, *, output_dir: str, cuda: bool, vllm_share: float | None,
                       vllm_sleep: bool = False) -> dict:
    """Our recipe as GRPOConfig's keyword arguments (TRL 1.16). `vllm_share`: sample with vLLM colocated,
    holding that share of the GPU; None: transformers' generate. Raises ValueError with `refusal`'s line."""
    problem = refusal(cfg)
    if problem:
        raise ValueError(problem)
    micro = cfg.micro_batch_size or cfg.batch_size
    values = dict(
        output_dir=output_dir, max_steps=cfg.max_steps, seed=cfg.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=cfg.batch_size // micro,
        num_generations=cfg.num_generations, shuffle_dataset=False,
        max_completion_length=cfg.max_completion_length or cfg.max_seq_length - (cfg.max_prompt_length or 0),
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
        beta=cfg.beta, use_bias_correction_kl=False, epsilon=cfg.policy_term.epsilon,
        epsilon_high=cfg.policy_term.epsilon_high, delta=cfg.policy_term.delta, importance_sampling_level=cfg.ratio_level, num_iterations=cfg.num_iterations,
        scale_rewards=cfg.scale_rewards, loss_type=LOSS_TYPES[cfg.loss_norm], mask_truncated_completions=False,
        # What the optimizer would be; the optimizer and schedule themselves are ours (optimizers=).
        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, optim=cfg.optim, lr_scheduler_type=cfg.lr_scheduler, max_grad_norm=cfg.max_grad_norm,
        gradient_checkpointing=cfg.gradient_checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_steps or cfg.max_steps, report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )
    if cfg.tools:  # our last turn runs no call: T model turns are the first generation and T - 1 tool rounds
        from grpo.data import CHAT_DATE

        values.update(max_tool_calling_iterations=cfg.max_turns - 1, chat_template_kwargs={"date_string": CHAT_DATE})
    if vllm_share is None:
        values.update(use_vllm=False)
    else:
        values.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=vllm_share,
                      vllm_enable_sleep_mode=vllm_sleep, vllm_max_model_length=cfg.max_seq_length,
                      generation_kwargs={"stop": list(cfg.stop), "include_stop_str_in_output": True} if cfg.stop else None,
                      vllm_importance_sampling_correction=cfg.is_correction != "none")
        if cfg.is_correction != "none":
            values.update(vllm_importance_sampling_mode=f"{cfg.is_level}_{cfg.is_correction}",
                          vllm_importance_sampling_clip_max=cfg.is_cap)
    return values


def trl_reward_functions(cfg, tokenizer=None) -> list:
    """Our reward functions as TRL calls them (the dataset's `answer` column as the answers), each under
    its own name; the answer and exact-format ones also log the share of strictly right and formatted
    completions through TRL's `log_metric`, as our trainer logs `accuracy` and `format`. A conversational
    completion (a tools run: TRL hands over its messages) is scored as ours scores an episode: its ids, tool
    results included, decoded by `tokenizer` without special tokens."""
    from grpo import rewards as grpo_rewards

    checks = {"answer": ("accuracy", grpo_rewards.is_correct),
              "format_exact": ("format", lambda completion, _answer: grpo_rewards.has_exact_format(completion))}

    def wrap(fn):
        name = getattr(fn, "__name__", type(fn).__name__)
        metric = next((m for prefix, m in checks.items() if name.startswith(prefix)), None)

        def reward(completions, answer, completion_ids=None, log_metric=None, **_):
            completions, answers = list(completions), list(answer)
            columns = {}
            if completions and not isinstance(completions[0], str):  # messages: the transcript's text, as ours
                columns = tool_columns(completions)
                completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            if metric is not None and log_metric is not None:
                log_metric(metric[0], sum(bool(metric[1](c, a)) for c, a in zip(completions, answers)) / len(answers))
            return [float(v) for v in fn(completions, answers, **columns)]

        reward.__name__ = name
        return reward

    return [wrap(fn) for fn in grpo_rewards.reward_functions(cfg.reward_preset, cfg.reward)]


def tool_columns(conversations: list[list[dict]]) -> dict[str, list[int]]:
    """Each TRL completion's tool calls and failed ones, the columns our trainer gives an episode's reward
    functions: TRL answers each call with a tool message, a failed one with the text of {"error": ...}."""
    results = [[m for m in messages if m.get("role") == "tool"] for messages in conversations]
    return {"tool_calls": [len(r) for r in results],
            "tool_errors": [sum(str(m.get("content", "")).startswith("{'error'") for m in r) for r in results]}


def train_rows(cfg, tokenizer) -> list[dict]:
    """The training prompts in the order our trainer draws them, P a step for max-steps steps; with --tools,
    as the conversations TRL renders (`tool_prompt_rows`)."""
    from bench_setup import trl_prompt_rows

    from grpo import data as grpo_data
    from grpo.agents.settings import EpisodeSettings
    from grpo.trainer import load_prompt_sets

    system_prompt = grpo_data.SYSTEM_PROMPT if cfg.system_prompt is None else cfg.system_prompt  # as train.py's
    episodes = EpisodeSettings.load(cfg.tools, None, cfg.max_turns, cfg.tool_timeout, system_prompt,
                                    cfg.system_prompt_turn)
    prompts, _, _ = load_prompt_sets(dataclasses.replace(cfg, eval_size=0), tokenizer, episodes=episodes)
    stream = grpo_data.PromptStream(len(prompts), cfg.prompts_per_step, seed=cfg.seed)
    order = [i for _ in range(cfg.max_steps) for i in next(stream)]
    if episodes is None:
        return trl_prompt_rows(tokenizer, prompts, order)
    return tool_prompt_rows(tokenizer, prompts, order, episodes)


def tool_prompt_rows(tokenizer, prompt_set, order: list[int], episodes) -> list[dict]:
    """Rows of a tools run: each prompt as the conversation it opens with (TRL renders it with the tools), checked
    to be our first prompt's text but for the first turn's prefill, which TRL cannot put after its generation
    prompt (the module's docstring)."""
    from grpo.agents.settings import opening_messages
    from grpo.data import CHAT_DATE

    rows, checked = [], set()
    for i in order:
        example = prompt_set.examples[i]
        messages = opening_messages(example, episodes)
        if i not in checked:
            trl_text = tokenizer.apply_chat_template(messages, tools=list(episodes.tools), tokenize=False,
                                                     add_generation_prompt=True, date_string=CHAT_DATE)
            if trl_text + episodes.prefill != prompt_set.prompts[i]:
                raise RuntimeError(f"prompt {i}: TRL would render another text than our first prompt, and the "
                                   "comparison would be unfair; fix: a chat template that renders tools alike")
            checked.add(i)
        rows.append({"prompt": messages, "answer": example.answer})
    return rows


def our_record(step: int, logs: dict, clock: dict, stop_strings: bool = False) -> dict:
    """One metrics.jsonl line: our keys where TRL's mean the same, the step's wall clock, TRL's keys as trl/*.
    `stop_strings`: the recipe stops on strings; TRL then counts every row they ended as clipped (it calls
    finished only a row that ends in EOS), so its clipped_ratio is not our frac_finished and is left out."""
    record: dict = {"step": step}
    for trl_key, ours in TRL_TO_OURS.items():
        if logs.get(trl_key) is not None:
            record[ours] = logs[trl_key]
    if logs.get("tools/call_frequency") is not None:  # calls per completion; failures per call
        record["episodes/tool_calls"] = logs["tools/call_frequency"]
        record["episodes/tool_errors"] = logs["tools/call_frequency"] * logs.get("tools/failure_frequency", 0.0)
    for key, value in logs.items():
        if key.startswith("rewards/") and key.endswith("/mean"):
            record[key.removesuffix("/mean")] = value
    if logs.get("completions/clipped_ratio") is not None and not stop_strings:
        record["frac_finished"] = 1.0 - logs["completions/clipped_ratio"]
    record.update({k: clock[k] for k in ("step_time", "peak_mem_gib", "peak_reserved_gib") if k in clock})
    record.update({f"trl/{k}": v for k, v in logs.items() if isinstance(v, (int, float))})
    return record


def run_recorder(metrics: Path, clock, started: float, budget_s: float | None, stop_strings: bool = False):
    """A TrainerCallback that appends each logged step to `metrics` (our keys, `our_record`) and, with a
    budget, saves and stops after the step that leaves less than 1.5 median steps of it. A step that leaves a
    trained weight not finite stops the run, naming the step and the weight: what TRL measures after it is no run."""
    import torch
    from transformers import TrainerCallback

    class RunRecorder(TrainerCallback):
        stopped_early = False

        def on_step_end(self, args, state, control, model=None, **kw):
            parameters = model.named_parameters() if model is not None else ()
            trained = [(name, p) for name, p in parameters if p.requires_grad]
            finite = torch.stack([torch.isfinite(p).all() for _, p in trained]).tolist() if trained else []
            broken = next((name for (name, _), ok in zip(trained, finite) if not ok), None)  # one sync a step
            if broken is not None:
                print(f"[peer] step {state.global_step} left {broken} not finite; stopped", flush=True)
                control.should_training_stop = True
                return
            times = [r["step_time"] for r in clock.records]
            if budget_s is None or not times or state.global_step >= state.max_steps:
                return
            if budget_s - (time.monotonic() - started) < 1.5 * statistics.median(times):
                control.should_save = control.should_training_stop = True
                self.stopped_early = True

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            timed = [r for r in clock.records if r["step"] == state.global_step]
            with metrics.open("a") as f:
                record = our_record(state.global_step, logs, timed[-1] if timed else {}, stop_strings)
                f.write(json.dumps(record) + "\n")

    return RunRecorder()


def resume_point(cfg) -> str | None:
    """The checkpoint to resume from (--resume latest: the newest in --output-dir), or None for a fresh run;
    a fresh run refuses a folder that already holds one."""
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(cfg.output_dir)
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    if cfg.resume is None:
        if last is not None or (out / "metrics.jsonl").exists():
            raise ValueError(f"--output-dir {out} holds a run; continue it with --resume latest or use another folder")
        return None
    if cfg.resume != "latest":
        return cfg.resume
    if last is None:
        raise ValueError(f"--resume latest: {out} holds no checkpoint-N folder")
    return last


def read_calls_as_ours(tokenizer, tool_names: list[str]) -> None:
    """TRL's trainer finds a reply's tool calls with the tokenizer's response template, which reads `<tool_call>`
    tags only; ours also runs Qwen2.5-Coder's calls in code blocks (`grpo.agents.tools`). So that both runs run the
    same calls, TRL's trainer parses replies with our parser. Only the message TRL runs its tools from changes: it
    builds the next turn from the generated ids themselves. A call ours cannot read reaches TRL under a name no tool
    has, so TRL answers it with an error, as ours does.
    TRL still asks the tokenizer for a response template, and sets one only for chat templates it knows by their
    exact text (a converted model's differs in whitespace): where there is none, the one of our parser's family."""
    import trl.trainer.grpo_trainer as trl_grpo
    from trl import chat_template_utils as known

    from grpo.agents.tools import parse_tool_calls, tool_call_style

    style = tool_call_style(tokenizer.chat_template)
    if getattr(tokenizer, "response_template", None) is None:
        tokenizer.response_template = known.qwen3_template if style == "qwen" else known.llama3_template

    def parse_response(tokenizer, ids, prefix=None, tools=None) -> dict:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        calls = parse_tool_calls(text, style, tool_names)
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": call.name or "unreadable call",
                                                                       "arguments": call.arguments}}
                                     for call in calls]
        return message

    trl_grpo.parse_response = parse_response


def run(cfg, args, started: float) -> Path:
    """Train with TRL on `cfg`; returns the output folder."""
    import datasets
    import torch
    import trl

    from bench_setup import step_clock

    from grpo.agents.tools import load_tools
    from grpo.model.load import default_device, load_policy
    from grpo.optim import make_optimizer, make_scheduler

    resume = resume_point(cfg)
    out = Path(cfg.output_dir)
    device = torch.device("cpu") if args.smoke else default_device()
    cuda = device.type == "cuda"
    if not cuda and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    values = grpo_config_values(cfg, output_dir=str(out), cuda=cuda,
                                vllm_share=args.vllm_share if cuda and not args.smoke else None,
                                vllm_sleep=args.vllm_sleep)
    torch.manual_seed(cfg.seed)  # as train.py before it loads the model: the same adapter initialisation
    policy, tokenizer, _ = load_policy(cfg, device)
    train_set = datasets.Dataset.from_list(train_rows(cfg, tokenizer))
    optimizer = make_optimizer(cfg, [p for p in policy.parameters() if p.requires_grad])
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out)
    (out / "trl_args.json").write_text(json.dumps({**values, "trl": trl.__version__}, indent=2, default=str) + "\n")
    tools = load_tools(cfg.tools) if cfg.tools else None
    if tools:
        read_calls_as_ours(tokenizer, [fn.__name__ for fn in tools])
    clock = step_clock(cuda)
    recorder = run_recorder(out / "metrics.jsonl", clock, started, args.time_budget_s, stop_strings=bool(cfg.stop))
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=trl_reward_functions(cfg, tokenizer),
                              args=trl.GRPOConfig(**values), train_dataset=train_set, processing_class=tokenizer,
                              callbacks=[clock, recorder], optimizers=(optimizer, make_scheduler(cfg, optimizer)),
                              tools=tools)
    if getattr(trainer, "chat_template", None) is not None:  # TRL would render prompts unlike `tool_prompt_rows`
        raise ValueError(f"--tools {cfg.tools}: {cfg.model}'s chat template does not keep a conversation's prefix, so "
                         "TRL renders its own training template; compare on a model whose template does")
    trainer.train(resume_from_checkpoint=resume)
    if recorder.stopped_early:
        print(f"stopped after step {trainer.state.global_step} of {cfg.max_steps} by --time-budget-s "
              f"{args.time_budget_s:g} (saved); continue with --resume latest", flush=True)
    else:
        trainer.save_model(str(out / "adapter"))
        print(f"done: {trainer.state.global_step} steps; adapter in {out / 'adapter'}", flush=True)
    return out


def parse(argv: list[str]) -> tuple[argparse.Namespace, object]:
    """(this probe's flags, the Config of train.py's flags after `--`)."""
    from grpo.cli import OneLineParser
    from grpo.config import parse_args

    split = argv.index("--") if "--" in argv else len(argv)
    mine, recipe = argv[:split], argv[split + 1:]
    parser = OneLineParser(prog="trl_same_recipe.py", description=__doc__.splitlines()[0],
                           epilog="Then --, then train.py's flags (the recipe), e.g. -- --preset qwen1.5b-gsm8k")
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check: a tiny random Llama, "
                        "transformers' generate, 2 steps of 1 prompt x 2 completions of 8 tokens.")
    parser.add_argument("--vllm-share", type=float, default=0.3, help="Share of the GPU's memory vLLM holds, "
                        "colocated in this process (TRL's vllm_gpu_memory_utilization).")
    parser.add_argument("--vllm-sleep", action="store_true", help="Let vLLM sleep while training (frees its "
                        "memory; each step then wakes it and pushes the weights again).")
    parser.add_argument("--time-budget-s", type=float, default=None, help="Save and stop after the step that "
                        "leaves less than 1.5 median steps of this many seconds since the start.")
    args = parser.parse_args(mine)
    if not 0 < args.vllm_share < 1:
        parser.error(f"--vllm-share {args.vllm_share}: must be in (0, 1)")
    cfg = parse_args(recipe)
    if not any(a == "--output-dir" or a.startswith("--output-dir=") for a in recipe):
        cfg = dataclasses.replace(cfg, output_dir=cfg.output_dir + "-trl")  # never into a run of ours
    if args.smoke:
        from bench_setup import build_model_dir

        tiny = build_model_dir(Path(cfg.output_dir).with_name(Path(cfg.output_dir).name + "-tiny-model"), "tiny",
                               device="cpu")
        if cfg.tools:  # the packaged Llama 3.2 tokenizer has no chat template: its own, as TRL ships it
            import trl

            template = Path(trl.__file__).parent / "chat_templates" / "llama3_2.jinja"
            (tiny / "chat_template.jinja").write_text(template.read_text())
        cfg = dataclasses.replace(cfg, model=str(tiny), max_seq_length=(cfg.max_prompt_length or 512) + 8, **SMOKE)
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    from grpo.run.failures import report
    from grpo.quiet import hide_known_warnings

    started = time.monotonic()
    args, cfg = parse(sys.argv[1:] if argv is None else list(argv))
    hide_known_warnings()
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        return report(ImportError(), message="this probe needs trl 1.16 and datasets: pip install trl==1.16.0 datasets")
    try:
        run(cfg, args, started)
    except ValueError as err:
        return report(err, cfg.debug, str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
