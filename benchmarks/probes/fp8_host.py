"""Where an FP8Linear call spends the host's time: its forward and backward beside each piece they are made of.

The FP8 bench step is slower than bf16's, most of it in the training pass, where its GPU is busy for less
time than bf16's: the host sets the pace. This times, per call, with the GPU queue not drained (`timing.host_ms`,
microseconds here), the module's forward and backward beside each piece: the activation's quantization and
the weight's transpose (Triton launches), `_scaled_mm`, the scales' copy, the empty tensors, an
autograd.Function that does no work, and the same pieces inside an autograd backward, which runs on the
engine's own thread:
- `launch_us`: a Triton launch through the JIT function and through its compiled kernel, and the lookups the
  JIT's run makes, on the main thread and inside a backward;
- `backward_variants_us`: a Function with the FP8 forward and a backward of one piece or another, with and
  without `once_differentiable`: which piece of the module's backward costs what;
- `host_us`: the module, the bf16 `nn.Linear`, and each piece on its own and inside a backward
  (`backward_pieces`); at the rows given.
Only the rows' few (16) keep the GPU from setting the pace; at the bench's 10240 rows the in-backward figures
follow the GPU's time. The profiler's tables of the module's forward + backward go to the .log.

    PYTHONPATH=$PWD python3 benchmarks/probes/fp8_host.py --out DIR [--rows 16 10240] [--shapes 2048x2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import Recorder, add_out_argument, host_ms  # noqa: E402

from grpo.kernels.fp8 import (  # noqa: E402
    FP8Linear,
    _FP8LinearFn,
    fp8_mm_bwd,
    fp8_mm_fwd,
    quantize_fp8_rows,
    transpose_fp8,
)


def host_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """Median over `repeats` of the host's microseconds per call."""
    return statistics.median(host_ms(fn, calls) for _ in range(repeats)) * 1e3


class _Nothing(torch.autograd.Function):
    """The autograd.Function structure of _FP8LinearFn with no work in it: what autograd itself costs."""

    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(w)
        return torch.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype, device=x2.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        (w,) = ctx.saved_tensors
        return torch.empty((gy.shape[0], w.shape[1]), dtype=gy.dtype, device=gy.device), None


def in_backward(body):
    """body() run inside an autograd backward: on the engine's thread, as the module's backward is."""

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, gt):
            body()
            return gt

    xs = torch.zeros(16, device="cuda", requires_grad=True)
    gs = torch.ones_like(xs)
    return lambda: torch.autograd.grad(InBackward.apply(xs), xs, gs)


def launch_pieces() -> dict:
    """What a Triton launch is made of, on the main thread and inside an autograd backward: the launch through
    the JIT function, through its compiled kernel with the stream given, and the lookups the JIT's run makes."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.runtime.driver import driver

    @triton.jit
    def _one(x_ptr, V: tl.constexpr):
        tl.store(x_ptr, V)

    t = torch.zeros(1, device="cuda")
    compiled = _one[(1,)](t, V=1.0)
    stream = torch.cuda.current_stream().cuda_stream
    fns = {
        "python_call": lambda: None,
        "jit_launch": lambda: _one[(1,)](t, V=1.0),
        "compiled_launch": lambda: compiled[(1, 1, 1)](t, 1.0, stream=stream),
        "compiled_launch_own_stream": lambda: compiled[(1, 1, 1)](t, 1.0),
        "driver_device_stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "knobs_debug": lambda: knobs.runtime.debug,
        "torch_current_device": torch.cuda.current_device,
        "torch_empty": lambda: torch.empty(1, device="cuda"),
    }
    out = {}
    for name, fn in fns.items():
        out[f"main_{name}"] = round(host_us(fn), 2)
        out[f"in_backward_{name}"] = round(host_us(in_backward(fn)), 2)
    return out


def operands(m: int, k: int, n: int):
    """A random bf16 nn.Linear K -> N (frozen), its FP8Linear, an input (M, K) that requires grad and an output
    gradient (M, N)."""
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return lin, FP8Linear.from_linear(lin), x, torch.randn(m, n, device="cuda", dtype=torch.bfloat16)


def backward_variants(m: int, k: int, n: int) -> dict:
    """An autograd.Function with _FP8LinearFn's forward and a backward of one piece or another: which piece of
    the module's backward costs the host what it does."""
    _, fp8, x, g = operands(m, k, n)
    w, s = fp8.weight, fp8.weight_scale_inv
    g_fp8, sg = quantize_fp8_rows(g, pad_rows_to=16)
    w_cm = transpose_fp8(w).t()
    s_bwd = s.t().contiguous().t()
    bodies = {
        "empty": lambda gy, w_, s_: torch.empty((gy.shape[0], k), dtype=gy.dtype, device=gy.device),
        "fp8_mm_bwd": lambda gy, w_, s_: fp8_mm_bwd(gy, w_, s_),
        "fp8_mm_bwd_contiguous": lambda gy, w_, s_: fp8_mm_bwd(gy.contiguous(), w_, s_),
        "quant": lambda gy, w_, s_: quantize_fp8_rows(gy, pad_rows_to=16)[0],
        "transpose": lambda gy, w_, s_: transpose_fp8(w_),
        "scale_copy": lambda gy, w_, s_: s_.t().contiguous().t(),
        "scaled_mm": lambda gy, w_, s_: torch._scaled_mm(g_fp8, w_cm, scale_a=sg, scale_b=s_bwd, out_dtype=g.dtype),
    }
    out = {}
    for name, body in bodies.items():
        for once in (True, False):
            class Variant(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x2, w_, s_):
                    ctx.save_for_backward(w_, s_)
                    return fp8_mm_fwd(x2, w_, s_)

                @staticmethod
                def backward(ctx, gy, body=body):
                    w_, s_ = ctx.saved_tensors
                    body(gy, w_, s_)
                    return torch.empty((gy.shape[0], k), dtype=gy.dtype, device=gy.device), None, None

            if once:
                Variant.backward = staticmethod(torch.autograd.function.once_differentiable(Variant.backward))
            fn = (lambda V=Variant: torch.autograd.grad(V.apply(x, w, s), x, g))
            out[f"{name}{'_once' if once else ''}"] = round(host_us(fn), 2)
    out["module"] = round(host_us(lambda: torch.autograd.grad(fp8(x), x, g)), 2)
    out["function"] = round(host_us(lambda: torch.autograd.grad(_FP8LinearFn.apply(x, w, s, "scaled_mm", "fp8"),
                                                                 x, g)), 2)
    return out


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


def pieces(m: int, k: int, n: int) -> tuple[dict, dict]:
    """Host microseconds of bf16's nn.Linear, of the FP8 module and of an autograd.Function doing nothing, and of
    each piece of the module (`backward_pieces`: on the main thread and inside a backward); and the callables
    timed here."""
    lin, fp8, x, g = operands(m, k, n)
    fns = {
        "bf16_linear_fwd_bwd": lambda: torch.autograd.grad(lin(x), x, g),
        "bf16_linear_fwd": lambda: lin(x),
        "fp8_module_fwd_bwd": lambda: torch.autograd.grad(fp8(x), x, g),
        "nothing_function_fwd_bwd": lambda: torch.autograd.grad(_Nothing.apply(x, fp8.weight), x, g),
        "nothing_function_fwd": lambda: _Nothing.apply(x, fp8.weight),
    }
    times = {name: round(host_us(fn), 2) for name, fn in fns.items()}
    for key, ms in backward_pieces(x, g, fp8).items():
        times[key.replace("_host_ms", "_us")] = round(ms * 1e3, 2)
    return times, fns


def profile_table(rec: Recorder, fn, label: str) -> None:
    """The profiler's top host ops of 20 calls of fn, by their own time and by their total, into the .log."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    for key in ("self_cpu_time_total", "cpu_time_total"):
        rec.say(f"{label}, by {key}:\n" + prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 10240], help="rows (tokens) a call")
    ap.add_argument("--shapes", nargs="+", default=["2048x2048", "2048x8192"], help="KxN of the projection")
    add_out_argument(ap)
    args = ap.parse_args()
    rec = Recorder("fp8_host", args.out)
    rec.record("env", torch=torch.__version__, gpu=torch.cuda.get_device_name())
    rec.record("launch_us", **launch_pieces())
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        for m in args.rows:
            rec.record("backward_variants_us", m=m, k=k, n=n, **backward_variants(m, k, n))
            times, fns = pieces(m, k, n)
            rec.record("host_us", m=m, k=k, n=n, **times)
            if m <= 64:
                profile_table(rec, fns["fp8_module_fwd_bwd"], f"FP8Linear forward + backward, {m} x {k} -> {n}")


if __name__ == "__main__":
    main()
