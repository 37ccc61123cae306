"""grpo.kernels.decode_gemm: the reference against float64, the Triton kernels under Triton's CPU
interpreter (a subprocess), and on CUDA the kernels at the Llama-3.2-1B decode shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo.kernels import decode_gemm as dg
from grpo.kernels.fp8 import dequantize_fp8_block, quantize_fp8_block
from grpo.kernels.tiles import DeviceTable

ROOT = Path(__file__).resolve().parents[1]
# Triton for the interpreter, kept out of the environment's site-packages (./dev setup puts it there):
# a CPU torch must not see a triton it was not built with.
INTERPRETER_TRITON = Path(os.environ.get("GRPO_TRITON_INTERPRETER", ROOT / ".venv" / "triton-interpreter"))


def test_reference_dequantizes_like_the_fp8_module_and_adds_lora():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g)
    codes, scale = quantize_fp8_block(w)
    a, b = torch.randn(8, 260, generator=g), torch.randn(300, 8, generator=g)
    p = dg.DecodeProj(codes, scale, a, b, 0.5)
    x = torch.randn(3, 260, generator=g, dtype=torch.float64)
    dense = dequantize_fp8_block(codes, scale, torch.float64)
    want = x @ dense.t() + 0.5 * (x @ a.double().t()) @ b.double().t()
    torch.testing.assert_close(dg.project_ref(x.float(), [p])[0].double(), want, rtol=1e-4, atol=1e-3)
    gate = dg.DecodeProj(w.to(torch.bfloat16))
    torch.testing.assert_close(dg.project_gated_ref(x.float(), gate, p).double(),
                               F.silu(x @ w.bfloat16().double().t()) * want, rtol=1e-4, atol=1e-3)


def test_reference_adds_each_projections_bias_before_rounding_once():
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 64, generator=g)
    plain, biased = dg.DecodeProj(w), dg.DecodeProj(w, bias=bias)
    torch.testing.assert_close(dg.project_ref(x, [biased])[0], dg.project_ref(x, [plain])[0] + bias)
    res = torch.randn(3, 40, generator=g)
    torch.testing.assert_close(dg.project_ref(x, [biased], residual=res)[0], x @ w.t() + bias + res)
    up_bias = torch.randn(40, generator=g)
    up = dg.DecodeProj(w.flip(0).contiguous(), bias=up_bias)
    torch.testing.assert_close(dg.project_gated_ref(x, biased, up),
                               F.silu(x @ w.t() + bias) * (x @ w.flip(0).t() + up_bias))


def test_bad_groups_are_refused_with_a_clear_error():
    x = torch.randn(4, 128)
    dense = dg.DecodeProj(torch.randn(64, 128, dtype=torch.bfloat16))
    codes, scale = quantize_fp8_block(torch.randn(64, 128))
    with pytest.raises(ValueError, match="all be FP8 or all dense"):
        dg.project(x, [dense, dg.DecodeProj(codes, scale)])
    biased = dg.DecodeProj(dense.weight, bias=torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="all have a bias or none"):
        dg.project(x, [biased, dense])
    with pytest.raises(ValueError, match=r"a bias must be contiguous \(64,\)"):
        dg.project(x, [dg.DecodeProj(dense.weight, bias=torch.zeros(32, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="M <= 64"):
        dg.project(torch.randn(65, 128), [dense])
    with pytest.raises(ValueError, match="expects 128"):
        dg.project(torch.randn(4, 64), [dense])
    with pytest.raises(ValueError, match="1 to 3"):
        dg.project(x, [dense] * 4)


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    if not (INTERPRETER_TRITON / "triton").is_dir():
        pytest.skip(f"no interpreter triton in {INTERPRETER_TRITON}; run ./dev setup")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(INTERPRETER_TRITON), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "interpreted")], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [("proj", 2048, [2048, 512, 512]), ("proj", 2048, [2048]), ("gated", 2048, [8192, 8192]),
          ("proj", 8192, [2048])]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rank,pdl", [(0, False), (32, False), (32, True)])  # pdl: beside lora_down (Tuning.pdl)
@pytest.mark.parametrize("kind,k,widths", SHAPES)
def test_kernels_at_llama_decode_shapes_on_cuda(kind, k, widths, fp8, rank, pdl):
    g = torch.Generator(device="cuda").manual_seed(0)
    projs = []
    for n in widths:
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        weight, s = quantize_fp8_block(w) if fp8 else (w.bfloat16(), None)
        a = torch.randn(rank, k, device="cuda", generator=g) / k**0.5 if rank else None
        b = torch.randn(n, rank, device="cuda", generator=g) * 0.05 if rank else None
        projs.append(dg.DecodeProj(weight, s, a, b, 11.3))
    for m in (64, 32, 16, 3, 1):  # every row tile (at 64 rows the device's tiles swept there)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, widths[0], device="cuda", dtype=torch.bfloat16) if len(widths) == 1 else None
        with dg.tuning(pdl=pdl):
            if kind == "gated":
                got, want = [dg.project_gated(x, *projs)], [dg.project_gated_ref(x.float(), *projs)]
                again = [dg.project_gated(x, *projs)]
            else:
                got = dg.project(x, projs, residual=res)
                want = dg.project_ref(x.float(), projs, residual=None if res is None else res.float())
                again = dg.project(x, projs, residual=res)
        assert all(torch.equal(y, z) for y, z in zip(got, again))  # no launch order changes a value
        for y, ref in zip(got, want):
            assert y.dtype == torch.bfloat16
            rel = ((y.float() - ref).norm() / ref.norm()).item()
            assert rel < 8e-3, (m, rel)  # bf16 output rounding is ~2e-3


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rank", [0, 32])
@pytest.mark.parametrize("kind,k,widths", SHAPES)
def test_fp8_kernels_with_fp16_activations_at_llama_decode_shapes_on_cuda(kind, k, widths, rank):
    # W x^T (dg._w_first) at each tile the device's table and the probe's W x^T sweep take, every row tile
    g = torch.Generator(device="cuda").manual_seed(1)
    projs = []
    for n in widths:
        weight, s = quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        a = torch.randn(rank, k, device="cuda", generator=g) / k**0.5 if rank else None
        b = torch.randn(n, rank, device="cuda", generator=g) * 0.05 if rank else None
        projs.append(dg.DecodeProj(weight, s, a, b, 11.3))
    key = (kind, sum(widths), k, True, "fp16")
    for cfg in (None, dg.TileConfig(64, 256, 2, 3, 4 if kind == "proj" else 1), dg.TileConfig(128, 128, 4, 4)):
        for m in (64, 16, 3):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            res = torch.randn(m, widths[0], device="cuda", dtype=torch.float16) if len(widths) == 1 else None
            with dg.tuning(tiles={} if cfg is None else {key: cfg}):
                if kind == "gated":
                    got, want = [dg.project_gated(x, *projs)], [dg.project_gated_ref(x.float(), *projs)]
                else:
                    got = dg.project(x, projs, residual=res)
                    want = dg.project_ref(x.float(), projs, residual=None if res is None else res.float())
            for y, ref in zip(got, want):
                assert y.dtype == torch.float16
                rel = ((y.float() - ref).norm() / ref.norm()).item()
                assert rel < 2e-3, (cfg, m, rel)  # fp16 output rounding is ~3e-4


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("unpack", ["convert", "bits"])
@pytest.mark.parametrize("act_scale", [1.0, 2.0**-12])
def test_every_fp8_code_unpacks_to_its_value_on_cuda(unpack, act_scale):
    """Each row of W holds one E4M3 code (all 254 finite ones, subnormals and -0 included); a one-hot x
    reads it back through the tensor cores times its block scale: exact. Small activations catch a
    path that would flush the tiny products the bit moves make (code * 2^-120)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())]
    weight = finite.to("cuda")[:, None].expand(-1, 256).contiguous()  # (254, 256)
    scale = torch.tensor([[2.0**-3, 2.0**5], [2.0**-7, 1.0]], device="cuda")  # (2, 2) blocks
    x = torch.zeros(16, 256, device="cuda", dtype=torch.bfloat16)
    x[:8, 5] = act_scale  # rows 0-7 read column 5 (first K block), rows 8-15 column 200 (second)
    x[8:, 200] = act_scale
    with dg.tuning(unpack=unpack):
        y = dg.project(x, [dg.DecodeProj(weight, scale)])[0].float()
    value = finite.float().to("cuda")
    rows = torch.arange(254, device="cuda") // 128
    want_first = (value * scale[rows, 0] * act_scale).bfloat16().float()
    want_second = (value * scale[rows, 1] * act_scale).bfloat16().float()
    assert torch.equal(y[0], want_first) and torch.equal(y[8], want_second)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_split_k_at_the_down_projection_on_cuda(fp8, split_k, pdl):
    # pdl: the projection launched beside its lora_down (Tuning.pdl; Hopper or newer), also in a CUDA graph
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, 8192, device="cuda", generator=g) / 8192**0.5
    weight, s = quantize_fp8_block(w) if fp8 else (w.bfloat16(), None)
    p = dg.DecodeProj(weight, s, torch.randn(32, 8192, device="cuda", generator=g) / 90,
                      torch.randn(2048, 32, device="cuda", generator=g) * 0.05, 11.3)
    with dg.tuning(tiles={("proj", 2048, 8192, fp8): dg.TileConfig(32, 256, 4, 4, split_k)}, pdl=pdl):
        for m in (64, 16, 3):
            x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            want = dg.project_ref(x.float(), [p], residual=res.float())[0]
            first = dg.project(x, [p], residual=res)[0]
            again = dg.project(x, [p], residual=res)[0]
            assert torch.equal(first, again)  # the slices are added in one order, whichever finishes last
            assert ((first.float() - want).norm() / want.norm()).item() < 8e-3
            assert not dg._COUNTERS[x.device].any()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = dg.project(x, [p], residual=res)[0]
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, first)
            assert not dg._COUNTERS[x.device].any()


def test_engine_plans_only_the_layers_the_kernels_can_stand_in_for():
    from peft import LoraConfig, get_peft_model

    from grpo.rollout.native.plan import layer_projections
    from test_native_engine import coarsen, small_llama

    plain = small_llama(seed=0)
    plan = layer_projections(plain.model.layers[0], torch.float32)
    assert plan is not None and plan.q.weight is plain.model.layers[0].self_attn.q_proj.weight  # no copy
    assert plan.q.rank == 0
    assert layer_projections(plain.model.layers[0], torch.bfloat16) is None  # weights not in the activations' dtype
    assert layer_projections(coarsen(small_llama(seed=0)).model.layers[0], torch.float32) is None  # forward overridden
    lora = get_peft_model(small_llama(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj",
                                                                                              "v_proj"]))
    plan = layer_projections(lora.base_model.model.model.layers[0], torch.float32)
    assert plan.q.rank == 4 and plan.q.lora_scale == 2.0 and plan.o.rank == 0
    with lora.disable_adapter():
        assert layer_projections(lora.base_model.model.model.layers[0], torch.float32) is None  # peft's switch: modules
    dora = get_peft_model(small_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert layer_projections(dora.base_model.model.model.layers[0], torch.float32) is None
    partial = get_peft_model(small_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    assert layer_projections(partial.base_model.model.model.layers[0], torch.float32) is None  # q/k/v ranks differ
    from grpo.model.lora_addmm import LinearInInputDtype

    layer = lora.base_model.model.model.layers[0]
    layer.self_attn.q_proj.lora_A["default"].__class__ = LinearInInputDtype  # --lora-compute base: same product
    assert layer_projections(layer, torch.float32) is not None

    class ScaledA(torch.nn.Linear):  # an adapter layer with its own forward: the kernels cannot stand in
        def forward(self, x):
            return 2 * super().forward(x)

    layer.self_attn.q_proj.lora_A["default"].__class__ = ScaledA
    assert layer_projections(layer, torch.float32) is None

    from test_native_engine import small_qwen2

    qwen = small_qwen2(seed=0)  # q/k/v with biases: the kernels add them (the module's own tensors)
    attn = qwen.model.layers[0].self_attn
    plan = layer_projections(qwen.model.layers[0], torch.float32)
    assert plan is not None and plan.q.bias is attn.q_proj.bias and plan.v.bias is attn.v_proj.bias
    assert plan.o.bias is None and plan.gate.bias is None
    attn.k_proj.bias = None  # biases on some of q/k/v only: one launch cannot mix them
    assert layer_projections(qwen.model.layers[0], torch.float32) is None


def test_engine_warns_once_when_layers_fall_back_to_their_modules(monkeypatch):
    from peft import LoraConfig, get_peft_model

    from grpo.rollout.base import Sampling
    from grpo.rollout.native import NativeEngine
    from test_native_engine import PAD, PROMPTS, small_llama

    monkeypatch.setattr(dg, "can_run", lambda device: True)  # plans only: no kernel runs with gemm="kernels" here
    monkeypatch.setattr("grpo.rollout.native.layer.KernelLayer", None)  # ...and none would be built
    partial = get_peft_model(small_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj"]))  # q/k/v ranks differ
    engine = NativeEngine(partial, max_seq_len=16, max_batch=3, pad_id=PAD, gemm="kernels")
    with pytest.warns(UserWarning, match="cover 0 of 2 layers"):
        engine.generate(PROMPTS, 1, Sampling(max_new_tokens=2, temperature=0.0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(PROMPTS, 1, Sampling(max_new_tokens=2, temperature=0.0))  # said once


def test_engine_gemm_choice_on_cpu():
    from grpo.rollout import build_engine
    from test_native_engine import PAD, small_llama

    model = small_llama(seed=0)
    assert build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=2).gemm == "modules"  # auto on CPU
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="gemm='kernels' needs triton and a CUDA model"):
            build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=2, gemm="kernels")
    with pytest.raises(ValueError, match="gemm='fast'"):
        build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=2, gemm="fast")


def test_engine_attention_choice_reaches_the_engine():
    from grpo.rollout import build_engine
    from test_native_engine import PAD, small_llama

    model = small_llama(seed=0)
    for choice, used in (("auto", "sdpa"), ("sdpa", "sdpa")):  # auto on a CPU model at any rows: sdpa
        engine = build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=64, attention=choice)
        assert engine.tuning.attention == used
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter runs the kernel on the CPU
        engine = build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=2, attention="kernel")
        assert engine.tuning.attention == "kernel"
    else:
        with pytest.raises(ValueError, match="attention='kernel' needs triton and a CUDA model"):
            build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=2, attention="kernel")
    with pytest.raises(ValueError, match="attention='flash'"):
        build_engine("native", model, pad_id=PAD, max_seq_len=16, max_batch=2, attention="flash")


def test_auto_attention_takes_the_kernel_on_cuda_from_16_rows_and_sdpa_elsewhere(monkeypatch):
    from grpo.kernels import decode_attention
    from grpo.rollout.native import EngineTuning
    from grpo.rollout.native.tuning import KERNEL_ATTENTION_ROWS, auto_attention

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(decode_attention, "can_run", lambda device: True)  # triton there, as on a GPU machine
    assert KERNEL_ATTENTION_ROWS == 16  # the fewest rows where the kernel was measured faster (the bench step's)
    assert [auto_attention(cuda, rows) for rows in (1, 15, 16, 64, 256)] == ["sdpa"] * 2 + ["kernel"] * 3
    assert EngineTuning().attention == "auto"  # the product's, made concrete by the engine's rows
    assert [EngineTuning().resolved(cuda, True, rows).attention for rows in (8, 16)] == ["sdpa", "kernel"]
    assert EngineTuning(attention="sdpa").resolved(cuda, True, 64).attention == "sdpa"  # a choice stays
    assert auto_attention(cpu, 64) == "sdpa"  # not the interpreter, even where it could run
    monkeypatch.setattr(decode_attention, "can_run", lambda device: False)  # no triton
    assert auto_attention(cuda, 64) == "sdpa"


def test_launches_read_the_devices_table_at_their_rows_and_a_tuning_choice_at_every_row_count(monkeypatch):
    key, only_wide = ("gated", 16384, 2048, False), ("proj", 1536, 1536, False)
    narrow, wide, mine = dg.TileConfig(32, 256, 4, 4), dg.TileConfig(32, 128, 4, 4), dg.TileConfig(16, 128, 4, 2)
    table = DeviceTable("sm90-132sm", 132, {16: {key: narrow}, 64: {key: wide, only_wide: narrow}})
    asked = []
    monkeypatch.setattr(dg, "device_table", lambda device: asked.append(device) or table)
    gpu = torch.device("cuda", 1)
    assert [dg.tile_config(key, rows, gpu) for rows in (1, 16, 32)] == [narrow] * 3  # row tiles of 16 and 32
    assert [dg.tile_config(key, rows, gpu) for rows in (33, 64)] == [wide] * 2
    assert dg.tile_config(only_wide, 16, gpu) == narrow  # swept at 64 rows only: read at every row count
    assert set(asked) == {gpu}
    with dg.tuning(tiles={key: mine}):
        assert dg.tile_config(key, 16, gpu) == dg.tile_config(key, 64, gpu) == mine


def test_tuning_block_sets_tiles_and_unpacking_and_leaving_it_restores_them():
    cpu = torch.device("cpu")
    key, tuned = ("proj", 2048, 8192, True), dg.tile_config(("proj", 2048, 8192, True), 16, cpu)
    mine, inner = dg.TileConfig(16, 128, 4, 2), dg.TileConfig(32, 128, 8, 2)
    with dg.tuning(unpack="convert", tiles={key: mine}) as outer:
        assert outer.unpack == "convert" and dg.tile_config(key, 16, cpu) == mine
        with dg.tuning(tiles={("gated", 64, 64, False): inner}) as nested:  # adds to the outer block's choices
            assert nested.unpack == "convert" and dg.tile_config(key, 16, cpu) == mine
            assert dg.tile_config(("gated", 64, 64, False), 16, cpu) == inner
        assert dg.tile_config(("gated", 64, 64, False), 16, cpu) != inner
    assert dg.tile_config(key, 16, cpu) == tuned != mine
    with pytest.raises(ValueError, match="unpack='fast'"):
        with dg.tuning(unpack="fast"):
            pass


def test_a_tile_choice_the_kernels_cannot_launch_is_refused_naming_the_rule():
    cpu = torch.device("cpu")
    with dg.tuning(tiles={("gated", 64, 64, False): dg.TileConfig(32, 128, 4, 2, split_k=2)}):
        with pytest.raises(ValueError, match="only projections take it"):
            dg.tile_config(("gated", 64, 64, False), 16, cpu)
    with dg.tuning(tiles={("proj", 64, 64, False): dg.TileConfig(24, 128, 4, 2)}):
        with pytest.raises(ValueError, match="powers of 2"):
            dg.tile_config(("proj", 64, 64, False), 16, cpu)


def test_smaller_tiles_drop_stages_then_halve_the_k_step_down_to_one_fp8_block():
    cfg, seen = dg.TileConfig(16, 512, 4, 4), []
    while cfg is not None:
        seen.append((cfg.block_k, cfg.stages))
        assert cfg.block_n == 16 and cfg.num_warps == 4
        cfg = dg.smaller_tiles(cfg)
    assert seen == [(512, 4), (512, 3), (512, 2), (256, 2), (128, 2)]


def test_engine_calls_the_fp8_modules_past_the_kernel_row_limit(monkeypatch):
    # FP8 weights: the packed layers do not take them, so a wider step calls the modules
    from grpo.kernels.fp8 import quantize_linears_
    from grpo.rollout.base import Sampling
    from grpo.rollout.native import EngineTuning, NativeEngine
    from grpo.rollout.native.plan import layer_projections
    from test_native_engine import PAD, PROMPTS, small_llama

    monkeypatch.setattr(dg, "can_run", lambda device: True)  # plans only: no kernel may run here...
    monkeypatch.setattr("grpo.rollout.native.layer.KernelLayer", None)  # ...and none would be built
    model = small_llama(seed=0)
    quantize_linears_(model)
    assert all(layer_projections(layer, torch.float32) is not None for layer in model.model.layers)
    engine = NativeEngine(model, max_seq_len=16, max_batch=3, pad_id=PAD, gemm="kernels",
                          tuning=EngineTuning(kernel_rows=2))  # the limit below the rows
    out = engine.generate(PROMPTS[:1], 3, Sampling(max_new_tokens=2, temperature=0.0))  # 3 rows
    assert out.completion_ids.shape[0] == 3
    assert engine._projections == [None] * len(model.model.layers)
