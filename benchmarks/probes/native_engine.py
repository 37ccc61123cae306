"""NativeEngine on the GPU: correctness against transformers, then decode speed and memory, one run.

Llama-3.2-1B shapes (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256,
tied embeddings, llama3 rope scaling), random weights in bf16; 4 prompts x G=4 = 16 rows, 128-token
prompts, 512 new tokens with ignore_eos; temperature 1, min_p 0.1 (the recipe's sampling).

    PYTHONPATH=$PWD python3 benchmarks/probes/native_engine.py [--plan compiled|graph|gemm|rows|qwen|bench|wide]
        [--budget-s 150]

Plans (`--variants` picks steps by name instead):
  graph     the CUDA graph against eager and transformers `generate`, every model kind (bf16, FP8, LoRA),
            correctness, kernel profiles, standby memory and one whole-model compile
  compiled  compiled variants of every model kind (attention kernel, parallel streams) and where the
            time goes in the compiled step (the default)
  gemm      the decode GEMM kernels against the module path, every model kind
  rows      the decode kernels beyond 16 rows: kernels against modules at 32 and 64 rows
  qwen      Qwen2.5-Coder-1.5B shapes with rsLoRA r=32 at the qwen1.5b-gsm8k preset's 64 rows and 384 tokens
            (4 random prompts of 128 tokens x 16, not its 8 x 8 of GSM8K): the product's step (kernels,
            compiled, graph) against the modules and the attention kernel, where a token step's GPU time goes
            (eager, and inside the graph), and the decode with rows stopping at the preset's recorded lengths
            against every row to the end (`qwen_stopped_rows`: the attention skips stopped rows' caches)
  bench     the bench's token step as the product runs it (Llama-3.2-1B shapes, rsLoRA r=32, 16 rows), and
            where its time goes inside the CUDA graph: the kernels by family, the time the GPU ran none of
            them; the adapters folded into the weights (EngineTuning.fold_adapter, the fold's cost in
            prefill_ms); each kind also under decode_gemm.Tuning's variants (`CHOICES`: `*_no_chain`;
            `qwen_product_*` in the qwen plan)
  wide      the product's token step with the adapter at the sampler's 64 and 256 rows (past the kernels' 64
            rows the packed layers; at 256 also folded), and FP8's at the bench's 16 rows, each timed and
            broken down inside its CUDA graph (issue 31: past 16 rows, and FP8 slower than bf16 in the bench
            step)
Prints one table at the end; every number goes to --out as JSON lines as it comes (timing.py).
Standalone on purpose (no pytest): a device lease is short, so everything runs in one process and
each step is skipped, not failed, when the time budget runs out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch._dynamo

from grpo.config import LORA_TARGETS
from grpo.kernels import decode_gemm
from grpo.model.load import compute_adapters_in_base_dtype
from grpo.rollout.native import EngineTuning, NativeEngine
from grpo.rollout.native.state import StopRule
from timing import Recorder, add_out_argument, copy_tbps, covered_us, graph_us  # beside this file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the suite's helpers
from bench_setup import weight_bytes  # noqa: E402

ROWS, P, G, PROMPT, NEW = 16, 4, 4, 128, 512
PAD = 128004
PLAIN = EngineTuning(compile=None, streams=False)  # eager pieces on one stream; variants opt in


def llama_1b_config():
    from transformers import LlamaConfig

    common = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128009,
                  pad_token_id=PAD)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    try:
        return LlamaConfig(rope_parameters=rope, **common)
    except TypeError:
        return LlamaConfig(rope_theta=500000.0, rope_scaling=rope, **common)


def qwen_1_5b_config():
    """The packaged Qwen2.5-Coder-1.5B-Instruct's shapes: q/k/v with biases, 2 kv heads of 128, and (as its
    GGUF has it) an output layer of its own: 1,777,088,000 parameters."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0, pad_token_id=PAD,
                       eos_token_id=151645)


def build_model(seed: int = 0, config=None):
    """A random bf16 model on the GPU: Llama-3.2-1B's shapes unless `config` is given."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config or llama_1b_config())
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=32, lora_alpha=64, use_rslora=True, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    # the trainer's default (--lora-compute base): float32 adapters multiplied in bf16. Without it peft casts
    # each input to float32, and a module's products run as float32 SIMT GEMMs
    compute_adapters_in_base_dtype(peft_model)
    with torch.no_grad():  # non-zero B so the adapters change the output, as after some training
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return peft_model


def make_engine(model, *, max_batch: int = ROWS, max_seq_len: int = PROMPT + NEW, gemm: str = "modules",
                **tuning) -> NativeEngine:
    """The engine of one variant: `gemm` for the projections (the modules unless named), and the PLAIN step
    with `tuning`'s EngineTuning fields changed. A variant is one dict (`engine_kw`) naming both."""
    return NativeEngine(model, max_seq_len=max_seq_len, max_batch=max_batch, pad_id=PAD, gemm=gemm,
                        tuning=replace(PLAIN, **tuning))


def gemm_table() -> list[dict]:
    """cuBLAS bf16 at M=16 for each projection shape, and the swapped product W @ x^T."""
    rows = []
    for name, n, k in [("q/o", 2048, 2048), ("k/v", 512, 2048), ("gate/up", 8192, 2048), ("down", 2048, 8192),
                       ("lm_head", 128256, 2048)]:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]  # rotate: beat L2
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        out = {}
        for label, fn in (("F.linear", lambda w: torch.nn.functional.linear(x, w)), ("W@x^T", lambda w: w @ x.t())):
            out[label] = graph_us(fn, ws, calls=5 * len(ws), replays=10) / 1e6  # seconds per call
        rows.append(dict(kind="gemm_m16", shape=name, n=n, k=k, us_linear=round(out["F.linear"] * 1e6, 2),
                         tbps_linear=round(n * k * 2 / out["F.linear"] / 1e12, 2),
                         us_swapped=round(out["W@x^T"] * 1e6, 2),
                         tbps_swapped=round(n * k * 2 / out["W@x^T"] / 1e12, 2)))
    return rows


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128000, (P, PROMPT), generator=g).tolist()


def sampling(**kw):
    from grpo.rollout.base import Sampling

    base = dict(max_new_tokens=NEW, temperature=1.0, min_p=0.1, ignore_eos=True, seed=0)
    base.update(kw)
    return Sampling(**base)


def run_engine(rec: Recorder, label: str, model, wbytes: int, *, graph=True, new=None, repeats=2, engine_kw=None,
               rows=ROWS, **sample_kw):
    """Generate `repeats` times, releasing memory in between as the trainer does (so every run after
    the first pays the re-capture, not the compile); ms/step is the median over runs of decode / steps.
    `rows`: P prompts x rows / P completions each."""
    engine = make_engine(model, max_batch=rows, use_cuda_graph=graph, **(engine_kw or {}))
    s = sampling(max_new_tokens=new or NEW, **sample_kw)
    first = None
    per_step = []
    for i in range(repeats):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        t = time.perf_counter()
        r = engine.generate(prompts(), rows // P, s)
        wall = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() - base_mem
        first = first or dict(first_wall_s=round(wall, 2), first_capture_s=round(r.timings["capture"], 3))
        steps = r.timings["decode_steps"]
        per_step.append(r.timings["decode"] / steps)
        engine.release_memory()
    ms = statistics.median(per_step[1:] if len(per_step) > 1 else per_step) * 1e3
    row = dict(kind="engine", variant=label, rows=rows, ms_per_step=round(ms, 3), tok_per_s=round(rows / ms * 1e3),
               gbps=round(wbytes / (ms / 1e3) / 1e9), prefill_ms=round(r.timings["prefill"] * 1e3, 1),
               capture_ms=round(r.timings["capture"] * 1e3, 1), wall_s=round(wall, 2),
               peak_extra_gib=round(peak / 2**30, 3), kv_gib=round(engine.kv_cache_bytes() / 2**30, 3),
               steps=int(steps), weight_gib=round(wbytes / 2**30, 3), **first)
    rec.record(**row)
    return row


def hf_generate_ms(model) -> float:
    ids = torch.tensor(prompts(), device="cuda").repeat_interleave(G, 0)  # (16, 128)
    kw = dict(do_sample=True, temperature=1.0, min_p=0.1, eos_token_id=None, pad_token_id=PAD,
              attention_mask=torch.ones_like(ids))
    model.generate(ids, max_new_tokens=4, **kw)  # warm-up
    times = {}
    for n in (8, 40):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, **kw)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - t
    return (times[40] - times[8]) / 32 * 1e3


def _family(name: str) -> str:
    """The kernel family a CUDA kernel's name belongs to, for the breakdowns."""
    n = name.lower()
    if "lora_down" in n:
        return "lora_down"
    if "proj_kernel" in n or "gated_kernel" in n:
        return "decode GEMM kernels"
    if "rope_store" in n:
        return "rope + KV write"
    if any(s in n for s in ("attend", "attention", "fmha", "flash", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "sm90", "xmma", "gemv", "splitk", "matmul", "mm_")):
        return "gemm"
    if "sort" in n or "radix" in n:
        return "sort"
    if "reduce" in n or "softmax" in n or "norm" in n or "rsqrt" in n:  # rsqrt: a compiled RMSNorm
        return "reduce/softmax"
    if "scatter" in n or "index" in n or "gather" in n:
        return "scatter/index"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    return "elementwise/other"


def _record_families(rec: Recorder, kind: str, label: str, prof, steps: int, **extra) -> float:
    """Records GPU time and launches per step by kernel family from a profile of `steps` steps, and the
    16 costliest kernels; returns the kernels' summed microseconds per step."""
    fams: dict[str, float] = {}
    count: dict[str, int] = {}
    top = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us <= 0:
            continue
        fam = _family(e.key)
        fams[fam] = fams.get(fam, 0.0) + us / steps
        count[fam] = count.get(fam, 0) + e.count // steps
        top.append((us / steps, e.count // steps, e.key[:90]))
    total = sum(fams.values())
    rec.record(kind, variant=label, per_step_us={k: round(v) for k, v in fams.items()}, per_step_launches=count,
               sum_us=round(total), sum_launches=sum(count.values()), **extra)
    for us, c, key in sorted(top, reverse=True)[:16]:
        rec.record("kernel", variant=label, us_per_step=round(us, 1), launches_per_step=c, name=key)
    return total


def _busy_us(prof, steps: int) -> float:
    """Microseconds per step in which the GPU ran at least one kernel or copy of the profile: below the kernels'
    sum where they overlap (parallel streams, a launch started beside the one it waits for)."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return covered_us(spans) / steps


def kernel_breakdown(rec: Recorder, label: str, model, engine_kw=None, rows: int = ROWS) -> None:
    """GPU time per kernel family in one eager (ungraphed) decode step of `rows` rows."""
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(model, use_cuda_graph=False, max_batch=rows, **(engine_kw or {}))
    s = sampling(max_new_tokens=3)
    engine.generate(prompts(), rows // P, s)  # allocates the state and plans the step for `rows` rows; both stay
    steps = 5
    was_training = model.training
    model.eval()
    with torch.no_grad():
        engine._step(rows, 256, s, StopRule())  # warm-up; no stop rule: every row stays alive
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine._step(rows, 256, s, StopRule())
            torch.cuda.synchronize()
    model.train(was_training)
    _record_families(rec, "kernels", label, prof, steps, rows=rows)
    engine.release_memory()


def graph_breakdown(rec: Recorder, label: str, model, engine_kw=None, rows: int = ROWS, new: int = NEW,
                    replays: int = 20) -> None:
    """A token step as a generate runs it, in its CUDA graph, halfway through the completions: its wall time
    (CUDA events around `replays` replays), the GPU time of the kernels it launched by family (CUPTI traces
    the kernels of a graph; their sum counts overlapping kernels twice), the time in which some kernel ran,
    and the idle rest: the launch gaps and waits that the eager breakdown cannot show."""
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(model, use_cuda_graph=True, max_batch=rows, **(engine_kw or {}))
    s = sampling(max_new_tokens=new)
    engine.generate(prompts(), rows // P, s)  # compiles and captures every KV bucket's graph, which stay
    half = new // 2
    kv_len = engine._kv_bucket(PROMPT, half + replays)  # one bucket for all the replays (the graph reads
    if engine._kv_bucket(PROMPT, half) != kv_len:  # no position past its bucket)
        half = kv_len - PROMPT - replays - 1
    # every replay writes its K/V at PROMPT + half + i and its outputs at column half + i: inside the cache
    assert 0 <= half and half + replays <= new and PROMPT + half + replays <= kv_len <= engine.max_seq_len, (
        f"graph_breakdown: {replays} replays from step {half} do not fit {new} new tokens")
    with torch.no_grad():  # generate's own graph, cached (captured again only if generate did not need it)
        graph = engine._graph_for(rows, kv_len, s, StopRule.of(s))
    st = engine._state

    def rewind() -> None:  # back to step `half` of every row, so that the replays stay in the cache and outputs
        st.pos[:rows] = PROMPT + half
        st.step.fill_(half)

    rewind()
    graph.replay()
    rewind()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    step_us = start.elapsed_time(end) * 1e3 / replays
    rewind()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels_us = _record_families(rec, "graph_kernels", label, prof, replays, rows=rows, kv_len=kv_len,
                                  step_us=round(step_us, 1))
    busy_us = _busy_us(prof, replays)
    rec.record("graph_step", variant=label, rows=rows, step_us=round(step_us, 1), kernels_us=round(kernels_us, 1),
               busy_us=round(busy_us, 1), idle_us=round(step_us - busy_us, 1))
    engine.release_memory()


def standby(rec: Recorder, model) -> None:
    """Peak memory of generate-then-train, with and without release_memory between the phases."""
    ids = torch.tensor(prompts(), device="cuda").repeat_interleave(G, 0)
    ids = torch.cat([ids, ids[:, :NEW].repeat(1, 4)[:, :NEW]], 1)  # (16, 640): prompt + completion length
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def train_phase():
        model.train()
        h = base.model(input_ids=ids).last_hidden_state  # (16, 640, 2048); no (T, V) logits
        h.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    train_phase()  # warm-up allocations of the training phase alone
    torch.cuda.synchronize()
    for release in (True, False):
        engine = make_engine(model)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        engine.generate(prompts(), G, sampling(max_new_tokens=64))
        torch.cuda.synchronize()
        gen_peak = torch.cuda.max_memory_allocated() - m0
        after_gen = torch.cuda.memory_allocated() - m0
        if release:
            engine.release_memory()
        after_release = torch.cuda.memory_allocated() - m0
        torch.cuda.reset_peak_memory_stats()
        train_phase()
        torch.cuda.synchronize()
        step_peak = max(gen_peak, torch.cuda.max_memory_allocated() - m0)
        rec.record("standby", release=release, gen_peak_gib=round(gen_peak / 2**30, 3),
            held_after_generate_gib=round(after_gen / 2**30, 3), held_after_release_gib=round(after_release / 2**30, 3),
            step_peak_over_weights_gib=round(step_peak / 2**30, 3),
            reserved_gib=round(torch.cuda.memory_reserved() / 2**30, 2))
        engine.release_memory()
        del engine
    torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated()
    train_phase()
    rec.record("standby", release="train_only", step_peak_over_weights_gib=round(
        (torch.cuda.max_memory_allocated() - m0) / 2**30, 3))


def correctness(rec: Recorder, model, engine_kw=None) -> None:
    """Greedy tokens against transformers generate; prefill logits against a forward; graph vs eager."""
    kw = engine_kw or {}
    ps = prompts()[:2]
    engine = make_engine(model, **kw)
    r = engine.generate(ps, 1, sampling(max_new_tokens=32, temperature=0.0, min_p=0.0))
    same = []
    for i, p in enumerate(ps):
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=PAD)[0, PROMPT:].tolist()
        mine = r.completion_ids[i].tolist()
        agree = next((j for j, (a, b) in enumerate(zip(mine, out)) if a != b), 32)
        same.append(agree)
    with torch.no_grad():
        ids = torch.tensor(ps, device="cuda")
        full = torch.cat([ids, r.completion_ids[:, :8]], 1)
        logits = model(full).logits.float()[:, PROMPT - 1 : PROMPT + 7]  # predicts completion tokens 0..7
    ref = torch.log_softmax(logits, -1).gather(-1, r.completion_ids[:, :8, None])[..., 0]
    logp_err = (ref - r.sampler_logp[:, :8]).abs().max().item()
    eager = make_engine(model, **{**kw, "use_cuda_graph": False})
    s = sampling(max_new_tokens=48, top_p=0.95, top_k=100)
    a, b = engine.generate(prompts(), G, s), eager.generate(prompts(), G, s)
    rec.record("correctness", engine_kw=engine_kw, greedy_tokens_equal_to_hf_of_32=same,
               greedy_logp_max_abs_err_vs_forward=round(logp_err, 4),
        graph_equals_eager=bool(torch.equal(a.completion_ids, b.completion_ids)),
        graph_vs_eager_logp_max_err=float((a.sampler_logp - b.sampler_logp).abs().max()))
    engine.release_memory()
    eager.release_memory()


def rows_check(rec: Recorder, model, rows: int, engine_kw: dict) -> None:
    """At `rows` rows, greedy: the sampler's log-probs of its own first 8 tokens against a full forward
    over prompt + those tokens, for the engine with the decode kernels and with the modules. (Comparing
    the two engines' tokens says nothing on random weights: near-ties part them after a step or two.)"""
    row = dict(kind="rows_check", rows=rows, engine_kw=engine_kw)
    ids = torch.tensor(prompts(), device="cuda").repeat_interleave(rows // P, 0)
    for gemm in ("kernels", "modules"):
        engine = make_engine(model, max_seq_len=PROMPT + 32, max_batch=rows,  # kernels at every row count they take
                             **{**engine_kw, "gemm": gemm, "kernel_rows": decode_gemm.MAX_ROWS})
        r = engine.generate(prompts(), rows // P, sampling(max_new_tokens=8, temperature=0.0, min_p=0.0))
        engine.release_memory()
        with torch.no_grad():
            logits = model(torch.cat([ids, r.completion_ids], 1)).logits[:, PROMPT - 1: PROMPT + 7].float()
        ref = torch.log_softmax(logits, -1).gather(-1, r.completion_ids[..., None])[..., 0]
        row[f"{gemm}_logp_max_abs_err_vs_forward"] = round(float((ref - r.sampler_logp).abs().max()), 4)
        del logits
    rec.record(**row)


def at_rows(rec: Recorder, label: str, model, wbytes: int, mode: str) -> None:
    """Agreement with a full forward at 16, 32 and 64 rows, and the decode step at 32 and 64 rows,
    kernels against modules."""
    rows_check(rec, model, 16, dict(compile=mode))  # the kernels' own row count: the baseline for agreement
    for rows in (32, 64):
        rows_check(rec, model, rows, dict(compile=mode))
        for g in ("kernels", "modules"):
            kw = dict(compile=mode, gemm=g, kernel_rows=decode_gemm.MAX_ROWS)
            run_engine(rec, f"{label} {rows} rows {g}", model, wbytes, engine_kw=kw, rows=rows)


PLANS = {
    # the CUDA graph against eager and transformers, every model kind; profiles, standby, a whole-model compile
    "graph": ["check", "hf", "eager", "graph", "greedy", "kernels", "fp8", "fp8_lora", "lora", "kernels_lora",
              "standby", "compile"],
    # compiled variants of every model kind, and where the time goes in the compiled step
    "compiled": ["graph", "compile_sdpa", "compile_kernel", "compile_streams", "kernels_compiled",
                 "fp8_compiled", "lora_compiled", "lora_compiled_nostreams", "fp8_lora_compiled", "fp8_graph"],
    # the decode GEMM kernels against the module path, every model kind
    "gemm": ["check", "check_gemm", "hf", "compile_streams", "gemm", "kernels_gemm", "fp8_compiled", "fp8_gemm",
             "lora_compiled", "lora_gemm", "kernels_lora_gemm", "fp8_lora_compiled", "fp8_lora_gemm"],
    # the decode kernels beyond 16 rows: kernels against modules at 32 and 64 rows
    "rows": ["rows", "fp8_rows"],
    # Qwen2.5-Coder-1.5B shapes with the adapter at the preset's 64 rows: the product's step, its modules, a profile
    "qwen": ["qwen_product", "qwen_product_no_pdl", "qwen_product_no_chain", "qwen_attention_kernel", "qwen_modules",
             "qwen_kernels", "qwen_graph", "qwen_stopped_rows"],
    # the bench's token step as the product runs it (Llama-3.2-1B shapes with the adapter, 16 rows), and where
    # its time goes inside the CUDA graph
    "bench": ["product", "product_no_chain", "product_graph", "lora_product", "lora_product_no_chain",
              "lora_product_graph", "lora_folded", "lora_folded_no_chain", "lora_folded_graph"],
    # the product's token step past the bench's 16 rows (the sampler's 64 and 256, with the adapter), and FP8's
    # at 16 rows: where each one's time goes inside the CUDA graph
    "wide": ["lora_product_64", "lora_product_64_graph", "lora_product_256", "lora_product_256_graph",
             "lora_product_folded_256", "lora_product_folded_256_graph", "fp8_lora_product", "fp8_lora_product_graph",
             "fp8_lora_256_fp8", "fp8_lora_256_dense", "fp8_lora_product_bf16"],
}
# the `wide` plan's steps past 16 rows: (name, rows, EngineTuning.fold_adapter)
WIDE_STEPS = (("lora_product_64", 64, False), ("lora_product_256", 256, False), ("lora_product_folded_256", 256, True))


def run_fp8_modules(rec: Recorder, gemm: str, model, wbytes: int, engine_kw: dict) -> None:
    """FP8's token step at 256 rows, where its layers call their modules, with FP8Linear's `gemm` as the
    trainer's --fp8-gemm sets it: fp8 (FP8Linear's auto, the FP8 GEMMs) or dense (a bf16 copy each call)."""
    from grpo.kernels.fp8 import FP8Linear

    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for layer in layers:
        layer.gemm = "auto" if gemm == "fp8" else gemm
    try:
        run_engine(rec, f"fp8+LoRA r32 product 256 rows, --fp8-gemm {gemm}", model, wbytes, engine_kw=engine_kw,
                   rows=256)
    finally:
        for layer in layers:
            layer.gemm = "auto"


QWEN_ROWS, QWEN_NEW = 64, 384  # the qwen1.5b-gsm8k preset: 8 prompts x 8, completions up to 384 tokens


def product_engine_kw() -> dict:
    """make_engine's arguments for the engine as the trainer builds it, but for the fold (the trainer folds
    bf16 adapters: the `lora_folded*` steps): EngineTuning's defaults, the decode kernels where they apply
    (run_engine and kernel_breakdown say whether to graph)."""
    kw = {f.name: getattr(EngineTuning(), f.name) for f in fields(EngineTuning) if f.name != "use_cuda_graph"}
    return kw | {"gemm": "auto"}


def _tuned(fn, **choices):
    """fn() under decode_gemm.tuning(**choices); the graphs captured inside keep them."""
    with decode_gemm.tuning(**choices):
        return fn()


# decode_gemm.Tuning's variants of the product's step, by the suffix of their names: chain off (each launch after the
# one ahead of it has ended)
CHOICES = {"no_chain": dict(chain=False)}


def step_variants(step, name: str, label: str, run, choices: dict | None = None) -> None:
    """The step `name` again under each of `choices` (default CHOICES) as `{name}_{suffix}`: run(its label) under
    its decode_gemm.tuning."""
    for suffix, chosen in (choices or CHOICES).items():
        step(f"{name}_{suffix}", lambda suffix=suffix, chosen=chosen: _tuned(lambda: run(f"{label}, {suffix}"),
                                                                             **chosen))


def qwen_steps(rec: Recorder, step) -> None:
    """The `qwen` plan: the product's engine (EngineTuning's defaults: decode kernels, compiled, CUDA graph)
    on Qwen2.5-Coder-1.5B shapes with rsLoRA r=32, against the same step through the modules, and the kernel
    families of one token step at 64 rows (eager: the graph replays these same kernels), and the same inside the
    CUDA graph with the time between the kernels (`graph_breakdown`)."""
    if not any(v.startswith("qwen_") for v in step.chosen):
        return
    try:
        model = add_lora(build_model(config=qwen_1_5b_config()))
    except Exception as exc:  # recorded as a step's failure is: the probe still prints what it has
        rec.record("error", variant="qwen model", error=repr(exc)[:400], tb=traceback.format_exc()[-1500:])
        return
    # what a token step reads: every weight but the untied input embedding (one row a token)
    wb = weight_bytes(model) - model.get_input_embeddings().weight.nbytes
    rec.record("model", variant="qwen1.5b+LoRA", params=sum(p.numel() for p in model.parameters()),
               weight_gib=round(wb / 2**30, 3))
    product = product_engine_kw()
    for name, kw in (("qwen_product", product), ("qwen_modules", product | {"gemm": "modules"})):
        step(name, lambda kw=kw, name=name: run_engine(rec, name, model, wb, engine_kw=kw, rows=QWEN_ROWS,
                                                       new=QWEN_NEW))
        if name == "qwen_product":  # the same with decode_gemm.Tuning.pdl off: each adapter's launch after its
            # lora_down
            step_variants(step, "qwen_product", "qwen_product", lambda label: run_engine(
                rec, label, model, wb, engine_kw=product, rows=QWEN_ROWS, new=QWEN_NEW),
                {"no_pdl": dict(pdl=False), **CHOICES})
            # the attention kernel (grpo.kernels.decode_attention) in place of sdpa: each row read to its own length
            step("qwen_attention_kernel", lambda: run_engine(rec, "qwen_attention_kernel", model, wb,
                                                             engine_kw=product | {"attention": "kernel"},
                                                             rows=QWEN_ROWS, new=QWEN_NEW))
    step("qwen_kernels", lambda: kernel_breakdown(rec, "qwen_product", model, engine_kw=product, rows=QWEN_ROWS))
    step("qwen_graph", lambda: graph_breakdown(rec, "qwen_product", model, engine_kw=product, rows=QWEN_ROWS,
                                               new=QWEN_NEW))
    step("qwen_stopped_rows", lambda: stopped_rows(rec, "qwen_product", model, engine_kw=product))


def stopped_rows(rec: Recorder, label: str, model, engine_kw: dict, repeats: int = 5) -> None:
    """The decode's steps as its CUDA graphs replay them, each row alive until the qwen1.5b-gsm8k preset's
    recorded completion length (`qwen_step.QWEN_COMPLETIONS`: the attention kernel reads no cache of a row that
    has stopped) against every row alive to the end: the whole decode's seconds, medians of `repeats`."""
    from qwen_step import QWEN_COMPLETIONS  # beside this file

    engine = make_engine(model, use_cuda_graph=True, max_batch=QWEN_ROWS, **engine_kw)
    s = sampling(max_new_tokens=QWEN_NEW)
    engine.generate(prompts(), QWEN_ROWS // P, s)  # compiles and captures every KV bucket's graph, which stay
    st = engine._state
    with torch.no_grad():
        graphs = [engine._graph_for(QWEN_ROWS, engine._kv_bucket(PROMPT, i), s, StopRule.of(s))
                  for i in range(QWEN_NEW)]
    steps = torch.arange(QWEN_NEW, device="cuda")[:, None]
    schedules = {"every_row": torch.ones(QWEN_NEW, QWEN_ROWS, dtype=torch.bool, device="cuda"),
                 "preset_lengths": steps < torch.tensor(QWEN_COMPLETIONS, device="cuda")[None, :]}

    def decode_s(alive: torch.Tensor) -> float:
        st.pos[:QWEN_ROWS] = PROMPT
        st.step.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i, graph in enumerate(graphs):
            st.alive[:QWEN_ROWS].copy_(alive[i])
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    times = {name: [] for name in schedules}
    for _ in range(repeats):
        for name, alive in schedules.items():
            times[name].append(decode_s(alive))
    rec.record("stopped_rows", variant=label, rows=QWEN_ROWS, steps=QWEN_NEW,
               **{f"{name}_s": round(statistics.median(t), 4) for name, t in times.items()})
    engine.release_memory()


@dataclass
class Steps:
    """Runs a step of the plan: one not chosen is passed over, one that would start past the budget is
    skipped, one that fails is recorded and the rest go on (one broken step must not cost the lease)."""

    rec: Recorder
    chosen: list[str]
    budget_s: float

    def __call__(self, name: str, fn):
        if name not in self.chosen:
            return None
        if self.rec.elapsed_s() > self.budget_s:
            self.rec.record("skipped", variant=name, reason="time budget")
            return None
        try:
            return fn()
        except Exception as exc:
            self.rec.record("error", variant=name, error=repr(exc)[:400], tb=traceback.format_exc()[-1500:])
            return None
        finally:
            torch.cuda.empty_cache()


def print_summary(rec: Recorder) -> None:
    env = rec.of_kind("env")[0]
    shapes = (f"Qwen2.5-Coder-1.5B shapes, {QWEN_ROWS} rows, prompt {PROMPT}, new {QWEN_NEW}"
              if any(r["kind"] == "model" and r["variant"].startswith("qwen") for r in rec.rows)
              else f"Llama-3.2-1B shapes, {ROWS} rows, prompt {PROMPT}, new {NEW}")
    print(f"\n=== NativeEngine, {shapes}, {env['gpu']} ===")
    print(f"torch {env['torch']}, transformers {env['transformers']}, copy {env['copy_tbps']} TB/s")
    for r in rec.rows:
        if r["kind"] == "hf_generate":
            print(f"HF generate: {r['ms_per_step']} ms/step")
        if r["kind"] == "engine":
            print(f"{r['variant']:<48} {r['ms_per_step']:>7.3f} ms/step {r['tok_per_s']:>7} tok/s {r['gbps']:>6} GB/s "
                  f"prefill {r['prefill_ms']} ms capture {r['capture_ms']} ms first {r['first_wall_s']} s "
                  f"peak+{r['peak_extra_gib']} GiB")
        if r["kind"] in ("standby", "correctness", "error", "skipped", "kernels", "best", "rows_check", "graph_kernels",
                         "graph_step"):
            print({k: v for k, v in r.items() if k not in ("tb",)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no step after this many seconds")
    ap.add_argument("--plan", default="compiled", choices=list(PLANS), help="which steps to run (listed above)")
    ap.add_argument("--variants", nargs="+", default=None, help="steps to run (default: the plan's)")
    ap.add_argument("--compile-mode", default="default")
    add_out_argument(ap)
    args = ap.parse_args()
    variants = args.variants or PLANS[args.plan]
    import transformers

    rec = Recorder("native_engine", args.out)
    step = Steps(rec, variants, args.budget_s)
    torch._dynamo.config.cache_size_limit = 32  # several model kinds in one process
    rec.record("env", torch=torch.__version__, transformers=transformers.__version__,
               gpu=torch.cuda.get_device_name(), copy_tbps=round(copy_tbps(), 2))
    for row in gemm_table():
        rec.record(**row)

    qwen_steps(rec, step)
    if all(v.startswith("qwen_") for v in variants):
        print_summary(rec)
        return
    mode = args.compile_mode
    model = build_model()
    wb = weight_bytes(model)
    rec.record("model", variant="bf16", params=sum(p.numel() for p in model.parameters()),
               weight_gib=round(wb / 2**30, 3))
    step("check", lambda: correctness(rec, model))
    gemm = dict(compile=mode, gemm="kernels")
    step("check_gemm", lambda: correctness(rec, model, gemm))
    step("hf", lambda: rec.record("hf_generate", ms_per_step=round(hf_generate_ms(model), 2)))
    step("eager", lambda: run_engine(rec, "bf16 eager (no graph)", model, wb, graph=False, new=32, repeats=1))
    step("graph", lambda: run_engine(rec, "bf16 graph", model, wb))
    step("greedy", lambda: run_engine(rec, "bf16 graph greedy", model, wb, temperature=0.0, min_p=0.0))
    step("kernels", lambda: kernel_breakdown(rec, "bf16", model))
    step("compile", lambda: run_engine(rec, f"bf16 graph+compile({mode})", model, wb, engine_kw=dict(compile=mode)))

    # compiled variants: attention kernel, then parallel streams with the better attention
    best = dict(compile=mode, attention="sdpa")
    timed = {}
    for attention in ("sdpa", "kernel"):  # kernel: grpo.kernels.decode_attention
        kw = dict(compile=mode, attention=attention)
        row = step(f"compile_{attention}", lambda kw=kw: run_engine(rec, f"bf16 compile {kw['attention']}", model, wb,
                                                                    engine_kw=kw))
        if row:
            timed[attention] = row["ms_per_step"]
    if timed:
        best["attention"] = min(timed, key=timed.get)
    kw = dict(best, streams=True)
    row = step("compile_streams", lambda: run_engine(rec, f"bf16 compile {best['attention']} streams", model, wb,
                                                     engine_kw=kw))
    if row and (not timed or row["ms_per_step"] < min(timed.values())):
        best = kw
    rec.record("best", engine_kw=best)
    step("kernels_compiled", lambda: kernel_breakdown(rec, f"bf16 {best}", model, engine_kw=best))
    step("gemm", lambda: run_engine(rec, f"bf16 {gemm}", model, wb, engine_kw=gemm))
    step("kernels_gemm", lambda: kernel_breakdown(rec, f"bf16 {gemm}", model, engine_kw=gemm))

    step("rows", lambda: at_rows(rec, "bf16", model, wb, mode))
    product = product_engine_kw()  # the trainer's engine; here without an adapter: what the adapter costs
    step("product", lambda: run_engine(rec, "bf16 product", model, wb, engine_kw=product))
    step_variants(step, "product", "bf16 product", lambda label: run_engine(rec, label, model, wb, engine_kw=product))
    step("product_graph", lambda: graph_breakdown(rec, "bf16 product", model, engine_kw=product))

    fp8 = None
    if any("fp8" in v for v in variants):
        try:
            from grpo.kernels.fp8 import quantize_linears_
        except ImportError as exc:
            rec.record("skipped", variant="fp8", reason=f"grpo.kernels.fp8 not importable: {exc}")
        else:
            fp8 = build_model()
            quantize_linears_(fp8, LORA_TARGETS)
            wf = weight_bytes(fp8)
            rec.record("model", variant="fp8", weight_gib=round(wf / 2**30, 3))
            step("fp8", lambda: run_engine(rec, "fp8 graph", fp8, wf))
            step("kernels_fp8", lambda: kernel_breakdown(rec, "fp8", fp8))
            step("fp8_compiled", lambda: run_engine(rec, f"fp8 {best}", fp8, wf, engine_kw=best))
            step("fp8_gemm", lambda: run_engine(rec, f"fp8 {gemm}", fp8, wf, engine_kw=gemm))
            step("fp8_rows", lambda: at_rows(rec, "fp8", fp8, wf, mode))

    lora = add_lora(model)  # wraps model's projections in place
    wl = weight_bytes(lora)
    step("lora", lambda: run_engine(rec, "bf16+LoRA r32 graph", lora, wl))
    step("lora_product", lambda: run_engine(rec, "bf16+LoRA r32 product", lora, wl, engine_kw=product))
    step("lora_product_graph", lambda: graph_breakdown(rec, "bf16+LoRA r32 product", lora, engine_kw=product))
    # the adapters folded into the weights for prefill and decode
    folded = product | {"fold_adapter": True}
    step("lora_folded", lambda: run_engine(rec, "bf16+LoRA r32 folded", lora, wl, engine_kw=folded))
    for name, kw in (("lora_folded", folded), ("lora_product", product)):
        step_variants(step, name, f"bf16+LoRA r32 {name.split('_')[1]}",
                      lambda label, kw=kw: run_engine(rec, label, lora, wl, engine_kw=kw))
    # (its replays run outside a generate, on weights not folded: the same kernels and bytes, other values)
    step("lora_folded_graph", lambda: graph_breakdown(rec, "bf16+LoRA r32 folded", lora, engine_kw=folded))
    for name, rows, fold in WIDE_STEPS:  # past the kernels' rows, packed: torch's GEMMs, the adapters packed
        kw = product | {"fold_adapter": fold}
        label = f"bf16+LoRA r32 product{' folded' if fold else ''} {rows} rows"
        step(name, lambda rows=rows, label=label, kw=kw: run_engine(rec, label, lora, wl, engine_kw=kw, rows=rows))
        step(f"{name}_graph", lambda rows=rows, label=label, kw=kw: graph_breakdown(rec, label, lora, engine_kw=kw,
                                                                                      rows=rows))
    step("kernels_lora", lambda: kernel_breakdown(rec, "bf16+LoRA", lora))
    step("standby", lambda: standby(rec, lora))
    step("lora_compiled", lambda: run_engine(rec, f"bf16+LoRA r32 {best}", lora, wl, engine_kw=best))
    step("lora_gemm", lambda: run_engine(rec, f"bf16+LoRA r32 {gemm}", lora, wl, engine_kw=gemm))
    step("kernels_lora_gemm", lambda: kernel_breakdown(rec, f"bf16+LoRA {gemm}", lora, engine_kw=gemm))
    nostreams = dict(best, streams=False)
    if best.get("streams"):
        step("lora_compiled_nostreams", lambda: run_engine(rec, f"bf16+LoRA r32 {nostreams}", lora, wl,
                                                           engine_kw=nostreams))
    if fp8 is not None:
        fp8_lora = add_lora(fp8)
        wfl = weight_bytes(fp8_lora)
        step("fp8_lora_compiled", lambda: run_engine(rec, f"fp8+LoRA r32 {best}", fp8_lora, wfl, engine_kw=best))
        step("fp8_lora_gemm", lambda: run_engine(rec, f"fp8+LoRA r32 {gemm}", fp8_lora, wfl, engine_kw=gemm))
        step("fp8_lora", lambda: run_engine(rec, "fp8+LoRA r32 graph", fp8_lora, wfl))
        step("fp8_lora_product", lambda: run_engine(rec, "fp8+LoRA r32 product", fp8_lora, wfl, engine_kw=product))
        step_variants(step, "fp8_lora_product", "fp8+LoRA r32 product",
                      lambda label: run_engine(rec, label, fp8_lora, wfl, engine_kw=product))
        step("fp8_lora_product_graph", lambda: graph_breakdown(rec, "fp8+LoRA r32 product", fp8_lora,
                                                               engine_kw=product))
        # the FP8 projections on the model's bf16 activations (EngineTuning.fp8_activations), not fp16 (W x^T)
        on_bf16 = product | {"fp8_activations": "bf16"}
        step("fp8_lora_product_bf16", lambda: run_engine(rec, "fp8+LoRA r32 product on bf16", fp8_lora, wfl,
                                                         engine_kw=on_bf16))
        # past the kernels' rows FP8 layers run their modules, multiplying as --fp8-gemm says
        step("fp8_lora_256_fp8", lambda: run_fp8_modules(rec, "fp8", fp8_lora, wfl, product))
        step("fp8_lora_256_dense", lambda: run_fp8_modules(rec, "dense", fp8_lora, wfl, product))
        with fp8_lora.disable_adapter():
            step("fp8_graph", lambda: run_engine(rec, "fp8 graph (same run)", fp8_lora, wf))

    print_summary(rec)


if __name__ == "__main__":
    main()
