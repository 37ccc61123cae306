"""grpo.model.compiled_layers: the decoder layer written out gives transformers' layers' values and gradients, its
compiled graph gives the function's without breaking or recompiling for new widths, and the installed layers take
it only where it reproduces the module and autograd records."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import FAMILY_DIMS as DIMS
from conftest import tiny_family_model
from grpo.model import compiled_layers, lora_addmm
from grpo.model.compiled_layers import decoder_layer, layer_shape, layer_weights
from grpo.model.load import adapters_off, compute_adapters_in_base_dtype

# The compiling tests share one worker and one model shape: aot_eager compiles the layer once for all of them
COMPILED = pytest.mark.xdist_group("compiled_layers")


def tiny_model(family: str, dtype=torch.float32, lora_dropout: float = 0.0):
    """A random two-layer model of `family` with the trainer's rsLoRA on the 7 projections, B non-zero (as after
    some training): Qwen2's q/k/v have biases, Qwen3's heads their norms."""
    model = tiny_family_model(family).to(dtype).requires_grad_(False)
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, use_rslora=True, lora_dropout=lora_dropout,
                                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]))
    compute_adapters_in_base_dtype(policy)  # --lora-compute base, the default
    lora_addmm.install(policy)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


def rotary(model, B: int, T: int, dtype):
    base = model.get_base_model().model
    h = torch.randn(B, T, DIMS["hidden_size"], dtype=dtype, requires_grad=True)
    return h, base.rotary_emb(h, torch.arange(T)[None])


def adapter_params(layer) -> list[torch.Tensor]:
    return [p for name, p in layer.named_parameters() if "lora_" in name]


def value_and_grads(fn, layer, h, grad):
    params = adapter_params(layer)
    out = fn(h)
    got = torch.autograd.grad(out, [h, *params], grad)
    return out.detach(), got


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_the_written_out_layer_gives_the_modules_values_and_gradients(family, dtype, tol):
    model = tiny_model(family, dtype)
    layer = model.get_base_model().model.layers[1]
    h, (cos, sin) = rotary(model, 3, 11, dtype)
    grad = torch.randn(3, 11, DIMS["hidden_size"], dtype=dtype)
    want, want_grads = value_and_grads(lambda x: layer(x, position_embeddings=(cos, sin)), layer, h, grad)
    weights = layer_weights(layer)
    assert weights is not None and (weights.q_norm is not None) == (family == "qwen3")
    got, got_grads = value_and_grads(lambda x: decoder_layer(x, cos, sin, weights, layer_shape(layer)), layer, h,
                                     grad)
    scale = want.abs().max()
    assert (got - want).abs().max() <= tol * scale
    for g, w in zip(got_grads, want_grads, strict=True):  # h's, then every adapter matrix's (float32)
        assert g.dtype == w.dtype and (g - w).abs().max() <= tol * w.abs().max()


@COMPILED
def test_the_compiled_layer_gives_the_functions_values_for_new_widths_without_compiling_again():
    model = tiny_model("qwen2")
    layer = model.get_base_model().model.layers[0]
    shape, weights = layer_shape(layer), layer_weights(layer)
    fn = compiled_layers.compiled(shape, "aot_eager")
    for i, (B, T) in enumerate([(2, 7), (3, 13), (2, 7)]):
        h, (cos, sin) = rotary(model, B, T, torch.float32)
        grad = torch.randn(B, T, DIMS["hidden_size"])
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got, got_grads = value_and_grads(lambda x: fn(x, cos, sin, weights), layer, h, grad)
        want, want_grads = value_and_grads(lambda x: decoder_layer(x, cos, sin, weights, shape), layer, h, grad)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@COMPILED
def test_installed_layers_take_the_compiled_function_only_where_it_reproduces_a_training_pass(monkeypatch):
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    assert compiled_layers.width_multiple(model) == 1
    assert compiled_layers.install(model.get_base_model(), backend="aot_eager") == DIMS["num_hidden_layers"]
    assert compiled_layers.width_multiple(model) == compiled_layers.WIDTH_MULTIPLE  # inductor's aligned widths
    calls = []
    real = compiled_layers.compiled
    monkeypatch.setattr(compiled_layers, "compiled", lambda *a: (calls.append(a), real(*a))[1])
    ids = torch.randint(1, DIMS["vocab_size"], (2, 9))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0

    def passes(m, **kwargs):
        calls.clear()
        kwargs = {"use_cache": False, **kwargs}
        return m.get_base_model().model(input_ids=ids, **kwargs).last_hidden_state, len(calls)

    with torch._dynamo.config.patch(error_on_recompile=True):  # the first layer's input given a gradient: one graph
        out, n = passes(model)
    assert n == DIMS["num_hidden_layers"]  # grad enabled, causal rows, adapters on: every layer compiled
    torch.testing.assert_close(out, passes(reference)[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the reference and evaluation passes
        assert passes(model)[1] == 0
    with adapters_off(model):  # adapters off: the base model's values, from the modules
        out, n = passes(model)
        assert n == 0
        with adapters_off(reference):
            assert torch.equal(out, passes(reference)[0])
    assert passes(model, attention_mask=mask)[1] == 0  # a padding mask: the modules'
    assert passes(model, use_cache=True)[1] == 0  # a cache: the modules'


@COMPILED
def test_under_gradient_checkpointing_the_layers_keep_their_inputs_alone_and_give_the_same_gradients():
    # transformers' checkpointing wraps the class's forward, which the compiled one replaces on the layer: a
    # checkpointed layer takes the module's, so the forward keeps each layer's input, and none of its activations
    model = tiny_model("qwen2")
    compiled_layers.install(model.get_base_model(), backend="aot_eager")
    ids = torch.randint(1, DIMS["vocab_size"], (2, 9))
    params = [p for p in model.parameters() if p.requires_grad]
    held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def grads_and_saved():
        model.train()
        saved = []  # the shapes of what autograd keeps for backward, the model's own weights left out

        def pack(t):
            if t.untyped_storage().data_ptr() not in held:
                saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
        return torch.autograd.grad(out.square().sum(), params), saved

    plain, kept = grads_and_saved()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, kept_checkpointed = grads_and_saved()
    for g, w in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    hidden = (2, 9, DIMS["hidden_size"])
    assert any(DIMS["intermediate_size"] in shape for shape in kept)  # without checkpointing: the MLP's too
    layer_inputs = [shape for shape in kept_checkpointed if shape == hidden]
    # each layer's input, and the final norm's input and output (the norm is outside the layers)
    assert len(layer_inputs) == DIMS["num_hidden_layers"] + 2, kept_checkpointed
    assert not any(DIMS["intermediate_size"] in shape for shape in kept_checkpointed), kept_checkpointed


def test_a_compile_that_fails_is_one_line_naming_the_flag_that_turns_it_off(monkeypatch):
    model = tiny_model("qwen2")
    compiled_layers.install(model.get_base_model(), backend="aot_eager")

    def failing(*_):
        def call(*_):
            raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, RuntimeError("no Triton for this GPU"), None)
        return call

    monkeypatch.setattr(compiled_layers, "compiled", failing)
    with pytest.raises(RuntimeError, match=r"\(RuntimeError: no Triton for this GPU\); run with --compile-layers off"):
        model.get_base_model().model(input_ids=torch.randint(1, DIMS["vocab_size"], (2, 9)), use_cache=False)


def test_layers_it_does_not_reproduce_keep_their_modules():
    from grpo.kernels.fp8 import quantize_linears_

    fp8 = tiny_model("llama", torch.bfloat16)
    quantize_linears_(fp8.get_base_model().model.layers[0])
    layers = fp8.get_base_model().model.layers
    assert "nn.Linear" in compiled_layers.refusal(layers[0]) and compiled_layers.refusal(layers[1]) is None
    assert compiled_layers.install(fp8.get_base_model()) == 1
    assert "forward" not in vars(layers[0]) and "forward" in vars(layers[1])

    with_dropout = tiny_model("llama", lora_dropout=0.1)
    assert "dropout" in compiled_layers.refusal(with_dropout.get_base_model().model.layers[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_compiled_layers_are_as_close_to_float32_as_the_modules():
    # inductor's kernels in bf16: the hidden states and the adapters' gradients no further from a float32 pass than
    # the modules' own bf16 pass is (the trainer's modules: lean activations and the norm kernel)
    from grpo.model import lean_activations

    truth_model = tiny_model("qwen2").cuda()
    ids = torch.randint(1, DIMS["vocab_size"], (3, 37), device="cuda")
    weight = torch.randn(3, 37, DIMS["hidden_size"], device="cuda")

    def pass_(model):
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()
        out = model.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
        return [out.float(), *torch.autograd.grad((out.float() * weight).sum(), params)]

    truth = pass_(truth_model)
    errors = {}
    for name in ("modules", "compiled"):
        model = copy.deepcopy(truth_model).to(torch.bfloat16)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # the adapters stay float32, as the trainer keeps them
        lean_activations.install(model.get_base_model())
        if name == "compiled":
            assert compiled_layers.install(model.get_base_model()) == DIMS["num_hidden_layers"]
        got = pass_(model)
        errors[name] = max(float((g - t).norm() / t.norm()) for g, t in zip(got, truth, strict=True))
    assert errors["compiled"] < 1.5 * errors["modules"] + 1e-3, errors
