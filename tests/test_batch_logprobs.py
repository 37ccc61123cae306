"""The trainer's log-probs of a batch of right-padded rows: one causal forward with no padding mask, equal
to each row's own unpadded forward, and a gradient that no attention backend's treatment of padding can
spoil (on the H200, cuDNN's backward returned NaN for every padded row when it was handed a mask)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from grpo.rollout import Rollout
from grpo.batch import make_batch, micro_batches, real_token_share, sequence_logprobs
from grpo.loss import clipped_surrogate

PAD = 4
PROMPTS = [[5, 17, 300, 42, 9], [7, 8], [99, 100, 101]]  # lengths 5, 2, 3
G = 2


def small_policy():
    """A tiny random Qwen2 (biases on q/k/v, as the packaged Qwen) under LoRA adapters that change the output."""
    from peft import LoraConfig, get_peft_model

    from test_native_engine import small_qwen2

    base = small_qwen2(seed=0)
    base.requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def ragged_rollout() -> Rollout:
    """Rows whose counted completions have 6, 3, 1, 5, 0 and 4 tokens: every row but the first is padded."""
    counted = [6, 3, 1, 5, 0, 4]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 500, (len(counted), 6), generator=g)
    mask = torch.arange(6)[None, :] < torch.tensor(counted)[:, None]
    ids = ids.masked_fill(~mask, PAD)
    return Rollout(prompt_ids=PROMPTS, completion_ids=ids, mask=mask, sampler_logp=torch.zeros(ids.shape),
                   finished=torch.ones(len(counted), dtype=torch.bool), num_generations=G)


class _NaNGradOnPaddedRows(torch.autograd.Function):
    """Identity forward; the backward returns NaN for the batch rows flagged, as cuDNN's did for padded rows."""

    @staticmethod
    def forward(ctx, out, padded_rows):
        ctx.save_for_backward(padded_rows)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        (padded_rows,) = ctx.saved_tensors
        return grad.masked_fill(padded_rows[:, None, None, None], float("nan")), None


def test_counted_tokens_equal_each_rows_own_unpadded_forward():
    policy = small_policy().eval()
    rollout = ragged_rollout()
    batch = make_batch(rollout, PAD, torch.device("cpu"))
    with torch.no_grad():
        logp = sequence_logprobs(policy, batch, temperature=0.7)
    assert (logp[~batch.mask] == 0).all()
    for i in range(len(batch)):
        prompt, n = PROMPTS[i // G], int(batch.mask[i].sum())
        if n == 0:
            continue
        ids = torch.tensor([prompt + rollout.completion_ids[i, :n].tolist()])
        with torch.no_grad():
            z = policy(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / 0.7
        expected = z.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        torch.testing.assert_close(logp[i, :n].double(), expected, rtol=0, atol=1e-5)


def test_gradient_stays_finite_under_an_attention_backend_that_breaks_padded_rows(monkeypatch):
    """The mechanism of step 3's NaN: a padding mask handed to scaled_dot_product_attention sent padded rows
    into a backward that breaks them. The trainer's forward must hand it none (causal attention suffices)."""
    real_sdpa = F.scaled_dot_product_attention
    masks_seen = []

    def sdpa_breaking_padded_rows(query, key, value, attn_mask=None, *args, **kwargs):
        out = real_sdpa(query, key, value, attn_mask, *args, **kwargs)
        masks_seen.append(attn_mask is not None)
        if attn_mask is None or attn_mask.dtype != torch.bool:
            return out
        padded_rows = ~attn_mask[:, 0, -1, :].all(-1)  # the last query sees every key of an unpadded row
        return _NaNGradOnPaddedRows.apply(out, padded_rows)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_breaking_padded_rows)
    policy = small_policy().train()
    batch = make_batch(ragged_rollout(), PAD, torch.device("cpu"))
    logp = sequence_logprobs(policy, batch, temperature=1.0)
    (logp * batch.mask).sum().backward()
    grads = [p.grad for p in policy.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert masks_seen and not any(masks_seen)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_a_micro_batch_runs_only_as_wide_as_its_longest_row_with_the_same_logprobs():
    policy = small_policy().eval()
    batch = make_batch(ragged_rollout(), PAD, torch.device("cpu"))  # real lengths 11, 8, 3, 7, 3, 7 of 11
    assert batch.lengths == (11, 8, 3, 7, 3, 7) and batch.input_ids.shape[1] == 11
    assert list(batch.lengths) == (batch.start + batch.mask.sum(1)).tolist()  # the host copy is the tensors'
    with torch.no_grad():
        whole = sequence_logprobs(policy, batch, temperature=0.7)
        part = batch.rows(slice(2, 5))
        assert part.input_ids.shape == (3, 7)  # cut to its longest row
        torch.testing.assert_close(sequence_logprobs(policy, part, temperature=0.7), whole[2:5], rtol=0, atol=1e-5)
    adv = torch.arange(6.0)
    same, same_adv, one = micro_batches(batch, adv, 6)  # one micro-batch: the rows as they came
    assert same is batch and same_adv is adv and one == [slice(0, 6)]
    ordered, ordered_adv, slices = micro_batches(batch, adv, 2)
    assert ordered.lengths == (3, 3, 7, 7, 8, 11) and ordered_adv.tolist() == [2, 4, 3, 5, 1, 0]
    assert list(ordered.lengths) == (ordered.start + ordered.mask.sum(1)).tolist()
    assert torch.equal(ordered.input_ids[0], batch.input_ids[2])  # each row keeps its advantage
    assert sum(ordered.rows(sl).input_ids.numel() for sl in slices) == 2 * (3 + 7 + 11) < batch.input_ids.numel()
    # the share of real tokens in what the forwards run: 39 of 6 x 11 in one pass, of 2 x (3 + 7 + 11) sorted
    assert real_token_share(batch, one) == 39 / 66 and real_token_share(ordered, slices) == 39 / 42
    assert real_token_share(ordered, []) == 1.0


def test_the_hosts_copy_of_the_mask_finds_the_same_tokens_in_every_micro_batch_and_order():
    policy = small_policy()
    batch = make_batch(ragged_rollout(), PAD, torch.device("cpu"))
    assert batch.host_mask is not None and torch.equal(batch.host_mask, batch.mask)
    from_device = dataclasses.replace(batch, host_mask=None)  # counted() reads the device's mask instead
    order = [4, 1, 5, 0, 3, 2]
    for part, same in ((batch.rows(slice(1, 4)), from_device.rows(slice(1, 4))),
                       (batch.take(order), from_device.take(order)), (batch, from_device)):
        assert torch.equal(part.host_mask, part.mask)
        assert torch.equal(part.counted(), same.counted())
        assert part.counted().tolist() == part.mask.flatten().nonzero().flatten().tolist()
        logp = sequence_logprobs(policy, part, temperature=0.7)
        assert torch.equal(logp, sequence_logprobs(policy, same, temperature=0.7))
        assert (logp[~part.mask] == 0).all() and (logp[part.mask] < 0).all()
        logp.sum().backward()  # the gradient flows back through the positions' gather and scatter
        grads = [p.grad.clone() for p in policy.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        policy.zero_grad(set_to_none=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_training_pass_and_its_statistics_never_wait_for_the_device(monkeypatch):
    from grpo.loss import SamplerGap, clipped_surrogate, importance_weights

    policy = small_policy().cuda()
    batch = make_batch(ragged_rollout(), PAD, torch.device("cuda"))
    adv = torch.linspace(-1, 1, len(batch), device="cuda")
    # The one wait allowed is transformers' own: each forward without an attention mask asks the device whether
    # the rows are packed sequences (masking_utils.find_packed_sequence_indices). It runs here unchecked, and is
    # counted: once for the one forward.
    from transformers import masking_utils

    checks = []
    find_packed = masking_utils.find_packed_sequence_indices

    def packed_check_allowed_to_wait(position_ids):
        checks.append(position_ids.shape)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return find_packed(position_ids)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", packed_check_allowed_to_wait)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any other wait for the device raises
    try:
        logp = sequence_logprobs(policy, batch, temperature=1.0)
        weights, _ = importance_weights(logp, batch.sampler_logp, batch.mask)
        loss, stats = clipped_surrogate(logp, logp.detach(), adv, batch.mask, is_weights=weights)
        loss.backward()
        SamplerGap().add(logp, batch.sampler_logp, batch.mask)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss) and stats and len(checks) == 1


def test_widths_rounded_up_to_a_multiple_leave_the_logprobs_as_they_are():
    # --pad-to-multiple-of: widths that repeat from step to step, at the price of padding no counted token reads
    policy = small_policy().eval()
    batch = make_batch(ragged_rollout(), PAD, torch.device("cpu"))  # real lengths 11, 8, 3, 7, 3, 7 of 11
    adv = torch.arange(6.0)
    exact, exact_adv, slices = micro_batches(batch, adv, 2)
    rounded, rounded_adv, same_slices = micro_batches(batch, adv, 2, pad_to_multiple_of=4)
    assert same_slices == slices and rounded.lengths == exact.lengths and torch.equal(rounded_adv, exact_adv)
    assert [exact.rows(sl).input_ids.shape[1] for sl in slices] == [3, 7, 11]
    assert [rounded.rows(sl).input_ids.shape[1] for sl in slices] == [4, 8, 12]  # the batch padded to a multiple too
    assert rounded.take([1, 0, 2, 3, 4, 5]).width_multiple == 4
    with torch.no_grad():
        for sl in slices:
            torch.testing.assert_close(sequence_logprobs(policy, rounded.rows(sl), 0.7),
                                       sequence_logprobs(policy, exact.rows(sl), 0.7), rtol=0, atol=1e-5)
    assert real_token_share(rounded, slices) == 39 / (2 * (4 + 8 + 12)) < real_token_share(exact, slices)


def test_models_whose_logits_are_not_the_output_layers_product_are_refused_at_load(tmp_path, llama_tokenizer):
    import pytest
    import transformers

    from conftest import tiny_llama
    from grpo.model.load import head_refusal
    from grpo.config import Config
    from grpo.model.load import load_policy

    small = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    llama = tiny_llama()
    rng = torch.get_rng_state()
    assert head_refusal(llama) is None
    assert torch.equal(torch.get_rng_state(), rng)  # the check draws nothing: the run's seed stays the run's
    assert head_refusal(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small))) is None
    assert head_refusal(transformers.GraniteForCausalLM(transformers.GraniteConfig(**small))) is None  # scaling 1
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**small, logits_scaling=8.0))
    assert "model 'granite' changes its logits after the output layer" in head_refusal(granite)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small, final_logit_softcapping=0.5))
    assert "model 'gemma2' changes its logits" in head_refusal(gemma2)
    granite.save_pretrained(tmp_path)
    llama_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"--model {tmp_path}: model 'granite' changes its logits"):
        load_policy(Config(model=str(tmp_path)), torch.device("cpu"))


def test_attention_without_cudnn_leaves_out_cudnn_alone_and_restores_what_was_enabled():
    import pytest

    from grpo.model.load import attention_without_cudnn

    backends = torch.backends.cuda

    def others():
        return backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled()

    was = backends.cudnn_sdp_enabled()
    backends.enable_cudnn_sdp(True)  # torch's default (a process that imported vLLM has it off)
    try:
        before = others()
        with attention_without_cudnn():
            assert not backends.cudnn_sdp_enabled()
            assert others() == before
        assert backends.cudnn_sdp_enabled()
        with pytest.raises(KeyError), attention_without_cudnn():
            raise KeyError("a run that fails")
        assert backends.cudnn_sdp_enabled()
        backends.enable_cudnn_sdp(False)  # a caller who turned it off keeps it off after the block
        with attention_without_cudnn():
            pass
        assert not backends.cudnn_sdp_enabled()
    finally:
        backends.enable_cudnn_sdp(was)


def test_a_transcript_with_a_masked_middle_trains_only_its_model_tokens_as_a_hand_built_reference():
    """Model tokens, then a tool's reply (mask False), then model tokens again: micro-batches of one row each run
    as wide as the whole transcript, and the loss and its gradient are those of each row's own full forward with
    the reply's positions left out of the sum."""
    policy = small_policy()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, 500, (2, 9), generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    ids[1, 8] = PAD
    rollout = Rollout(prompt_ids=[PROMPTS[1]], completion_ids=ids, mask=mask, sampler_logp=torch.zeros(ids.shape),
                      finished=torch.ones(2, dtype=torch.bool), num_generations=2)
    assert rollout.spans.tolist() == [7, 8] and rollout.lengths.tolist() == [4, 4]
    assert rollout.completions() == [ids[0, :7].tolist(), ids[1, :8].tolist()]
    adv = torch.tensor([1.0, -0.5])
    batch, batch_adv, slices = micro_batches(make_batch(rollout, PAD, torch.device("cpu")), adv, 1)
    assert batch.lengths == (9, 10) and [batch.rows(sl).input_ids.shape[1] for sl in slices] == [9, 10]
    logp = torch.cat([sequence_logprobs(policy, batch.rows(sl), temperature=0.7) for sl in slices])
    loss, _ = clipped_surrogate(logp, logp.detach(), batch_adv, batch.mask)
    grads = torch.autograd.grad(loss, [p for p in policy.parameters() if p.requires_grad])

    reference = []
    for row in range(2):  # each row's own unpadded forward over prompt and whole transcript
        tokens = torch.tensor(PROMPTS[1] + ids[row, :rollout.spans[row]].tolist())
        logits = policy(input_ids=tokens[None]).logits[0].float() / 0.7
        at = mask[row].nonzero().flatten()
        targets = ids[row, at]
        lp = torch.log_softmax(logits[len(PROMPTS[1]) - 1 + at], -1).gather(-1, targets[:, None]).squeeze(-1)
        reference.append(-(adv[row] * torch.exp(lp - lp.detach())).mean())  # ratio 1: the policy gradient
    ref_loss = torch.stack(reference).mean()
    ref_grads = torch.autograd.grad(ref_loss, [p for p in policy.parameters() if p.requires_grad])
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_reference_pass_is_the_base_models_without_walking_pefts_model_status(monkeypatch):
    # peft's disable_adapter() asks for the model's status on entry: every module walked many times over and each
    # adapter layer formatted as text, host work between the step's phases. The reference pass switches the
    # adapters off and on itself: the same log-probs, the same adapters after, and no status asked for.
    from types import SimpleNamespace

    from peft import PeftModel

    from grpo.batch import batch_logprobs
    from grpo.config import Config
    from grpo.model.load import adapters_off
    from grpo.step import reference_and_old_logprobs

    policy = small_policy().eval()
    batch, _, slices = micro_batches(make_batch(ragged_rollout(), PAD, torch.device("cpu")), torch.zeros(6), 2)
    with torch.no_grad():
        with policy.disable_adapter():
            expected = batch_logprobs(policy, batch, slices, 0.7)
        with_adapters = batch_logprobs(policy, batch, slices, 0.7)
    assert (with_adapters - expected).abs().max() > 1e-3  # the adapters change what the reference must not see
    adapters = [(name, p.requires_grad) for name, p in policy.named_parameters() if "lora_" in name]
    assert adapters and all(grad for _, grad in adapters)

    def no_status(self):
        raise AssertionError("the reference pass asked for peft's model status")

    monkeypatch.setattr(PeftModel, "get_model_status", no_status)
    setup = SimpleNamespace(cfg=Config(beta=0.04, temperature=0.7), policy=policy, clock=lambda: 0.0)
    ref_logp, old_logp, _ = reference_and_old_logprobs(setup, batch, slices)
    assert torch.equal(ref_logp, expected) and old_logp is None
    on_again = [(name, p.requires_grad) for name, p in policy.named_parameters() if "lora_" in name]
    assert on_again == adapters and not any(m.disable_adapters for m in policy.modules() if hasattr(m, "lora_A"))
    with pytest.raises(RuntimeError), adapters_off(policy):  # however the block ends, the adapters come back
        raise RuntimeError("a failing reference pass")
    with torch.no_grad():
        assert torch.equal(batch_logprobs(policy, batch, slices, 0.7), with_adapters)
