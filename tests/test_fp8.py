"""grpo.kernels.fp8: block quantization, FP8Linear's autograd, peft LoRA on top; and FP8-Block
checkpoints (grpo.model.fp8_checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from torch import nn

from grpo.config import LORA_TARGETS
from grpo.model.fp8_checkpoint import is_fp8_checkpoint, load_fp8_block_model, save_fp8_block_checkpoint
from grpo.kernels.fp8 import (
    FP8_DTYPE,
    FP8Linear,
    dequantize_fp8_block,
    fp8_linear,
    quantize_fp8_block,
    quantize_fp8_rows,
    quantize_fp8_rows_ref,
    quantize_linears_,
    transpose_fp8,
)

TARGETS = list(LORA_TARGETS)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def block_scales_64(w: torch.Tensor) -> torch.Tensor:
    """float64 reference of the block scales: amax of each 128x128 block over 448."""
    n, k = w.shape
    out = torch.empty((n + 127) // 128, (k + 127) // 128, dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].double().abs().max() / 448
    return out


# --- quantize / dequantize ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 129), (130, 1)])
def test_quantize_block_scales_match_block_amax_and_round_trip_is_bounded(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.rand(*shape).pow(4) * 3  # a heavy-ish tail, per-block amax varies
    w_fp8, scale_inv = quantize_fp8_block(w)
    assert w_fp8.dtype == FP8_DTYPE and w_fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
    torch.testing.assert_close(scale_inv.double(), block_scales_64(w), rtol=1e-6, atol=0)
    back = dequantize_fp8_block(w_fp8, scale_inv, torch.float32).double()
    scale = scale_inv.double().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # E4M3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing is 2^-9 of the scale
    bound = w.double().abs() * 2**-4 + scale * 2**-10
    assert ((back - w.double()).abs() <= bound * (1 + 1e-6)).all()
    assert rel(back, w) < 0.04
    # the largest element of each block is coded exactly as +-448
    assert w_fp8.float().abs().max() == 448


def test_quantize_keeps_zero_blocks_zero_and_finite():
    w = torch.zeros(256, 256)
    w[:128, :128] = torch.randn(128, 128)
    w_fp8, scale_inv = quantize_fp8_block(w)
    back = dequantize_fp8_block(w_fp8, scale_inv, torch.float32)
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    assert (back[128:] == 0).all() and (back[:, 128:] == 0).all()


def test_dequantize_rounds_once_to_bf16():
    torch.manual_seed(1)
    w_fp8, scale_inv = quantize_fp8_block(torch.randn(256, 128))
    exact = dequantize_fp8_block(w_fp8, scale_inv, torch.float32)
    assert torch.equal(dequantize_fp8_block(w_fp8, scale_inv, torch.bfloat16), exact.to(torch.bfloat16))


def test_dequantize_rejects_scales_of_the_wrong_shape():
    w_fp8, scale_inv = quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        dequantize_fp8_block(w_fp8, scale_inv[:1])


def test_row_quantization_groups_of_128_round_trip():
    torch.manual_seed(2)
    x = torch.randn(7, 384) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(128)  # groups of very different range
    x[3] = 0  # an all-zero (padding) row stays zero and finite
    codes, scale = quantize_fp8_rows_ref(x)
    assert scale.shape == (7, 3) and scale.stride() == (1, 7)  # column-major, as _scaled_mm wants
    back = codes.float().view(7, 3, 128) * scale[..., None]
    back = back.view(7, 384)
    assert torch.isfinite(back).all() and (back[3] == 0).all()
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale.repeat_interleave(128, 1) * 2**-10 + 1e-30).all()


def test_row_quantization_pads_rows_with_zero_codes():
    x = torch.randn(5, 256)
    codes, scale = quantize_fp8_rows_ref(x, pad_rows_to=16)
    assert codes.shape == (16, 256) and scale.shape == (16, 2) and scale.stride() == (1, 16)
    assert (codes[5:].float() == 0).all() and torch.equal(codes[:5].view(torch.uint8),
                                                          quantize_fp8_rows_ref(x)[0].view(torch.uint8))


# --- FP8Linear ---------------------------------------------------------------------------------------


def test_fp8linear_is_a_frozen_nn_linear_that_keeps_its_format():
    lin = nn.Linear(200, 300, bias=True)
    fp8 = FP8Linear.from_linear(lin)
    assert isinstance(fp8, nn.Linear)
    assert (fp8.in_features, fp8.out_features) == (200, 300)
    assert fp8.weight.dtype == FP8_DTYPE and not fp8.weight.requires_grad and not fp8.bias.requires_grad
    keys = list(fp8.state_dict())
    assert sorted(keys) == ["bias", "weight", "weight_scale_inv"]
    fp8.to(torch.bfloat16)  # a dtype cast must not touch the codes or the fp32 scales
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale_inv.dtype == torch.float32
    assert fp8.compute_dtype == torch.bfloat16 and fp8.bias.dtype == torch.bfloat16
    assert list(fp8.state_dict()) == keys


@pytest.mark.parametrize("gemm", ["auto", "dense"])  # on the CPU auto is dequant: the weight dequantized per product
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("in_f,out_f,lead", [(200, 300, (3, 5)), (128, 256, (1,)), (64, 130, (4,))])
def test_fp8linear_forward_and_input_gradient_match_the_dequantized_float64_linear(dtype, tol, in_f, out_f, lead,
                                                                                   gemm):
    torch.manual_seed(3)
    fp8 = FP8Linear.from_linear(nn.Linear(in_f, out_f)).to(dtype)
    fp8.gemm = gemm
    x = torch.randn(*lead, in_f, dtype=dtype, requires_grad=True)
    y = fp8(x)
    assert y.dtype == dtype and y.shape == (*lead, out_f)
    w64 = fp8.dequantized_weight(torch.float64)
    x64 = x.detach().double().requires_grad_()
    y64 = x64 @ w64.t() + fp8.bias.double()
    assert rel(y, y64) < tol
    g = torch.randn_like(y64)
    (y * g.to(dtype)).sum().backward()
    (y64 * g).sum().backward()
    assert rel(x.grad, x64.grad) < tol
    assert fp8.weight.grad is None and fp8.weight_scale_inv.grad is None


def test_dense_gemm_backward_is_torch_s_own_node_and_gives_the_dequant_function_s_values():
    torch.manual_seed(13)
    fp8 = FP8Linear.from_linear(nn.Linear(256, 384))
    x = torch.randn(2, 7, 256, requires_grad=True)
    g = torch.randn(2, 7, 384)
    out = {}
    for gemm in ("dequant", "dense"):
        fp8.gemm = gemm
        y = fp8(x)
        # dense: no Python autograd.Function in the graph, so none runs in the backward
        python_nodes = []
        stack = [y.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None:
                python_nodes += [node] if isinstance(node, torch.autograd.function.BackwardCFunction) else []
                stack += [next_fn for next_fn, _ in node.next_functions]
        assert bool(python_nodes) == (gemm == "dequant")
        (grad_x,) = torch.autograd.grad(y, x, g)
        out[gemm] = (y.detach(), grad_x)
    for a, b in zip(out["dense"], out["dequant"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_dequantizing_kernel_is_what_runs_where_triton_does_and_the_reference_elsewhere():
    codes, scale = quantize_fp8_block(torch.randn(130, 260))
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8_block(codes, scale[:1])
    ref = dequantize_fp8_block(codes, scale, torch.float32, impl="ref")
    assert torch.equal(dequantize_fp8_block(codes, scale, torch.float32), ref)  # auto on the CPU: the reference
    assert ref[0, 0] == codes[0, 0].float() * scale[0, 0] and ref[129, 259] == codes[129, 259].float() * scale[1, 2]


def test_fp8linear_output_is_close_to_the_original_bf16_linear():
    torch.manual_seed(4)
    lin = nn.Linear(512, 256, bias=False)
    x = torch.randn(64, 512)
    assert rel(FP8Linear.from_linear(lin)(x), lin(x)) < 0.04  # only the weight quantization error


def test_fp8_linear_rejects_a_wrong_feature_count():
    fp8 = FP8Linear.from_linear(nn.Linear(128, 128))
    with pytest.raises(ValueError, match="features"):
        fp8(torch.randn(2, 127))


def test_quantize_linears_replaces_only_the_targets_and_leaves_head_and_embeddings():
    model = tiny_llama(seed=0)
    ids = torch.randint(0, 128256, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    n = quantize_linears_(model, TARGETS)
    assert n == 7 * 2
    assert all(isinstance(model.get_submodule(f"model.layers.{i}.self_attn.{t}"), FP8Linear)
               for i in range(2) for t in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is head is embed
    assert quantize_linears_(model, TARGETS) == 0  # already FP8
    with torch.no_grad():
        out = model(ids).logits
    assert rel(out, ref) < 0.05


def test_quantize_linears_with_no_names_quantizes_every_linear_but_the_untied_head():
    model = tiny_llama(seed=0, tie=False)
    assert quantize_linears_(model) == 7 * 2
    assert type(model.lm_head) is nn.Linear


# --- peft LoRA on FP8Linear ---------------------------------------------------------------------------


def _lora(model, r=8):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=16, use_rslora=True, target_modules=TARGETS,
                                            lora_dropout=0.0))


def _train_lora(model, ids, steps=3):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_rslora_trains_on_fp8_linears_and_disable_adapter_gives_the_base():
    model = tiny_llama(seed=5)
    quantize_linears_(model, TARGETS)
    codes_before = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    model = _lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    ids = torch.randint(0, 128256, (2, 12))
    with torch.no_grad():
        base = model(ids).logits
    losses = _train_lora(model, ids, steps=4)
    assert losses[-1] < losses[0]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        adapted = model(ids).logits
        with model.disable_adapter():
            disabled = model(ids).logits
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(disabled, base, rtol=0, atol=1e-6)
    for n, m in model.named_modules():
        if isinstance(m, FP8Linear):
            name = n.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(m.weight.view(torch.uint8), codes_before[name].view(torch.uint8))


@pytest.mark.parametrize("choice,checkpointing,expected", [("auto", True, "dense"), ("auto", False, "auto"),
                                                            ("dense", False, "dense"), ("fp8", True, "auto")])
def test_fp8_gemm_flag_sets_every_fp8_layer_and_auto_is_dense_only_where_layers_are_recomputed(choice, checkpointing,
                                                                                                expected):
    from grpo.config import Config
    from grpo.model.load import add_lora

    model = tiny_llama(seed=6)
    quantize_linears_(model, TARGETS)
    policy = add_lora(model, Config(fp8_gemm=choice, gradient_checkpointing=checkpointing))
    layers = [m for m in policy.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 2 * 7 and {m.gemm for m in layers} == {expected}  # FP8Linear's auto: its FP8 GEMMs


def test_lora_adapters_get_the_same_dtype_as_on_a_bf16_base_never_float8():
    plain = _lora(tiny_llama(seed=6).to(torch.bfloat16))
    model = tiny_llama(seed=6).to(torch.bfloat16)
    quantize_linears_(model, TARGETS)
    model = _lora(model)
    dtypes = {n: p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {n: p.dtype for n, p in plain.named_parameters() if "lora_" in n}
    assert FP8_DTYPE not in dtypes.values()
    ids = torch.randint(0, 128256, (1, 5))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


# --- FP8-Block checkpoints ----------------------------------------------------------------------------


def write_fp8_block_checkpoint(model: nn.Module, path, block_size=(128, 128), shards=1) -> dict:
    """Save `model` the way FP8-Block checkpoints are (`save_fp8_block_checkpoint`); another `block_size` is
    only declared in config.json, for the refusal test."""
    codes = save_fp8_block_checkpoint(model, path, TARGETS, shards=shards)
    if tuple(block_size) != (128, 128):
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = list(block_size)
        (path / "config.json").write_text(json.dumps(config))
    return codes


@pytest.mark.parametrize("shards", [1, 2])
def test_fp8_block_checkpoint_loads_with_the_stored_codes_and_matches_quantize_on_load(tmp_path, shards):
    source = tiny_llama(seed=7)
    codes = write_fp8_block_checkpoint(source, tmp_path, shards=shards)
    assert is_fp8_checkpoint(tmp_path)
    model = load_fp8_block_model(tmp_path, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    for name, (w_fp8, scale_inv) in codes.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, FP8Linear)
        assert torch.equal(layer.weight.view(torch.uint8), w_fp8.view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, scale_inv)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    # the same model quantized at load time (dense tensors rounded to bf16, as stored) gives the same logits
    expected = tiny_llama(seed=7)
    quantize_linears_(expected, TARGETS)
    with torch.no_grad():
        for p in expected.parameters():
            if p.dtype == torch.float32 and p.dim() != 2 or p is expected.model.embed_tokens.weight:
                p.copy_(p.to(torch.bfloat16))
    ids = torch.randint(0, 128256, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)
        assert rel(model(ids).logits, source(ids).logits) < 0.05


def test_lora_trains_on_a_loaded_fp8_block_checkpoint(tmp_path):
    write_fp8_block_checkpoint(tiny_llama(seed=8), tmp_path)
    model = _lora(load_fp8_block_model(tmp_path, dtype=torch.float32))
    ids = torch.randint(0, 128256, (2, 10))
    losses = _train_lora(model, ids, steps=3)
    assert losses[-1] < losses[0]


def test_fp8_block_checkpoint_with_other_block_size_is_refused_in_one_line(tmp_path):
    write_fp8_block_checkpoint(tiny_llama(seed=9), tmp_path, block_size=(64, 64))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        load_fp8_block_model(tmp_path)


def test_a_plain_checkpoint_is_not_fp8_block(tmp_path):
    tiny_llama(seed=10).save_pretrained(tmp_path)
    assert not is_fp8_checkpoint(tmp_path)
    assert not is_fp8_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="quant_method is None"):
        load_fp8_block_model(tmp_path)


# --- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@cuda
def test_triton_row_quantization_matches_the_reference_on_cuda():
    torch.manual_seed(11)
    x = (torch.randn(1000, 2048, device="cuda") * 3).to(torch.bfloat16)
    x[7] = 0
    codes, scale = quantize_fp8_rows(x)
    codes_ref, scale_ref = quantize_fp8_rows_ref(x)
    assert scale.stride() == scale_ref.stride() == (1, 1000)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    diff = (codes.float() - codes_ref.float()).abs()
    assert (diff <= codes_ref.float().abs() * 2**-3 + 2**-9).all()  # at most one code step apart
    assert (diff > 0).float().mean() < 1e-3


@pytest.mark.cuda
@cuda
def test_triton_transpose_and_padded_quantization_on_cuda():
    w_fp8, _ = quantize_fp8_block(torch.randn(640, 200, device="cuda"))  # edges not multiples of 64
    assert torch.equal(transpose_fp8(w_fp8).view(torch.uint8), w_fp8.t().contiguous().view(torch.uint8))
    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    codes, scale = quantize_fp8_rows(x, pad_rows_to=16)
    codes_ref, scale_ref = quantize_fp8_rows_ref(x, pad_rows_to=16)
    assert codes.shape == (48, 512) and scale.stride() == (1, 48) and (codes[37:].float() == 0).all()
    torch.testing.assert_close(scale[:37], scale_ref[:37], rtol=1e-6, atol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n,k", [(2048, 2048), (640, 200), (8192, 2048)])  # 640 x 200: partial edge blocks
def test_the_dequantizing_kernel_matches_the_reference_bit_for_bit_on_cuda(n, k):
    codes, scale = quantize_fp8_block(torch.randn(n, k, device="cuda") * 5)
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)):
        kernel = dequantize_fp8_block(codes, scale, dtype)
        assert torch.equal(kernel.view(bits), dequantize_fp8_block(codes, scale, dtype, impl="ref").view(bits))


@pytest.mark.cuda
@cuda
def test_dense_gemm_matches_dequantized_float64_closer_than_scaled_mm_on_cuda():
    torch.manual_seed(14)
    fp8 = FP8Linear.from_linear(nn.Linear(2048, 512, bias=False, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1000, 2048, device="cuda", dtype=torch.bfloat16)
    truth = x.double() @ fp8.dequantized_weight(torch.float64).t()
    errors = {}
    for gemm in ("dense", "scaled_mm"):
        fp8.gemm = gemm
        errors[gemm] = rel(fp8(x), truth)
    assert errors["dense"] < 0.01 and errors["dense"] < errors["scaled_mm"] / 2, errors  # weight-only: X stays bf16


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("m,k,n", [(1, 512, 512), (1000, 2048, 512), (4096, 2048, 8192), (333, 8192, 2048)])
def test_scaled_mm_path_matches_dequantized_float64_on_cuda(m, k, n):
    torch.manual_seed(12)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(lin)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w64 = fp8.dequantized_weight(torch.float64)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for bwd in ("fp8", "dequant"):
        x.grad = None
        y = fp8_linear(x, fp8.weight, fp8.weight_scale_inv, gemm="scaled_mm", bwd=bwd)
        y.backward(g)
        assert rel(y, x.detach().double() @ w64.t()) < 0.05  # X quantized to E4M3 on top of bf16
        assert rel(x.grad, g.double() @ w64) < 0.05
    auto = fp8(x.detach())
    assert torch.equal(auto, fp8_linear(x.detach(), fp8.weight, fp8.weight_scale_inv, gemm="scaled_mm"))
