"""The decode GEMM Triton kernels, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1).

Collected only when that variable is set: tests/test_decode_gemm.py runs this file in a subprocess
with the interpreter's own triton on the path (./dev setup installs it in .venv/triton-interpreter).
float32 activations: the interpreter mishandles bf16 loads; the weights are bf16 or FP8 as on the GPU.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from grpo.kernels import _decode_gemm_triton as kernels
from grpo.kernels import decode_gemm as dg
from grpo.kernels.fp8 import quantize_fp8_block

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_native_engine's helpers


def proj(n: int, k: int, fp8: bool, rank: int, seed: int, scale: float = 2.0, fp8_act: bool = False
         ) -> dg.DecodeProj:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    weight, s = quantize_fp8_block(w) if fp8 else (w.to(torch.bfloat16), None)
    a = b = None
    if rank:
        a = torch.randn(rank, k, generator=g) / k**0.5
        b = torch.randn(n, rank, generator=g) / rank**0.5
    return dg.DecodeProj(weight, s, a, b, scale, fp8_activations=fp8_act)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rank", [0, 4, 32])
@pytest.mark.parametrize("m,k,widths", [(16, 384, [256, 64, 64]), (5, 300, [70]), (1, 256, [130, 200]),
                                        (20, 256, [48]), (64, 128, [32, 16])])  # row tiles of 32 and 64
def test_project_matches_reference(fp8, rank, m, k, widths):
    # widths not multiples of the tile, K not a multiple of 128 (partial FP8 blocks), one row
    projs = [proj(n, k, fp8, rank, seed=i) for i, n in enumerate(widths)]
    x = torch.randn(m, k)
    for got, want in zip(dg.project(x, projs), dg.project_ref(x, projs)):
        close(got, want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rank", [0, 8])
@pytest.mark.parametrize("m", [7, 40])
def test_residual_and_gated_match_reference(fp8, rank, m):
    x = torch.randn(m, 384)
    p = proj(200, 384, fp8, rank, seed=3)
    res = torch.randn(m, 200)
    close(dg.project(x, [p], residual=res)[0], dg.project_ref(x, [p], residual=res)[0])
    gate, up = proj(96, 384, fp8, rank, seed=4), proj(96, 384, fp8, rank, seed=5)
    close(dg.project_gated(x, gate, up), dg.project_gated_ref(x, gate, up))


def test_every_tile_config_gives_the_same_result():
    projs = [proj(n, 512, True, 16, seed=i) for i, n in enumerate([160, 32])]
    x = torch.randn(9, 512)
    want = dg.project_ref(x, projs)
    key = ("proj", 192, 512, "fp8")
    try:
        for cfg in (dg.TileConfig(16, 128, 4, 2), dg.TileConfig(64, 256, 4, 3), dg.TileConfig(32, 512, 8, 4)):
            dg.CONFIG_OVERRIDE[key] = cfg
            for got, ref in zip(dg.project(x, projs), want):
                close(got, ref)
    finally:
        dg.CONFIG_OVERRIDE.pop(key, None)


@pytest.mark.parametrize("rank", [0, 8])
@pytest.mark.parametrize("m,k,widths", [(16, 384, [256, 64, 64]), (1, 300, [70]), (20, 256, [48]),
                                        (64, 128, [32, 16])])
def test_fp8_activations_match_the_quantizing_reference(rank, m, k, widths):
    projs = [proj(n, k, True, rank, seed=i, fp8_act=True) for i, n in enumerate(widths)]
    x = torch.randn(m, k) * torch.rand(m, 1) * 4  # rows of different magnitudes: one scale per row and group
    got = dg.project(x, projs)
    for g, want in zip(got, dg.project_ref(x, projs)):
        close(g, want)
    # the activations really went through E4M3: the weight-only result is measurably different
    weight_only = dg.project_ref(x, [dataclasses.replace(projs[0], fp8_activations=False)])[0]
    assert (got[0] - weight_only).abs().max() > 1e-3


@pytest.mark.parametrize("rank", [0, 8])
def test_fp8_activations_gated_and_residual_match_reference(rank):
    x = torch.randn(7, 384)
    gate, up = proj(96, 384, True, rank, seed=4, fp8_act=True), proj(96, 384, True, rank, seed=5, fp8_act=True)
    close(dg.project_gated(x, gate, up), dg.project_gated_ref(x, gate, up))
    p, res = proj(200, 384, True, rank, seed=3, fp8_act=True), torch.randn(7, 200)
    close(dg.project(x, [p], residual=res)[0], dg.project_ref(x, [p], residual=res)[0])


def test_fp8_activations_zero_rows_and_groups_stay_finite():
    # an all-zero row (a finished row's padding) and an all-zero 128-group get the floor scale, not 0/0
    p = proj(64, 384, True, 0, seed=9, fp8_act=True)
    x = torch.randn(4, 384)
    x[1] = 0.0
    x[2, 128:256] = 0.0
    got = dg.project(x, [p])[0]
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros(64))
    close(got, dg.project_ref(x, [p])[0])


@pytest.mark.parametrize("fp8", [False, True])
def test_native_engine_with_kernels_equals_engine_with_modules(fp8):
    from peft import LoraConfig, get_peft_model

    from grpo.kernels.fp8 import quantize_linears_
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = small_llama(seed=1)
    if fp8:
        quantize_linears_(base, targets)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    sampling = Sampling(max_new_tokens=6, temperature=1.0, top_k=20, seed=3)
    ref = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules").generate(PROMPTS, 2, sampling)
    engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels")
    out = engine.generate(PROMPTS, 2, sampling)
    # the kernels did run, with LoRA (and FP8 codes)
    assert all(plan is not None and plan.q.rank == 4 and (plan.q.scale_inv is not None) == fp8
               for plan in engine._plans)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)


def test_rope_store_kv_matches_reference_on_cache_views():
    rows, n_kv, seq, dim = 5, 3, 12, 16
    k, v = torch.randn(rows, n_kv * dim), torch.randn(rows, n_kv * dim)
    cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
    pos = torch.tensor([0, 4, 11, 7, 4])
    k_init, v_init = torch.randn(2, rows + 2, n_kv, seq + 4, dim)  # bigger than the views the step passes
    caches = [k_init.clone(), v_init.clone(), k_init.clone(), v_init.clone()]
    views = [c[:rows, :, :seq] for c in caches]
    dg.rope_store_kv(k, v, cos, sin, pos, views[0], views[1])
    dg.rope_store_kv_ref(k, v, cos, sin, pos, views[2], views[3])
    assert not torch.equal(caches[0], k_init) and not torch.equal(caches[1], v_init)
    close(caches[0], caches[2])
    close(caches[1], caches[3])


def test_fp8_partial_last_k_step_reads_no_scale_past_the_tensor():
    # K = 300 with block_k 256: the last step's second 128-slice starts past K and has no scale. The
    # scales live in a bigger buffer whose next element is NaN: reading it would poison the output.
    p = proj(64, 300, True, 0, seed=7)
    buffer = torch.full((p.scale_inv.numel() + 4,), float("nan"))
    buffer[: p.scale_inv.numel()] = p.scale_inv.flatten()
    x = torch.randn(3, 300)
    for fp8_act in (False, True):
        guarded = dg.DecodeProj(p.weight, buffer[: p.scale_inv.numel()].view_as(p.scale_inv), fp8_activations=fp8_act)
        got = dg.project(x, [guarded])[0]
        assert torch.isfinite(got).all()
        close(got, dg.project_ref(x, [dataclasses.replace(p, fp8_activations=fp8_act)])[0])


@triton.jit
def _cast_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + r, mask=r < n, other=0.0)
    tl.store(out_ptr + r, kernels._to_e4m3(v).to(tl.float32), mask=r < n)


def test_e4m3_rounding_matches_torch_cast_on_every_code_and_tie():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[torch.isfinite(codes)].unique()  # every finite E4M3 value, subnormals included
    ties = (grid[1:] + grid[:-1]) / 2  # exactly halfway: round to the even code
    v = torch.cat([grid, ties, torch.empty(4096).uniform_(-448, 448), torch.randn(4096) * 0.01])
    out = torch.empty_like(v)
    _cast_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    assert torch.equal(out, v.to(torch.float8_e4m3fn).float())
