"""The adapters in one flat buffer (grpo.flat_params): bit for bit bitsandbytes' 8-bit AdamW one tensor at a time,
gradients gathered for the step and held by no one after it, checkpoints in the per-parameter format both ways, one
call a step."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_llama
from grpo.config import Config
from grpo.data import PromptStream
from grpo.distributed import World
from grpo.flat_params import FlatOptimizer, flat_refusal
from grpo.model.load import add_lora
from grpo.optim import clip_grad_norm_, make_optimizer, make_scheduler, optimizer_line
from grpo.run.checkpoint import Resumable, RunState, load_checkpoint, save_checkpoint

bnb = pytest.importorskip("bitsandbytes")

# 8-bit AdamW as the recipe runs it, with a weight decay and a warmup large enough to show, a clip that binds
CFG = Config(gradient_checkpointing=False, lora_rank=32, lora_alpha=64, learning_rate=1e-2, weight_decay=0.1,
             warmup_ratio=0.5, max_steps=6, max_grad_norm=0.05)
# Llama-3.2-1B's projections (in, out): q, k, v, o, gate, up, down
LLAMA_1B = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]


def aligned_llama(seed: int = 0):
    """A tiny Llama whose rank-32 adapters all hold a multiple of 256 elements, at least 4096, as the real
    models' do (hidden 256, k/v 128 wide, MLP 512); vocabulary 128."""
    return add_lora(tiny_llama(seed=seed, vocab_size=128, hidden=256, intermediate=512, layers=1, heads=4,
                               kv_heads=2, max_pos=64), CFG)


def adapters(policy) -> list[nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]


def per_tensor_optimizer(params):
    """Today's other path, and what older checkpoints were saved from: bitsandbytes one tensor at a time."""
    return bnb.optim.AdamW8bit(params, lr=CFG.learning_rate, weight_decay=CFG.weight_decay,
                               betas=(CFG.adam_beta1, CFG.adam_beta2))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits, not equal values (-0.0 and 0.0 differ)."""
    return t.detach().contiguous().view(torch.uint8)


def assert_same_bits(a, b, where: str = "") -> None:
    """Nested state dicts (or tensors) equal bit for bit, with the same keys, shapes and dtypes."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_bits(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), where
        assert torch.equal(bits(a), bits(b)), where
    else:
        assert a == b, where


def train_steps(policy, optimizer, scheduler, steps: int, seed: int, start: int = 0) -> list[float]:
    """Steps start+1..steps of two micro-batches each (gradients accumulate), clipped as grpo.step clips; the same
    batches for the same seed and step. Returns the norms before clipping."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2 * start):  # the batches of the steps before `start`
        torch.randint(0, 128, (2, 12), generator=gen)
    params, norms = adapters(policy), []
    for _ in range(steps - start):
        optimizer.zero_grad()
        for _ in range(2):
            ids = torch.randint(0, 128, (2, 12), generator=gen)
            policy(input_ids=ids, labels=ids).loss.backward()
        norms.append(float(clip_grad_norm_(optimizer, params, CFG.max_grad_norm)))
        optimizer.step()
        scheduler.step()
    return norms


def test_real_shapes_qualify_for_the_flat_buffer_and_odd_ones_say_why_not():
    for r in (16, 32, 64):
        shapes = [s for n_in, n_out in LLAMA_1B for s in ((r, n_in), (n_out, r))]
        assert flat_refusal([torch.empty(s, device="meta") for s in shapes]) is None, r
    assert "adapter 1 of shape (64, 8) has 512 elements, not a multiple of 256 of at least 4096" in \
        flat_refusal([torch.empty(16, 256), torch.empty(64, 8)])
    assert "not a multiple of 256" in flat_refusal([torch.empty(17, 256 + 1)])
    assert "dtypes" in flat_refusal([torch.empty(16, 256), torch.empty(16, 256, dtype=torch.bfloat16)])
    assert flat_refusal([]) == "no adapters"


def test_the_flat_update_is_bit_for_bit_the_per_tensor_one_on_a_real_layers_shapes():
    # One Llama-3.2-1B layer's 14 adapters at r=16, as plain tensors: gradients of very different sizes from step
    # to step (clipping binds at some steps, not others), weight decay, a warmup then a linear decay.
    torch.manual_seed(0)
    shapes = [s for n_in, n_out in LLAMA_1B for s in ((16, n_in), (n_out, 16))]
    start = [torch.randn(s) * 0.02 for s in shapes]
    ours = [nn.Parameter(t.clone()) for t in start]
    theirs = [nn.Parameter(t.clone()) for t in start]
    flat, plain = make_optimizer(CFG, ours), per_tensor_optimizer(theirs)
    assert isinstance(flat, FlatOptimizer)
    schedules = make_scheduler(CFG, flat), make_scheduler(CFG, plain)
    clipped = []
    for step in range(5):
        grads = [torch.randn(s) * 10.0 ** (step - 3) for s in shapes]
        flat.zero_grad()
        for p, g in zip((*ours, *theirs), grads + grads):
            p.grad = g.clone()
        norm = clip_grad_norm_(flat, ours, 1.0)
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, 1.0))
        clipped.append(float(norm) > 1.0)
        flat.step(), plain.step()
        for schedule in schedules:
            schedule.step()
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(bits(a), bits(b)), (step, i, shapes[i])
        assert_same_bits(flat.state_dict(), plain.state_dict())
    assert any(clipped) and not all(clipped)


def test_training_a_model_through_the_flat_buffer_is_bit_for_bit_the_per_tensor_optimizer():
    # Autograd's own gradients, accumulated over two micro-batches into the views, and the trainer's clipping.
    ours, theirs = aligned_llama(), aligned_llama()
    flat, plain = make_optimizer(CFG, adapters(ours)), per_tensor_optimizer(adapters(theirs))
    assert isinstance(flat, FlatOptimizer) and len(adapters(ours)) == 14
    norms = train_steps(ours, flat, make_scheduler(CFG, flat), 4, seed=1)
    assert norms == train_steps(theirs, plain, make_scheduler(CFG, plain), 4, seed=1)
    assert max(norms) > CFG.max_grad_norm  # the clip bound
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(bits(a), bits(b)), name
    assert_same_bits(flat.state_dict(), plain.state_dict())
    assert any(bool((bits(a) != bits(b)).any()) for a, b in zip(adapters(ours), adapters(aligned_llama())))


def test_the_step_reads_the_adapters_gradients_gathered_and_holds_no_copy_after_it():
    policy = aligned_llama()
    params = adapters(policy)
    optimizer = make_optimizer(CFG, params)
    flat = optimizer.flat
    for p, at in zip(params, flat.offsets):
        assert p.data_ptr() == flat.param.data_ptr() + at * flat.param.element_size()
    ids = torch.randint(0, 128, (2, 12))
    policy(input_ids=ids, labels=ids).loss.backward()
    policy(input_ids=ids, labels=ids).loss.backward()  # accumulated in each adapter's own .grad, as always
    assert flat.grad is None  # nothing gathered during the pass: the pass holds no second copy
    grads = [p.grad.clone() for p in params]
    clip_grad_norm_(optimizer, params, float("inf"))
    assert torch.equal(flat.grad, torch.cat([g.reshape(-1) for g in grads]))  # in the buffer's order
    optimizer.step()
    assert flat.grad is None  # dropped after the step
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
    policy(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # a step without a clip gathers for itself
    assert flat.grad is None


def test_an_adapter_that_left_the_buffer_or_has_no_gradient_is_an_error_before_the_update():
    ids = torch.randint(0, 128, (2, 12))
    for leave, said in ((lambda p: setattr(p, "data", p.data.clone()), "its data is no longer a view of the flat "
                         "buffer"), (lambda p: setattr(p, "grad", None), r"no gradient \(1 of 14 have none\)")):
        policy = aligned_llama()
        params = adapters(policy)
        optimizer = make_optimizer(CFG, params)
        policy(input_ids=ids, labels=ids).loss.backward()
        leave(params[3])
        before = [p.detach().clone() for p in params]
        with pytest.raises(RuntimeError, match=f"adapter 3 of shape .*: {said}"):
            clip_grad_norm_(optimizer, params, 1.0)
        with pytest.raises(RuntimeError, match=f"adapter 3 of shape .*: {said}"):
            optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(before, params))  # nothing was updated


class OpCounts(TorchDispatchMode):
    """The aten and bitsandbytes ops dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def update_ops(make, n: int) -> Counter:
    """The ops of one clipped optimizer step and its zeroing over n adapters of 16 x 256 (after a first step, so
    that the state exists)."""
    params = [nn.Parameter(torch.randn(16, 256)) for _ in range(n)]
    optimizer = make(params)
    counts = OpCounts()
    for counted in (False, True):
        for p in params:
            if p.grad is None:  # the per-tensor optimizer's, set to None by its zero_grad
                p.grad = torch.randn(16, 256)
            else:
                p.grad.copy_(torch.randn(16, 256))
        with counts if counted else torch.no_grad():
            clip_grad_norm_(optimizer, params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return counts.ops


def test_a_flat_step_dispatches_the_same_few_ops_whatever_the_number_of_adapters():
    flat = [update_ops(lambda ps: make_optimizer(CFG, ps), n) for n in (4, 28)]
    plain = [update_ops(per_tensor_optimizer, n) for n in (4, 28)]
    # a view an adapter (its gradient flattened for the gather: metadata, no kernel); the rest the same few ops
    assert [ops.pop("aten.view") for ops in flat] == [4, 28]
    assert flat[0] == flat[1] and sum(flat[0].values()) < 20
    assert flat[0]["bitsandbytes.optimizer_update_8bit_blockwise"] == 1
    assert [ops["bitsandbytes.optimizer_update_8bit_blockwise"] for ops in plain] == [4, 28]  # one per tensor


def test_odd_shapes_keep_one_call_per_tensor_torchs_adamw_stays_itself_and_the_banner_says_which():
    cfg = Config(gradient_checkpointing=False, lora_rank=4, lora_alpha=8)
    odd = adapters(add_lora(tiny_llama(vocab_size=256, max_pos=64), cfg))
    optimizer = make_optimizer(cfg, odd)
    assert type(optimizer) is bnb.optim.AdamW8bit
    assert "adamw_8bit: one bitsandbytes call per adapter tensor (adapter 0 of shape (4, 64) has 256 elements, not " \
        "a multiple of 256 of at least 4096)" == optimizer_line(cfg, optimizer, odd)
    assert all(p.grad is None for p in odd)  # left as they were
    aligned = adapters(aligned_llama())
    torch_cfg = Config(optim="adamw_torch")
    assert type(make_optimizer(torch_cfg, aligned)) is torch.optim.AdamW
    assert optimizer_line(torch_cfg, make_optimizer(torch_cfg, aligned), aligned) == \
        "adamw_torch: torch's AdamW over 14 adapter tensors"
    flat = make_optimizer(CFG, aligned)
    assert optimizer_line(CFG, flat, aligned) == \
        "adamw_8bit: one bitsandbytes call a step over a flat buffer of 14 adapter tensors"


# --------------------------------------------------------------------------------------------------
# Checkpoints: the per-parameter format, both ways
# --------------------------------------------------------------------------------------------------
def parts(flat: bool) -> Resumable:
    policy = aligned_llama()
    params = adapters(policy)
    optimizer = make_optimizer(CFG, params) if flat else per_tensor_optimizer(params)
    assert isinstance(optimizer, FlatOptimizer) == flat
    return Resumable(policy, optimizer, make_scheduler(CFG, optimizer), PromptStream(10, 3, seed=1))


def save(tmp_path, resumable: Resumable, step: int):
    return save_checkpoint(tmp_path, RunState(step=step), resumable, Config(output_dir=str(tmp_path)),
                           [{"python": random.getstate(), "torch": torch.get_rng_state()}])


@pytest.mark.parametrize("saved_by, resumed_by", [("per_tensor", "flat"), ("flat", "per_tensor"), ("flat", "flat")])
def test_a_checkpoint_resumes_bit_for_bit_across_the_two_optimizers(tmp_path, saved_by, resumed_by):
    # Two steps, saved; two more after loading the checkpoint into the other (or the same) optimizer: the end is
    # the bits of four steps without a stop.
    straight = parts(flat=True)
    train_steps(straight.policy, straight.optimizer, straight.scheduler, 4, seed=2)

    first = parts(flat=saved_by == "flat")
    train_steps(first.policy, first.optimizer, first.scheduler, 2, seed=2)
    path = save(tmp_path, first, 2)
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    reference = parts(flat=False)  # the per-parameter format: its keys, shapes and dtypes, tensor by tensor
    train_steps(reference.policy, reference.optimizer, reference.scheduler, 2, seed=2)
    assert_same_bits(saved, reference.optimizer.state_dict())

    resumed = parts(flat=resumed_by == "flat")
    load_checkpoint(path, resumed, World())
    assert_same_bits(resumed.optimizer.state_dict(), saved)
    train_steps(resumed.policy, resumed.optimizer, resumed.scheduler, 4, seed=2, start=2)
    for (name, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(bits(a), bits(b)), name
    assert_same_bits(resumed.optimizer.state_dict(), straight.optimizer.state_dict())


def test_a_checkpoint_for_other_adapters_is_refused_in_one_line():
    flat = parts(flat=True).optimizer
    other = per_tensor_optimizer([nn.Parameter(torch.randn(16, 256)) for _ in range(14)])
    for p in other.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    other.step()
    with pytest.raises(ValueError, match="adapter 0 holds 4096 values of state1, the adapter needs 8192"):
        flat.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="holds \\[3\\] tensors in its groups, this optimizer one group of 14"):
        flat.load_state_dict(per_tensor_optimizer([nn.Parameter(torch.randn(16, 256)) for _ in range(3)]).state_dict())


# --------------------------------------------------------------------------------------------------
# A run: train.py's loop on the flat buffer
# --------------------------------------------------------------------------------------------------
def test_a_run_on_the_flat_buffer_says_so_learns_and_resumes_bit_for_bit(aligned_char_llama_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from grpo.trainer import train

    def cfg(out, **kw) -> Config:
        return Config(model=str(aligned_char_llama_dir), dataset="arithmetic", num_train_examples=16, engine="hf",
                      max_steps=3, prompts_per_step=2, num_generations=2, max_completion_length=8,
                      max_prompt_length=None, max_seq_length=1024, learning_rate=1e-3, warmup_ratio=0.34,
                      weight_decay=0.1, log_completions_steps=0, eval_size=0, output_dir=str(out), seed=11,
                      reward=("test_train:text_signal",), **kw)

    train(cfg(tmp_path / "a", save_steps=2))
    assert "adamw_8bit: one bitsandbytes call a step over a flat buffer of 14 adapter tensors" in capsys.readouterr().out
    train(cfg(tmp_path / "b", save_steps=0, resume=str(tmp_path / "a" / "checkpoint-2")))
    a, b = (load_file(tmp_path / run / "adapter" / "adapter_model.safetensors") for run in ("a", "b"))
    two = load_file(tmp_path / "a" / "checkpoint-2" / "adapter_model.safetensors")
    assert a.keys() == b.keys() == two.keys()
    assert any(not torch.equal(a[k], two[k]) for k in a), "step 3 changed nothing"
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k
