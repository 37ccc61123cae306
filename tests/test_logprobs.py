"""grpo.kernels.logprobs: chunked token log-probs and entropy against float64, values and gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from grpo.kernels.logprobs import default_chunk_size, token_logprobs, token_logprobs_ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def ref64(hidden, weight, targets, temperature):
    """float64 log-probs, entropy and d(sum g*logp)/d hidden, through plain autograd."""
    h = hidden.detach().double().requires_grad_()
    logp, ent = token_logprobs_ref(h, weight.detach().double(), targets, temperature, return_entropy=True)
    return logp, ent, h


def make(n, v, h, dtype=torch.float32, seed=0, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(device, dtype)  # logits of std ~3
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    upstream = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, upstream


def check(hidden, weight, targets, upstream, temperature, atol, rtol, **kw):
    logp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True, **kw)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == targets.shape
    (grad,) = torch.autograd.grad((logp * upstream).sum(), hidden)
    logp64, ent64, h64 = ref64(hidden, weight, targets, temperature)
    (grad64,) = torch.autograd.grad((logp64 * upstream.double()).sum(), h64)
    torch.testing.assert_close(logp.double(), logp64, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent.double(), ent64, atol=atol, rtol=rtol)
    assert grad.dtype == hidden.dtype
    # dz @ W sums V terms per element; fp32 matmuls over small row blocks accumulate with error ~ sqrt(V)
    grad_atol = atol * max(1.0, weight.shape[0] / 1000) ** 0.5
    torch.testing.assert_close(grad.double(), grad64, atol=grad_atol, rtol=rtol)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("n,v,h,chunk", [
    (37, 1000, 32, 8),  # N not a multiple of the chunk
    (1, 1000, 32, None),  # a single token
    (64, 777, 48, 64),  # one exact chunk, odd vocabulary
    (20, 128256, 16, 7),  # Llama's vocabulary
])
def test_fp32_values_and_gradients_match_float64(n, v, h, chunk, recompute):
    hidden, weight, targets, upstream = make(n, v, h, seed=n)
    check(hidden, weight, targets, upstream, 1.0, atol=2e-5, rtol=1e-5, chunk_size=chunk, recompute=recompute)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_divides_the_logits_before_the_softmax(temperature):
    hidden, weight, targets, upstream = make(29, 501, 24, seed=1)
    check(hidden, weight, targets, upstream, temperature, atol=2e-5, rtol=1e-5, chunk_size=10)
    logits = (hidden.detach().double() @ weight.double().t()) / temperature
    expected = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(token_logprobs(hidden, weight, targets, temperature).double(), expected,
                               atol=2e-5, rtol=1e-5)


def test_bf16_inputs_match_float64_within_bf16_logit_rounding():
    hidden, weight, targets, upstream = make(33, 2000, 64, dtype=torch.bfloat16, seed=2)
    # the logits are rounded to bf16 (8 bits) as in the plain path; |z| ~ 3 -> about 0.01 absolute
    check(hidden, weight, targets, upstream, 1.0, atol=4e-2, rtol=2e-2, chunk_size=16)
    plain = token_logprobs_ref(hidden, weight, targets)
    torch.testing.assert_close(token_logprobs(hidden, weight, targets, chunk_size=16), plain, atol=1e-5, rtol=1e-5)


def test_padding_rows_are_finite_and_masked_rows_get_no_gradient():
    hidden, weight, targets, upstream = make(16, 1000, 32, seed=3)
    with torch.no_grad():
        hidden[4:] = 0  # padding positions: all-zero hidden states, uniform distribution
    targets[4:] = 0
    upstream[4:] = 0  # the loss masks them
    logp, ent = token_logprobs(hidden, weight, targets, return_entropy=True, chunk_size=5)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), hidden)
    log_v = torch.log(torch.tensor(1000.0))
    torch.testing.assert_close(logp[4:], -log_v.expand(12), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[4:], log_v.expand(12), atol=1e-5, rtol=0)
    assert torch.isfinite(grad).all() and (grad[4:] == 0).all() and (grad[:4] != 0).any()


def test_peaked_distributions_stay_finite():
    hidden, weight, targets, upstream = make(12, 3000, 32, seed=4, scale=300.0)  # logits in the thousands
    check(hidden, weight, targets, upstream, 1.0, atol=1e-3, rtol=1e-5, chunk_size=5)


def test_no_grad_calls_return_the_same_values_and_skip_the_gradient_work(monkeypatch):
    import grpo.kernels.logprobs as mod

    asked = []
    real = mod._chunk_torch
    monkeypatch.setattr(mod, "_chunk_torch", lambda *a: asked.append(a[-1]) or real(*a))
    hidden, weight, targets, _ = make(21, 1000, 32, seed=5)
    with_grad = token_logprobs(hidden, weight, targets, chunk_size=4)
    assert asked == [True] * 6
    asked.clear()
    with torch.no_grad():
        without = token_logprobs(hidden, weight, targets, chunk_size=4)
    assert asked == [False] * 6  # no softmax gradient and no second matmul under no_grad
    assert not without.requires_grad and with_grad.requires_grad
    assert torch.equal(with_grad.detach(), without)


def test_entropy_carries_no_gradient():
    hidden, weight, targets, _ = make(9, 100, 8, seed=6)
    logp, ent = token_logprobs(hidden, weight, targets, return_entropy=True)
    assert logp.requires_grad and not ent.requires_grad


def test_gradients_accumulate_through_two_calls_on_the_same_hidden():
    hidden, weight, targets, upstream = make(10, 300, 16, seed=7)
    (token_logprobs(hidden, weight, targets, chunk_size=3) * upstream).sum().backward()
    (token_logprobs(hidden, weight, targets, 0.5, chunk_size=4) * upstream).sum().backward()
    h64 = hidden.detach().double().requires_grad_()
    w64, g64 = weight.double(), upstream.double()
    ((token_logprobs_ref(h64, w64, targets) + token_logprobs_ref(h64, w64, targets, 0.5)) * g64).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=2e-5, rtol=1e-5)


def test_matches_a_tiny_llama_on_its_final_hidden_states_and_tied_head():
    model = tiny_llama(seed=0)
    ids = torch.randint(0, 128256, (2, 7))
    out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :-1].reshape(-1, 64)  # after the final norm, shifted by one
    targets = ids[:, 1:].reshape(-1)
    expected = torch.log_softmax(out.logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).reshape(-1)
    logp = token_logprobs(hidden, model.get_output_embeddings().weight.detach(), targets, chunk_size=5)
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=1e-5)
    logp.sum().backward()  # gradients flow back into the model through hidden
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_default_chunk_keeps_one_chunk_of_logits_small():
    assert default_chunk_size(32768, 128256, torch.bfloat16, "triton") == 2048  # 0.5 GiB of bf16 logits
    assert default_chunk_size(32768, 128256, torch.bfloat16, "torch") == 256
    assert default_chunk_size(3, 128256, torch.float32, "torch") == 3


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(impl="cuda"), "impl"),
    (dict(impl="triton"), "CUDA"),
])
def test_bad_arguments_raise_one_line_value_errors(bad, match):
    hidden, weight, targets, _ = make(4, 50, 8)
    with pytest.raises(ValueError, match=match):
        token_logprobs(hidden, weight, targets, **bad)


def test_shape_dtype_and_trainable_head_errors():
    hidden, weight, targets, _ = make(4, 50, 8)
    with pytest.raises(ValueError, match="share H"):
        token_logprobs(hidden, weight[:, :7], targets)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="cast"):
        token_logprobs(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="frozen"):
        token_logprobs(hidden, weight.requires_grad_(), targets)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n,v,chunk,temperature", [(1, 1000, None, 1.0), (37, 4099, 8, 0.7), (300, 128256, 128, 1.0)])
def test_triton_matches_float64_on_cuda(n, v, chunk, temperature):
    hidden, weight, targets, upstream = make(n, v, 256, dtype=torch.bfloat16, seed=n, device="cuda")
    for recompute in (False, True):
        check(hidden, weight, targets, upstream, temperature, atol=4e-2, rtol=2e-2, chunk_size=chunk,
              impl="triton", recompute=recompute)
    # against the plain path on the same bf16 logits (same row blocks, so the same matmul kernel), the
    # only difference left is the order of the fp32 sums
    step = chunk or n
    plain = torch.cat([token_logprobs_ref(hidden[s:s + step], weight, targets[s:s + step], temperature)
                       for s in range(0, n, step)])
    torch.testing.assert_close(token_logprobs(hidden, weight, targets, temperature, chunk_size=chunk, impl="triton"),
                               plain, atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
@cuda
def test_triton_padding_rows_on_cuda():
    hidden, weight, targets, upstream = make(16, 5000, 128, dtype=torch.bfloat16, seed=9, device="cuda")
    with torch.no_grad():
        hidden[4:] = 0
    upstream[4:] = 0
    logp, ent = token_logprobs(hidden, weight, targets, return_entropy=True, chunk_size=5, impl="triton")
    (grad,) = torch.autograd.grad((logp * upstream).sum(), hidden)
    log_v = torch.log(torch.tensor(5000.0, device="cuda"))
    torch.testing.assert_close(logp[4:], -log_v.expand(12), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[4:], log_v.expand(12), atol=1e-4, rtol=0)
    assert torch.isfinite(grad).all() and (grad[4:] == 0).all()
