"""Decode GEMMs: a few rows (M <= 64) times whole weights, at memory speed, LoRA and FP8 fused in.

A decode step multiplies 16 rows by every weight of the model once, so its GEMMs are memory-bound:
the time is the bytes of the weights over the bandwidth. cuBLAS reaches only part of it at M = 16, and
with LoRA a projection becomes five launches (base GEMM, A, B, scale, add); these kernels beat both
(benchmarks/RESULTS.md, "The measured defaults"). They stream each weight once in tiles of BLOCK_N
output features, with the rows padded to 16 for the tensor cores, and fuse what a decode layer does
around its projections:

- FP8 block weights (float8_e4m3fn codes with 128x128 float32 scales) are read as codes, half the bytes
  of bf16, turned into bf16 by moving their bits (`Tuning.unpack`: it spares the conversion unit, the
  bottleneck otherwise) and multiplied as bf16 with the block scale applied to each 128-wide partial
  product. The activations stay bf16 (weight-only FP8: quantizing them too, as FP8Linear's `_scaled_mm`
  path does, is slower at a few rows: benchmarks/RESULTS.md, "The measured defaults").
- Split-K for projections with few output tiles (down, o): K slices in separate programs, the last one
  to finish adding the partial sums in a fixed order (deterministic) and finishing the tile.
- A LoRA adapter's up-projection: `y += scaling * (x A^T) B^T`, with `x A^T` from `lora_down` (split
  over K as the projections are: partial sums added in a fixed order, so the result is deterministic).
- up to three projections that read the same input (q/k/v) in one launch;
- the gated MLP, `silu(x Wg^T) * (x Wu^T)`, in one launch;
- a residual add (`o_proj`, `down_proj`);
- and, beside the GEMMs, `rope_store_kv`: K's rotary embedding and the K/V cache write of a decode
  step, one launch per layer in place of two scatters and the rotary kernels.

Everything accumulates in float32 and rounds once into the output's dtype. `project_ref` and
`project_gated_ref` are the plain-PyTorch definitions the tests compare with (the Triton kernels run
on CPU under TRITON_INTERPRET=1 in the tests, with float32 activations: the interpreter mishandles
bf16 loads).

Launch choices: the tiles come from the device's tuned table, or a guess where no sweep has run there
(`grpo.kernels.tiles`); how FP8 codes are unpacked and whether launches go dependently are `Tuning`'s
defaults. Benchmarks and tests change them for a block of code with `with tuning(...)`, never
by rebinding module names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from grpo.kernels._triton import have_triton
from grpo.kernels.fp8 import BLOCK as FP8_BLOCK
from grpo.kernels.fp8 import dequantize_fp8_block
from grpo.kernels.tiles import GemmKey, TileConfig, device_table, tile_problem

# The kernels take up to MAX_ROWS rows (row tiles of 16, 32 or 64); the engine uses them up to there in either
# weight format, where they beat the modules (benchmarks/RESULTS.md, "The measured defaults").
MAX_ROWS = 64

_UNPACK_MODES = {"convert": 0, "bits": 1}  # the kernels' UNPACK constant for each way


@dataclass(frozen=True)
class DecodeProj:
    """One projection as the decode kernels read it: references to the model's tensors, never copies.

    weight: (N, K) in the activations' dtype, or float8_e4m3fn codes with `scale_inv`
        (ceil(N/128), ceil(K/128)) float32 block scales.
    lora_a (R, K), lora_b (N, R), lora_scale: an active LoRA adapter, y += lora_scale * x A^T B^T.
    bias (N,): the projection's bias, y += bias (Qwen2's q/k/v), added in float32 before the one rounding.
    """

    weight: torch.Tensor
    scale_inv: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: float = 1.0
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def rank(self) -> int:
        return 0 if self.lora_a is None else self.lora_a.shape[0]


# --- the reference ---------------------------------------------------------------------------------


def _dense_ref(proj: DecodeProj) -> torch.Tensor:
    if proj.scale_inv is None:
        return proj.weight.float()
    return dequantize_fp8_block(proj.weight, proj.scale_inv, torch.float32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it (rotate_half convention), in x's dtype:
    `x * cos + rotate_half(x) * sin`, cos and sin broadcast against x (..., D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _proj_ref(x2: torch.Tensor, proj: DecodeProj) -> torch.Tensor:
    """float32 x W^T (+ scale * x A^T B^T) (+ bias)."""
    y = x2.float() @ _dense_ref(proj).t()
    if proj.lora_a is not None:
        y = y + (x2.float() @ proj.lora_a.float().t()) @ proj.lora_b.float().t() * proj.lora_scale
    if proj.bias is not None:
        y = y + proj.bias.float()
    return y


def project_ref(x2: torch.Tensor, projs: Sequence[DecodeProj], residual: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
    """[x W_i^T (+ LoRA_i) (+ bias_i) (+ residual)] for each projection, in float32, rounded once to x's dtype."""
    outs = [_proj_ref(x2, p) for p in projs]
    if residual is not None:
        outs = [y + residual.float() for y in outs]
    return [y.to(x2.dtype) for y in outs]


def project_gated_ref(x2: torch.Tensor, gate: DecodeProj, up: DecodeProj) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T), LoRA and biases included, in float32, rounded once."""
    return (F.silu(_proj_ref(x2, gate)) * _proj_ref(x2, up)).to(x2.dtype)


# --- the kernels -----------------------------------------------------------------------------------

def can_run(device: torch.device) -> bool:
    """Triton is installed and runs on `device`: CUDA, or the CPU under TRITON_INTERPRET=1 (tests)."""
    if not have_triton():
        return False
    if device.type == "cuda":  # bf16 tensor-core dots: Ampere or newer
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def can_run_fp8(device: torch.device) -> bool:
    """float8_e4m3fn operands: Ada/Hopper or newer on CUDA (Triton refuses them before sm_89)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _triton_kernels():
    """The kernels module, imported on first use (importing triton costs a second)."""
    from grpo.kernels import _decode_gemm_triton

    return _decode_gemm_triton


# --- launch configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tuning:
    """The launch choices in force; `tuning(...)` sets them for a block, the defaults are the product's.

    unpack: how FP8 codes become bf16 operands on CUDA. "bits": inline PTX moves each code's bits into
        bf16's fields, four codes per PRMT/AND/SHF/LOP3 group, giving code * 2^-120 exactly (2^120 joins
        the block scale). "convert": the hardware's E4M3 -> f16 -> bf16 conversions, two per code on the
        conversion unit, which then bounds the FP8 step (benchmarks/RESULTS.md, "The measured defaults").
        Under Triton's interpreter (no PTX) it is always "convert".
    tiles: `tiles.GemmKey` (kind, output features in all, K, fp8[, activations]) -> TileConfig, read before the
        device's table.
    pdl: programmatic dependent launch (NVIDIA, Hopper or newer; ignored elsewhere): a projection launch
        with an adapter starts while its lora_down still runs, streams its weights, and waits for lora_down
        only before the LoRA term at each tile's end, instead of every lora_down's latency standing between
        two launches (four a layer); the same values, a shorter step with adapters (benchmarks/RESULTS.md,
        "The measured defaults").
    chain: the decode step's Triton launches (these projections, `rmsnorm.norm_rows`, the attention's) each go
        dependently on the launch before it (NVIDIA, Hopper or newer): a launch lets the next one be scheduled
        once its own programs run, and the next one's programs wait for it before touching memory, so they are
        resident when it ends instead of a launch gap later. The same values, a shorter step
        (benchmarks/RESULTS.md, "The measured defaults").
    """

    unpack: str = "bits"
    tiles: Mapping[tuple, TileConfig] = field(default_factory=dict)
    pdl: bool = True
    chain: bool = True


_TUNING: ContextVar[Tuning] = ContextVar("decode_gemm_tuning", default=Tuning())


@contextmanager
def tuning(*, unpack: str | None = None, tiles: Mapping[tuple, TileConfig] | None = None,
           pdl: bool | None = None, chain: bool | None = None) -> Iterator[Tuning]:
    """Within the block, launches unpack FP8 codes by `unpack`, take `tiles[GemmKey(kind, N, K, fp8[, activations])]`
    over the device's table (benchmark sweeps, tests) and launch dependently where `pdl` and `chain` say. A nested
    block adds to the outer one's choices; leaving a block restores what was in force before it. Graphs captured
    inside keep the choices they captured."""
    outer = _TUNING.get()
    if unpack is not None and unpack not in _UNPACK_MODES:
        raise ValueError(f"decode_gemm.tuning: unpack={unpack!r}; use one of {sorted(_UNPACK_MODES)}")
    chosen = {GemmKey(*key): cfg for key, cfg in (tiles or {}).items()}
    inner = Tuning(unpack=unpack or outer.unpack, tiles={**outer.tiles, **chosen},
                   pdl=outer.pdl if pdl is None else pdl, chain=outer.chain if chain is None else chain)
    token = _TUNING.set(inner)
    try:
        yield inner
    finally:
        _TUNING.reset(token)


def tile_config(key: tuple, rows: int, device: torch.device) -> TileConfig:
    """The tiles for one launch of `rows` rows on `device`; `key` is its `tiles.GemmKey` (kind "proj" or "gated", the
    group's output features in all, K, fp8, and "fp16" activations for FP8 weights multiplied W x^T: `_w_first`). A
    `tuning(tiles=...)` choice for the launch (for fp16 activations, else for its bf16 twin) holds at every row count;
    else the device's table (`grpo.kernels.tiles`: swept at the launch's rows or near them, the bf16 twin's likewise,
    else a guess)."""
    key = GemmKey(*key)
    kind, fp8 = key.kind, key.fp8
    chosen = _TUNING.get().tiles
    cfg = (chosen.get(key) or chosen.get(key._replace(activations="bf16"))
           or device_table(device).gemm_tiles(key, _block_m(rows)))
    problem = tile_problem(kind, fp8, cfg)
    if problem is not None:
        raise ValueError(f"decode_gemm: {cfg} for a {kind} launch{' of FP8 weights' if fp8 else ''}: {problem}")
    return cfg


def smaller_tiles(cfg: TileConfig) -> TileConfig | None:
    """The next config to try when `cfg` does not fit in shared memory: fewer stages, then a shorter
    K step (never under 128: FP8 scale blocks); None when nothing smaller is left."""
    if cfg.stages > 2:
        return replace(cfg, stages=cfg.stages - 1)
    if cfg.block_k > 128:
        return replace(cfg, block_k=cfg.block_k // 2)
    return None


_FITTED: dict[tuple, TileConfig] = {}  # (launch shape, config asked for) -> the config that fitted


def forget_fitted_tiles() -> None:
    """Forget which tiles fitted each launch shape: the next launches try their configs as asked (tests)."""
    _FITTED.clear()


def _launch_fitting(shape: tuple, cfg: TileConfig, launch) -> None:
    """launch(cfg), shrinking the tiles while Triton reports too little shared memory: a table's tiles may have
    been swept at fewer rows than the launch has (more rows, more shared memory a stage), a guess may ask for
    more than the device holds. Triton raises before anything runs, so retrying is safe; the fit is remembered
    per shape and config asked for."""
    from triton.runtime.errors import OutOfResources

    key = (*shape, cfg)
    fitted = _FITTED.get(key, cfg)
    while True:
        try:
            launch(fitted)
        except OutOfResources:
            fitted = smaller_tiles(fitted)
            if fitted is None:
                raise
            continue
        _FITTED[key] = fitted
        return


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # counters a bigger launch replaced: captured graphs may still use them


# The first counters are lora_down's (one per adapter, up to 3), the projections' tiles count after them: a
# projection launched while its lora_down still runs (Tuning.pdl) must not share a counter with it.
_LORA_COUNTERS = 4  # 16 bytes, so that the tiles' counters keep the buffer's alignment


def _tile_counters(device: torch.device, tiles: int, lora: bool = False) -> torch.Tensor:
    """Arrival counts of split-K launches, one per output tile (`lora`: per adapter, for lora_down): zeros,
    and every launch leaves them zero again (the last K slice to arrive re-arms its counter), so one buffer
    per device serves every launch in stream order, CUDA graph replays included. Launches on concurrent
    streams would need their own."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < _LORA_COUNTERS + tiles:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(4096, _LORA_COUNTERS + tiles), dtype=torch.int32,
                                                   device=device)
    return counters[:tiles] if lora else counters[_LORA_COUNTERS:]


def lora_split(k: int) -> int:
    """K slices of the LoRA down-projection, one program each (per adapter): 256 columns a slice, so
    the (16, r) product of a 1 MB float32 A is read by 32 programs instead of a few."""
    return max(1, min(32, k // 256))


def _lora_group(projs: Sequence[DecodeProj]) -> int:
    """The shared LoRA rank of a group (0: no adapters); mixed groups are the caller's error."""
    ranks = {p.rank for p in projs}
    if len(ranks) != 1:
        raise ValueError(f"decode_gemm: projections of one launch need one LoRA rank (or none), got {sorted(ranks)}")
    return ranks.pop()


def _check_group(x2: torch.Tensor, projs: Sequence[DecodeProj]) -> None:
    if x2.dim() != 2 or x2.shape[0] > MAX_ROWS:
        raise ValueError(f"decode_gemm: x must be (M <= {MAX_ROWS}, K), got {tuple(x2.shape)}")
    fp8 = {p.scale_inv is not None for p in projs}
    if len(fp8) != 1:
        raise ValueError("decode_gemm: projections of one launch must all be FP8 or all dense")
    if len({p.bias is None for p in projs}) != 1:
        raise ValueError("decode_gemm: projections of one launch must all have a bias or none")
    if x2.stride(1) != 1:
        raise ValueError("decode_gemm: x must have contiguous rows (x.stride(1) == 1); pass x.contiguous()")
    for p in projs:
        if p.in_features != x2.shape[1]:
            raise ValueError(f"decode_gemm: x has {x2.shape[1]} features, a weight expects {p.in_features}")
        if not p.weight.is_contiguous():
            raise ValueError("decode_gemm: weights must be contiguous (N, K)")
        if p.scale_inv is not None and (not p.scale_inv.is_contiguous() or tuple(p.scale_inv.shape) != (
                -(-p.out_features // FP8_BLOCK), -(-p.in_features // FP8_BLOCK))):
            raise ValueError(f"decode_gemm: FP8 scales must be contiguous (ceil(N/128), ceil(K/128)), got "
                             f"{tuple(p.scale_inv.shape)} for a weight of {tuple(p.weight.shape)}")
        if p.bias is not None and (tuple(p.bias.shape) != (p.out_features,) or not p.bias.is_contiguous()):
            raise ValueError(f"decode_gemm: a bias must be contiguous ({p.out_features},), got {tuple(p.bias.shape)}")
        if p.lora_a is not None and (
                p.lora_b is None or tuple(p.lora_a.shape) != (p.rank, p.in_features)
                or tuple(p.lora_b.shape) != (p.out_features, p.rank)
                or not (p.lora_a.is_contiguous() and p.lora_b.is_contiguous())):
            raise ValueError("decode_gemm: LoRA needs contiguous lora_a (r, K) and lora_b (N, r)")


def lora_down(x2: torch.Tensor, lora_as: Sequence[torch.Tensor], block_r: int, split: int | None = None,
              block_k: int = 64) -> torch.Tensor:
    """x A_i^T for each adapter: (len(lora_as), rows padded, block_r) float32, over `split` (default
    lora_split(K)) slices of K, `block_k` columns a loop step, whose partial sums the last slice to finish
    adds in a fixed order (split K, as the projections'). `split` and `block_k`: for the probes' sweeps."""
    return _lora_down(x2, lora_as, block_r, pdl=False, split=split, block_k=block_k)[0]


def _lora_down(x2: torch.Tensor, lora_as: Sequence[torch.Tensor], block_r: int, pdl: bool,
               split: int | None = None, block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_down`, and its scratch of partial sums, which the caller keeps until it has launched the
    projection: with `pdl` that launch runs beside this one, and memory freed here could be handed to it."""
    kernels = _triton_kernels()
    m, k = x2.shape
    r = lora_as[0].shape[0]
    split = split or lora_split(k)
    out = torch.empty((len(lora_as), _block_m(m), block_r), dtype=torch.float32, device=x2.device)
    if split > 1:
        parts = torch.empty((len(lora_as), split, _block_m(m), block_r), dtype=torch.float32, device=x2.device)
        counters = _tile_counters(x2.device, len(lora_as), lora=True)
    else:
        parts = counters = out
    a = list(lora_as) + [lora_as[0]] * (3 - len(lora_as))
    chain = chained(x2.device)
    kernels.lora_down_kernel[(len(lora_as), split)](
        x2, x2.stride(0), m, k, a[0], a[1], a[2], out, parts, counters, r, BLOCK_M=_block_m(m), BLOCK_R=block_r,
        BLOCK_K=block_k, SPLIT=split, EXACT=x2.dtype == torch.float32, PDL=pdl, CHAIN=chain, launch_pdl=chain,
        num_warps=4)
    return out, parts


def _dependent_launches(device: torch.device) -> bool:
    """Programmatic dependent launch runs on `device`: NVIDIA (ROCm's devices are "cuda" too, with no
    griddepcontrol), Hopper or newer."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _pdl(x2: torch.Tensor, rank: int) -> bool:
    """Whether a launch with an adapter goes beside its lora_down (Tuning.pdl)."""
    return bool(rank) and _TUNING.get().pdl and _dependent_launches(x2.device)


def chained(device: torch.device) -> bool:
    """Whether the decode's launches on `device` go dependently on the launch before each (Tuning.chain)."""
    return _TUNING.get().chain and _dependent_launches(device)


def _block_m(m: int) -> int:
    """Rows padded for the tensor cores: 16, 32 or 64 (the weights are read once whatever the rows)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _w_first(x2: torch.Tensor, fp8: bool) -> bool:
    """FP8 weights with fp16 activations: the kernels multiply W x^T, the weights the first operand, whose
    registers the hardware's E4M3 -> f16 conversion fills in the tensor cores' order (the activations the second,
    loaded in theirs): a fraction of the instructions a weight element x W^T takes (`benchmarks/probes/
    decode_gemm_sass.py`)."""
    return fp8 and x2.dtype == torch.float16


def _activations(x2: torch.Tensor, fp8: bool) -> str:
    """A launch's activations as its tiles are keyed (`tiles.GemmKey`): "fp16" for W x^T launches, else "bf16"."""
    return "fp16" if _w_first(x2, fp8) else "bf16"


def _unpack(x2: torch.Tensor, fp8: bool) -> int:
    """The UNPACK constant of a launch (`Tuning.unpack`; bit moves make bf16, so only for bf16 activations)."""
    if not fp8 or x2.device.type != "cuda" or x2.dtype != torch.bfloat16:
        return 0
    return _UNPACK_MODES[_TUNING.get().unpack]


def _block_r(rank: int) -> int:
    return max(16, 1 << (rank - 1).bit_length()) if rank else 16


def project(x2: torch.Tensor, projs: Sequence[DecodeProj], residual: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """[x W_i^T + LoRA_i (+ bias_i) (+ residual)] for 1-3 projections of the same input, one launch (plus one for
    the LoRA down-projections). x2 (M <= MAX_ROWS, K) contiguous rows; outputs (M, N_i) in `out_dtype` (default
    x2's)."""
    if not 1 <= len(projs) <= 3:
        raise ValueError(f"decode_gemm.project takes 1 to 3 projections, got {len(projs)}")
    _check_group(x2, projs)
    kernels = _triton_kernels()
    m, k = x2.shape
    rank = _lora_group(projs)
    block_r = _block_r(rank)
    fp8 = projs[0].scale_inv is not None
    has_bias = projs[0].bias is not None
    if residual is not None and (len(projs) != 1 or tuple(residual.shape) != (m, projs[0].out_features)
                                 or not residual.is_contiguous()):
        raise ValueError("decode_gemm.project: a residual needs one projection and a contiguous (M, N) tensor")
    pdl, chain = _pdl(x2, rank), chained(x2.device)
    xa, scratch = _lora_down(x2, [p.lora_a for p in projs], block_r, pdl) if rank else (x2, None)
    outs = [torch.empty((m, p.out_features), dtype=out_dtype or x2.dtype, device=x2.device) for p in projs]
    n_all = sum(p.out_features for p in projs)
    cfg = tile_config(GemmKey("proj", n_all, k, fp8, _activations(x2, fp8)), m, x2.device)
    args = []
    for i in range(3):
        p, y = (projs[i], outs[i]) if i < len(projs) else (projs[0], outs[0])
        args += [p.weight, p.scale_inv if fp8 else p.weight, y, p.lora_b if rank else p.weight,
                 p.bias if has_bias else p.weight, p.out_features, float(p.lora_scale)]

    def launch(cfg: TileConfig) -> None:
        tiles = sum(-(-p.out_features // cfg.block_n) for p in projs)
        if cfg.split_k > 1:  # float32 partial sums of each K slice, and the tiles' arrival counts
            parts = torch.empty(tiles * cfg.split_k * _block_m(m) * cfg.block_n, dtype=torch.float32, device=x2.device)
            counters = _tile_counters(x2.device, tiles)
        else:
            parts = counters = x2
        kernels.proj_kernel[(tiles, cfg.split_k)](
            x2, x2.stride(0), m, k, *args, xa, rank, residual if residual is not None else x2, parts, counters,
            NUM=len(projs), BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SUB_K=FP8_BLOCK if fp8 else cfg.block_k, HAS_SCALE=fp8, HAS_LORA=rank > 0, HAS_RES=residual is not None,
            HAS_BIAS=has_bias, BLOCK_R=block_r, STAGES=cfg.stages,
            EXACT=x2.dtype == torch.float32, UNPACK=unpack, W_FIRST=_w_first(x2, fp8), SPLIT_K=cfg.split_k,
            PDL=pdl, CHAIN=chain, launch_pdl=pdl or chain, num_warps=cfg.num_warps)

    unpack = _unpack(x2, fp8)
    _launch_fitting(("proj", len(projs), n_all, k, fp8, rank, residual is not None, has_bias, _block_m(m), x2.dtype,
                     unpack, pdl, chain), cfg, launch)
    del scratch  # lora_down's partial sums, kept until the launch beside it was made
    return outs


def project_gated(x2: torch.Tensor, gate: DecodeProj, up: DecodeProj) -> torch.Tensor:
    """silu(x Wg^T + LoRA_g (+ bias_g)) * (x Wu^T + LoRA_u (+ bias_u)), one launch (plus one for the LoRA
    down-projections)."""
    _check_group(x2, [gate, up])
    if gate.out_features != up.out_features:
        raise ValueError(f"decode_gemm.project_gated: gate has {gate.out_features} outputs, up {up.out_features}")
    kernels = _triton_kernels()
    m, k = x2.shape
    n = gate.out_features
    rank = _lora_group([gate, up])
    block_r = _block_r(rank)
    fp8 = gate.scale_inv is not None
    has_bias = gate.bias is not None
    pdl, chain = _pdl(x2, rank), chained(x2.device)
    xa, scratch = _lora_down(x2, [gate.lora_a, up.lora_a], block_r, pdl) if rank else (x2, None)
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    cfg = tile_config(GemmKey("gated", 2 * n, k, fp8, _activations(x2, fp8)), m, x2.device)  # gate's and up's n

    def launch(cfg: TileConfig) -> None:
        kernels.gated_kernel[(-(-n // cfg.block_n),)](
            x2, x2.stride(0), m, k,
            gate.weight, gate.scale_inv if fp8 else gate.weight, gate.lora_b if rank else gate.weight,
            float(gate.lora_scale), up.weight, up.scale_inv if fp8 else up.weight, up.lora_b if rank else up.weight,
            float(up.lora_scale), y, n, xa, rank, gate.bias if has_bias else y, up.bias if has_bias else y,
            BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SUB_K=FP8_BLOCK if fp8 else cfg.block_k,
            HAS_SCALE=fp8, HAS_LORA=rank > 0, HAS_BIAS=has_bias, BLOCK_R=block_r, STAGES=cfg.stages,
            EXACT=x2.dtype == torch.float32, UNPACK=unpack, W_FIRST=_w_first(x2, fp8), PDL=pdl, CHAIN=chain,
            launch_pdl=pdl or chain, num_warps=cfg.num_warps)

    unpack = _unpack(x2, fp8)
    _launch_fitting(("gated", 2 * n, k, fp8, rank, has_bias, _block_m(m), x2.dtype, unpack, pdl, chain), cfg,
                    launch)
    del scratch  # as in project
    return y


# --- the KV write ----------------------------------------------------------------------------------


def rope_store_kv_ref(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Rotate K (rotate_half convention, float32, rounded once) and write K and V at each row's position.
    k, v (B, n_kv * D); cos, sin (B, D); pos (B,); caches (B, n_kv, S, D), written in place."""
    rows, n_kv, _, dim = k_cache.shape
    k_rot = rope(k.float().view(rows, n_kv, dim), cos.float()[:, None], sin.float()[:, None])
    at = torch.arange(rows, device=k.device)
    k_cache[at, :, pos] = k_rot.to(k_cache.dtype)
    v_cache[at, :, pos] = v.view(rows, n_kv, dim).to(v_cache.dtype)


def rope_store_kv(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """`rope_store_kv_ref` in one launch (a program per row); replaces the rotary kernels and two scatters
    per layer of a decode step. The caches may be views (strided in batch, head and position)."""
    rows, n_kv, _, dim = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or dim & (dim - 1):
        raise ValueError("decode_gemm.rope_store_kv: caches need one layout, contiguous head_dim, a power of 2")
    kernels = _triton_kernels()
    kernels.rope_store_kernel[(rows,)](
        k.contiguous(), v.contiguous(), cos.contiguous(), sin.contiguous(), pos, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), n_kv, D=dim,
        BLOCK_H=max(1, 1 << (n_kv - 1).bit_length()), num_warps=1)
