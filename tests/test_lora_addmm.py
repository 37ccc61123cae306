"""grpo.model.lora_addmm: peft's LoRA layers in the training pass with the adapter's product added inside one GEMM, against
peft's own forward: values and gradients, the cases left to peft, and the tensors it no longer makes."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_llama
from grpo.model import lora_addmm
from grpo.config import Config
from grpo.model.load import add_lora


VOCAB = 512  # a small head: the projections are the point, and the tests stay quick


def _policy(dtype, fp8: bool = False, device: str = "cpu", shapes: dict | None = None, **cfg):
    """A tiny Llama with rsLoRA (--lora-compute base) and B made non-zero, without the one-GEMM forward."""
    model = tiny_llama(seed=3, dtype=dtype, **({"vocab_size": VOCAB} | (shapes or {}))).to(device)
    if fp8:
        from grpo.config import LORA_TARGETS
        from grpo.kernels.fp8 import quantize_linears_

        quantize_linears_(model, LORA_TARGETS)
    policy = add_lora(model, Config(gradient_checkpointing=False, **cfg))
    for module in policy.modules():  # peft's forward again (add_lora installed the one-GEMM one)
        if _installed(module):
            del module.forward
    torch.manual_seed(1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return policy.to(device)


def _installed(module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and forward.__func__ is lora_addmm._forward


def nodes(out: torch.Tensor) -> list[str]:
    """The names of the autograd nodes behind `out`."""
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def _loss_and_grads(policy, ids):
    out = policy(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    policy.zero_grad(set_to_none=True)
    return out.logits.detach().float(), grads


def test_add_lora_installs_it_on_every_adapted_projection_with_base_compute_only():
    from peft.tuners.lora.layer import Linear

    def installed(policy):
        return sum(_installed(m) for m in policy.modules() if type(m) is Linear)

    base = add_lora(tiny_llama(vocab_size=VOCAB), Config(gradient_checkpointing=False))
    assert installed(base) == 2 * 7  # two layers, the seven projections
    float32 = Config(gradient_checkpointing=False, lora_compute="float32")
    assert installed(add_lora(tiny_llama(vocab_size=VOCAB), float32)) == 0


# FP8Linear projections: dequantized for each product (the CPU's auto), or once for F.linear (dense), whose frozen
# weight _UpAndBase reads again in backward as it does nn.Linear's
@pytest.mark.parametrize("fp8", [False, "dequant", "dense"])
def test_values_and_gradients_match_pefts_forward(fp8):
    peft_policy = _policy(torch.float32, fp8=bool(fp8), fp8_gemm=fp8 or "auto")
    ours = copy.deepcopy(peft_policy)
    assert lora_addmm.install(ours) == 14
    ids = torch.randint(0, VOCAB, (2, 20))
    assert ("_UpAndBaseBackward" in nodes(ours(input_ids=ids).logits)) == (fp8 != "dequant")
    logits_peft, grads_peft = _loss_and_grads(peft_policy, ids)
    logits_ours, grads_ours = _loss_and_grads(ours, ids)
    # float32: the one rounding of the GEMM's epilogue against peft's three differs in the last bits only
    assert torch.allclose(logits_ours, logits_peft, rtol=1e-5, atol=1e-5)
    assert grads_ours.keys() == grads_peft.keys()
    for name, g in grads_peft.items():
        # An adapter's gradient entry sums products over every token and the layer's width: its rounding scales
        # with the tensor's largest entries, not with its own value, which may cancel to near zero. So the
        # tolerance is relative to the tensor's scale, elementwise it would fail on such an entry.
        torch.testing.assert_close(grads_ours[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=name)
    # the adapters matter here, so a product left out or scaled wrongly could not pass
    with torch.no_grad(), peft_policy.disable_adapter():
        base = peft_policy(input_ids=ids).logits.float()
    assert (logits_peft - base).abs().max() > 100 * (logits_ours - logits_peft).abs().max()


def test_in_bf16_it_is_no_further_from_float32_than_peft_is():
    truth = _policy(torch.float32)
    peft_policy = _policy(torch.bfloat16)
    peft_policy.load_state_dict({k: v.to(peft_policy.state_dict()[k].dtype) for k, v in truth.state_dict().items()})
    ours = copy.deepcopy(peft_policy)
    lora_addmm.install(ours)
    ids = torch.randint(0, VOCAB, (2, 20))
    logits_true, grads_true = _loss_and_grads(truth, ids)
    results = [_loss_and_grads(p, ids) for p in (peft_policy, ours)]
    (logits_peft, grads_peft), (logits_ours, grads_ours) = results
    assert (logits_ours - logits_true).norm() < 1.2 * (logits_peft - logits_true).norm()

    def median_error(grads):
        errors = sorted(float((grads[n].float() - t).norm() / t.norm()) for n, t in grads_true.items())
        return errors[len(errors) // 2]

    assert median_error(grads_ours) < 1.2 * median_error(grads_peft) and median_error(grads_ours) < 0.1


def test_no_grad_disabled_and_merged_adapters_take_pefts_forward():
    peft_policy = _policy(torch.float32)
    ours = copy.deepcopy(peft_policy)
    lora_addmm.install(ours)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():  # the engine, the evaluation: peft's own ops, bit for bit
        assert torch.equal(ours(input_ids=ids).logits, peft_policy(input_ids=ids).logits)
        with ours.disable_adapter(), peft_policy.disable_adapter():
            assert torch.equal(ours(input_ids=ids).logits, peft_policy(input_ids=ids).logits)
    with ours.disable_adapter():  # with grad on too: the base model alone
        with torch.no_grad(), peft_policy.disable_adapter():
            base = peft_policy(input_ids=ids).logits
        assert torch.equal(ours(input_ids=ids).logits.detach(), base)
    layer = ours.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, layer.in_features)
    expected = layer(x).detach()
    layer.merge()
    assert layer.merged and torch.allclose(layer(x).detach(), expected, atol=1e-5)


def test_the_training_forward_makes_no_scaled_copy_or_sum_of_a_projections_output():
    from peft.tuners.lora.layer import Linear

    peft_policy = _policy(torch.bfloat16)
    layer = peft_policy.base_model.model.model.layers[0].mlp.up_proj
    assert type(layer) is Linear
    x = torch.randn(3, 7, layer.in_features, dtype=torch.bfloat16)
    peft_nodes = nodes(layer(x))
    lora_addmm.install(layer)
    ours = layer(x)
    assert ours.shape == (3, 7, layer.out_features)
    # peft: the product, its scaling and the sum, each a tensor of the output's size; ours: the adapter's product
    # and the base GEMM adding into it (a frozen nn.Linear: lora_addmm._UpAndBase)
    assert "MulBackward0" in peft_nodes and "AddBackward0" in peft_nodes
    assert "MulBackward0" not in nodes(ours) and "AddBackward0" not in nodes(ours)
    assert {"_UpAndBaseBackward", "_DownBackward"} <= set(nodes(ours))


def test_under_gradient_checkpointing_the_gradients_are_those_without_it():
    ids = torch.randint(0, VOCAB, (2, 16))
    grads = []
    for checkpointing in (False, True):
        policy = add_lora(tiny_llama(seed=3, vocab_size=VOCAB), Config(gradient_checkpointing=checkpointing))
        torch.manual_seed(1)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
        policy.train()  # checkpointing recomputes in training mode only
        assert sum(_installed(m) for m in policy.modules()) == 14
        grads.append(_loss_and_grads(policy, ids)[1])
    for name, g in grads[0].items():
        assert g.abs().sum() > 0 and torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name


class _WeightReads(TorchDispatchMode):
    """Counts the GEMMs (aten ops named *mm*) that read `weight`'s storage inside it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.storage, self.gemms = weight.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reads = any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage for a in args)
        self.gemms += reads and "mm" in func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def _checkpointed_layer(peft_way: bool, monkeypatch, intermediate: int = 128):
    """One checkpointed bf16 decoder layer and a loss on its hidden states for a (2, 64) batch. peft_way: the base
    GEMMs left to the base layers' own nodes (the path for other layers), until `monkeypatch` is undone."""
    if peft_way:
        monkeypatch.setattr(lora_addmm, "_weight_read_again", lambda base, x: False)
    policy = add_lora(tiny_llama(seed=3, dtype=torch.bfloat16, vocab_size=VOCAB, layers=1, intermediate=intermediate),
                      Config(gradient_checkpointing=True))
    policy.train()
    hidden = policy.get_base_model().model(input_ids=torch.randint(0, VOCAB, (2, 64)), use_cache=False)
    return policy, hidden.last_hidden_state.float().square().sum()


@pytest.mark.parametrize("peft_way", [False, True])
def test_a_checkpointed_layers_backward_reads_its_down_projections_weight_once(peft_way, monkeypatch):
    # The recomputation stops once the layer's last saved tensor is back: the down projection's x A^T, saved by
    # _Down, so its base GEMM (_UpAndBase, nothing saved) is not run again; its weight is read for x's gradient only
    policy, loss = _checkpointed_layer(peft_way, monkeypatch)
    down = policy.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    with _WeightReads(down) as reads:
        loss.backward()
    assert reads.gemms == (2 if peft_way else 1)


def test_a_checkpointed_layers_backward_frees_the_mlps_input_before_making_its_gradient(monkeypatch, tmp_path):
    # The down projection's input (the SiLU product, tokens x intermediate) is freed once the adapter's gradients
    # are made, before x's gradient is: one tensor of that size less at the backward's peak than peft's way, where
    # the base's input gradient is made first. The peak from the profiler's allocations, in their order.
    import json

    from torch.profiler import ProfilerActivity, profile

    peaks = []
    for peft_way in (False, True):
        with monkeypatch.context() as patch:
            _, loss = _checkpointed_layer(peft_way, patch, intermediate=2048)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                loss.backward()
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
        events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        live = peak = 0
        for event in events:
            if event.get("name") == "[memory]":
                live += event["args"]["Bytes"]
                peak = max(peak, live)
        peaks.append(peak)
    intermediate_tensor = 2 * 64 * 2048 * 2  # bf16 bytes
    assert peaks[0] <= peaks[1] - 0.9 * intermediate_tensor, peaks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# fp8: FP8Linear on the FP8 tensor cores (_scaled_mm), K and N of 512; dense: its weight dequantized to bf16
@pytest.mark.parametrize("fp8", [False, "fp8", "dense"])
def test_on_cuda_in_bf16_it_is_no_further_from_float32_than_peft_is(fp8):
    # every projection's K and N a multiple of 512; Llama's vocabulary, as when the bounds below were measured
    shapes = dict(hidden=512, intermediate=1024, heads=8, kv_heads=8, vocab_size=128256)
    truth = _policy(torch.float32, device="cuda", shapes=shapes)
    peft_policy = _policy(torch.bfloat16, fp8=bool(fp8), device="cuda", shapes=shapes, fp8_gemm=fp8 or "auto")
    if fp8:  # the truth: the same FP8 weights, dequantized to float32
        from grpo.kernels.fp8 import FP8Linear, dequantize_fp8_block

        for name, module in peft_policy.named_modules():
            if isinstance(module, FP8Linear):
                dense = truth.get_submodule(name)
                dense.weight.data = dequantize_fp8_block(module.weight, module.weight_scale_inv, torch.float32)
    state = {k: v for k, v in truth.state_dict().items() if "lora_" in k}
    peft_policy.load_state_dict(state, strict=False)
    ours = copy.deepcopy(peft_policy)
    lora_addmm.install(ours)
    ids = torch.randint(0, 128256, (2, 64), device="cuda")
    logits_true, grads_true = _loss_and_grads(truth, ids)
    (logits_peft, grads_peft), (logits_ours, grads_ours) = (_loss_and_grads(p, ids) for p in (peft_policy, ours))
    assert (logits_ours - logits_true).norm() < 1.2 * (logits_peft - logits_true).norm(), \
        (float((logits_ours - logits_true).norm()), float((logits_peft - logits_true).norm()))

    def median_error(grads):
        errors = sorted(float((grads[n].float() - t).norm() / t.norm()) for n, t in grads_true.items())
        return errors[len(errors) // 2]

    bound = 0.2 if fp8 == "fp8" else 0.1  # FP8's quantized activations and gradients: 0.108 for both on the H200
    assert median_error(grads_ours) < 1.2 * median_error(grads_peft) and median_error(grads_ours) < bound, \
        (median_error(grads_ours), median_error(grads_peft))


# plain: nn.Linear with a bias (Qwen's q/k/v) and no dropout, the two Functions (_Down, _UpAndBase); dropout: peft's
# dropout on the adapter's input; view: also a base layer whose product is a view (FP8's padded rows)
@pytest.mark.parametrize("case", ["plain", "dropout", "view"])
def test_a_biased_base_dropout_and_a_view_for_a_product_give_pefts_values_and_gradients(case):
    from peft import LoraConfig, get_peft_model

    from grpo.model.load import compute_adapters_in_base_dtype

    view = case == "view"

    class Base(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(torch.cat([x, x[:1]]) if view else x)
            return y[: x.shape[0]] if view else y  # the first rows of a longer product: a view

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = (torch.nn.Linear if case == "plain" else Base)(24, 40, bias=True)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    net = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0 if case == "plain" else 0.3,
                                           target_modules=["proj"], init_lora_weights=False))
    compute_adapters_in_base_dtype(net)
    ours = copy.deepcopy(net)
    assert lora_addmm.install(ours) == 1
    x = torch.randn(5, 24, requires_grad=True)
    results = []
    for model in (net, ours):
        torch.manual_seed(7)  # the same dropout mask: one draw of x's size in both
        y = model(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *(p for p in model.parameters() if p.requires_grad)])
        results.append((y, grads))
    (y_peft, g_peft), (y_ours, g_ours) = results
    assert ("_UpAndBaseBackward" in nodes(y_ours)) == (case == "plain")
    assert torch.allclose(y_ours, y_peft, rtol=1e-5, atol=1e-6)
    assert len(g_ours) == len(g_peft) == 3 and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                                                    for a, b in zip(g_ours, g_peft))


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops issued inside it: what the host dispatches, each a launch or at least a dispatch on
    the GPU."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _train_ops(policy, ids):
    """The aten ops of one training forward and of its backward, through the decoder (as the trainer runs it)."""
    forward, backward = _AtenOps(), _AtenOps()
    with forward:
        hidden = policy.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state
    with backward:
        hidden.float().square().sum().backward()
    policy.zero_grad(set_to_none=True)
    return forward.ops, backward.ops


def test_on_the_tokens_as_rows_a_projection_issues_no_view_and_gives_the_same_values_and_gradients():
    policy = _policy(torch.bfloat16)
    lora_addmm.install(policy)
    layer = policy.base_model.model.model.layers[0].mlp.up_proj
    rows = torch.randn(12, layer.in_features, dtype=torch.bfloat16)
    results = []
    for x in (rows.view(3, 4, -1), rows):  # (B, T, in) as attention's projections get it; rows as the MLP's do
        x = x.detach().requires_grad_()
        y = layer(x)
        grads = torch.autograd.grad(y.float().square().sum(), [x, *(p for p in layer.parameters() if p.requires_grad)])
        results.append((y.reshape(12, -1), grads[0].reshape(12, -1), grads[1:]))
    (y3, dx3, dw3), (y2, dx2, dw2) = results
    assert torch.equal(y2, y3) and torch.equal(dx2, dx3) and len(dw2) == 2
    assert all(torch.equal(a, b) for a, b in zip(dw2, dw3))
    with _AtenOps() as counted:
        layer(rows.requires_grad_())
    assert counted.ops["view"] == 0, counted.ops


def test_a_decoder_layers_training_pass_issues_a_pinned_number_of_ops():
    # The host issues the training pass op by op, and on the bench it issues them slower than the GPU runs them,
    # so the count is the host's cost. Pinned on the CPU in bf16 (the casts the GPU's pass makes; its RMSNorms are
    # one Triton launch there, eight ops here) with gradient checkpointing, per decoder layer (two layers less
    # one). The MLP is ours whole (lean_activations and this module): pinned exactly. The layer's total also holds
    # transformers' attention, which a new version may change: a bound. A count that moves: see where the ops
    # went with benchmarks/probes/train_ops.py, then pin the new one.
    ids = torch.randint(0, VOCAB, (2, 16))
    counts = []
    for layers in (1, 2):
        policy = add_lora(tiny_llama(seed=3, dtype=torch.bfloat16, vocab_size=VOCAB, layers=layers),
                          Config(gradient_checkpointing=True))
        policy.train()
        counts.append(_train_ops(policy, ids))
    (forward_1, backward_1), (forward_2, backward_2) = counts
    per_layer = (forward_2.total() - forward_1.total(), backward_2.total() - backward_1.total())
    assert per_layer[0] <= 112 and per_layer[1] <= 312, per_layer  # forward, backward (recomputation included)

    mlp = add_lora(tiny_llama(seed=3, dtype=torch.bfloat16, vocab_size=VOCAB, layers=1),
                   Config(gradient_checkpointing=False)).base_model.model.model.layers[0].mlp
    x = torch.randn(2, 8, mlp.gate_proj.in_features, dtype=torch.bfloat16, requires_grad=True)
    with _AtenOps() as forward:
        y = mlp(x)
    with _AtenOps() as backward:
        y.float().square().sum().backward()
    # three projections of 9 ops each (A and B cast to bf16 and three transposes, the down product and its
    # detach as it is saved, the adapter's product, the base GEMM adding into it), SiLU and the product, the
    # rows' view in and out. Backward: each projection's input gradient is one tensor (80 ops in peft's way)
    assert forward.ops.total() == 31 and forward.ops["view"] == 2, forward.ops
    assert backward.ops.total() == 56, backward.ops
