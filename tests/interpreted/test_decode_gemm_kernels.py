"""The decode GEMM Triton kernels, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1).

Collected only when that variable is set: tests/test_decode_gemm.py runs this file in a subprocess
with the interpreter's own triton on the path (./dev setup installs it in .venv/triton-interpreter).
float32 activations: the interpreter mishandles bf16 loads; the weights are bf16 or FP8 as on the GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from grpo.kernels import decode_gemm as dg
from grpo.kernels._decode_gemm_triton import _tf32
from grpo.kernels.fp8 import quantize_fp8_block

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_native_engine's helpers


def proj(n: int, k: int, fp8: bool, rank: int, seed: int, scale: float = 2.0, bias: bool = False) -> dg.DecodeProj:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    weight, s = quantize_fp8_block(w) if fp8 else (w.to(torch.bfloat16), None)
    a = b = None
    if rank:
        a = torch.randn(rank, k, generator=g) / k**0.5
        b = torch.randn(n, rank, generator=g) / rank**0.5
    return dg.DecodeProj(weight, s, a, b, scale, torch.randn(n, generator=g) if bias else None)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


SHAPES = [(16, 384, [256, 64, 64]), (5, 300, [70]), (1, 256, [130, 200]), (20, 256, [48]),
          (64, 128, [32, 16])]  # (rows, K, widths); the last two: row tiles of 32 and 64


# Every shape in bf16 and in FP8, each at another rank, so that every rank meets both formats (pairs, not the whole
# cross product: a case takes about a second under the interpreter)
@pytest.mark.parametrize("m,k,widths,fp8,rank", [(*shape, fp8, (0, 4, 32)[(2 * i + fp8) % 3])
                                                 for i, shape in enumerate(SHAPES) for fp8 in (False, True)])
def test_project_matches_reference(fp8, rank, m, k, widths):
    # widths not multiples of the tile, K not a multiple of 128 (partial FP8 blocks), one row
    projs = [proj(n, k, fp8, rank, seed=i) for i, n in enumerate(widths)]
    x = torch.randn(m, k)
    for got, want in zip(dg.project(x, projs), dg.project_ref(x, projs)):
        close(got, want)


@pytest.mark.parametrize("fp8,rank,m", [(False, 0, 7), (False, 8, 40), (True, 8, 7), (True, 0, 40)])  # every pair
def test_residual_and_gated_match_reference(fp8, rank, m):
    x = torch.randn(m, 384)
    p = proj(200, 384, fp8, rank, seed=3)
    res = torch.randn(m, 200)
    close(dg.project(x, [p], residual=res)[0], dg.project_ref(x, [p], residual=res)[0])
    gate, up = proj(96, 384, fp8, rank, seed=4), proj(96, 384, fp8, rank, seed=5)
    close(dg.project_gated(x, gate, up), dg.project_gated_ref(x, gate, up))


@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_weights_with_fp16_activations_multiply_weights_first_as_the_reference(split_k):
    # W x^T (decode_gemm._w_first), transposed at the end: q/k/v widths with LoRA, biases and split K, a residual,
    # the gated MLP; each output rounded once to fp16 from the float32 reference
    x = torch.randn(6, 640).half()
    projs = [proj(n, 640, True, 4, seed=i, bias=True) for i, n in enumerate([96, 32, 32])]
    res = torch.randn(6, 96).half()
    with dg.tuning(tiles={("proj", 160, 640, True): dg.TileConfig(16, 128, 4, 2, split_k),
                          ("proj", 96, 640, True): dg.TileConfig(32, 128, 4, 2, split_k)}):
        got = [*dg.project(x, projs), dg.project(x, projs[:1], residual=res)[0]]
    want = [*dg.project_ref(x, projs), dg.project_ref(x, projs[:1], residual=res)[0]]
    gate, up = proj(48, 640, True, 4, seed=7), proj(48, 640, True, 4, seed=8)
    got.append(dg.project_gated(x, gate, up))
    want.append(dg.project_gated_ref(x, gate, up))
    for g, w in zip(got, want):
        assert g.dtype == torch.float16
        # the LoRA term's float32 operands rounded to TF32 (_decode_gemm_triton._tf32): off by their rounding,
        # unbiased, on top of the output's own rounding to fp16 (~3e-4 of the norm)
        assert ((g.float() - w).norm() / w.norm()).item() < 1.5e-3
        assert (g.float() - w).abs().max().item() < 4e-3 * w.abs().max().item()


@triton.jit
def tf32_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _tf32(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def test_tf32_rounds_float32_to_ten_mantissa_bits_half_to_even():
    # what the tensor cores then read unchanged: frexp's 24-bit mantissa rounded to 11 bits, ties to even
    one_ulp = 2.0**-10  # TF32's step at 1.0
    ties = torch.tensor([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), 3 + 3 * one_ulp])
    near = torch.tensor([1 + one_ulp / 2 + 2.0**-23, 1 + one_ulp / 2 - 2.0**-23, 0.0, -0.0, 2.0**-130])
    x = torch.cat([ties, near, torch.randn(2000) * torch.logspace(-20, 20, 2000, base=2.0)])
    y = torch.empty_like(x)
    tf32_kernel[(1,)](x, y, x.numel(), BLOCK=4096)
    mantissa, exponent = torch.frexp(x)
    want = torch.ldexp(torch.round(mantissa.double() * 2**11) / 2**11, exponent).float()
    assert torch.equal(y[:4], torch.tensor([1.0, 1 + 2 * one_ulp, -1.0, 3 + 4 * one_ulp]))
    assert torch.equal(y, want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_biases_are_added_to_each_projection_with_lora_and_split_k(fp8, split_k):
    # Qwen2's q/k/v (three widths in one launch), o with a residual, and a gated MLP with biases
    x = torch.randn(6, 640)
    projs = [proj(n, 640, fp8, 4, seed=i, bias=True) for i, n in enumerate([96, 32, 32])]
    with dg.tuning(tiles={("proj", 160, 640, fp8): dg.TileConfig(16, 128, 4, 2, split_k)}):
        for got, want in zip(dg.project(x, projs), dg.project_ref(x, projs)):
            close(got, want)
    res = torch.randn(6, 96)
    with dg.tuning(tiles={("proj", 96, 640, fp8): dg.TileConfig(16, 128, 4, 2, split_k)}):
        close(dg.project(x, projs[:1], residual=res)[0], dg.project_ref(x, projs[:1], residual=res)[0])
    gate, up = proj(48, 640, fp8, 4, seed=7, bias=True), proj(48, 640, fp8, 4, seed=8, bias=True)
    close(dg.project_gated(x, gate, up), dg.project_gated_ref(x, gate, up))


def test_lora_down_adds_its_k_slices_once_and_rearms_its_counters():
    # K = 2048: 8 slices whose partial sums the last to finish adds; run twice, so counters left set would show
    x = torch.randn(9, 2048)
    lora_as = [torch.randn(8, 2048, generator=torch.Generator().manual_seed(i)) / 2048**0.5 for i in range(3)]
    assert dg.lora_split(2048) == 8
    for _ in range(2):
        out = dg.lora_down(x, lora_as, 16)
        assert out.shape == (3, 16, 16)
        for i, a in enumerate(lora_as):
            close(out[i, :9, :8], x @ a.T)
        assert not out[:, 9:].any() and not out[:, :, 8:].any()  # padded rows and ranks stay zero


def test_lora_down_gives_the_same_result_at_every_split_and_k_step_the_probe_sweeps():
    # decode_gemm_tiles.py --lora-down: over K = 640, 7 slices of 128 columns (each rounded up to whole 64-column
    # steps) and 10 slices of 128 leave the last ones empty
    x = torch.randn(5, 640)
    lora_as = [torch.randn(8, 640, generator=torch.Generator().manual_seed(i)) / 640**0.5 for i in range(2)]
    for split, block_k in ((1, 64), (3, 128), (7, 64), (10, 64), (10, 128)):
        out, parts = dg._lora_down(x, lora_as, 8, pdl=False, split=split, block_k=block_k)
        assert parts.shape[1] == split or split == 1  # the split asked for is the one launched
        for i, a in enumerate(lora_as):
            close(out[i, :5], x @ a.T)


def test_every_tile_config_gives_the_same_result():
    projs = [proj(n, 512, True, 16, seed=i) for i, n in enumerate([160, 32])]
    x = torch.randn(9, 512)
    want = dg.project_ref(x, projs)
    key = ("proj", 192, 512, True)
    for cfg in (dg.TileConfig(16, 128, 4, 2), dg.TileConfig(64, 256, 4, 3), dg.TileConfig(32, 512, 8, 4)):
        with dg.tuning(tiles={key: cfg}):
            for got, ref in zip(dg.project(x, projs), want):
                close(got, ref)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split_k", [3, 5])
def test_split_k_sums_every_slice_once_and_rearms_its_counters(fp8, split_k):
    # K = 640 over slices of whole K steps: 3 slices of 256 leave the last one partial, 5 leave empty
    # slices; a residual and LoRA, which only the last slice to arrive adds; three projections whose
    # tiles share one counter buffer; run twice, so counters left set would show on the second run
    projs = [proj(n, 640, fp8, 8, seed=i) for i, n in enumerate([160, 64, 40])]
    x = torch.randn(11, 640)
    key = ("proj", 264, 640, fp8)
    with dg.tuning(tiles={key: dg.TileConfig(32, 256, 4, 2, split_k)}):
        for _ in range(2):
            for got, want in zip(dg.project(x, projs), dg.project_ref(x, projs)):
                close(got, want)
            assert not dg._COUNTERS[x.device].any()
        res = torch.randn(11, 160)
        with dg.tuning(tiles={("proj", 160, 640, fp8): dg.TileConfig(16, 128, 4, 2, split_k)}):
            close(dg.project(x, projs[:1], residual=res)[0], dg.project_ref(x, projs[:1], residual=res)[0])


@pytest.mark.parametrize("kind", ["proj", "gated"])
def test_launches_read_the_config_under_the_key_the_sweeps_write(kind):
    # tile_config keys a launch by its outputs in all (gate + up for the gated MLP): an FP8 config that
    # tile_config refuses, put under that key, must be what the launch reads
    x = torch.randn(3, 256)
    projs = [proj(96, 256, True, 0, seed=i) for i in range(2)]
    key = (kind, 192, 256, True)
    with dg.tuning(tiles={key: dg.TileConfig(48, 128, 4, 2)}):
        with pytest.raises(ValueError, match="block_n must divide 128"):
            dg.project_gated(x, *projs) if kind == "gated" else dg.project(x, projs)


def test_launches_shrink_tiles_that_do_not_fit_shared_memory():
    # the GPU refuses configs that need too much shared memory (Triton raises before running anything):
    # the launch retries with smaller tiles, remembers the fit, and a sweep's other configs are not shadowed
    from triton.runtime.errors import OutOfResources

    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg.stages * cfg.block_k > 600:
            raise OutOfResources(cfg.stages * cfg.block_k, 600, "shared memory")

    dg.forget_fitted_tiles()
    dg._launch_fitting(("proj", 1), dg.TileConfig(16, 512, 4, 4), launch)
    assert [(c.block_k, c.stages) for c in tried] == [(512, 4), (512, 3), (512, 2), (256, 2)]
    tried.clear()
    dg._launch_fitting(("proj", 1), dg.TileConfig(16, 512, 4, 4), launch)
    assert tried == [dg.TileConfig(16, 256, 4, 2)]  # remembered: one launch
    tried.clear()
    dg._launch_fitting(("proj", 1), dg.TileConfig(32, 128, 4, 4), launch)
    assert tried == [dg.TileConfig(32, 128, 4, 4)]  # another config asked for is launched as asked
    with pytest.raises(OutOfResources):  # nothing smaller left to try: Triton's error goes through
        dg._launch_fitting(("proj", 2), dg.TileConfig(16, 128, 4, 2),
                           lambda cfg: launch(dg.TileConfig(16, 1024, 4, 4)))


@pytest.mark.parametrize("fp8", [False, True])
def test_native_engine_with_kernels_equals_engine_with_modules(fp8):
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.kernels.fp8 import quantize_linears_
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    targets = list(LORA_TARGETS)
    base = small_llama(seed=1, layers=1)
    if fp8:  # FP8Linear bases (on the CPU their forward multiplies by the dequantized weight, as the kernels do)
        quantize_linears_(base, targets)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    sampling = Sampling(max_new_tokens=4, temperature=1.0, top_k=20, seed=3)
    ref = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules").generate(PROMPTS, 2, sampling)
    engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels")
    out = engine.generate(PROMPTS, 2, sampling)
    # the kernels did run, with LoRA (and FP8 codes), and the norms in launches of their own (rmsnorm.norm_rows)
    assert all(plan is not None and plan.q.rank == 4 and (plan.q.scale_inv is not None) == fp8
               for plan in engine._projections)
    assert all(norm is not None for layer in engine._layers for norm in layer.norms)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])  # sdpa: the modules' attention, below 16 rows
def test_native_engine_with_fp8_projections_on_fp16_activations_samples_what_the_modules_do(attention):
    # EngineTuning.fp8_activations="fp16": the norms, the attention and the SiLU product write fp16 for the FP8
    # projections (W x^T); the residual stream and q/k/v stay in the model's dtype; values within fp16's rounding
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.kernels.fp8 import quantize_linears_
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    base = small_llama(seed=1, layers=1)
    quantize_linears_(base, list(LORA_TARGETS))
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                           init_lora_weights=False))
    sampling = Sampling(max_new_tokens=4, temperature=1.0, top_k=20, seed=3)
    ref = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules").generate(PROMPTS, 2, sampling)
    engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(fp8_activations="fp16", attention=attention))
    out = engine.generate(PROMPTS, 2, sampling)
    assert all(layer.inputs == torch.float16 for layer in engine._layers)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=5e-3, rtol=0)
    with pytest.raises(ValueError, match="fp8_activations"):
        EngineTuning(fp8_activations="fp8")


def test_fp8_projections_read_fp16_by_default_in_a_bf16_models_narrow_steps_and_a_float32_models_own_dtype():
    # EngineTuning.fp8_activations="auto": fp16 (W x^T) where the model is bf16 and the step no wider than the rows
    # its tiles were swept for; a float32 model keeps its exact sums
    from grpo.config import LORA_TARGETS
    from grpo.kernels.fp8 import quantize_linears_
    from grpo.rollout.native import NativeEngine
    from grpo.rollout.native.engine import FP16_ACTIVATIONS_ROWS
    from test_native_engine import PAD, small_llama

    widest = FP16_ACTIVATIONS_ROWS
    for dtype, rows, read in ((torch.bfloat16, 4, torch.float16), (torch.bfloat16, widest, torch.float16),
                              (torch.bfloat16, widest + 1, None), (torch.float32, 4, None)):
        base = small_llama(seed=1, layers=2).to(dtype)
        quantize_linears_(base, list(LORA_TARGETS))
        engine = NativeEngine(base, max_seq_len=16, max_batch=64, pad_id=PAD, gemm="kernels")
        engine._plan(rows)  # the layers a generate of these rows would run
        assert [layer.inputs for layer in engine._layers] == [read, read], (dtype, rows)
    bf16 = NativeEngine(small_llama(seed=1, layers=1).to(torch.bfloat16), max_seq_len=16, max_batch=6, pad_id=PAD,
                        gemm="kernels")
    bf16._plan(4)
    assert bf16._layers[0].inputs is None  # no FP8 projection: nothing reads fp16


def test_native_engine_with_the_adapters_folded_samples_what_the_modules_do_and_gives_the_weights_back():
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    lora = get_peft_model(small_llama(seed=1, layers=1), config)
    before = {name: p.clone() for name, p in lora.named_parameters()}
    sampling = Sampling(max_new_tokens=4, temperature=1.0, top_k=20, seed=3)
    ref = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules").generate(PROMPTS, 2, sampling)
    engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(fold_adapter=True))
    out = engine.generate(PROMPTS, 2, sampling)
    assert engine._fold and all(layer.proj.q.rank == 0 for layer in engine._layers)  # the kernels read no adapter
    assert engine.needs_importance_correction  # the folded weights are not the trainer's numerics
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)
    for name, p in lora.named_parameters():
        assert torch.equal(p, before[name]), name
    with lora.disable_adapter():  # peft's switch off: the kernels take no layer (plan.decode_proj), nothing folds
        engine.generate(PROMPTS, 1, sampling)
        assert not engine._fold and not engine.needs_importance_correction


def test_native_engine_runs_qwen2_on_the_kernels_as_through_its_modules():
    # Qwen2.5 (the packaged Qwen): q/k/v biases, which the kernels add; LoRA on every projection. (FP8 codes
    # with biases: test_biases_are_added_to_each_projection_with_lora_and_split_k.)
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import NativeEngine
    from test_native_engine import PAD, PROMPTS, small_qwen2

    base = small_qwen2(seed=2, layers=1)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                           init_lora_weights=False))
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=4)
    ref = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules").generate(PROMPTS, 2, sampling)
    engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels")
    out = engine.generate(PROMPTS, 2, sampling)
    assert all(plan is not None and plan.q.bias is not None for plan in engine._projections)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)


def test_native_engine_runs_qwen3_on_the_kernels_as_through_its_modules():
    # Qwen3: RMS norms over each head of q and k between the q/k/v launch and the rotary embedding; the
    # attention kernel too (decode_attention), against the modules with torch's sdpa attention
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from test_native_engine import PAD, PROMPTS, small_decoder

    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=list(LORA_TARGETS))
    lora = get_peft_model(small_decoder("qwen3", seed=2, layers=1), config)
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=4)
    ref = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="modules",
                       tuning=EngineTuning(attention="sdpa")).generate(PROMPTS, 2, sampling)
    engine = NativeEngine(lora, max_seq_len=16, max_batch=6, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(attention="kernel"))
    out = engine.generate(PROMPTS, 2, sampling)
    assert all(plan is not None for plan in engine._projections)
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
    guarded = dg.DecodeProj(p.weight, buffer[: p.scale_inv.numel()].view_as(p.scale_inv))
    x = torch.randn(3, 300)
    got = dg.project(x, [guarded])[0]
    assert torch.isfinite(got).all()
    close(got, dg.project_ref(x, [p])[0])


def _run_ptx(asm: str, word: int) -> tuple[int, int]:
    """The PTX of _E4M3_BITS run on one 32-bit input by a model of its four instructions (prmt's default
    mode, logical shr, lop3's truth table)."""
    regs = {"$2": word}

    def val(token: str) -> int:
        return regs[token] if token in regs else int(token, 0)

    for statement in asm.replace("{", "").replace("}", "").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":  # bytes of {src1:src0} picked by the selector's nibbles
            pool, sel, out = val(src[0]) | val(src[1]) << 32, val(src[2]), 0
            for i in range(4):
                nibble = sel >> 4 * i & 0xF
                byte = pool >> 8 * (nibble & 7) & 0xFF
                out |= (0xFF * (byte >> 7) if nibble & 8 else byte) << 8 * i
        elif op == "and.b32":
            out = val(src[0]) & val(src[1])
        elif op == "shr.b32":
            out = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            out = sum((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)) & 1) << i for i in range(32))
        else:
            raise AssertionError(f"no model for {op}")
        regs[dst] = out & 0xFFFFFFFF
    return regs["$0"], regs["$1"]


def test_e4m3_bit_moves_give_every_code_times_2_to_the_minus_120():
    # the CPU side of the CUDA test that reads every code back through the tensor cores
    from grpo.kernels._decode_gemm_triton import _E4M3_BITS

    codes = torch.arange(256, dtype=torch.uint8)
    halves = []
    for i in range(0, 256, 4):  # element j of a pack is byte j of the register, and half j of the outputs
        lo, hi = _run_ptx(_E4M3_BITS.value, int.from_bytes(bytes(codes[i:i + 4].tolist()), "little"))
        halves += [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]
    got = torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double() * 2.0**120
    want = codes.view(torch.float8_e4m3fn).double()
    finite = torch.isfinite(want)
    assert finite.sum() == 254 and torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))  # -0 stays -0


# What benchmarks/probes/decode_gemm_sass.py compiles for the tests below, in one process of its own (kernels
# cannot be compiled while TRITON_INTERPRET=1; a process a compile spent its seconds importing torch): name ->
# compile_kernel's arguments (the decode attention's: compile_attention's)
SASS = {"gated-bf16": dict(kind="gated", fp8=False, tile=(32, 256, 4, 4), chain=True),  # as the engine launches it
        "gated-convert": dict(kind="gated", fp8=True, tile=(32, 128, 4, 4), unpack="convert"),
        "gated-bits": dict(kind="gated", fp8=True, tile=(32, 128, 4, 4), unpack="bits"),
        "gated-fp16": dict(kind="gated", fp8=True, tile=(32, 128, 4, 4), activations="fp16"),
        "qkv-qwen2": dict(kind="proj", fp8=True, tile=(32, 256, 4, 3), bias=True, split_k=4),
        "lora-epilogue": dict(kind="proj", fp8=False, tile=(32, 128, 4, 6), rows=64, lora=True, split_k=2),
        "lora-epilogue-pdl": dict(kind="proj", fp8=False, tile=(32, 128, 4, 6), rows=64, lora=True, split_k=2,
                                  pdl=True),
        "attention-rope": dict(kind="attention", rope=True),  # compile_attention's argument
        "attention-plain": dict(kind="attention", rope=False)}
COMPILE_EACH = """
import json, sys
sys.path.insert(0, sys.argv[1])
import decode_gemm_sass as sass
out = {}
for name, spec in json.loads(sys.argv[2]).items():
    if spec["kind"] == "attention":
        compiled = sass.compile_attention(spec["rope"])
    else:
        compiled = sass.compile_kernel(**{**spec, "tile": tuple(spec["tile"])})
    ptx = compiled.asm["ptx"]
    out[name] = dict(loops=sass.sass_loops(compiled.asm["cubin"]), ptx_waits="griddepcontrol.wait" in ptx,
                     ptx_at={op: ptx.find(op) for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                         "cp.async", "ld.global", "st.global")})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sass_compiled() -> dict:
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_EACH, str(root / "benchmarks" / "probes"), json.dumps(SASS)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("unpack", ["bf16", "convert", "bits"])
def test_sass_tool_compiles_the_kernels_for_sm90_as_the_gpu_specializes_them(sass_compiled, unpack):
    # decode_gemm_sass.py: no GPU needed; with the launch-time divisibility it must show the pipelined 16-byte
    # async copies a Hopper GPU runs (scalar loads would mean it compiled something else). FP8 codes become bf16
    # through the conversion unit ("convert") or by bit moves alone ("bits").
    loops = [loop for loop in sass_compiled[f"gated-{unpack}"]["loops"] if loop["instructions"] > 8]
    assert len(loops) == 2  # gate's K loop and up's
    ops = loops[0]["ops"]
    assert any(op.startswith("HMMA") for op in ops) and "LDGSTS.E.BYPASS.128" in ops
    conversions = any(op.startswith(("F2F", "F2FP")) for op in ops)
    assert conversions == (unpack == "convert")
    assert ("PRMT" in ops and "SHF.R.U32.HI" in ops) == (unpack == "bits")


def test_fp8_codes_with_fp16_activations_take_one_conversion_a_pair_and_fewer_instructions_than_bit_moves(
        sass_compiled):
    # decode_gemm._w_first: the hardware turns two E4M3 codes into two f16 in one instruction, in the tensor
    # cores' operand order (no bit moves, no bf16 step); a K step issues fewer instructions than bits' at one tile
    loops = [loop for loop in sass_compiled["gated-fp16"]["loops"] if loop["instructions"] > 8]
    bits = [loop for loop in sass_compiled["gated-bits"]["loops"] if loop["instructions"] > 8]
    ops = loops[0]["ops"]
    assert "F2FP.F16.E4M3.UNPACK_B" in ops and not any(op.startswith("F2F.") for op in ops)
    assert "PRMT" not in ops and "SHF.R.U32.HI" not in ops
    assert loops[0]["instructions"] < 0.85 * bits[0]["instructions"]


def test_a_launch_in_the_chain_waits_for_the_one_before_it_ahead_of_any_memory_access(sass_compiled):
    # Tuning.chain: griddepcontrol.wait, then launch_dependents (the next launch may be scheduled), and only then
    # the first load or store; a launch outside the chain has neither
    at = sass_compiled["gated-bf16"]["ptx_at"]
    wait, release = at["griddepcontrol.wait"], at["griddepcontrol.launch_dependents"]
    assert 0 <= wait < release < min(at[op] for op in ("cp.async", "ld.global", "st.global") if at[op] >= 0)
    assert sass_compiled["gated-bits"]["ptx_at"]["griddepcontrol.launch_dependents"] == -1


def test_sass_tool_compiles_a_split_k_projection_with_biases_for_sm90(sass_compiled):
    # the q/k/v launch of Qwen2 (biases, FP8 codes, split K) compiles for sm_90, with tensor-core products
    loops = sass_compiled["qkv-qwen2"]["loops"]
    assert any(op.startswith("HMMA") for loop in loops for op in loop["ops"])


def test_lora_down_and_the_tiles_count_arrivals_in_counters_of_their_own():
    # With Tuning.pdl a projection runs beside its lora_down: sharing a counter would corrupt both sums
    lora = dg._tile_counters(torch.device("cpu"), 3, lora=True)
    tiles = dg._tile_counters(torch.device("cpu"), 500)
    assert lora.data_ptr() + 3 * lora.element_size() <= tiles.data_ptr()
    assert tiles.data_ptr() % 16 == 0 and tiles.numel() >= 500
    projs = [proj(n, 1024, False, 8, seed=i) for i, n in enumerate([96, 32])]  # lora_down splits K = 1024 in 4
    x = torch.randn(7, 1024)
    with dg.tuning(tiles={("proj", 128, 1024, False): dg.TileConfig(32, 256, 4, 2, split_k=2)}, pdl=True):
        for got, want in zip(dg.project(x, projs), dg.project_ref(x, projs)):  # pdl: CUDA only, so off here
            close(got, want)
    assert not dg._COUNTERS[x.device].any()


def test_sass_tool_compiles_the_lora_epilogue_to_wait_for_lora_down_only_when_launched_beside_it(sass_compiled):
    # Tuning.pdl: griddepcontrol.wait (SASS ACQBULK) before the LoRA term, the K loop unchanged
    apart, beside = sass_compiled["lora-epilogue"], sass_compiled["lora-epilogue-pdl"]
    assert beside["ptx_waits"] and not apart["ptx_waits"]
    assert [loop["instructions"] for loop in beside["loops"]] == [loop["instructions"] for loop in apart["loops"]]


def test_the_attention_loop_reads_k_and_v_into_the_tensor_cores_as_without_the_rotaries_in_the_launch(
        sass_compiled):
    # the decode attention's chunk kernel (decode_gemm_sass.py --kernel attention): the token's own K/V join after
    # the loop, so the loop over the cache is the plain kernel's; a select on each tile inside it sent K and V
    # through registers (445 instructions a step against 291, triton 3.6)
    loops = {way: [loop for loop in sass_compiled[f"attention-{way}"]["loops"] if loop["instructions"] >= 8]
             for way in ("rope", "plain")}  # as the probe's --kernel attention lists them
    (rope,), (plain,) = loops["rope"], loops["plain"]
    assert rope["instructions"] == plain["instructions"]
    assert "LDGSTS.E.BYPASS.128" in rope["ops"] and any(op.startswith("HMMA") for op in rope["ops"])
    assert "PRMT" not in rope["ops"]
