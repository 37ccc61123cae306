"""FP8 (E4M3) base weights in 128x128 blocks, as a frozen `nn.Linear` that LoRA trains on.

The checkpoint format (DeepSeek-V3 style, e.g. `unsloth/Llama-3.2-1B-Instruct-FP8-Block`): for each
quantized linear, `weight` is float8_e4m3fn (N, K) and `weight_scale_inv` is float32
(ceil(N/128), ceil(K/128)); `config.json` has `quantization_config = {quant_method: fp8,
weight_block_size: [128, 128], ...}`. Dequantization is `W[i, j] = weight[i, j] * scale_inv[i//128, j//128]`,
so `scale_inv` is the block's amax / 448 (448 is E4M3's largest finite value).

The GEMMs. With W frozen, a training step needs only two products per layer:

    forward   Y  = X W^T      X (M, K) bf16, W (N, K)      -> Y (M, N)
    backward  dX = dY W       dY (M, N)                    -> dX (M, K)     (no dW: the base is frozen)

On Hopper both run as `torch._scaled_mm` with blockwise scales. The activation side is quantized per
token in 1x128 groups along the reduction dimension (one fp32 scale per row and 128 columns), the
weight side uses its 128x128 block scales. `_scaled_mm(a, b, scale_a, scale_b)` computes
`(a * scale_a) @ (b * scale_b)` with a row-major and b column-major, and wants its scales
"column-major" (outer dimension contiguous):

    forward   a = X_fp8 (M, K),   scale_a (M, K/128)   as sx.t().contiguous().t()
              b = W_fp8.t() (K, N),  column-major for free,  scale_b (K/128, N/128) = sw.contiguous().t()
    backward  a = dY_fp8 (M, N),  scale_a (M, N/128)   as above
              b = W_fp8 as (N, K) column-major = W_fp8.t().contiguous().t()   (one fp8 transpose per call,
                  a Triton kernel: keeping a transposed copy would double the weight memory)
              scale_b (N/128, K/128) = sw.t().contiguous().t()   (a 128x128 block is its own transpose)

cuBLAS refuses blockwise scaling for some row counts (M = 1 and M = 333 among them; 1000 and 16384 run), so
the quantized activations are padded with zero rows to a multiple of 16 and the output is sliced back.

Only the fp8 weight and its scales are saved for backward: no activation is kept.

The other way, `gemm="dense"` (the trainer's with gradient checkpointing, `--fp8-gemm`): W dequantized to bf16
by one Triton pass per call, then torch's own linear. Its backward is a C++ node; the FP8 GEMMs' is Python,
and a Python backward's torch ops and launches cost their host several times what they do on the main thread,
enough to make FP8's training pass slower than bf16's where the host bounds the step (benchmarks/RESULTS.md,
"The measured defaults"). Its numerics are weight-only FP8, as the decode kernels' are.

Everywhere else (CPU, GPUs before Hopper, shapes whose K or N is not a multiple of 512, fp32 inputs)
the same autograd function dequantizes W to the input's dtype for each product: slower, exact with
respect to the stored weight, and the only path the CPU tests exercise.

What this module deliberately is not: no weight gradient, no FP8 for embeddings, norms or the LM head,
no use of transformers' FineGrainedFP8 integration (it fetches a kernel from a hub at run time), and no
checkpoint reading: loading FP8-Block checkpoints is the Model room's (`grpo/model/fp8_checkpoint.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from grpo.kernels._triton import have_triton

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = 1e-12  # floor of an activation group's amax: an all-zero group gets a harmless scale


# --- weights -------------------------------------------------------------------------------------


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight (N, K) into E4M3 codes (N, K) and float32 block scales (ceil(N/b), ceil(K/b)).

    `scale_inv` is the dequantization multiplier (block amax / 448). An all-zero block gets scale 1.
    Works for any N, K: partial edge blocks take their amax over the elements they hold.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block: w must be 2-D (N, K), got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_fp8_block: w must be a float tensor, got {w.dtype}")
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    wf = F.pad(w.detach().float(), (0, kb * block - k, 0, nb * block - n))  # zero padding keeps each amax
    blocks = wf.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))  # (nb, kb)
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)  # clamp: never NaN on cast
    w_fp8 = codes.view(nb * block, kb * block)[:n, :k].to(FP8_DTYPE)
    return w_fp8.contiguous(), scale_inv.contiguous()


def _check_pair(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> None:
    if w_fp8.dtype != FP8_DTYPE or w_fp8.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D float8_e4m3fn, got {w_fp8.dtype} {tuple(w_fp8.shape)}")
    want = (math.ceil(w_fp8.shape[0] / block), math.ceil(w_fp8.shape[1] / block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a weight of "
                         f"shape {tuple(w_fp8.shape)} in {block}x{block} blocks")


def dequantize_fp8_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16, impl: str = "auto") -> torch.Tensor:
    """E4M3 codes (N, K) times their block scales, in float32, rounded once to `dtype`.
    `impl`: auto (one Triton pass on CUDA, torch's ops elsewhere), ref, or triton (also on the CPU, under
    Triton's interpreter). Both compute the same float32 product, so they agree bit for bit."""
    _check_pair(w_fp8, scale_inv)
    if impl == "triton" or (impl == "auto" and _use_triton(w_fp8)):
        return _dequantize_triton(w_fp8, scale_inv, dtype)
    n, k = w_fp8.shape
    scale = scale_inv.float()
    if n % BLOCK == 0 and k % BLOCK == 0:  # broadcast the scales without materialising them
        w = w_fp8.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).float() * scale[:, None, :, None]
        return w.view(n, k).to(dtype)
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]  # (N, K)
    return (w_fp8.float() * full).to(dtype)


# --- activations (1x128 groups along the reduction dimension) -------------------------------------


def quantize_fp8_rows_ref(x: torch.Tensor, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization in 1x128 groups: x (M, K), K % 128 == 0 -> codes (M', K), scales (M', K/128).

    M' is M rounded up to `pad_rows_to`; the extra rows are zeros. The scales come back column-major
    (stride (1, M')), the layout `_scaled_mm` wants for its `scale_a`.
    """
    m, k = x.shape
    m_pad = -(-m // pad_rows_to) * pad_rows_to
    groups = F.pad(x.float(), (0, 0, 0, m_pad - m)).view(m_pad, k // BLOCK, BLOCK)
    scale = groups.abs().amax(-1).clamp_(min=_TINY) / FP8_MAX  # (M', K/128)
    codes = (groups / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m_pad, k)
    return codes, scale.t().contiguous().t()


_TRITON = {}


def _triton_kernels():
    """Build (once, on first use) the two small Triton kernels of the FP8 path."""
    if not _TRITON:
        import triton
        import triton.language as tl

        @triton.jit
        def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, M_PAD, K, stride_xm, BLOCK_M: tl.constexpr,
                               GROUP: tl.constexpr):
            # one (BLOCK_M, 128) tile: amax per row, scale = amax / 448, codes = x / scale
            pid_m = tl.program_id(0)
            pid_k = tl.program_id(1)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_k * GROUP + tl.arange(0, GROUP)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
            x = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0  # (BLOCK_M,)
            q = tl.clamp(x / scale[:, None], -448.0, 448.0)
            keep = rows < M_PAD  # padding rows get zero codes
            tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=keep[:, None])
            tl.store(s_ptr + pid_k * M_PAD + rows, scale, mask=keep)  # scales stored (K/128, M'): column-major

        @triton.jit
        def _transpose_kernel(src_ptr, dst_ptr, R, C, BLOCK: tl.constexpr):
            # dst (C, R) = src (R, C)^T, one byte per element, BLOCK x BLOCK tiles
            r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            tile = tl.load(src_ptr + r[:, None] * C + c[None, :], mask=(r[:, None] < R) & (c[None, :] < C))
            tl.store(dst_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=(c[:, None] < C) & (r[None, :] < R))

        @triton.jit
        def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, K_BLOCKS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
            # one (BLOCK_N, BLOCK_K) tile, inside one 128x128 block (both divide 128): codes times its scale
            pid_n = tl.program_id(0)
            pid_k = tl.program_id(1)
            rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
            inside = (rows < N)[:, None] & (cols < K)[None, :]
            scale = tl.load(s_ptr + (pid_n * BLOCK_N // 128) * K_BLOCKS + pid_k * BLOCK_K // 128)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=inside, other=0.0).to(tl.float32) * scale
            tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=inside)

        _TRITON.update(triton=triton, quant=_quant_rows_kernel, transpose=_transpose_kernel,
                       dequant=_dequant_kernel)
    return _TRITON


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and have_triton()


def quantize_fp8_rows(x: torch.Tensor, impl="auto", pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_rows_ref` in one pass over x: a Triton kernel on CUDA, the reference elsewhere.
    `impl`: auto, ref, or a callable taking x with the same contract (benchmarks pass a compiled one)."""
    if callable(impl):
        m = x.shape[0]
        return impl(F.pad(x, (0, 0, 0, -(-m // pad_rows_to) * pad_rows_to - m)))
    if impl == "ref" or not _use_triton(x):
        return quantize_fp8_rows_ref(x, pad_rows_to)
    kernels = _triton_kernels()
    m, k = x.shape
    m_pad = -(-m // pad_rows_to) * pad_rows_to
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((m_pad, k), dtype=FP8_DTYPE, device=x.device)
    scale_t = torch.empty((k // BLOCK, m_pad), dtype=torch.float32, device=x.device)
    block_m = 32
    kernels["quant"][(kernels["triton"].cdiv(m_pad, block_m), k // BLOCK)](
        x, codes, scale_t, m, m_pad, k, x.stride(0), BLOCK_M=block_m, GROUP=BLOCK, num_warps=4)
    return codes, scale_t.t()


def transpose_fp8(w_fp8: torch.Tensor) -> torch.Tensor:
    """W^T stored row-major (K, N) from W (N, K): one Triton pass on CUDA (torch's byte transpose is slow)."""
    if not _use_triton(w_fp8):
        return w_fp8.t().contiguous()
    kernels = _triton_kernels()
    n, k = w_fp8.shape
    out = torch.empty((k, n), dtype=w_fp8.dtype, device=w_fp8.device)
    tile = 64
    kernels["transpose"][(kernels["triton"].cdiv(n, tile), kernels["triton"].cdiv(k, tile))](
        w_fp8.view(torch.uint8), out.view(torch.uint8), n, k, BLOCK=tile, num_warps=4)
    return out


def _dequantize_triton(w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # As few torch calls as can be: in the training pass this also runs inside autograd's backward (the layers
    # checkpointing recomputes), where each one costs the host several times what it does on the main thread.
    if not w_fp8.is_contiguous():
        w_fp8 = w_fp8.contiguous()
    if scale_inv.dtype != torch.float32 or not scale_inv.is_contiguous():
        scale_inv = scale_inv.float().contiguous()
    kernels = _triton_kernels()
    n, k = w_fp8.shape
    out = torch.empty((n, k), dtype=dtype, device=w_fp8.device)
    tile_n, tile_k = 32, 128
    kernels["dequant"][(kernels["triton"].cdiv(n, tile_n), kernels["triton"].cdiv(k, tile_k))](
        w_fp8, scale_inv, out, n, k, scale_inv.shape[1], BLOCK_N=tile_n, BLOCK_K=tile_k, num_warps=4)
    return out


# --- the autograd function ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _scaled_mm_ok(x: torch.Tensor, n: int, k: int) -> bool:
    """Blockwise `_scaled_mm` checked on Hopper (sm_90) only; K and N multiples of 512 keep every
    scale tensor's outer dimension a multiple of 4, as cuBLAS's blockwise layouts require."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and k % 512 == 0 and n % 512 == 0
            and _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()))


_PAD_M = 16  # cuBLAS refuses blockwise scaling for some M (M=1 and M=333 among them): pad rows to a multiple


def fp8_mm_fwd(x2: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, quant="auto") -> torch.Tensor:
    """Y = X W^T on the FP8 tensor cores. x2 (M, K) bf16/fp16 -> (M, N) in x2's dtype."""
    x_fp8, sx = quantize_fp8_rows(x2, quant, _PAD_M)  # (M', K), (M', K/128) column-major
    y = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=sx, scale_b=scale_inv.contiguous().t(), out_dtype=x2.dtype)
    return y if y.shape[0] == x2.shape[0] else y[: x2.shape[0]]


def fp8_mm_bwd(g2: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, quant="auto") -> torch.Tensor:
    """dX = dY W on the FP8 tensor cores. g2 (M, N) -> (M, K) in g2's dtype."""
    g_fp8, sg = quantize_fp8_rows(g2, quant, _PAD_M)  # (M', N), (M', N/128)
    w_cm = transpose_fp8(w_fp8).t()  # (N, K) column-major: W^T stored row-major
    dx = torch._scaled_mm(g_fp8, w_cm, scale_a=sg, scale_b=scale_inv.t().contiguous().t(), out_dtype=g2.dtype)
    return dx if dx.shape[0] == g2.shape[0] else dx[: g2.shape[0]]


class _FP8LinearFn(torch.autograd.Function):
    """Y = X W^T with W frozen FP8 blocks; backward gives dX only. `mode`: "scaled_mm" or "dequant";
    `bwd`: "fp8" (quantize dY, FP8 GEMM) or "dequant" (dequantize W to bf16 once, bf16 GEMM)."""

    @staticmethod
    def forward(ctx, x2, w_fp8, scale_inv, mode, bwd):
        ctx.save_for_backward(w_fp8, scale_inv)
        ctx.mode, ctx.bwd = mode, bwd
        if mode == "scaled_mm":
            return fp8_mm_fwd(x2, w_fp8, scale_inv)
        return x2 @ dequantize_fp8_block(w_fp8, scale_inv, x2.dtype).t()  # (M, N)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        w_fp8, scale_inv = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        if ctx.mode == "scaled_mm" and ctx.bwd == "fp8":
            grad_x = fp8_mm_bwd(grad_y, w_fp8, scale_inv)
        else:
            grad_x = grad_y @ dequantize_fp8_block(w_fp8, scale_inv, grad_y.dtype)  # (M, K)
        return grad_x, None, None, None, None


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
               *, gemm: str = "auto", bwd: str = "fp8") -> torch.Tensor:
    """Functional FP8 linear: x (..., K) -> (..., N). `gemm`:
      scaled_mm  FP8 tensor-core GEMMs both ways (Hopper), X quantized per 1x128 group: `_FP8LinearFn`
      dequant    W dequantized to x's dtype for each product, forward and backward: `_FP8LinearFn`
      dense      W dequantized once (one kernel) and `F.linear`: torch's own autograd node, so no Python runs
                 in the backward, where each FP8 call spent most of its host time (benchmarks/RESULTS.md, "The measured defaults");
                 what autograd saves for dX is that dense weight, so keep it to recomputed layers (gradient
                 checkpointing), where only the layer being recomputed holds its dense weights
      auto       scaled_mm where it runs, else dequant (`grpo.config`'s --fp8-gemm picks dense for the trainer)"""
    n, k = w_fp8.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight expects {k}")
    if gemm == "dense":
        return F.linear(x, dequantize_fp8_block(w_fp8, scale_inv, x.dtype), None if bias is None else bias.to(x.dtype))
    mode = gemm
    if gemm == "auto":
        mode = "scaled_mm" if _scaled_mm_ok(x, n, k) else "dequant"
    x2 = x.reshape(-1, k)
    if mode == "scaled_mm" and x2.stride(1) != 1:
        x2 = x2.contiguous()
    # on rows the product itself, not a view of it (`lora_addmm` adds to it in place), unless fp8_mm_fwd padded
    # the rows to _PAD_M for cuBLAS and returns the first ones
    y = _FP8LinearFn.apply(x2, w_fp8, scale_inv, mode, bwd)
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


class FP8Linear(nn.Linear):
    """A frozen linear layer whose weight is stored as E4M3 codes in 128x128 blocks.

    A subclass of `nn.Linear` so that peft's LoRA wraps it like any linear layer. `compute_dtype` is
    the dtype of activations and outputs; peft reads it (as it does for bitsandbytes layers) to give
    the adapters that dtype instead of the weight's float8. `weight` and `weight_scale_inv` are
    frozen parameters named as in FP8-Block checkpoints, so `state_dict()` writes that format.
    `model.to(dtype)` moves them between devices but never casts them.
    """

    def __init__(self, w_fp8: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a dense weight
        _check_pair(w_fp8, scale_inv)
        self.out_features, self.in_features = w_fp8.shape
        self.weight = nn.Parameter(w_fp8, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype
        self.gemm = "auto"  # auto | scaled_mm | dequant | dense (fp8_linear says what each is)
        self.bwd = "fp8"  # fp8 | dequant (only with scaled_mm)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize a dense nn.Linear (on its own device) into an FP8Linear."""
        w_fp8, scale_inv = quantize_fp8_block(linear.weight.detach())
        return cls(w_fp8, scale_inv, None if linear.bias is None else linear.bias.detach(),
                   compute_dtype=linear.weight.dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, gemm=self.gemm, bwd=self.bwd)

    def _apply(self, fn, recurse=True):
        # Follow device moves, never dtype casts: the codes and scales are the weight.
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.weight.device))
        order = list(self._parameters)
        held = {name: self._parameters.pop(name) for name in ("weight", "weight_scale_inv")}
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters.update(held)
            for name in order:  # keep the state_dict order
                self._parameters[name] = self._parameters.pop(name)
        for p in held.values():
            if p.device != probe.device:
                p.data = torch.empty_like(p, device=probe.device) if p.is_meta else p.data.to(probe.device)
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3 {BLOCK}x{BLOCK}, compute_dtype={self.compute_dtype}")


# --- models ---------------------------------------------------------------------------------------


def _output_embedding_ids(model: nn.Module) -> set[int]:
    ids = set()
    for getter in ("get_output_embeddings", "get_input_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            ids.add(id(module.weight))
    return ids


def quantize_linears_(model: nn.Module, target_names: Iterable[str] | None = None) -> int:
    """Replace, in place, every nn.Linear whose name ends with one of `target_names` (every nn.Linear
    when None) by an FP8Linear quantized from it. The LM head and embeddings are never touched.
    Returns how many layers were replaced."""
    targets = None if target_names is None else tuple(target_names)
    if targets is not None and isinstance(target_names, str):
        raise ValueError("quantize_linears_: target_names must be a list of names, not one string")
    keep = _output_embedding_ids(model)
    chosen = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or id(module.weight) in keep:
            continue
        if targets is None or name.rsplit(".", 1)[-1] in targets:
            chosen.append(name)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_linear(getattr(parent, child)))
    return len(chosen)
