"""grpo.model.lean_activations: the same values and gradients as transformers' modules, bit for bit, and fewer
bytes saved for backward."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from grpo.model import lean_activations
from grpo.model.lean_activations import RMSNormFn, SiluMul


def gradients(fn, inputs, grad):
    """fn(*inputs) and the gradients of (fn * grad).sum() for the inputs that require grad (None for the others)."""
    out = fn(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, grad))
    return out.detach(), [next(got) if t.requires_grad else None for t in inputs]


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])  # gate's, up's
@pytest.mark.parametrize("wanted", [(True, True), (True, False), (False, True)])  # which of gate, up need grads
@pytest.mark.parametrize("consume", [False, True])  # True: the gradients made in gate's and up's buffers
def test_silu_mul_gives_eagers_values_and_gradients_bit_for_bit(dtypes, wanted, consume):
    torch.manual_seed(0)
    gate, up = (torch.randn(48, 200, dtype=d, requires_grad=w) for d, w in zip(dtypes, wanted))
    grad = torch.randn(48, 200, dtype=torch.promote_types(*dtypes))
    eager, eager_grads = gradients(lambda g, u: F.silu(g) * u, (gate, up), grad)
    kept = gate.detach().clone(), up.detach().clone()
    lean, lean_grads = gradients(lambda g, u: SiluMul.apply(g, u, consume), (gate, up), grad)
    assert torch.equal(lean, eager) and all(same(a, b) for a, b in zip(lean_grads, eager_grads))
    if not consume:  # the caller's tensors as they were
        assert torch.equal(gate, kept[0]) and torch.equal(up, kept[1])


@pytest.mark.parametrize("fp8", [False, True])  # FP8Linear projections (on the CPU: dequantized for each product)
def test_an_mlps_backward_makes_no_tensor_of_the_intermediate_size_but_down_projs_two_input_gradients(fp8):
    # eager: those two, their sum (autograd gets them as views of the 3-D input's products and adds them anew),
    # SiLU's two products and its backward; the lean MLP adds them in place and makes its gradients in gate's
    # and up's buffers
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from grpo.model.load import compute_adapters_in_base_dtype

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=128, intermediate_size=384)).to(torch.bfloat16).requires_grad_(False)
    if fp8:
        from grpo.kernels.fp8 import quantize_linears_
        quantize_linears_(mlp)
    peft = get_peft_model(torch.nn.ModuleDict({"mlp": mlp}),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]))
    compute_adapters_in_base_dtype(peft)  # --lora-compute base, the default
    mlp = peft.base_model.model["mlp"]
    intermediate = 2 * 24 * 384 * 2  # bytes

    def made_in_backward():
        y = mlp(torch.randn(2, 24, 128, dtype=torch.bfloat16, requires_grad=True))
        grad = torch.randn_like(y)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y.backward(grad)
        return sorted(e.name for e in prof.events()
                      if e.name.startswith("aten::") and e.self_cpu_memory_usage == intermediate)

    assert len(made_in_backward()) == 6
    lean_activations.install(mlp)
    assert made_in_backward() == ["aten::mm", "aten::mm"]


@pytest.mark.parametrize("dtype,weight_dtype,wanted", [  # wanted: whether x and the weight need grads
    (torch.float32, torch.float32, (True, True)), (torch.bfloat16, torch.bfloat16, (True, True)),
    (torch.bfloat16, torch.bfloat16, (True, False)),  # the trainer's: a frozen weight
    (torch.bfloat16, torch.bfloat16, (False, True)),
    (torch.bfloat16, torch.float32, (True, True))])  # a float32 weight on bf16 activations
def test_rms_norm_gives_the_modules_values_and_gradients_bit_for_bit(dtype, weight_dtype, wanted):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(1)
    norm = LlamaRMSNorm(96, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        norm.weight.normal_()
    norm.weight.requires_grad_(wanted[1])
    x = (torch.randn(3, 40, 96) * 4).to(dtype).requires_grad_(wanted[0])
    grad = torch.randn(3, 40, 96, dtype=torch.promote_types(dtype, weight_dtype))
    eager, eager_grads = gradients(lambda x, w: norm(x), (x, norm.weight), grad)
    lean, lean_grads = gradients(lambda x, w: RMSNormFn.apply(x, w, norm.variance_epsilon), (x, norm.weight), grad)
    assert torch.equal(lean, eager) and all(same(a, b) for a, b in zip(lean_grads, eager_grads))


def lora(model):
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS

    model.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS),
                                            init_lora_weights=False))


def decoder(family: str):
    from test_native_engine import small_decoder, small_llama, small_qwen2

    return {"llama": small_llama, "qwen2": small_qwen2}.get(family, lambda seed: small_decoder(family, seed))(seed=2)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_training_pass_through_the_lean_modules_gives_the_same_loss_and_adapter_gradients(family, checkpointing):
    model = decoder(family).to(torch.bfloat16)
    policy = lora(model)
    models = [policy, copy.deepcopy(policy)]  # the same adapters
    n_layers = len(model.model.layers)
    qk_norms = 2 * n_layers if family == "qwen3" else 0  # Qwen3's q and k norms are RMSNorms too
    assert lean_activations.install(models[1]) == 3 * n_layers + 1 + qk_norms  # MLP and 2 norms a layer, the final
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for policy in models:
        if checkpointing:
            policy.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.train()
        loss = policy(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1) and grads0.keys() == grads1.keys() and len(grads0) == 7 * n_layers * 2
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)



def test_without_autograd_the_modules_run_their_own_forward(monkeypatch):
    # generation, evaluation and the reference's pass: transformers' forward, the lean functions never called
    policy = lora(decoder("llama").to(torch.bfloat16))
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
    assert lean_activations.install(policy) > 0

    def refuse(*args):
        raise AssertionError("a lean function ran without autograd")

    monkeypatch.setattr(SiluMul, "apply", refuse)
    monkeypatch.setattr(RMSNormFn, "apply", refuse)
    with torch.no_grad():
        assert torch.equal(policy(input_ids=ids).logits, expected)
    with torch.inference_mode():
        assert torch.equal(policy(input_ids=ids).logits, expected)
    with pytest.raises(AssertionError, match="without autograd"):  # (and with it, they run)
        policy(input_ids=ids)


def test_a_llama_layer_saves_less_for_backward_by_silus_output_and_the_norms_float32_copies():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=100)
    cfg._attn_implementation = "sdpa"
    tokens, hidden = 32, 64
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16).requires_grad_(False)
    layer = lora(torch.nn.ModuleDict({"layer": layer})).base_model.model["layer"]
    rope = LlamaRotaryEmbedding(cfg)

    def saved(module) -> int:
        x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(tokens)[None]
        held = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in held:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x, position_embeddings=rope(x, pos), attention_mask=None, position_ids=pos)
        return sum(seen.values())

    eager = saved(layer)
    lean_activations.install(layer)
    lean = saved(layer)
    # SiLU's output (bf16, intermediate), the first norm's float32 copy (its input is the layer's, held
    # anyway), the second's float32 copy for its bf16 input (both save the rstd, as eager's product does)
    expected = tokens * 256 * 2 + tokens * hidden * 4 + tokens * hidden * (4 - 2)
    assert eager - lean == expected


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs the kernel")
def test_without_a_kernel_to_run_the_silu_product_is_eagers_and_the_kernel_says_what_it_lacks():
    from grpo.kernels import silu_mul

    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    assert not silu_mul.kernel_runs(gate, up)  # the CPU without the interpreter: SiluMul in the lean MLP
    with pytest.raises(ValueError, match=r"no kernel for gate \(4, 6\) .* use silu_mul_ref"):
        silu_mul.silu_mul(gate, up)


def test_the_silu_kernel_takes_contiguous_tensors_of_one_shape_and_dtype(monkeypatch):
    from grpo.kernels import silu_mul

    monkeypatch.setattr(silu_mul, "can_run", lambda device: True)
    gate = torch.randn(4, 6)
    assert silu_mul.kernel_runs(gate, torch.randn(4, 6))
    assert not silu_mul.kernel_runs(gate, torch.randn(4, 6).half())
    assert not silu_mul.kernel_runs(gate, torch.randn(6, 4).t())
    assert not silu_mul.kernel_runs(gate, torch.randn(4, 7))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bf16_the_silu_kernels_are_as_close_to_float32_as_eagers_ops():
    from grpo.kernels import silu_mul

    torch.manual_seed(0)
    gate32, up32, grad32 = (torch.randn(333, 8192, device="cuda") * 3 for _ in range(3))
    truth = silu_mul.silu_mul_ref(gate32.requires_grad_(), up32.requires_grad_())
    truth_grads = torch.autograd.grad(truth, [gate32, up32], grad32)
    errors = {}
    for name, fn in (("eager", lambda g, u: SiluMul.apply(g, u, True)), ("kernel", silu_mul.silu_mul)):
        gate, up = (t.detach().bfloat16().requires_grad_() for t in (gate32, up32))
        y = fn(gate, up)
        grads = torch.autograd.grad(y, [gate, up], grad32.bfloat16())
        errors[name] = [float((a.float() - b).norm() / b.norm()) for a, b in zip((y, *grads), (truth, *truth_grads))]
    assert all(k < 1.2 * e + 1e-4 and k < 1e-2 for k, e in zip(errors["kernel"], errors["eager"])), errors
