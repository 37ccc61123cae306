"""Two faults of a real run, located: a step whose gradient is not finite, and single tokens far apart
between the sampler and the trainer.

    python benchmarks/probes/learning_faults.py nonfinite --step 3 -- --preset qwen1.5b-gsm8k ...
    python benchmarks/probes/learning_faults.py gap --batches 8 -- --preset qwen1.5b-gsm8k ...
    python benchmarks/probes/learning_faults.py replay --replay gap-batch0-sdpa.pt --rows 8 -- --preset ... --dtype bf16

`nonfinite` runs train.py's own loop (`grpo.trainer.train`, the flags after `--`) up to step `--step` and,
in that step only, before the real update: records every module whose forward output holds a non-finite
value (which rows, which positions, padding or not), which adapter gradients are not finite, then
backs up each row alone to find the rows that make it, and replays the first such row with autograd's
anomaly mode (its traceback names the forward op whose backward made the NaN). The step's batch and its
advantages are saved (`nonfinite-batch.pt`) so the row can be replayed on a CPU. The step itself then runs
as the trainer runs it.

`gap` samples `--batches` batches of the run's prompts (P x G rows each, the run's sampling) through the
native engine in several ways (the product's: CUDA graphs, compiled step, the decode GEMM kernels where
they take the model; its modules instead; without the streams; eager; attention by two float32 matmuls
instead of torch's fused kernel), or plain vLLM, and scores every
sampled token with the trainer's path (`sequence_logprobs`, bf16, the fused kernel), the same hidden
states through unfused bf16 logits, and a float32 copy of the model. Each
pair's |difference| per token is summarised (quantiles, counts over 1 and 5 nats), the worst tokens listed
with their context, and the first batch's tensors saved (`gap-batch0-<way>.pt`) for `replay`: the same
tokens scored by the trainer's path on another machine (a CPU), against the saved columns.

The adapters are the run's freshly initialised ones (lora_B = 0): the numerics under test are the base
model's. What it deliberately is not: a test or a benchmark; read its log. Nothing happens at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Recorder, add_out_argument  # noqa: E402


# --------------------------------------------------------------------------------------------------
# nonfinite
# --------------------------------------------------------------------------------------------------
def _nonfinite_where(t: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    """How many entries of t are not finite, in which (row, position) pairs, and how many of those
    positions are padding (attention_mask 0) when t is (B, L, ...) like the batch."""
    bad = ~torch.isfinite(t)
    if t.dim() >= 2:
        per_pos = bad.reshape(t.shape[0], t.shape[1], -1).any(-1) if t.dim() > 2 else bad
    else:
        per_pos = bad[:, None]
    where = per_pos.nonzero().tolist()
    out = {"count": int(bad.sum()), "shape": list(t.shape), "first": where[:8], "positions": len(where)}
    if attention_mask is not None and per_pos.shape == attention_mask.shape:
        out["on_padding"] = int((per_pos & (attention_mask == 0)).sum())
    return out


class ForwardWatch:
    """Forward hooks on every module: the first `limit` modules whose output holds a non-finite value."""

    def __init__(self, model: torch.nn.Module, limit: int = 40) -> None:
        self.events: list[dict] = []
        self.attention_mask: torch.Tensor | None = None
        self.limit = limit
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if len(self.events) >= self.limit:
                return
            tensors = output if isinstance(output, (tuple, list)) else [output]
            for i, t in enumerate(tensors):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    self.events.append({"module": name, "output": i, **_nonfinite_where(t.detach(),
                                                                                         self.attention_mask)})
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _row_loss(s, mb, adv, cfg):
    """The trainer's loss for a micro-batch, as update_policy builds it (first pass, mu = 1)."""
    from grpo.loss import clipped_surrogate
    from grpo.batch import sequence_logprobs
    from grpo.step import surrogate_options

    logp = sequence_logprobs(s.policy, mb, cfg.temperature)
    return clipped_surrogate(
        logp, logp.detach(), adv, mb.mask, ref_logp=None, is_weights=None,
        **surrogate_options(cfg, s.max_completion_length))[0], logp


def _padding_mask(batch) -> torch.Tensor:
    """(B, L) 1 on each row's prompt and counted completion tokens, 0 on its padding."""
    L = batch.input_ids.shape[1]
    return (torch.arange(L, device=batch.input_ids.device)[None, :] < (batch.start + batch.mask.sum(1))[:, None]).long()


def _bad_grads(params_named) -> list[str]:
    return [n for n, p in params_named if p.grad is not None and not bool(torch.isfinite(p.grad).all())]


def diagnose_step(s, batch, slices, adv, rec: Recorder, out: Path) -> None:
    """Where the step's non-finite gradient comes from; leaves the gradients zeroed."""
    cfg, policy = s.cfg, s.policy
    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    torch.save({"batch": dataclasses.asdict(batch) if dataclasses.is_dataclass(batch) else batch.__dict__,
                "adv": adv.cpu(), "slices": [(sl.start, sl.stop) for sl in slices]}, out / "nonfinite-batch.pt")
    rec.say(f"saved the step's batch: rows {len(batch)}, width {batch.input_ids.shape[1]}, "
             f"completion {batch.completion_ids.shape[1]}, tokens counted {int(batch.mask.sum())}")
    rec.record("batch", rows=len(batch), prompt_lengths=batch.start.tolist(),
            completion_tokens=batch.mask.sum(1).tolist(), adv=[round(float(a), 4) for a in adv])
    policy.train()
    watch = ForwardWatch(policy)
    # 1. the whole step's passes as update_policy runs them: forward events, loss, bad gradients
    for sl in slices:
        mb = batch.rows(sl)
        watch.attention_mask = _padding_mask(mb)
        policy.zero_grad(set_to_none=True)
        loss, logp = _row_loss(s, mb, adv[sl], cfg)
        rec.record("micro_batch", rows=[sl.start, sl.stop], loss=float(loss), logp_finite=bool(torch.isfinite(logp).all()),
                forward_events=watch.events[:20])
        watch.events.clear()
        loss.backward()
        bad = _bad_grads(named)
        rec.record("micro_batch_grads", rows=[sl.start, sl.stop], bad_params=len(bad), first_bad=bad[:12],
                backward_forward_events=watch.events[:20])  # gradient checkpointing re-runs forwards here
        watch.events.clear()
    # 2. each row alone: which rows make the gradient non-finite
    culprits = []
    for i in range(len(batch)):
        mb = batch.rows(slice(i, i + 1))
        if not bool(mb.mask.any()):
            continue
        policy.zero_grad(set_to_none=True)
        watch.attention_mask = _padding_mask(mb)
        loss, _ = _row_loss(s, mb, adv[i:i + 1], cfg)
        loss.backward()
        bad = _bad_grads(named)
        if bad or not math.isfinite(float(loss)):
            culprits.append(i)
            rec.record("bad_row", row=i, loss=float(loss), prompt_len=int(mb.start[0]),
                    completion_tokens=int(mb.mask.sum()), width=int(_padding_mask(mb).sum()), adv=float(adv[i]),
                    bad_params=len(bad), first_bad=bad[:12], forward_events=watch.events[:20])
        watch.events.clear()
    rec.record("bad_rows", rows=culprits)
    watch.close()
    # 3. the first culprit row under anomaly mode, with gradient checkpointing off (a plain backward)
    if culprits:
        i = culprits[0]
        mb = batch.rows(slice(i, i + 1))
        base = policy.get_base_model()
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
        if checkpointing:
            base.gradient_checkpointing_disable()
        policy.zero_grad(set_to_none=True)
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                loss, _ = _row_loss(s, mb, adv[i:i + 1], cfg)
                loss.backward()
            rec.record("anomaly", row=i, raised=False, bad_params=len(_bad_grads(named)),
                    first_bad=_bad_grads(named)[:12])
        except RuntimeError as err:
            rec.record("anomaly", row=i, raised=True, error=str(err)[:400])
            rec.say("anomaly traceback:\n" + traceback.format_exc())
        finally:
            if checkpointing:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.save({k: getattr(mb, k).cpu() for k in ("input_ids", "start", "completion_ids",
                                                       "mask", "sampler_logp")} | {"adv": adv[i:i + 1].cpu()},
                   out / "nonfinite-row.pt")
    policy.zero_grad(set_to_none=True)


def run_nonfinite(args, train_argv: list[str], rec: Recorder) -> None:
    """train.py's loop with these flags (its schedule untouched), stopped by SIGTERM after step `--step`."""
    import os
    import signal

    import grpo.step as step_mod
    from grpo.config import parse_command_line
    from grpo.trainer import train

    cfg, _ = parse_command_line(train_argv)
    original = step_mod.update_policy
    calls = {"n": 0}

    def update_policy(s, batch, slices, adv, ref_logp, old_logp, in_flight):
        calls["n"] += 1
        if calls["n"] == args.step:
            diagnose_step(s, batch, slices, adv, rec, Path(args.out))
        result = original(s, batch, slices, adv, ref_logp, old_logp, in_flight)
        rec.record("update", step=calls["n"], skipped=result.skipped, grad_norm=result.grad_norm, gap=result.gap)
        if calls["n"] == args.step:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer finishes this step, saves and stops
        return result

    step_mod.update_policy = update_policy  # a probe's instrument, not the product's code
    try:
        train(dataclasses.replace(cfg, eval_size=0))
    except KeyboardInterrupt:
        rec.say(f"stopped after step {calls['n']}")
    finally:
        step_mod.update_policy = original


# --------------------------------------------------------------------------------------------------
# gap
# --------------------------------------------------------------------------------------------------
def _full_logprobs(lm, batch, micro: int, padding_mask: bool = False) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens from `lm`'s own logits (no fused kernel), float32 softmax;
    with `padding_mask`, the forward is also given the rows' padding mask (as the trainer did before)."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
    for s in range(0, len(batch), micro):
        mb = batch.rows(slice(s, s + micro))
        mask = _padding_mask(mb) if padding_mask else None
        logits = lm(input_ids=mb.input_ids, attention_mask=mask, use_cache=False).logits
        T = mb.completion_ids.shape[1]
        pos = (mb.start[:, None] - 1 + torch.arange(T, device=logits.device)).clamp(max=logits.shape[1] - 1)
        z = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).float()  # (b, T, V)
        lp = z.log_softmax(-1).gather(-1, mb.completion_ids[..., None])[..., 0]
        out[s:s + micro] = torch.where(mb.mask, lp, 0.0)
        del logits, z
    return out


def _summary(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    return _distances((a.double() - b.double()).abs()[mask])


def _distances(d: torch.Tensor) -> dict:
    """Quantiles, mean, max and counts over 1 and 5 nats of per-token |differences| d (tokens,)."""
    if d.numel() == 0:
        return {"tokens": 0}
    q = torch.quantile(d.float().cpu(), torch.tensor([0.5, 0.99, 0.999, 0.9999]))
    return {"tokens": d.numel(), "mean": float(d.mean()), "p50": float(q[0]), "p99": float(q[1]),
            "p999": float(q[2]), "p9999": float(q[3]), "max": float(d.max()), "over_1": int((d > 1).sum()),
            "over_5": int((d > 5).sum())}


def _worst(tokenizer, batch, paths: dict[str, torch.Tensor], a: str, b: str, k: int = 6) -> list[dict]:
    d = (paths[a] - paths[b]).abs().masked_fill(~batch.mask, -1)
    flat = d.flatten().topk(k)
    T = d.shape[1]
    rows = []
    for v, idx in zip(flat.values.tolist(), flat.indices.tolist()):
        r, t = divmod(idx, T)
        ids = batch.completion_ids[r]
        rows.append({"row": r, "t": t, "gap": round(v, 3), "prompt_len": int(batch.start[r]),
                     "token": int(ids[t]), "text": tokenizer.decode(ids[max(0, t - 8):t + 1]),
                     **{name: round(float(p[r, t]), 3) for name, p in paths.items()}})
    return rows


GAP_WAYS = ("product", "modules", "no_streams", "no_graph", "eager", "matmul", "vllm")


def run_gap(args, train_argv: list[str], rec: Recorder) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.config import parse_command_line
    from grpo.model.load import default_device, load_policy
    from grpo.rollout.vllm import VLLMEngine
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import NativeEngine
    from grpo.rollout.native.tuning import EngineTuning
    from grpo.rollout.stops import stop_string_sequences, stop_token_ids
    from grpo.batch import make_batch, sequence_logprobs
    from grpo.trainer import load_prompt_sets

    cfg, _ = parse_command_line(train_argv)
    torch.manual_seed(cfg.seed)
    device = default_device()
    policy, tokenizer, model_dir = load_policy(cfg, device)
    policy.eval()
    prompts, _, max_completion_length = load_prompt_sets(dataclasses.replace(cfg, eval_size=0), tokenizer)
    stop_ids = stop_token_ids(tokenizer, policy.get_base_model().generation_config)
    sampling = Sampling(max_new_tokens=max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                        top_k=cfg.top_k, min_p=cfg.min_p, stop_token_ids=stop_ids,
                        stop_sequences=stop_string_sequences(tokenizer, cfg.stop), ignore_eos=cfg.ignore_eos)
    ref_dtype = torch.float64 if device.type == "cpu" and args.fp64_on_cpu else torch.float32
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=ref_dtype).to(device).eval()
    P, G = cfg.prompts_per_step, cfg.num_generations
    ways = {"product": EngineTuning(), "no_streams": EngineTuning(streams=False),
            "no_graph": EngineTuning(use_cuda_graph=False), "eager": EngineTuning(use_cuda_graph=False, compile=None,
                                                                                   streams=False),
            "matmul": EngineTuning(attention="matmul"),
            "modules": EngineTuning()}  # modules: the product's tuning, with gemm="modules"
    chosen = args.ways.split(",") if args.ways else list(ways)
    max_seq = prompts.max_prompt_length + max_completion_length
    for way in chosen:
        if way == "vllm":
            # Plain vLLM with the adapter sent each call, eager (no compile wait), and raw log-probs: at the
            # preset's temperature 1 the sampled tokens' are the exact ones, and its prompt log-probs are then
            # log-softmaxed (with --engine vllm's "processed_logits" they would be bare logits).
            engine = VLLMEngine(policy, str(model_dir), lora_rank=cfg.lora_rank, max_model_len=max_seq,
                                dtype=cfg.dtype, seed=cfg.seed, work_dir=str(Path(args.out) / "vllm-adapters"),
                                pad_id=tokenizer.pad_token_id, enforce_eager=True,
                                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, logprobs_mode="raw_logprobs")
            if args.replay:
                _score_replay_with_vllm(engine.llm, args.replay, rec)
        else:
            gemm = "modules" if device.type == "cpu" or way == "modules" else "auto"  # auto: the decode kernels
            engine = NativeEngine(policy, max_seq_len=max_seq, max_batch=P * G, pad_id=tokenizer.pad_token_id,
                                  gemm=gemm, tuning=ways[way])
        totals: dict[str, list] = {}
        worst: list[dict] = []
        for b in range(args.batches):
            idx = list(range(b * P, (b + 1) * P))
            rollout = engine.generate([prompts.prompt_ids[i % len(prompts.prompt_ids)] for i in idx], G,
                                      dataclasses.replace(sampling, seed=1000 + b))
            engine.release_memory()
            batch = make_batch(rollout, tokenizer.pad_token_id, device)
            with torch.no_grad():
                paths = {"sampler": batch.sampler_logp,
                         "trainer": torch.cat([sequence_logprobs(policy, batch.rows(slice(s, s + args.micro)),
                                                                 cfg.temperature)
                                               for s in range(0, len(batch), args.micro)]),
                         "bf16_logits": _full_logprobs(policy.get_base_model(), batch, args.micro),
                         "bf16_masked": _full_logprobs(policy.get_base_model(), batch, args.micro, padding_mask=True),
                         "fp32": _full_logprobs(ref, batch, args.micro).float()}
            for a, c in (("sampler", "trainer"), ("sampler", "fp32"), ("trainer", "fp32"), ("trainer", "bf16_logits"),
                         ("bf16_logits", "fp32"), ("bf16_masked", "fp32"), ("sampler", "bf16_masked")):
                totals.setdefault(f"{a}-{c}", []).append((paths[a] - paths[c]).abs()[batch.mask].double().cpu())
            worst += _worst(tokenizer, batch, paths, "sampler", "trainer")
            if b == 0:
                torch.save({k: v.cpu() for k, v in paths.items()} | {
                    "completion_ids": batch.completion_ids.cpu(), "mask": batch.mask.cpu(),
                    "input_ids": batch.input_ids.cpu(),
                    "start": batch.start.cpu()}, Path(args.out) / f"gap-batch0-{way}.pt")
            planned = getattr(engine, "_projections", None) or []  # native: each layer's kernel plan, or None
            rec.record("gap_batch", way=way, batch=b, tokens=int(batch.mask.sum()),
                    kernel_layers=sum(p is not None for p in planned),
                    decode_s=round(rollout.timings.get("decode", rollout.timings.get("generate", 0.0)), 2),
                    sampler_trainer_max=round(float((paths["sampler"] - paths["trainer"]).abs()[batch.mask].max()), 3),
                    sampler_fp32_max=round(float((paths["sampler"] - paths["fp32"]).abs()[batch.mask].max()), 3),
                    trainer_fp32_max=round(float((paths["trainer"] - paths["fp32"]).abs()[batch.mask].max()), 3))
        for pair, chunks in totals.items():
            rec.record("gap_summary", way=way, pair=pair, **_distances(torch.cat(chunks)))
        worst.sort(key=lambda w: -w["gap"])
        rec.record("gap_worst", way=way, tokens=worst[:12])
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _score_replay_with_vllm(llm, replay: str, rec: Recorder) -> None:
    """Every completion token of a `gap-batch0-<way>.pt` scored by vLLM's own forward over the same tokens
    (prompt log-probs: one prefill per row, temperature 1, no adapter: the probe's adapters are zero), against
    the file's float32, trainer and sampler columns: vLLM's numerics on the very rollouts ours were judged on."""
    from vllm import SamplingParams

    saved = torch.load(replay, map_location="cpu")
    start, mask = saved["start"], saved["mask"]
    n = mask.sum(1)
    prompts = [{"prompt_token_ids": saved["input_ids"][r, :int(start[r] + n[r])].tolist()} for r in range(len(n))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0), use_tqdm=False)
    scored = torch.zeros(mask.shape, dtype=torch.float32)
    for r, out in enumerate(outs):
        ids = prompts[r]["prompt_token_ids"]
        for t in range(int(n[r])):
            pos = int(start[r]) + t
            scored[r, t] = out.prompt_logprobs[pos][ids[pos]].logprob
    for name, other in (("vllm_prefill-saved_fp32", "fp32"), ("vllm_prefill-saved_trainer", "trainer"),
                        ("vllm_prefill-saved_sampler", "sampler")):
        rec.record("vllm_replay", pair=name, file=Path(replay).name, **_summary(scored, saved[other], mask))


def run_replay(args, train_argv: list[str], rec: Recorder) -> None:
    """The first `--rows` rows of a `gap-batch0-<way>.pt` scored by the trainer's path on this machine (the
    flags after `--` pick the model and dtype), against the file's float32, trainer and sampler columns."""
    from grpo.config import parse_command_line
    from grpo.model.load import default_device, load_policy
    from grpo.batch import Batch, sequence_logprobs

    cfg, _ = parse_command_line(train_argv)
    policy, _, _ = load_policy(cfg, default_device())
    policy.eval()
    saved = torch.load(args.replay, map_location="cpu")
    rows = slice(0, args.rows)
    width = int((saved["start"][rows] + saved["mask"][rows].sum(1)).max())
    batch = Batch(saved["input_ids"][rows, :width], saved["start"][rows], saved["completion_ids"][rows],
                  saved["mask"][rows], saved["sampler"][rows])
    with torch.no_grad():
        here = torch.cat([sequence_logprobs(policy, batch.rows(slice(s, s + 2)), cfg.temperature).cpu()
                          for s in range(0, len(batch), 2)])
    fp32 = saved["fp32"][rows]
    for name, a, b in (("here_trainer-saved_fp32", here, fp32), ("saved_trainer-saved_fp32", saved["trainer"][rows], fp32),
                       ("saved_sampler-saved_fp32", saved["sampler"][rows], fp32),
                       ("here_trainer-saved_trainer", here, saved["trainer"][rows])):
        rec.record("replay", pair=name, **_summary(a, b, batch.mask))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["nonfinite", "gap", "replay"])
    parser.add_argument("--step", type=int, default=3, help="nonfinite: the 1-based step to look into")
    parser.add_argument("--batches", type=int, default=4, help="gap: batches of P x G rows per way")
    parser.add_argument("--micro", type=int, default=16, help="gap: rows per scoring forward")
    parser.add_argument("--ways", default="", help="gap: comma-separated engine ways (default all native "
                        "ones): product, modules, no_streams, no_graph, eager, matmul, and vllm (plain vLLM: the "
                        "vLLM kit)")
    parser.add_argument("--fp64-on-cpu", action="store_true", help="gap: the reference in float64 on a CPU")
    parser.add_argument("--replay", default="", help="replay: a gap-batch0-<way>.pt written by `gap`; gap with "
                        "the vllm way: also score that file's tokens with vLLM's prefill")
    parser.add_argument("--rows", type=int, default=8, help="replay: its first rows to score")
    add_out_argument(parser)
    args = parser.parse_args(own)
    unknown = sorted(set(args.ways.split(",")) - set(GAP_WAYS)) if args.ways else []
    if unknown:  # before any model loads
        parser.error(f"--ways {','.join(unknown)}: choose from {','.join(GAP_WAYS)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rec = Recorder(f"learning_faults-{args.what}", args.out)
    rec.say(f"train.py flags: {' '.join(train_argv)}")
    if args.what == "nonfinite":
        run_nonfinite(args, train_argv, rec)
    elif args.what == "gap":
        run_gap(args, train_argv, rec)
    else:
        run_replay(args, train_argv, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
