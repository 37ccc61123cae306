"""NativeEngine on tiny random Llamas (CPU, no graphs): it must sample exactly what the model says."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import tiny_llama, tiny_llama_config
from grpo.rollout.base import Engine, Sampling
from grpo.rollout.native import EngineTuning, NativeEngine, fold
from test_sampling import chi2_critical, chi2_statistic, reference_probs

PAD = 4  # small_llama's pad id; tiny_llama's (128004) where the real vocabulary is used
PROMPTS = [[5, 17, 300, 42], [7, 8, 9, 10, 11, 12, 13], [99]]  # lengths 4, 7, 1


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def full_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logits predicting each completion token, from one plain forward over prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].double()  # (L + T, V)
    return logits[len(prompt) - 1 : len(prompt) + len(completion) - 1]  # (T, V)


def small_llama(seed: int = 0, vocab: int = 1024, layers: int = 2) -> nn.Module:
    """tiny_llama with a small vocabulary (special ids moved inside it): fast enough for many rollouts."""
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(vocab_size=vocab, layers=layers)
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 4, 1, 2
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return small_llama(seed=0)


def test_engine_satisfies_the_engine_protocol(model):
    engine = NativeEngine(model, max_seq_len=32, max_batch=2, pad_id=PAD)
    assert isinstance(engine, Engine)
    # CPU defaults
    assert engine.tuning.compile is None and engine._streams is None and not engine.tuning.use_cuda_graph


def test_engine_needs_no_importance_correction_and_keeps_its_kv_cache_on_standby(model):
    engine = NativeEngine(model, max_seq_len=32, max_batch=3, pad_id=PAD)
    assert engine.needs_importance_correction is False
    # 2 (K and V) x 2 layers x 3 rows x 2 kv heads x 32 positions x head_dim 16 x 4 bytes (float32)
    assert engine.standby_bytes() == engine.kv_cache_bytes() == 2 * 2 * 3 * 2 * 32 * 16 * 4
    assert engine.held_bytes() == 0  # nothing allocated before the first generate


def test_engine_tuning_refuses_values_it_cannot_run():
    for bad in (dict(kv_bucket=0), dict(check_every=0), dict(turn_block=0), dict(attention="flash"),
                dict(kernel_rows=0), dict(kernel_rows=65), dict(prefill_bucket=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineTuning(**bad)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the attention kernel needs Triton on a GPU (or its interpreter)
        with pytest.raises(ValueError, match="attention='kernel' needs triton"):
            EngineTuning(attention="kernel").resolved(torch.device("cpu"), llama_mlp=True, rows=2)


def test_greedy_equals_transformers_generate_for_prompts_of_different_lengths(model):
    engine = NativeEngine(model, max_seq_len=48, max_batch=8, pad_id=PAD, tuning=EngineTuning(kv_bucket=16))
    rollout = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=20, temperature=0.0))
    assert rollout.completion_ids.shape == (6, 20)
    assert rollout.mask.all()
    assert not rollout.finished.any()
    for i, prompt in enumerate(PROMPTS):
        ref = hf_greedy(model, prompt, 20)
        assert rollout.completion_ids[2 * i].tolist() == ref
        assert rollout.completion_ids[2 * i + 1].tolist() == ref  # n=2: both rows of a group
    # transformers with left padding and an attention mask gives the same tokens as the engine's
    # own per-row positions
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    padded = model.generate(ids, attention_mask=attention, max_new_tokens=20, do_sample=False,
                            eos_token_id=None, pad_token_id=PAD)[:, width:]
    assert torch.equal(padded, rollout.completion_ids[::2])


def test_greedy_equals_transformers_generate_with_the_llama_vocabulary():
    big = tiny_llama(seed=0)  # 128256 tokens, Llama 3.2's ids
    engine = NativeEngine(big, max_seq_len=24, max_batch=4, pad_id=128004)
    rollout = engine.generate(PROMPTS[:2], 2, Sampling(max_new_tokens=8, temperature=0.0))
    for i, prompt in enumerate(PROMPTS[:2]):
        out = big.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=128004)
        assert rollout.completion_ids[2 * i].tolist() == out[0, len(prompt):].tolist()
        assert rollout.completion_ids[2 * i + 1].tolist() == out[0, len(prompt):].tolist()


def test_greedy_logp_is_log_softmax_at_temperature_one(model):
    engine = NativeEngine(model, max_seq_len=48, max_batch=4, pad_id=PAD)
    rollout = engine.generate(PROMPTS[:2], 1, Sampling(max_new_tokens=12, temperature=0.0))
    for i, prompt in enumerate(PROMPTS[:2]):
        completion = rollout.completion_ids[i].tolist()
        ref = torch.log_softmax(full_logits(model, prompt, completion), -1)
        ref = ref.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(rollout.sampler_logp[i].double(), ref, atol=2e-5, rtol=0)


def test_sampler_logp_equals_log_softmax_of_full_forward_before_filters(model):
    engine = NativeEngine(model, max_seq_len=48, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=8))
    sampling = Sampling(max_new_tokens=16, temperature=0.7, top_k=50, top_p=0.95, min_p=0.05, seed=3)
    rollout = engine.generate(PROMPTS, 2, sampling)
    for row in range(6):
        prompt = PROMPTS[row // 2]
        completion = rollout.completion_ids[row].tolist()
        ref = torch.log_softmax(full_logits(model, prompt, completion) / 0.7, -1)
        ref = ref.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(rollout.sampler_logp[row].double(), ref, atol=2e-5, rtol=0)


def test_seed_reproduces_rollout_and_another_seed_differs(model):
    engine = NativeEngine(model, max_seq_len=40, max_batch=6, pad_id=PAD)
    a = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=10, temperature=1.0, seed=11))
    b = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=10, temperature=1.0, seed=11))
    c = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=10, temperature=1.0, seed=12))
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.sampler_logp, b.sampler_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the rows of a group are independent samples, not copies
    assert not torch.equal(a.completion_ids[0], a.completion_ids[1])


def test_stops_at_stop_token_keeps_it_and_pads_after(model):
    engine = NativeEngine(model, max_seq_len=48, max_batch=6, pad_id=PAD, tuning=EngineTuning(check_every=2))
    free = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=12, temperature=0.0))
    eos = free.completion_ids[0, 3].item()  # row 0's fourth token plays EOS
    first = free.completion_ids[0].tolist().index(eos)
    stopped = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=12, temperature=0.0, stop_token_ids=(eos,)))
    assert stopped.finished[0]
    assert stopped.mask[0].tolist() == [True] * (first + 1) + [False] * (stopped.mask.shape[1] - first - 1)
    assert stopped.completion_ids[0, : first + 1].tolist() == free.completion_ids[0, : first + 1].tolist()
    assert (stopped.completion_ids[0, first + 1 :] == PAD).all()
    assert (stopped.sampler_logp[0, first + 1 :] == 0).all()
    for row in (1, 2):  # rows that never produce it run to max_new_tokens, unfinished
        hits = free.completion_ids[row].tolist()
        if eos not in hits:
            assert not stopped.finished[row] and stopped.mask[row].all()
    ignored = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=12, temperature=0.0, stop_token_ids=(eos,),
                                                   ignore_eos=True))
    assert torch.equal(ignored.completion_ids, free.completion_ids)
    assert not ignored.finished.any()


def test_stops_at_stop_sequence_only_when_the_whole_sequence_appears(model):
    engine = NativeEngine(model, max_seq_len=48, max_batch=6, pad_id=PAD)
    free = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=14, temperature=0.0))
    row0 = free.completion_ids[0].tolist()
    seq = tuple(row0[4:7])
    end = next(i + 3 for i in range(len(row0) - 2) if tuple(row0[i : i + 3]) == seq)  # first full match
    never = (row0[4], 5, 5)  # starts like seq, never completes
    stopped = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=14, temperature=0.0,
                                                   stop_sequences=(never, seq)))
    assert stopped.finished[0]
    assert stopped.lengths[0].item() == end
    assert stopped.completion_ids[0, :end].tolist() == row0[:end]
    # a stop sequence that overlaps the prompt does not count: only completion tokens match
    prompt_tail = (PROMPTS[1][-1], free.completion_ids[1, 0].item())
    overlap = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=14, temperature=0.0,
                                                   stop_sequences=(prompt_tail,)))
    assert overlap.lengths[1].item() > 1 or tuple(free.completion_ids[1, :2].tolist()) == prompt_tail


def test_early_exit_when_every_row_finished(model):
    engine = NativeEngine(model, max_seq_len=48, max_batch=2, pad_id=PAD, tuning=EngineTuning(check_every=2))
    free = engine.generate([PROMPTS[0]], 1, Sampling(max_new_tokens=30, temperature=0.0))
    eos = free.completion_ids[0, 1].item()
    stopped = engine.generate([PROMPTS[0]], 1, Sampling(max_new_tokens=30, temperature=0.0,
                                                        stop_token_ids=(eos,)))
    first = free.completion_ids[0].tolist().index(eos)
    assert stopped.completion_ids.shape[1] == first + 1
    assert stopped.timings["decode_steps"] <= first + 1 + 2  # checked every 2 steps


def test_lora_adapters_are_active_and_match_peft_generate():
    from peft import LoraConfig, get_peft_model

    base = small_llama(seed=1)
    plain = {i: hf_greedy(base, p, 12) for i, p in enumerate(PROMPTS)}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                 init_lora_weights=False))
    engine = NativeEngine(peft_model, max_seq_len=32, max_batch=3, pad_id=PAD)
    rollout = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=12, temperature=0.0))
    for i, p in enumerate(PROMPTS):
        assert rollout.completion_ids[i].tolist() == hf_greedy(peft_model, p, 12)
    assert any(rollout.completion_ids[i].tolist() != plain[i] for i in plain), "adapters had no effect"
    with peft_model.disable_adapter():  # the engine follows peft's switch too
        off = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=12, temperature=0.0))
    assert all(off.completion_ids[i].tolist() == plain[i] for i in plain)


class CoarseLinear(nn.Linear):
    """A stand-in for FP8Linear: an nn.Linear subclass whose forward uses a rounded copy of its weight."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CoarseLinear.calls += 1
        return F.linear(x, torch.round(self.weight / 0.02) * 0.02, self.bias)


def coarsen(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                old = getattr(parent, name)
                new = CoarseLinear(old.in_features, old.out_features, bias=old.bias is not None)
                new.weight = old.weight
                setattr(parent, name, new)
    return model


def test_projections_run_through_their_modules_forward_with_lora_on_top():
    from peft import LoraConfig, get_peft_model

    reference = small_llama(seed=2)
    ref_tokens = [hf_greedy(reference, p, 10) for p in PROMPTS]
    model = coarsen(small_llama(seed=2))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                             init_lora_weights=False))
    CoarseLinear.calls = 0
    engine = NativeEngine(model, max_seq_len=32, max_batch=3, pad_id=PAD)
    rollout = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=10, temperature=0.0))
    assert CoarseLinear.calls >= 7 * 2 * 10
    for i, p in enumerate(PROMPTS):
        assert rollout.completion_ids[i].tolist() == hf_greedy(model, p, 10)
    assert [rollout.completion_ids[i].tolist() for i in range(3)] != ref_tokens


class CopyWatch(TorchDispatchMode):
    """Records every op output shaped like a weight matrix (or its transpose) that is not a view of one."""

    def __init__(self, model: nn.Module):
        super().__init__()
        params = [p for p in model.parameters() if p.dim() >= 2]
        self.shapes = {tuple(p.shape) for p in params} | {tuple(p.shape[::-1]) for p in params}
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes \
                    and t.untyped_storage().data_ptr() not in self.storages:
                self.copies.append((str(func), tuple(t.shape)))
        return out


def test_no_parameter_is_duplicated_or_moved():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(small_llama(seed=3), LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                "o_proj", "gate_proj", "up_proj",
                                                                                "down_proj"]))
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    engine = NativeEngine(model, max_seq_len=40, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=8))
    watch = CopyWatch(model)
    with watch:
        rollout = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=9, temperature=1.0, top_k=20, seed=0))
    assert rollout.completion_ids.shape == (6, 9)
    assert watch.copies == []
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
    held = engine._state.tensors()
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() not in param_storages for t in held)
    assert all(tuple(t.shape) not in watch.shapes for t in held)
    # the check can fail: a weight cast to another dtype is caught
    with watch:
        model.base_model.model.model.layers[0].mlp.gate_proj.base_layer.weight.to(torch.float64)
    assert watch.copies


def test_leaves_each_module_train_flag_as_found():
    model = small_llama(seed=4)
    model.train()
    model.model.layers[0].mlp.eval()
    before = [m.training for m in model.modules()]
    engine = NativeEngine(model, max_seq_len=24, max_batch=2, pad_id=PAD)
    engine.generate([[1, 2, 3]], 2, Sampling(max_new_tokens=4, temperature=1.0, seed=0))
    assert [m.training for m in model.modules()] == before
    assert torch.is_grad_enabled()


def test_release_memory_frees_buffers_and_generation_resumes(model):
    engine = NativeEngine(model, max_seq_len=32, max_batch=4, pad_id=PAD)
    sampling = Sampling(max_new_tokens=8, temperature=0.9, seed=5)
    a = engine.generate(PROMPTS[:2], 2, sampling)
    assert engine.held_bytes() >= engine.kv_cache_bytes() > 0
    engine.release_memory()
    assert engine.held_bytes() == 0
    b = engine.generate(PROMPTS[:2], 2, sampling)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_prefill_padded_past_the_longest_prompt_writes_the_same_cache_and_logits(model):
    # a graphed prefill runs at the longest prompt's width rounded up to EngineTuning.prefill_bucket; the columns
    # after every prompt's end must change nothing a decode reads: the K/V before each row's position, the logits
    engine = NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD)
    engine.generate(PROMPTS, 2, Sampling(max_new_tokens=1, temperature=0.0))  # allocates the state
    st, lengths = engine._state, torch.tensor([len(p) for p in PROMPTS])
    seen = []
    for width in (7, 16):
        ids = torch.full((len(PROMPTS), width), 9)  # not the pad id: whatever lies past a prompt is ignored
        for i, p in enumerate(PROMPTS):
            ids[i, :len(p)] = torch.tensor(p)
        with torch.no_grad():
            engine._prefill_rows(ids, lengths, 2)
        rows = [(r, len(PROMPTS[r // 2])) for r in range(6)]
        seen.append(([c[r, :, :n].clone() for c in st.k_caches + st.v_caches for r, n in rows],
                     st.logits[:6].clone(), st.pos[:6].clone()))
    (kv7, logits7, pos7), (kv16, logits16, pos16) = seen
    for a, b in zip(kv7, kv16):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits7, logits16, atol=1e-5, rtol=1e-5)
    assert pos7.tolist() == pos16.tolist() == [4, 4, 7, 7, 1, 1]
    assert torch.equal(logits7[0], logits7[1]) and not torch.equal(logits7[0], logits7[2])  # a prompt's n rows


def test_smaller_batch_after_larger_uses_the_same_cache(model):
    engine = NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD)
    engine.generate(PROMPTS, 2, Sampling(max_new_tokens=6, temperature=1.0, seed=0))
    one = engine.generate([PROMPTS[2]], 1, Sampling(max_new_tokens=6, temperature=0.0))
    assert one.completion_ids[0].tolist() == hf_greedy(model, PROMPTS[2], 6)


def vocab16_model() -> nn.Module:
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(vocab_size=16, hidden=32, intermediate=64)
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(15.0)  # spread the logits so the distribution is far from uniform
    return model


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.8, 0, 1.0, 0.0), (1.2, 10, 0.9, 0.03)])
def test_sampled_token_frequencies_match_model_distribution(temperature, top_k, top_p, min_p):
    model = vocab16_model()
    prompt, draws = [3, 7, 11, 5], 3000
    engine = NativeEngine(model, max_seq_len=8, max_batch=draws, pad_id=0)
    sampling = Sampling(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=9)
    rollout = engine.generate([prompt], draws, sampling)
    first = rollout.completion_ids[:, 0]
    double = copy.deepcopy(model).double()
    ref = reference_probs(full_logits(double, prompt, [0])[0], temperature, top_k, top_p, min_p)
    counts = torch.bincount(first, minlength=16)
    assert counts[ref == 0].sum() == 0, "sampled a token the filters remove"
    stat, df = chi2_statistic(counts, ref)
    assert stat < chi2_critical(df), (stat, df)
    # the second token, given the most common first one, follows the model's conditional distribution
    top = counts.argmax().item()
    second = rollout.completion_ids[first == top, 1]
    ref2 = reference_probs(full_logits(double, prompt, [top, 0])[1], temperature, top_k, top_p, min_p)
    counts2 = torch.bincount(second, minlength=16)
    assert counts2[ref2 == 0].sum() == 0
    stat2, df2 = chi2_statistic(counts2, ref2)
    assert stat2 < chi2_critical(df2), (stat2, df2)


def test_invalid_requests_raise_value_error(model):
    engine = NativeEngine(model, max_seq_len=16, max_batch=4, pad_id=PAD)
    s = Sampling(max_new_tokens=8, temperature=0.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[1] * 9], 1, s)
    with pytest.raises(ValueError, match="max_batch"):
        engine.generate([[1], [2], [3]], 2, s)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], 1, s)
    with pytest.raises(ValueError, match="num_generations=0"):
        engine.generate([[1]], 0, s)
    with pytest.raises(ValueError, match="token id"):
        engine.generate([[1, 128256]], 1, s)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        NativeEngine(model, max_seq_len=16, max_batch=4, pad_id=PAD, tuning=EngineTuning(use_cuda_graph=True))
    with pytest.raises(ValueError, match="pad_id"):
        NativeEngine(model, max_seq_len=16, max_batch=4, pad_id=128004)
    with pytest.raises(ValueError, match="attention"):
        NativeEngine(model, max_seq_len=16, max_batch=4, pad_id=PAD, tuning=EngineTuning(attention="flash"))
    with pytest.raises(ValueError, match="reproduces the decoder layers of"):
        NativeEngine(nn.Linear(2, 2), max_seq_len=16, max_batch=4, pad_id=PAD)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_cuda_graph_rollout_equals_eager_rollout():
    model = small_llama(seed=6).cuda()
    sampling = Sampling(max_new_tokens=40, temperature=1.0, top_p=0.9, min_p=0.05, seed=1,
                        stop_sequences=((17, 18),))
    eager = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD,
                         tuning=EngineTuning(kv_bucket=16, use_cuda_graph=False, compile=None, streams=False))
    b = eager.generate(PROMPTS, 2, sampling)
    for kw in (dict(), dict(compile=None, streams=False), dict(compile=None, attention="sdpa", streams=True),
               dict(attention="kernel")):  # the attention kernel as a custom op in the compiled, captured step
        graphed = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=16, **kw))
        a = graphed.generate(PROMPTS, 2, sampling)
        assert torch.equal(a.completion_ids, b.completion_ids), kw
        torch.testing.assert_close(a.sampler_logp, b.sampler_logp, atol=1e-4, rtol=0)
    graphed = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=16))
    greedy = graphed.generate(PROMPTS, 1, Sampling(max_new_tokens=20, temperature=0.0))
    for i, p in enumerate(PROMPTS):
        assert greedy.completion_ids[i].tolist() == hf_greedy(model, p, 20)


@pytest.mark.cuda
@cuda
def test_prefill_replayed_from_its_cuda_graph_gives_the_rollout_of_the_eager_prefill():
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS

    model = get_peft_model(small_llama(seed=8), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS),
                                                           init_lora_weights=False)).cuda()
    sampling = Sampling(max_new_tokens=24, temperature=1.0, seed=3)
    others = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41]]  # width 17: a bucket of 32
    eager = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD,
                         tuning=EngineTuning(kv_bucket=16, use_cuda_graph=False))
    want = {id(p): eager.generate(p, 2, sampling) for p in (PROMPTS, others)}
    engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD,
                          tuning=EngineTuning(kv_bucket=16, prefill_bucket=16))
    for prompts in (PROMPTS, PROMPTS, others, PROMPTS, others, others):  # eager, capture, eager, replays
        out = engine.generate(prompts, 2, sampling)
        assert torch.equal(out.completion_ids, want[id(prompts)].completion_ids)
        torch.testing.assert_close(out.sampler_logp, want[id(prompts)].sampler_logp, atol=1e-4, rtol=0)
    assert sorted(k[:3] for k in engine._prefill_graphs) == [(2, 2, 32), (3, 2, 16)]
    engine.release_memory()  # under release_memory every prefill runs eager: a capture would not be replayed
    for _ in range(2):
        engine.generate(PROMPTS, 2, sampling)
        engine.release_memory()
    assert not engine._prefill_graphs


@pytest.mark.cuda
@cuda
def test_generates_with_the_memory_released_between_them_hold_no_more_each_time():
    # each generate captures its graphs anew; their warm-ups ran on a new stream each, and cuBLAS kept a
    # workspace for every one (96 MiB more a step at the bench). torch hands out streams from a pool of 32 a
    # device: once earlier tests had given each a workspace the memory would not grow, so they are dropped first.
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    model = small_llama(seed=6).cuda()
    engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=16))
    sampling = Sampling(max_new_tokens=40, temperature=1.0, seed=1)
    held = []
    for _ in range(4):
        engine.generate(PROMPTS, 2, sampling)
        engine.release_memory()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert held[1] == held[2] == held[3], held


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("gemm", ["modules", "kernels"])
def test_qwen3_in_cuda_graphs_samples_what_transformers_generate_does(gemm):
    model = small_decoder("qwen3", seed=7).cuda()
    engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, gemm=gemm)
    greedy = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=20, temperature=0.0))
    for i, p in enumerate(PROMPTS):
        assert greedy.completion_ids[i].tolist() == hf_greedy(model, p, 20)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows,heads,n_kv,dim,seq", [(16, 32, 8, 64, 640), (64, 12, 2, 128, 512),
                                                     (3, 16, 8, 128, 4096), (256, 16, 2, 64, 256)])  # 3-11 chunks; 1
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_kernel_matches_its_reference_on_cuda(rows, heads, n_kv, dim, seq, dtype):
    from grpo.kernels.decode_attention import decode_attention, decode_attention_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, heads, dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, rows, n_kv, seq + 64, dim, device="cuda", generator=g) * 2).to(dtype)[:, :, :, :seq]
    lengths = torch.randint(1, seq + 1, (rows,), device="cuda", generator=g)
    got = decode_attention(q, k, v, lengths, dim**-0.5).float()
    want = decode_attention_ref(q, k, v, lengths, dim**-0.5).float()
    per_row = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)  # no row may hide in the mean
    assert per_row.max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-5)  # bf16: probabilities rounded


@pytest.mark.cuda
@cuda
def test_attention_kernel_in_chunks_in_the_captured_step_gives_the_rollout_of_eager_sdpa_attention():
    # a bucket of 128 positions and 6 rows: two chunks a row, so the combine launch and the op's scratch run
    # inside the compiled, captured step; float32, where the two ways agree to rounding
    model = small_llama(seed=9).cuda()
    sampling = Sampling(max_new_tokens=80, temperature=1.0, seed=4)
    ref = NativeEngine(model, max_seq_len=160, max_batch=6, pad_id=PAD, tuning=EngineTuning(
        kv_bucket=128, use_cuda_graph=False, compile=None, attention="sdpa")).generate(PROMPTS, 2, sampling)
    out = NativeEngine(model, max_seq_len=160, max_batch=6, pad_id=PAD, tuning=EngineTuning(
        kv_bucket=128, attention="kernel")).generate(PROMPTS, 2, sampling)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-4, rtol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotaries_in_the_attention_kernels_launch_give_the_rollout_of_the_launches_apart(dtype, monkeypatch):
    # the kernel layer with the attention kernel: q's and K's rotaries and the K/V write in the attention's
    # launch, in the compiled, captured step (two chunks a row from position 64), against the same kernel layer
    # attending with sdpa, the rotaries and the K/V write apart: float32 to rounding over all 80 tokens; bf16
    # (its roundings) over the first 8 of each row
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.kernels import decode_gemm

    model = get_peft_model(small_llama(seed=10), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS),
                                                            init_lora_weights=False)).cuda().to(dtype)
    sampling = Sampling(max_new_tokens=80, temperature=1.0, seed=5)

    def rollout(attention: str):
        return NativeEngine(model, max_seq_len=160, max_batch=6, pad_id=PAD, gemm="kernels", tuning=EngineTuning(
            kv_bucket=128, attention=attention)).generate(PROMPTS, 2, sampling)

    apart = rollout("sdpa")

    def separate_write(*args):
        raise AssertionError("the K/V write ran apart from the attention")

    monkeypatch.setattr(decode_gemm, "rope_store_kv", separate_write)  # every layer takes the fused path
    fused = rollout("kernel")
    if dtype == torch.float32:
        assert torch.equal(fused.completion_ids, apart.completion_ids)
        torch.testing.assert_close(fused.sampler_logp, apart.sampler_logp, atol=1e-4, rtol=0)
    else:  # near-ties may part a row later on
        assert torch.equal(fused.completion_ids[:, :8], apart.completion_ids[:, :8])
        torch.testing.assert_close(fused.sampler_logp[:, :8], apart.sampler_logp[:, :8], atol=2e-2, rtol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rank", [0, 8])  # with an adapter, lora_down joins the chain and its projection goes beside
def test_launches_chained_in_the_captured_step_give_the_rollout_of_launches_one_after_another(rank):
    # decode_gemm.Tuning.chain: the kernel layer's launches (norms, projections, attention in chunks, combine) each
    # scheduled while the one before it runs, waiting for it in the kernel: a launch that touched memory before its
    # wait would race, and its values would differ from the unchained step's at random. bf16, every token.
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.kernels import decode_gemm

    model = small_llama(seed=12)
    if rank:
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=list(LORA_TARGETS),
                                                 init_lora_weights=False))
    model = model.cuda().to(torch.bfloat16)
    sampling = Sampling(max_new_tokens=100, temperature=1.0, seed=6)

    def rollout(**choices):
        with decode_gemm.tuning(**choices):  # the graphs captured inside keep them
            engine = NativeEngine(model, max_seq_len=160, max_batch=6, pad_id=PAD, gemm="kernels",
                                  tuning=EngineTuning(kv_bucket=128, attention="kernel"))
            out = engine.generate(PROMPTS, 2, sampling)
        assert all(norm is not None for layer in engine._layers for norm in layer.norms)  # in the chain too
        return out

    chained, apart = rollout(chain=True), rollout(chain=False)
    assert torch.equal(chained.completion_ids, apart.completion_ids)
    assert torch.equal(chained.sampler_logp, apart.sampler_logp)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fold_kernel", [False, True])  # torch's ops (the reference), or the Triton kernel
def test_adapters_folded_for_a_cuda_graph_decode_come_out_bit_for_bit_and_sample_near_the_unfolded_step(
        fold_kernel, monkeypatch):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = get_peft_model(small_llama(seed=2).to(torch.bfloat16).cuda(),
                          LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    before = {name: p.clone() for name, p in lora.named_parameters()}
    sampling = Sampling(max_new_tokens=24, temperature=1.0, seed=5)
    plain = NativeEngine(lora, max_seq_len=64, max_batch=6, pad_id=PAD).generate(PROMPTS, 2, sampling)
    if not fold_kernel:
        monkeypatch.setattr(fold, "kernel_folds", lambda ds: False)
    engine = NativeEngine(lora, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(fold_adapter=True))
    for _ in range(2):  # the second replays the graphs captured by the first
        out = engine.generate(PROMPTS, 2, sampling)
        assert engine._fold
        for name, p in lora.named_parameters():
            assert torch.equal(fold.bits(p), fold.bits(before[name])), name
    # The same noise: tokens part only where the folded weights' rounding does. Up to each row's first differing
    # token the log-probs stay within rounding (measured on CPU in bf16: 0.008; adapter missing or twice: 0.47)
    same = out.completion_ids == plain.completion_ids
    gap = (out.sampler_logp - plain.sampler_logp).abs()[same.int().cumprod(1).bool()]
    assert gap.max() < 0.05, gap.max()


@pytest.mark.cuda
@cuda
def test_adapter_launches_beside_their_lora_down_give_the_rollout_of_plain_launches():
    # decode_gemm.Tuning.pdl on Hopper or newer: each projection with an adapter starts while its lora_down
    # still runs and waits for it before the LoRA term; in the engine's CUDA graphs, replayed step after step
    from peft import LoraConfig, get_peft_model

    from grpo.config import LORA_TARGETS
    from grpo.kernels import decode_gemm as dg
    from grpo.rollout.native.plan import layer_projections

    model = get_peft_model(small_llama(seed=8), LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS),
                                                           init_lora_weights=False)).cuda()
    assert layer_projections(model.base_model.model.model.layers[0], torch.float32).q.rank == 8  # the kernels
    sampling = Sampling(max_new_tokens=40, temperature=1.0, seed=3)
    rollouts = {}
    for pdl in (False, True):
        with dg.tuning(pdl=pdl):  # the graphs captured inside keep it
            engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=16))
            rollouts[pdl] = [engine.generate(PROMPTS, 2, sampling) for _ in range(2)]
    plain = rollouts[False][0]
    for out in rollouts[False][1:] + rollouts[True]:
        assert torch.equal(out.completion_ids, plain.completion_ids)
        torch.testing.assert_close(out.sampler_logp, plain.sampler_logp, atol=1e-5, rtol=0)


def test_the_layer_in_streamed_pieces_gives_the_whole_layers_rollout(model):
    # streams=True on the CPU: the pieces the GPU runs on parallel streams, here in sequence, against the layer
    # called whole (what a CPU runs by default)
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(small_llama(seed=7), LoraConfig(r=4, target_modules=["q_proj", "up_proj"],
                                                          init_lora_weights=False))
    sampling = Sampling(max_new_tokens=12, temperature=0.9, top_k=40, seed=2)
    for m in (model, lora):
        ref = NativeEngine(m, max_seq_len=32, max_batch=6, pad_id=PAD, tuning=EngineTuning(kv_bucket=8)).generate(
            PROMPTS, 2, sampling)
        out = NativeEngine(m, max_seq_len=32, max_batch=6, pad_id=PAD,
                           tuning=EngineTuning(kv_bucket=8, streams=True)).generate(
            PROMPTS, 2, sampling)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        torch.testing.assert_close(out.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)


def small_qwen2(seed: int = 0, vocab: int = 1024, layers: int = 2) -> nn.Module:
    """A tiny random Qwen2 (what the packaged Qwen2.5-Coder is): q/k/v projections with bias, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, rope_theta=1000000.0, pad_token_id=PAD, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers starts biases at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def small_decoder(family: str, seed: int = 0, vocab: int = 1024, layers: int = 3) -> nn.Module:
    """A tiny random model of another family than Llama: "qwen3" (RMS norms over each head of q and k),
    "mistral", or one NativeEngine refuses ("granite": multipliers on the embedding, residuals, scores and
    logits; "smollm3": every 4th layer without rotary; "olmo2": norms after attention and MLP instead of
    before; "gemma": its own norms and activation). Every 1-d weight is moved off its initial value (norms
    start at 1 or 0), so that a step that skips one samples another model."""
    import transformers

    configs = {"qwen3": "Qwen3", "mistral": "Mistral", "granite": "Granite", "smollm3": "SmolLM3", "olmo2": "Olmo2",
               "gemma": "Gemma"}
    name = configs[family]
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers if family != "smollm3" else 4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=PAD,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 1:
                weight.add_(torch.randn_like(weight) * 0.3)
    return model


@pytest.mark.parametrize("family,streams", [("qwen2", False), ("qwen3", False), ("qwen3", True), ("mistral", False)])
def test_greedy_equals_transformers_generate_on_other_families_with_lora(family, streams):
    from peft import LoraConfig, get_peft_model

    base = small_qwen2(seed=3) if family == "qwen2" else small_decoder(family, seed=3)
    if family == "qwen2":  # the packaged Qwen's family: q/k/v biases, added by the projections
        assert base.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    engine = NativeEngine(policy, max_seq_len=40, max_batch=6, pad_id=PAD, tuning=EngineTuning(streams=streams))
    rollout = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=16, temperature=0.0))
    for i, prompt in enumerate(PROMPTS):
        assert rollout.completion_ids[2 * i].tolist() == hf_greedy(policy, prompt, 16)
    sampled = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=8, temperature=1.0, seed=5))
    for i, completion in enumerate(sampled.completions()):
        logits = full_logits(policy, PROMPTS[i // 2], completion)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(sampled.sampler_logp[i, :len(completion)].double(), expected,
                                   rtol=0, atol=2e-4)


@pytest.mark.parametrize("family", ["granite", "smollm3", "olmo2", "gemma"])
def test_families_it_does_not_reproduce_are_refused_and_auto_samples_them_with_transformers(family, monkeypatch):
    from grpo.rollout import auto_refusal, build_engine, resolve_engine_name

    model = small_decoder(family)
    with pytest.raises(ValueError, match=f"the model is '{model.config.model_type}'.*--engine hf"):
        NativeEngine(model, max_seq_len=16, max_batch=2, pad_id=PAD)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where auto would take the native engine
    assert "--engine hf" in auto_refusal(model)
    assert resolve_engine_name("auto", model) == "hf"
    assert type(build_engine("auto", model, pad_id=PAD, max_seq_len=16, max_batch=2)).__name__ == "HFEngine"
    assert resolve_engine_name("auto", small_decoder("qwen3")) == "native"
    assert resolve_engine_name("auto", small_llama()) == "native"


def test_the_run_banner_says_why_auto_took_transformers_generate_on_a_gpu():
    import types

    from rich.console import Console

    from grpo.config import Config
    from grpo.distributed import World
    from grpo.rollout import build_engine
    from grpo.trainer import print_banner

    prompts = type("Prompts", (list,), {"dropped": 0, "max_prompt_length": 64})([[1], [2], [3]])

    def banner(engine_name: str, device: str = "cpu", cfg: Config = Config(engine="auto"), **setup) -> str:
        fields = dict(cfg=cfg, world=World(), device=torch.device(device), policy=small_decoder("granite"),
                      prompts=prompts, keep_engine=False, engine=None, max_completion_length=32, sample_ahead=False)
        console = Console(record=True, width=300)
        print_banner(console, types.SimpleNamespace(**{**fields, **setup}), engine_name)
        return console.export_text()

    for device, said in (("cuda", True), ("cpu", False)):  # on a CPU hf is auto's pick
        text = banner("hf", device)
        assert ("--engine auto took hf: the model is 'granite'" in text) == said
        assert "engine hf" in text and "completions up to 32 tokens" in text
        assert "--engine-attention" not in text
    assert "--engine-attention kernel is not used: it picks the native engine's attention, and this run samples " \
        "with hf" in banner("hf", cfg=Config(engine="auto", engine_attention="kernel"))
    assert Config().engine_fold_adapter and "fold" not in banner("hf")  # on by default, native only
    engine = build_engine("native", small_llama(), pad_id=PAD, max_seq_len=16, max_batch=64, attention="auto")
    native = dict(keep_engine=True, engine=engine)
    assert "engine native (kept between steps, sdpa attention)" in banner("native", **native)  # auto's pick on a CPU
    folding = build_engine("native", small_llama(), pad_id=PAD, max_seq_len=16, max_batch=64, fold_adapter=True)
    for device in ("cuda", "cpu"):  # the line only (nothing runs); on a CPU nothing folds, and it says nothing
        said = "(kept between steps, sdpa attention, adapters folded where it decodes on its kernels)" \
            in banner("native", device, **{**native, "engine": folding})
        assert said == (device == "cuda")
    from grpo.config import LORA_TARGETS
    from grpo.kernels.fp8 import quantize_linears_

    fp8 = small_llama()
    quantize_linears_(fp8, LORA_TARGETS)
    text = banner("native", "cuda", **{**native, "engine": folding, "policy": fp8})
    assert "engine native (kept between steps, sdpa attention)" in text  # FP8 weights never fold


def test_progress_hears_rows_times_steps_as_decoding_goes_and_the_total_at_the_end(model):
    engine = NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD, tuning=EngineTuning(check_every=4))
    heard = []
    engine.progress = lambda done, total: heard.append((done, total))
    engine.generate(PROMPTS, 2, Sampling(max_new_tokens=18, temperature=0.0))
    assert heard == [(6 * s, 6 * 18) for s in (4, 8, 12, 16)] + [(6 * 18, 6 * 18)]
    stop_id = engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=18, temperature=0.0)).completion_ids[0, 1].item()
    heard.clear()
    engine.generate(PROMPTS[:1], 1, Sampling(max_new_tokens=18, temperature=0.0, stop_token_ids=(stop_id,)))
    assert heard[-1] == (18, 18) and len(heard) < 6  # stopped early: the total, once, at the end


def test_decode_attention_keeps_scores_of_thousands_in_float32():
    """Qwen2.5's layer 0 gives attention scores up to ~12,700, where a bf16 score is off by up to 32 units:
    rounded, they put sampled tokens 13 nats off the trainer's. The same bf16 q, k, v through `attend` must
    match a float64 attention over those very values to bf16 output rounding (~4e-3)."""
    from grpo.rollout.native.layer import ModelDims, attend

    dims = ModelDims(n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=8)
    g = torch.Generator().manual_seed(0)
    B, S, D = 3, 20, dims.head_dim
    # every score is 16 * 16 * 16 = 4096 plus a part of a few units: bf16 keeps only multiples of 32 there
    q = (16 + 0.5 * torch.randn(B, dims.n_heads, 1, D, generator=g)).bfloat16()
    k = (16 + 0.5 * torch.randn(B, dims.n_kv_heads, S, D, generator=g)).bfloat16()
    v = torch.randn(B, dims.n_kv_heads, S, D, generator=g).bfloat16()
    pos = torch.tensor([5, 12, 19])
    valid = torch.arange(S)[None, :] <= pos[:, None]  # (B, S)
    out = attend(q, k, v, valid, pos, dims, "sdpa").double()  # (B, 1, nh*D)

    qg = q.double().view(B, dims.n_kv_heads, 2, D)
    scores = (qg @ k.double().transpose(-1, -2)) * D**-0.5  # (B, n_kv, g, S)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    ref = (scores.softmax(-1) @ v.double()).reshape(B, 1, dims.n_heads * D)
    assert scores.amax() > 1000  # the regime under test
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
