"""GPU checks and timings of the training kernels in grpo/kernels: FP8Linear and token_logprobs.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/probes/fp8_and_logprobs.py [--only SECTION ...]

Sections (each one is independent; a failure records its traceback and the rest go on):
  env       GPU and versions
  rates     the two ceilings: device copy bandwidth and a large bf16 matmul
  fp8_err   relative errors of the FP8 paths against float64 on the dequantized weight
  fp8_time  forward+backward at M=16384 for the Llama-3.2-1B shapes, bf16 nn.Linear vs FP8 variants
  logprobs  N=32768, V=128256, H=2048 forward+backward: plain, chunked plain, torch and Triton variants
  model     a Llama-3.2-1B-shaped model (random weights): base-weight memory, FP8 vs bf16 log-probs,
            and forward+backward of the whole model with rsLoRA adapters
  overhead  (only with --only overhead) host-side cost of the autograd path at small shapes
  smollm2   (only with --only smollm2; CPU) a real trained model, SmolLM2-135M, FP8 vs bf16 log-probs
Timings are medians over CUDA events after warm-up (timing.py), on random (never zero) inputs; every
row goes to --out as JSON lines, and a summary is printed at the end. `--small` shrinks every size so
the script can be smoke-run on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback

import torch
from torch import nn

from grpo.config import LORA_TARGETS
from grpo.kernels.fp8 import (
    FP8Linear,
    dequantize_fp8_block,
    fp8_mm_bwd,
    fp8_mm_fwd,
    quantize_fp8_rows,
    quantize_fp8_rows_ref,
    quantize_linears_,
    transpose_fp8,
)
from grpo.kernels.logprobs import token_logprobs, token_logprobs_ref
from grpo.kernels.logprobs import tuning as logprobs_tuning  # `logprobs` is a section here
from timing import (  # beside this file
    Recorder,
    add_out_argument,
    copy_tbps,
    host_ms,
    kernel_ms,
    median_ms,
    peak_extra_gib,
    sync,
)

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run_section(section, args, rec: Recorder) -> None:
    """One section; a failure is recorded with its traceback and the next section goes on."""
    rec.say(f"\n=== {section.__name__} ===")
    t0 = time.time()
    try:
        section(args, rec)
    except Exception:  # keep going: one broken section must not hide the others
        tb = traceback.format_exc()
        rec.say(tb)
        rec.record("error", section=section.__name__, error=tb.splitlines()[-1])
    rec.say(f"[{section.__name__} took {time.time() - t0:.1f} s]")
    sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- sections -------------------------------------------------------------------------------------


def env(args, rec: Recorder):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = torch.cuda.get_device_capability()
        import triton

        info["triton"] = triton.__version__
    import peft
    import transformers

    info["transformers"], info["peft"] = transformers.__version__, peft.__version__
    rec.record("env", **info)


def rates(args, rec: Recorder):
    d = args.device
    gbps = copy_tbps(2**29 if not args.small else 2**20) * 1e3
    s = 8192 if not args.small else 256
    a = torch.randn(s, s, device=d, dtype=torch.bfloat16)
    b = torch.randn(s, s, device=d, dtype=torch.bfloat16)
    ms_mm = kernel_ms(lambda: a @ b)
    tflops = 2 * s**3 / ms_mm / 1e9
    rec.record("rates", copy_GBps=gbps, bf16_tflops=tflops, matmul_size=s)


SHAPES = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]  # (K in, N out) of Llama-3.2-1B


def fp8_err(args, rec: Recorder):
    d = args.device
    cases = [(16384, k, n) for k, n in SHAPES] + [(1000, 2048, 512), (1, 512, 512), (333, 8192, 2048)]
    if args.small:
        cases = [(64, 512, 512)]
    for m, k, n in cases:
        torch.manual_seed(m + k + n)
        lin = nn.Linear(k, n, bias=False, device=d, dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(lin)
        w64 = fp8.dequantized_weight(torch.float64)
        x = torch.randn(m, k, device=d, dtype=torch.bfloat16)
        g = torch.randn(m, n, device=d, dtype=torch.bfloat16)
        y64, dx64 = x.double() @ w64.t(), g.double() @ w64
        row = {"m": m, "k": k, "n": n}
        if d == "cuda":
            row["fwd_fp8"] = rel(fp8_mm_fwd(x, fp8.weight, fp8.weight_scale_inv), y64)
            row["bwd_fp8"] = rel(fp8_mm_bwd(g, fp8.weight, fp8.weight_scale_inv), dx64)
        row["fwd_dequant"] = rel(x @ fp8.dequantized_weight().t(), y64)
        row["bwd_dequant"] = rel(g @ fp8.dequantized_weight(), dx64)
        row["bf16_linear_vs_fp8_weight"] = rel(lin(x), y64)  # the bf16 weight itself vs its FP8 copy
        if d == "cuda":
            xq, sx = quantize_fp8_rows(x)
            xr, sr = quantize_fp8_rows_ref(x)
            row["quant_triton_code_mismatch"] = (xq.view(torch.uint8) != xr.view(torch.uint8)).float().mean().item()
            row["quant_triton_scale_maxrel"] = ((sx - sr).abs() / sr).max().item()
        rec.record("fp8_err", **row)


def fp8_time(args, rec: Recorder):
    d = args.device
    m = 16384 if not args.small else 256
    compiled = None
    if d == "cuda":
        qc = torch.compile(quantize_fp8_rows_ref, dynamic=True)

        def compiled(x):
            codes, scale = qc(x)
            return codes, scale.t().contiguous().t()  # insist on the layout _scaled_mm wants

    for k, n in SHAPES:
        torch.manual_seed(k * n)
        lin = nn.Linear(k, n, bias=False, device=d, dtype=torch.bfloat16).requires_grad_(False)
        lin_train = nn.Linear(k, n, bias=False, device=d, dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(lin)
        fp8_deq = FP8Linear.from_linear(lin)
        fp8_deq.bwd = "dequant"
        w, s = fp8.weight, fp8.weight_scale_inv
        x = torch.randn(m, k, device=d, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=d, dtype=torch.bfloat16)
        row = {"k": k, "n": n, "m": m}
        row["bf16_frozen_fb"] = kernel_ms(lambda: torch.autograd.grad(lin(x), x, g))
        row["bf16_train_fb"] = kernel_ms(lambda: torch.autograd.grad(lin_train(x), (x, lin_train.weight), g))
        row["bf16_fwd"] = kernel_ms(lambda: lin(x.detach()))
        if d == "cuda":
            xd = x.detach()
            row["fp8_fb"] = kernel_ms(lambda: torch.autograd.grad(fp8(x), x, g))
            row["fp8_fb_bwd_dequant"] = kernel_ms(lambda: torch.autograd.grad(fp8_deq(x), x, g))
            row["fp8_fb_manual"] = kernel_ms(lambda: (fp8_mm_fwd(xd, w, s), fp8_mm_bwd(g, w, s)))
            row["fp8_fb_quant_eager"] = kernel_ms(lambda: (fp8_mm_fwd(xd, w, s, "ref"), fp8_mm_bwd(g, w, s, "ref")))
            try:
                row["fp8_fb_quant_compiled"] = kernel_ms(lambda: (fp8_mm_fwd(xd, w, s, compiled),
                                                                  fp8_mm_bwd(g, w, s, compiled)))
            except Exception as e:  # torch.compile is optional here
                rec.say(f"  compiled quantize failed: {type(e).__name__}: {str(e)[:200]}")
            row["fp8_fwd"] = kernel_ms(lambda: fp8(xd))
            xq, sx = quantize_fp8_rows(xd)
            row["fp8_gemm_fwd_only"] = kernel_ms(lambda: torch._scaled_mm(
                xq, w.t(), scale_a=sx, scale_b=s.contiguous().t(), out_dtype=torch.bfloat16))
            gq, sg = quantize_fp8_rows(g)
            w_cm, s_cm = w.t().contiguous().t(), s.t().contiguous().t()
            row["fp8_gemm_bwd_only"] = kernel_ms(lambda: torch._scaled_mm(
                gq, w_cm, scale_a=sg, scale_b=s_cm, out_dtype=torch.bfloat16))
            try:  # the ceiling without block scales: one scale per row of X and per column of W
                one_a = torch.ones(m, 1, device=d)
                one_b = torch.ones(1, n, device=d)
                row["fp8_gemm_rowwise_fwd"] = kernel_ms(lambda: torch._scaled_mm(
                    xq, w.t(), scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16, use_fast_accum=True))
            except Exception as e:
                rec.say(f"  rowwise _scaled_mm failed: {type(e).__name__}: {str(e)[:200]}")
            row["quant_x_triton"] = kernel_ms(lambda: quantize_fp8_rows(xd))
            row["quant_x_eager"] = kernel_ms(lambda: quantize_fp8_rows_ref(xd))
            row["dequant_w"] = kernel_ms(lambda: dequantize_fp8_block(w, s))
            row["transpose_w_torch"] = kernel_ms(lambda: w.t().contiguous())
            row["transpose_w_triton"] = kernel_ms(lambda: transpose_fp8(w))
            assert torch.equal(transpose_fp8(w).view(torch.uint8), w.t().contiguous().view(torch.uint8))
            row["speedup_vs_bf16_frozen"] = row["bf16_frozen_fb"] / row["fp8_fb"]
        rec.record("fp8_time", **row)


def logprobs(args, rec: Recorder):
    d = args.device
    n, v, h = (32768, 128256, 2048) if not args.small else (512, 5000, 64)
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=d, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device=d) * (3 / h**0.5)).to(torch.bfloat16)  # logits of std ~3
    targets = torch.randint(0, v, (n,), device=d)
    upstream = torch.randn(n, device=d)

    def plain():
        return torch.autograd.grad(token_logprobs_ref(hidden, weight, targets), hidden, upstream)[0]

    def plain_chunked(rows=4096):
        grad = torch.empty_like(hidden)
        for s in range(0, n, rows):
            hc = hidden[s:s + rows].detach().requires_grad_()
            grad[s:s + rows] = torch.autograd.grad(token_logprobs_ref(hc, weight, targets[s:s + rows]), hc,
                                                   upstream[s:s + rows])[0]
        return grad

    def matmuls_only(rows=2048):
        for s in range(0, n, rows):
            (hidden[s:s + rows].detach() @ weight.t()) @ weight

    def ours(**kw):
        def run():
            out = token_logprobs(hidden, weight, targets, **kw)
            out = out[0] if isinstance(out, tuple) else out
            return torch.autograd.grad(out, hidden, upstream)[0]
        return run

    def ours_fwd(**kw):
        def run():
            with torch.no_grad():
                return token_logprobs(hidden, weight, targets, **kw)
        return run

    def triton_blocks(block_v, warps, **kw):
        def run():
            with logprobs_tuning(block_v=block_v, num_warps=warps):
                return ours(impl="triton", **kw)()
        return run

    small_chunk = 128 if not args.small else 64
    variants = [
        ("plain (bf16 logits, fp32 log_softmax, gather)", plain),
        ("plain chunked by 4096 rows", plain_chunked),
        ("two matmuls only (floor), 2048-row chunks", matmuls_only),
        ("torch, grad in forward, default chunk", ours(impl="torch")),
        ("torch, recompute in backward, default chunk", ours(impl="torch", recompute=True)),
    ]
    if d == "cuda":
        variants += [
            ("triton, grad in forward, chunk 2048 (default)", ours(impl="triton")),
            ("triton, grad in forward, chunk 1024", ours(impl="triton", chunk_size=1024)),
            ("triton, grad in forward, chunk 4096", ours(impl="triton", chunk_size=4096)),
            ("triton, recompute in backward, chunk 2048", ours(impl="triton", recompute=True)),
            ("triton BLOCK_V 4096 / 8 warps, chunk 2048", triton_blocks(4096, 8)),
            ("triton BLOCK_V 16384 / 16 warps, chunk 2048", triton_blocks(16384, 16)),
            ("triton + entropy, grad in forward, chunk 2048", ours(impl="triton", return_entropy=True)),
            ("triton forward only (no grad), chunk 2048", ours_fwd(impl="triton")),
        ]
    else:
        variants += [("torch small chunk", ours(impl="torch", chunk_size=small_chunk))]

    # correctness against the plain path on the same bf16 logits, and against float64 on a few rows
    ref_logp = token_logprobs_ref(hidden, weight, targets).detach()
    ref_grad = plain()
    rows64 = slice(0, 64)
    h64 = hidden[rows64].detach().double().requires_grad_()
    logp64 = token_logprobs_ref(h64, weight.double(), targets[rows64])
    (grad64,) = torch.autograd.grad(logp64, h64, upstream[rows64].double())
    impls = [("torch", False), ("torch", True)] + ([("triton", False), ("triton", True)] if d == "cuda" else [])
    for impl, recompute in impls:
        out = token_logprobs(hidden, weight, targets, impl=impl, recompute=recompute)
        (grad,) = torch.autograd.grad(out, hidden, upstream)
        e = {"impl": impl, "recompute": recompute,
             "logp_maxabs_vs_plain": (out.detach() - ref_logp).abs().max().item(),
             "grad_rel_vs_plain": rel(grad, ref_grad),
             "logp_maxabs_vs_fp64": (out.detach()[rows64].double() - logp64.detach()).abs().max().item(),
             "grad_rel_vs_fp64": rel(grad[rows64], grad64),
             "plain_logp_maxabs_vs_fp64": (ref_logp[rows64].double() - logp64.detach()).abs().max().item(),
             "plain_grad_rel_vs_fp64": rel(ref_grad[rows64], grad64)}
        rec.record("logprobs_err", **e)
    del ref_grad

    for name, fn in variants:
        try:
            ms = median_ms(fn, warmup=2, iters=7)
            mem = peak_extra_gib(fn)
        except Exception as e:
            rec.say(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        rec.record("logprobs_time", variant=name, ms=ms, peak_extra_GiB=mem, n=n, v=v, h=h)


def llama_1b_config(small: bool):
    from transformers import LlamaConfig

    if small:
        return LlamaConfig(vocab_size=128256, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                           rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=4096)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                       rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)


def param_bytes(model: nn.Module, only=None) -> int:
    total = 0
    for name, mod in model.named_modules():
        if only is not None and not only(name, mod):
            continue
        for p in mod.parameters(recurse=False):
            total += p.numel() * p.element_size()
    return total


def model(args, rec: Recorder):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    d = args.device
    cfg = llama_1b_config(args.small)
    torch.manual_seed(0)
    with torch.device(d):
        m32 = LlamaForCausalLM(cfg).eval()  # the float32 truth for this random model
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    m8 = copy.deepcopy(m16)
    count = quantize_linears_(m8, LORA_TARGETS)  # as --load-in-fp8 does, from the bf16 weights
    is_target = lambda name, mod: name.rsplit(".", 1)[-1] in LORA_TARGETS  # noqa: E731
    mem = {"fp8_layers": count,
           "linear_bf16_GB": param_bytes(m16, is_target) / 1e9, "linear_fp8_GB": param_bytes(m8, is_target) / 1e9,
           "model_bf16_GB": param_bytes(m16) / 1e9, "model_fp8_GB": param_bytes(m8) / 1e9}
    mem["linear_ratio"] = mem["linear_fp8_GB"] / mem["linear_bf16_GB"]
    mem["model_ratio"] = mem["model_fp8_GB"] / mem["model_bf16_GB"]
    if d == "cuda":  # what the allocator actually holds for each model
        sync()
        before = torch.cuda.memory_allocated()
        probe = copy.deepcopy(m16)
        quantize_linears_(probe, LORA_TARGETS)
        sync()
        mem["allocated_fp8_copy_GB"] = (torch.cuda.memory_allocated() - before) / 1e9
        del probe
    rec.record("model_memory", **mem)

    b, t = (8, 512) if not args.small else (2, 32)
    ids = torch.randint(0, cfg.vocab_size, (b, t), device=d)

    def logp_of(mdl):
        with torch.no_grad():
            hid = mdl.model(ids).last_hidden_state[:, :-1].reshape(-1, cfg.hidden_size)
            return token_logprobs(hid, mdl.get_output_embeddings().weight, ids[:, 1:].reshape(-1)).double(), hid

    def set_gemm(mdl, gemm):
        for mod in mdl.modules():
            if isinstance(mod, FP8Linear):
                mod.gemm = gemm

    lp32, h32 = logp_of(m32)
    lp16, h16 = logp_of(m16)
    lp8, h8 = logp_of(m8)
    set_gemm(m8, "dequant")  # FP8 weights, bf16 activations: the weight error alone
    lp8w, h8w = logp_of(m8)
    set_gemm(m8, "auto")
    acc = {"logp_mean_fp32": lp32.mean().item()}
    for name, lp_, h_ in (("bf16", lp16, h16), ("fp8", lp8, h8), ("fp8_weights_only", lp8w, h8w)):
        acc[f"{name}_logp_rel_vs_fp32"] = rel(lp_, lp32)
        acc[f"{name}_logp_maxabs_vs_fp32"] = (lp_ - lp32).abs().max().item()
        acc[f"{name}_hidden_rel_vs_fp32"] = rel(h_, h32)
    acc["fp8_logp_rel_vs_bf16"] = rel(lp8, lp16)
    acc["fp8_logp_maxabs_vs_bf16"] = (lp8 - lp16).abs().max().item()
    acc["fp8_hidden_rel_vs_bf16"] = rel(h8, h16)
    acc["fp8_ratio_rel_err_mean"] = (lp8 - lp16).exp().sub(1).abs().mean().item()  # |pi_fp8/pi_bf16 - 1|
    rec.record("model_logp", **acc)
    del m32, h32, h16, h8, h8w

    # forward+backward of the whole model with rsLoRA (r=32, alpha=64) on the 7 projections
    bt = (16, 1024) if not args.small else (2, 32)
    ids_t = torch.randint(0, cfg.vocab_size, bt, device=d)
    step = {}
    for name, base in (("bf16", m16), ("fp8", m8)):
        lora = LoraConfig(r=32, lora_alpha=64, use_rslora=True, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
        pm = get_peft_model(base, lora)
        pm.train()
        inner = pm.base_model.model
        w = inner.get_output_embeddings().weight

        def fb():
            hid = inner.model(ids_t).last_hidden_state[:, :-1].reshape(-1, cfg.hidden_size)
            loss = token_logprobs(hid, w, ids_t[:, 1:].reshape(-1)).mean()
            loss.backward()
            for p in pm.parameters():
                p.grad = None

        ms = median_ms(fb, warmup=2, iters=5)
        peak = peak_extra_gib(fb)
        step[name] = {"ms": ms, "peak_extra_GiB": peak}
        rec.say(f"  {name}: whole-model fwd+bwd with rsLoRA, {bt[0]}x{bt[1]} tokens: {ms:.1f} ms, "
                f"peak extra {peak:.2f} GiB")
        pm.unload() if hasattr(pm, "unload") else None
        del pm
    step["speedup"] = step["bf16"]["ms"] / step["fp8"]["ms"]
    rec.record("model_step", **step)


def overhead(args, rec: Recorder):
    """Where the module path loses to the manual path at small shapes: a Python autograd.Function
    wrapping plain bf16 matmuls, host-side wall clock per call, and the profiler's top ops."""
    d = args.device
    m = 16384 if not args.small else 256

    class PyLinear(torch.autograd.Function):  # the same autograd structure as _FP8LinearFn, bf16 math
        @staticmethod
        def forward(ctx, x2, w):
            ctx.save_for_backward(w)
            return x2 @ w.t()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, gy):
            (w,) = ctx.saved_tensors
            return gy @ w, None

    for k, n in ((2048, 512), (2048, 2048)):
        lin = nn.Linear(k, n, bias=False, device=d, dtype=torch.bfloat16).requires_grad_(False)
        fp8 = FP8Linear.from_linear(lin)
        x = torch.randn(m, k, device=d, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=d, dtype=torch.bfloat16)
        xd, w, s = x.detach(), fp8.weight, fp8.weight_scale_inv
        fns = {"bf16_linear": lambda: torch.autograd.grad(lin(x), x, g),
               "bf16_pyfunction": lambda: torch.autograd.grad(PyLinear.apply(x, lin.weight), x, g),
               "fp8_module": lambda: torch.autograd.grad(fp8(x), x, g),
               }
        if d == "cuda":
            fns["fp8_manual"] = lambda: (fp8_mm_fwd(xd, w, s), fp8_mm_bwd(g, w, s))
        row = {"k": k, "n": n}
        for name, fn in fns.items():
            row[f"{name}_gpu_ms"] = kernel_ms(fn)
            row[f"{name}_host_ms"] = host_ms(fn)
        if d == "cuda":
            row.update(backward_pieces(x, g, fp8))
        rec.record("overhead", **row)
        if d == "cuda" and n == 512:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fns["fp8_module"]()
                sync()
            rec.say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def backward_pieces(x, g, fp8: FP8Linear) -> dict:
    """Host time of each piece of the FP8 backward, called from the main thread and from inside an
    autograd backward (the engine's own thread, where the module's backward runs)."""
    w, s = fp8.weight, fp8.weight_scale_inv
    g_fp8, sg = quantize_fp8_rows(g, pad_rows_to=16)
    w_cm = transpose_fp8(w).t()
    s_bwd = s.t().contiguous().t()
    pieces = {
        "nothing": lambda: None,
        "quant": lambda: quantize_fp8_rows(g, pad_rows_to=16),
        "transpose": lambda: transpose_fp8(w),
        "scale_copy": lambda: s.t().contiguous().t(),
        "scaled_mm": lambda: torch._scaled_mm(g_fp8, w_cm, scale_a=sg, scale_b=s_bwd, out_dtype=g.dtype),
        "fp8_mm_bwd": lambda: fp8_mm_bwd(g, w, s),
        "bf16_mm": lambda: g @ fp8.dequantized_weight(),
    }
    out = {}
    from grpo.kernels.fp8 import _FP8LinearFn

    xd = x.detach()
    forward = {  # where the module's forward spends host time: autograd, the input that requires grad
        "module": lambda: fp8(x),
        "module_no_grad": lambda: torch.no_grad()(fp8)(x),
        "function_apply": lambda: _FP8LinearFn.apply(x, w, s, "scaled_mm", "fp8"),
        "fp8_mm_fwd": lambda: fp8_mm_fwd(xd, w, s),
        "fp8_mm_fwd_grad_input": lambda: fp8_mm_fwd(x, w, s),
        "quant_grad_input": lambda: quantize_fp8_rows(x, pad_rows_to=16),
        "quant_detached": lambda: quantize_fp8_rows(xd, pad_rows_to=16),
    }
    for name, fn in forward.items():
        out[f"fwd_{name}_host_ms"] = host_ms(fn)
    for name, body in pieces.items():
        class InBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, gt, body=body):
                body()
                return gt

        xs = x[:16]
        gs = torch.ones_like(xs)
        out[f"piece_{name}_main_host_ms"] = host_ms(body)
        out[f"piece_{name}_in_backward_host_ms"] = host_ms(lambda: torch.autograd.grad(InBackward.apply(xs), xs, gs))
    return out


def smollm2(args, rec: Recorder):
    """A real trained model on the CPU: SmolLM2-135M-Instruct (the Q4_1 GGUF that grpo.assets ships,
    dequantized), FP8 block weights against bf16 and fp32, on text the model wrote itself. Activation
    quantization (1x128 groups, as the scaled_mm path does) is simulated with a pre-hook."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.assets import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    m32 = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = ["Question: A farmer has 17 sheep and buys 3 times as many goats. How many animals does he have? "
               "Answer step by step.", "Explain why the sum of two odd numbers is always even.",
               "Write a short paragraph about the history of the printing press."]
    torch.manual_seed(0)
    seqs = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        new = 128 if not args.small else 8
        out = m32.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                           pad_token_id=tok.eos_token_id)
        seqs.append(out[0])

    def act_quant(mod, inputs):
        x = inputs[0]
        k = x.shape[-1]
        kp = -(-k // 128) * 128
        codes, scale = quantize_fp8_rows_ref(F.pad(x.reshape(-1, k).float(), (0, kp - k)))
        deq = (codes.float().view(-1, kp // 128, 128) * scale[..., None]).view(-1, kp)[:, :k]
        return (deq.to(x.dtype).view_as(x),)

    def logp_of(mdl):
        lps = []
        with torch.no_grad():
            for seq in seqs:
                hid = mdl.model(seq[None]).last_hidden_state[0, :-1]
                lps.append(token_logprobs(hid, mdl.get_output_embeddings().weight, seq[1:]).double())
        return torch.cat(lps)

    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    m8 = copy.deepcopy(m16)
    quantize_linears_(m8, LORA_TARGETS)
    lp32, lp16, lp8 = logp_of(m32), logp_of(m16), logp_of(m8)
    hooks = [mod.register_forward_pre_hook(act_quant) for mod in m8.modules() if isinstance(mod, FP8Linear)]
    lp8a = logp_of(m8)
    for h_ in hooks:
        h_.remove()
    acc = {"tokens": lp32.numel(), "logp_mean_fp32": lp32.mean().item()}
    for name, lp_ in (("bf16", lp16), ("fp8_weights", lp8), ("fp8_weights_acts", lp8a)):
        acc[f"{name}_logp_rel_vs_fp32"] = rel(lp_, lp32)
        acc[f"{name}_logp_rel_vs_bf16"] = rel(lp_, lp16) if name != "bf16" else 0.0
        acc[f"{name}_ratio_dev_vs_bf16"] = (lp_ - lp16).exp().sub(1).abs().mean().item()
        acc[f"{name}_logp_maxabs_vs_bf16"] = (lp_ - lp16).abs().max().item()
    rec.record("smollm2_cpu", **acc)


def summary(rec: Recorder) -> None:
    """The run's figures again, as tables a reader can compare with RESULTS.md."""
    rec.say("\n=================== SUMMARY ===================")
    env_ = next(iter(rec.of_kind("env")), {})
    rec.say(f"{env_.get('gpu', 'cpu')}  torch {env_.get('torch')}  triton {env_.get('triton')}  "
            f"transformers {env_.get('transformers')}  peft {env_.get('peft')}")
    for r in rec.of_kind("rates"):
        rec.say(f"copy {r['copy_GBps']:.0f} GB/s, bf16 matmul {r['bf16_tflops']:.0f} TFLOP/s")
    if rec.of_kind("fp8_time"):
        rec.say("FP8Linear fwd+bwd (dX only) at M=16384, ms (median):")
        rec.say(f"{'K->N':>11} {'bf16 frz':>8} {'bf16 trn':>8} {'fp8':>7} {'fp8 bdq':>7} {'eagerQ':>7} {'compQ':>7} "
                f"{'x':>5} | {'bf16 f':>6} {'fp8 f':>6} {'gemm f':>6} {'gemm b':>6} {'rowwise':>7} {'quantX':>6}")
        for r in rec.of_kind("fp8_time"):
            f = lambda key: f"{r[key]:.3f}" if key in r else "-"  # noqa: E731
            rec.say(f"{r['k']:>5}->{r['n']:<5} {f('bf16_frozen_fb'):>8} {f('bf16_train_fb'):>8} {f('fp8_fb'):>7} "
                    f"{f('fp8_fb_bwd_dequant'):>7} {f('fp8_fb_quant_eager'):>7} {f('fp8_fb_quant_compiled'):>7} "
                    f"{r.get('speedup_vs_bf16_frozen', float('nan')):>5.2f} | {f('bf16_fwd'):>6} {f('fp8_fwd'):>6} "
                    f"{f('fp8_gemm_fwd_only'):>6} {f('fp8_gemm_bwd_only'):>6} {f('fp8_gemm_rowwise_fwd'):>7} "
                    f"{f('quant_x_triton'):>6}")
    timed = rec.of_kind("logprobs_time")
    if timed:
        rec.say(f"token_logprobs fwd+bwd at N={timed[0]['n']}, V={timed[0]['v']}, H={timed[0]['h']}:")
        for r in timed:
            rec.say(f"  {r['variant']:52s} {r['ms']:8.2f} ms  {r['peak_extra_GiB']:6.2f} GiB")
    for kind in ("model_memory", "model_logp", "model_step", "smollm2_cpu", "error"):
        for r in rec.of_kind(kind):
            rec.say(f"{kind}: {json.dumps(r, default=float)}")


SECTIONS = (env, rates, fp8_err, fp8_time, logprobs, model, overhead, smollm2)
ON_REQUEST = (overhead, smollm2)  # a diagnosis, and a CPU run that needs the cached GGUF: only when named


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(ap)
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke run on any device")
    ap.add_argument("--only", nargs="*", default=None, choices=[sec.__name__ for sec in SECTIONS],
                    help="run only these sections (overhead and smollm2 run only when named here)")
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rec = Recorder("fp8_and_logprobs", args.out)
    for sec in SECTIONS:
        if (args.only and sec.__name__ not in args.only) or (not args.only and sec in ON_REQUEST):
            continue
        run_section(sec, args, rec)
    summary(rec)


if __name__ == "__main__":
    main()
