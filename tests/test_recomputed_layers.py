"""grpo.model.recomputed_layers: a checkpointed training pass through the layers recomputed by hand gives the
trainer's modules' values and gradients, keeps each layer's input alone and holds no more than they do; the
hand-written node takes only the checkpointed training pass of the layers it reproduces, and its forward the
reference pass."""

from __future__ import annotations

import copy

import pytest
import torch
from test_compiled_layers import DIMS, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grpo.model import lean_activations, recomputed_layers
from grpo.model.load import adapters_off


def trainer_modules(family: str, dtype=torch.float32, lora_dropout: float = 0.0, device: str = "cpu",
                    fp8: bool = False):
    """tiny_model with the trainer's lean modules, checkpointed, in training mode."""
    model = tiny_model(family, dtype, lora_dropout, fp8).to(device)
    lean_activations.install(model.get_base_model())
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def calls_to(monkeypatch, name: str = "_backward") -> list:
    """A list that grows by one at each call of recomputed_layers' function `name`."""
    calls = []
    real = getattr(recomputed_layers, name)
    monkeypatch.setattr(recomputed_layers, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def hidden_and_grads(model, ids, **kwargs):
    params = [p for p in model.parameters() if p.requires_grad]
    out = model.get_base_model().model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
    return out.detach(), torch.autograd.grad(out.float().square().sum(), params)


@pytest.mark.parametrize("family,fp8", [("llama", False), ("mistral", False), ("qwen2", False), ("qwen3", False),
                                        ("llama", True), ("qwen2", True)])  # FP8 base layers: their dense weight
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_a_checkpointed_pass_gives_the_modules_values_and_gradients(family, fp8, dtype, tol, monkeypatch):
    model = trainer_modules(family, dtype, fp8=fp8)
    modules = copy.deepcopy(model)
    assert recomputed_layers.install(model.get_base_model()) == DIMS["num_hidden_layers"]
    calls = calls_to(monkeypatch)
    ids = torch.randint(1, DIMS["vocab_size"], (3, 13))
    got, got_grads = hidden_and_grads(model, ids)
    assert len(calls) == DIMS["num_hidden_layers"]  # every layer differentiated by hand
    want, want_grads = hidden_and_grads(modules, ids)
    assert torch.equal(got, want)  # the forward: the modules' ops
    assert len(got_grads) == 2 * 7 * DIMS["num_hidden_layers"]
    for g, w in zip(got_grads, want_grads, strict=True):  # every adapter matrix's, float32
        assert g.dtype == w.dtype and (g - w).abs().max() <= tol * w.abs().max()


def test_the_forward_keeps_each_layers_input_alone():
    model = trainer_modules("qwen2")
    recomputed_layers.install(model.get_base_model())
    held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            saved.append(tuple(t.shape))
        return t

    ids = torch.randint(1, DIMS["vocab_size"], (2, 9))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_base_model().model(input_ids=ids, use_cache=False)
    hidden = (2, 9, DIMS["hidden_size"])
    # each layer's input with the rotary's cos and sin, and the final norm's input and rstd (outside the layers)
    assert saved.count(hidden) == DIMS["num_hidden_layers"] + 1, saved
    assert saved.count((1, 9, DIMS["head_dim"])) == 2 * DIMS["num_hidden_layers"], saved
    assert not any(DIMS["intermediate_size"] in shape for shape in saved), saved


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that ops made and that are still alive, at each op; their peak."""

    def __init__(self):
        super().__init__()
        self.made, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.made:
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (storage._weak_ref(), storage.nbytes())
        for key, (ref, _) in list(self.made.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self.made[key]
        self.peak = max(self.peak, sum(n for _, n in self.made.values()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pass_holds_no_more_than_the_modules(dtype):
    # what the ops make and keep alive, the forward and the backward: the recomputed layer holds what the modules
    # hold at their peak (the layer being recomputed) and drops each tensor once its last gradient is made; it
    # also keeps one layer's adapters in the activations' dtype for its whole backward (the modules cast at each use)
    model = trainer_modules("llama", dtype)
    modules = copy.deepcopy(model)
    recomputed_layers.install(model.get_base_model())
    ids = torch.randint(1, DIMS["vocab_size"], (4, 96))

    def peak(m) -> int:
        with LiveBytes() as live:
            hidden_and_grads(m, ids)
        return live.peak

    layer = model.get_base_model().model.layers[0]
    casts = sum(p.numel() * dtype.itemsize for n, p in layer.named_parameters() if "lora_" in n)
    assert peak(model) <= peak(modules) + casts


def test_other_passes_take_the_modules(monkeypatch):
    model = trainer_modules("llama")
    reference = copy.deepcopy(model)
    recomputed_layers.install(model.get_base_model())
    calls = calls_to(monkeypatch, "recomputed_layer")
    ids = torch.randint(1, DIMS["vocab_size"], (2, 9))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0

    def calls_of(m, **kwargs):
        calls.clear()
        out = m.get_base_model().model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
        return out, len(calls)

    assert calls_of(model)[1] == DIMS["num_hidden_layers"]
    with torch.no_grad():  # evaluation passes, with the adapters
        assert calls_of(model)[1] == 0
    with adapters_off(model), adapters_off(reference):  # the adapters off where autograd records: by the modules
        out, n = calls_of(model)
        assert n == 0 and torch.equal(out, calls_of(reference)[0])
    assert calls_of(model, attention_mask=mask)[1] == 0  # a padding mask
    model.eval()  # transformers checkpoints only in training mode
    assert calls_of(model)[1] == 0
    model.train()
    model.get_base_model().gradient_checkpointing_disable()
    assert calls_of(model)[1] == 0


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_pass_takes_the_written_out_forward_with_the_modules_values(dtype, fp8, monkeypatch):
    # no grad, the adapters off: the base layers through `_forward`, no autograd node, the modules' values
    model = trainer_modules("qwen3", dtype, fp8=fp8)
    reference = copy.deepcopy(model)
    recomputed_layers.install(model.get_base_model())
    calls = calls_to(monkeypatch, "_forward")
    ids = torch.randint(1, DIMS["vocab_size"], (3, 11))
    with torch.no_grad(), adapters_off(model), adapters_off(reference):
        got = model.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
        want = reference.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
    assert len(calls) == DIMS["num_hidden_layers"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_layers_it_does_not_reproduce_keep_their_modules(monkeypatch):
    class OtherLinear(torch.nn.Linear):  # a base layer whose forward the written-out layer does not reproduce
        pass

    model = trainer_modules("llama")
    layers = model.get_base_model().model.layers
    layers[0].self_attn.o_proj.base_layer.__class__ = OtherLinear
    assert recomputed_layers.install(model.get_base_model()) == 1
    assert "forward" not in vars(layers[0]) and "forward" in vars(layers[1])
    assert recomputed_layers.install(trainer_modules("llama", lora_dropout=0.1).get_base_model()) == 0
    fp8 = trainer_modules("llama", fp8=True)  # FP8 on its own GEMMs (--fp8-gemm fp8): the modules, checkpointed
    recomputed_layers.install(fp8.get_base_model())
    fp8.get_base_model().model.layers[1].mlp.down_proj.base_layer.gemm = "auto"
    calls = calls_to(monkeypatch)
    hidden_and_grads(fp8, torch.randint(1, DIMS["vocab_size"], (2, 9)))
    assert len(calls) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_recomputed_layers_are_as_close_to_float32_as_the_modules(monkeypatch):
    # the norm kernel and flash attention in bf16: the adapters' gradients no further from a float32 pass of the
    # same weights than the modules' bf16 pass is
    calls = calls_to(monkeypatch)
    ids = torch.randint(1, DIMS["vocab_size"], (4, 61), device="cuda")
    exact = trainer_modules("llama", torch.float32, device="cuda")
    model = trainer_modules("llama", torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p, q in zip(model.parameters(), exact.parameters(), strict=True):
            q.copy_(p)  # the bf16 model's weights, in float32
    modules = copy.deepcopy(model)
    recomputed_layers.install(model.get_base_model())
    _, want = hidden_and_grads(exact, ids)
    _, got = hidden_and_grads(model, ids)
    _, theirs = hidden_and_grads(modules, ids)
    assert len(calls) == DIMS["num_hidden_layers"]
    for g, t, w in zip(got, theirs, want, strict=True):
        scale = w.abs().max()
        assert (g - w).abs().max() <= 1.5 * (t - w).abs().max() + 1e-3 * scale


def test_a_layers_checkpointed_pass_issues_a_pinned_number_of_ops():
    # What the host issues is the training pass's cost where the GPU is fast: the modules' 112 ops a layer
    # forward and 407 backward (recomputation included; test_lora_addmm pins those), here 103 and 267, all of them
    # this module's (the attention's own backward aside), on the CPU in bf16 (the norms' reference ops; CUDA runs
    # one launch each way). A count that moves: see where with benchmarks/probes/train_ops.py, then pin the new one.
    from test_lora_addmm import VOCAB, _train_ops, tiny_llama

    from grpo.config import Config
    from grpo.model.load import add_lora

    ids = torch.randint(0, VOCAB, (2, 16))
    counts = []
    for layers in (1, 2):
        policy = add_lora(tiny_llama(seed=3, dtype=torch.bfloat16, vocab_size=VOCAB, layers=layers),
                          Config(gradient_checkpointing=True, recompute_layers="auto"))
        counts.append(_train_ops(policy.train(), ids))
    (forward_1, backward_1), (forward_2, backward_2) = counts
    assert (forward_2.total() - forward_1.total(), backward_2.total() - backward_1.total()) == (103, 267)
