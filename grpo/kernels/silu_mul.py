"""The training pass's SiLU product, silu(gate) * up, as one Triton launch each way.

Eager, `lean_activations.SiluMul` takes two kernels forward (SiLU, the product) and four backward, each a pass
over tensors of the MLP's intermediate size, the layer's largest: five tensors read or written forward and eleven
backward, where these kernels read or write three and five (benchmarks/RESULTS.md, "The measured defaults").
Under gradient checkpointing the forward runs twice.

The arithmetic is eager's (float32, SiLU's output and the product's gradient rounded to the dtype where eager
writes them), with `tl.sigmoid` for aten's SiLU: values within a rounding of eager's, not bit for bit. Where
it runs: CUDA, or the CPU under TRITON_INTERPRET=1 (the tests, against `SiluMul`'s values and gradients); gate
and up contiguous, of one shape and dtype, as the MLP's projections make them. `lean_activations` gives it to
the MLPs it installs where it runs, and `SiluMul` elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.kernels.decode_gemm import can_run

BLOCK = 1024  # elements a program (4 warps, 8 a thread)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def kernel_runs(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` can take gate and up: triton runs on their device, and they are contiguous tensors of
    one shape and floating dtype."""
    return (can_run(gate.device) and gate.shape == up.shape and gate.dtype == up.dtype and gate.is_floating_point()
            and gate.is_contiguous() and up.is_contiguous())


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class _SiluMulKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, consume: bool) -> torch.Tensor:
        from grpo.kernels import _silu_mul_triton as k

        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            k.silu_mul_forward_kernel[(_blocks(n),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.consume = consume
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        from grpo.kernels import _silu_mul_triton as k

        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        # consumed: the gradients in the inputs' own buffers (d_gate in up's, d_up in gate's), as SiluMul does
        reuse = ctx.consume and grad.dtype == gate.dtype
        d_gate = up if reuse else torch.empty_like(gate)
        d_up = gate if reuse else torch.empty_like(up)
        n = gate.numel()
        if n:
            k.silu_mul_backward_kernel[(_blocks(n),)](grad, gate, up, d_gate, d_up, n, BLOCK=BLOCK)
        return d_gate if ctx.needs_input_grad[0] else None, d_up if ctx.needs_input_grad[1] else None, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """`silu_mul_ref` in one launch (and one in backward); the caller checks `kernel_runs(gate, up)`. `consume`:
    gate and up are the caller's own temporaries, which nothing reads after this product's backward: it makes
    the gradients in their buffers."""
    if not kernel_runs(gate, up):
        raise ValueError(f"silu_mul: no kernel for gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} on {gate.device} (contiguous, one shape and dtype); use silu_mul_ref")
    return _SiluMulKernel.apply(gate, up, consume)
