"""Sampling one step ahead (grpo.rollout.ahead): a copy with the adapters folded or with a copy of the adapters
(FP8 weights), a rollout started before an update that samples the policy before it, other generates in
between, errors, refusals, and the trainer's run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo.config import Config
from grpo.model import compiled_layers
from grpo.kernels.fp8 import FP8Linear, quantize_linears_
from grpo.rollout.ahead import SampleAhead, adapters_copy, folded_copy, folds, refusal
from grpo.rollout.base import Engine, Sampling
from grpo.rollout.native import NativeEngine
from test_native_engine import PAD, PROMPTS, small_llama
from test_train import tiny_cfg

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROOT = Path(__file__).resolve().parents[1]
SAMPLING = Sampling(max_new_tokens=10, temperature=1.0, min_p=0.1, ignore_eos=True, seed=5)


def adapted(seed: int = 1, dtype=torch.float32, fp8: bool = False):
    from peft import LoraConfig, get_peft_model

    base = small_llama(seed=seed).to(dtype)
    if fp8:  # as --load-in-fp8 loads it
        assert quantize_linears_(base, TARGETS) == 2 * 7
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    for name, p in policy.named_parameters():
        p.requires_grad_("lora_" in name)
    return policy


def native(model) -> NativeEngine:
    return NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD)


def lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


def move_adapters(policy, by: float = 0.5) -> None:
    """What an optimizer step would do to the adapters, larger."""
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * by)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_copy_holds_the_rounded_fold_and_shares_every_other_tensor(dtype):
    policy = adapted(dtype=dtype)
    model, taken = folded_copy(policy)
    for f in taken:
        f.take()
    originals = lora_layers(policy)
    assert len(taken) == len(originals) == 2 * 7
    names = dict(policy.get_base_model().named_modules())
    for name, module in model.named_modules():
        if name in names and names[name] in originals:
            lora = names[name]
            assert type(module) is nn.Linear
            a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
            expect = (lora.base_layer.weight.float() + lora.scaling["default"] * (b.float() @ a.float())).to(dtype)
            torch.testing.assert_close(module.weight, expect, rtol=0, atol=1e-6)
            assert module.weight.data_ptr() != lora.base_layer.weight.data_ptr()
    copy_ptrs = {t.data_ptr() for t in model.parameters()}
    folded_ptrs = {f.weight.data_ptr() for f in taken}
    base_ptrs = {t.data_ptr() for n, t in policy.named_parameters() if "lora_" not in n and "base_layer" not in n}
    assert copy_ptrs - folded_ptrs == base_ptrs  # embeddings, norms, head: the policy's own tensors
    assert not any(p.requires_grad for p in model.parameters())


def test_the_adapters_copy_shares_every_tensor_but_the_adapters_and_takes_them_when_told():
    policy = adapted(fp8=True)
    assert not folds(policy)
    model, taken = adapters_copy(policy)
    theirs = dict(policy.get_base_model().named_parameters())
    mine = dict(model.named_parameters())
    assert mine.keys() == theirs.keys()
    adapters = {name for name in mine if "lora_" in name}
    assert len(adapters) == len(taken) == 2 * 7 * 2
    for name, t in mine.items():
        assert (t.data_ptr() == theirs[name].data_ptr()) == (name not in adapters), name
        assert not t.requires_grad
    assert all(theirs[name].requires_grad for name in adapters)  # the policy still trains its own
    move_adapters(policy)
    assert not all(torch.equal(mine[name], theirs[name]) for name in adapters)  # until taken, the copy's are its own
    for t in taken:
        t.take()
    assert all(torch.equal(mine[name], theirs[name]) for name in adapters)
    assert any(type(m) is FP8Linear for m in model.modules())


def test_the_copy_has_none_of_the_trainings_own_forwards():
    policy = adapted()
    assert compiled_layers.install(policy, backend="aot_eager") == 2
    model, _ = folded_copy(policy)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all("forward" in layer.__dict__ for layer in policy.get_base_model().model.layers)  # the policy keeps its


@pytest.mark.parametrize("fp8", [False, True])
def test_a_rollout_started_ahead_samples_the_policy_before_the_update(fp8):
    policy = adapted(fp8=fp8)
    before = copy.deepcopy(policy)
    ahead = SampleAhead(policy, native)
    assert isinstance(ahead, Engine) and ahead.needs_importance_correction and ahead.folded is not fp8
    ahead.prefetch(PROMPTS, 2, SAMPLING)
    move_adapters(policy)  # the update runs while the rollout generates
    got = ahead.generate(PROMPTS, 2, SAMPLING)
    want = SampleAhead(before, native).generate(PROMPTS, 2, SAMPLING)
    assert torch.equal(got.completion_ids, want.completion_ids)
    torch.testing.assert_close(got.sampler_logp, want.sampler_logp, rtol=0, atol=1e-6)
    now = ahead.generate(PROMPTS, 2, SAMPLING)  # nothing in flight: the policy as it is now
    assert not torch.equal(now.sampler_logp, got.sampler_logp)
    moved = copy.deepcopy(policy)
    torch.testing.assert_close(now.sampler_logp, SampleAhead(moved, native).generate(PROMPTS, 2, SAMPLING).sampler_logp,
                               rtol=0, atol=1e-6)
    if fp8:  # the adapters through the copy, as the policy's own engine reads them
        torch.testing.assert_close(now.sampler_logp, native(moved).generate(PROMPTS, 2, SAMPLING).sampler_logp,
                                   rtol=0, atol=1e-6)


def test_dense_weights_without_the_fold_get_the_adapters_copied_and_an_engine_that_folds_is_refused():
    from grpo.rollout.native import EngineTuning

    policy = adapted()
    ahead = SampleAhead(policy, native, fold=False)
    assert not ahead.folded and len(lora_layers(ahead.model)) == 2 * 7  # the copy keeps its LoRA layers
    got = ahead.generate(PROMPTS, 2, SAMPLING)  # through the adapters, as the policy's own engine samples it
    want = native(copy.deepcopy(policy)).generate(PROMPTS, 2, SAMPLING)
    assert torch.equal(got.completion_ids, want.completion_ids)
    torch.testing.assert_close(got.sampler_logp, want.sampler_logp, rtol=0, atol=1e-6)

    def folding(model):
        return NativeEngine(model, max_seq_len=32, max_batch=6, pad_id=PAD, tuning=EngineTuning(fold_adapter=True))

    with pytest.raises(ValueError, match="fold_adapter=False"):  # it would fold into the policy's own weights
        SampleAhead(policy, folding, fold=False)
    assert SampleAhead(policy, folding).folded  # into a copy of them: fine


def test_another_generate_waits_for_the_one_in_flight_and_leaves_it_for_its_step():
    policy = adapted()
    ahead = SampleAhead(policy, native)
    ahead.prefetch(PROMPTS, 2, SAMPLING)
    move_adapters(policy)
    other = ahead.generate(PROMPTS[:1], 3, SAMPLING)  # an evaluation in between: from the policy as it is now
    assert other.completion_ids.shape[0] == 3
    taken = ahead.generate(PROMPTS, 2, SAMPLING)
    fresh = ahead.generate(PROMPTS, 2, SAMPLING)
    assert not torch.equal(taken.sampler_logp, fresh.sampler_logp)  # the first was the one started ahead
    ahead.release_memory()
    assert ahead.held_bytes() == 0  # the engine's own, through the wrapper
    assert hasattr(ahead.engine, "turns") and not hasattr(ahead, "turns")  # episodes: through generate


def test_an_error_in_the_background_is_raised_by_the_generate_that_asks_for_it():
    ahead = SampleAhead(adapted(), native)

    def fails(*args):
        raise RuntimeError("out of memory in the decode")

    ahead.engine.generate = fails
    ahead.prefetch(PROMPTS, 2, SAMPLING)
    with pytest.raises(RuntimeError, match="out of memory in the decode"):
        ahead.generate(PROMPTS, 2, SAMPLING)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_on_cuda_the_rollout_ahead_runs_beside_training_and_still_samples_the_policy_before(fp8):
    policy = adapted(dtype=torch.bfloat16, fp8=fp8).cuda()

    def engine(model):
        return NativeEngine(model, max_seq_len=64, max_batch=6, pad_id=PAD)  # kernels, graphs, compiled pieces

    ahead = SampleAhead(policy, engine)
    assert ahead.folded is not fp8
    sampling = Sampling(max_new_tokens=40, temperature=1.0, min_p=0.1, ignore_eos=True, seed=5)
    ahead.generate(PROMPTS, 2, sampling)  # captures; the copy now holds these adapters
    move_adapters(policy)  # a step's update: the next take writes other values into the copy
    before = copy.deepcopy(policy)
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # work queued ahead of the take on the default stream: a generate that did not wait for
        x = torch.tanh(x @ x / 64)  # the take would read the copy's old values
    ahead.prefetch(PROMPTS, 2, sampling)
    for _ in range(20):  # the training pass's work meanwhile, and its update
        x = torch.tanh(x @ x / 64)
    move_adapters(policy)
    got = ahead.generate(PROMPTS, 2, sampling)
    want = SampleAhead(before, engine).generate(PROMPTS, 2, sampling)
    assert torch.equal(got.completion_ids, want.completion_ids)
    torch.testing.assert_close(got.sampler_logp, want.sampler_logp, rtol=0, atol=1e-5)
    assert torch.isfinite(x).all()


def test_adapters_it_cannot_take_are_refused_in_one_line():
    policy = adapted()
    lora_layers(policy)[0].lora_variant["default"] = object()  # what peft keeps for DoRA
    assert refusal(policy) == "DoRA and other LoRA variants are not scale * B A"
    with pytest.raises(ValueError, match="--sample-ahead: DoRA .*; fix: pass --no-sample-ahead"):
        SampleAhead(policy, native)
    assert refusal(small_llama()) == "the policy has no LoRA layers to copy"


@pytest.mark.parametrize("kw, named", [(dict(engine="vllm"), "--engine vllm"), (dict(engine="hf"), "--engine hf"),
                                       (dict(dynamic_sampling=True), "--dynamic-sampling"),
                                       (dict(environment="number-guess"), "--environment"),
                                       (dict(is_correction="none"), "--is-correction none"),
                                       (dict(engine_standby="release"), "--engine-standby release")])
def test_flags_it_cannot_serve_are_refused_in_one_line_naming_the_flag(kw, named):
    with pytest.raises(ValueError, match=named) as err:
        Config(sample_ahead=True, **kw)
    assert "--no-sample-ahead" in str(err.value) and "\n" not in str(err.value)
    Config(sample_ahead=False, **kw)  # each alone is fine


def test_fp8_weights_and_the_adapters_unfolded_are_served_with_a_copy_of_the_adapters():
    assert Config(sample_ahead=True, load_in_fp8=True).sample_ahead
    assert Config(sample_ahead=True, engine_fold_adapter=False).sample_ahead


def test_a_run_whose_engine_is_not_native_says_so_and_samples_in_each_step(tiny_llama_dir, tmp_path, capsys):
    # --engine auto on a CPU takes hf, whose sampling reseeds torch's RNGs: no thread of its own for it
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", engine="auto", sample_ahead=True, max_steps=1))
    assert "--sample-ahead is not used" in capsys.readouterr().out


@pytest.mark.slow
def test_a_process_that_ends_with_a_rollout_in_flight_exits_with_its_own_status():
    # the thread is joined at exit: killed inside a torch call, it would abort the process (status 134)
    code = (f"import sys; sys.path[:0] = {[str(ROOT / 'tests'), str(ROOT)]!r}\n"
            "from test_sample_ahead import adapted, PAD, PROMPTS\n"
            "from grpo.rollout.ahead import SampleAhead\n"
            "from grpo.rollout.base import Sampling\n"
            "from grpo.rollout.native import NativeEngine\n"
            "ahead = SampleAhead(adapted(), lambda m: NativeEngine(m, max_seq_len=1024, max_batch=6, pad_id=PAD))\n"
            "ahead.prefetch(PROMPTS, 2, Sampling(max_new_tokens=300, ignore_eos=True, seed=1))  # a second\n"
            "raise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_run_sampling_ahead_trains_each_step_on_the_rollout_started_in_the_step_before(tiny_llama_dir, tmp_path,
                                                                                        monkeypatch):
    started, received, taken = [], [], []
    prefetch, generate, received_ahead = SampleAhead.prefetch, SampleAhead.generate, SampleAhead._received

    def spy_prefetch(self, prompt_ids, n, sampling):
        started.append(sampling.seed)
        prefetch(self, prompt_ids, n, sampling)

    def spy_generate(self, prompt_ids, n, sampling):
        if n == 2:  # the steps' (the evaluations' take 1 a prompt)
            received.append((sampling.seed, self._in_flight is not None and self._in_flight.request[2] == sampling))
        return generate(self, prompt_ids, n, sampling)

    def spy_received(self, job):
        taken.append(job.request[2].seed)
        return received_ahead(self, job)

    monkeypatch.setattr(SampleAhead, "prefetch", spy_prefetch)
    monkeypatch.setattr(SampleAhead, "generate", spy_generate)
    monkeypatch.setattr(SampleAhead, "_received", spy_received)
    # an evaluation after every step: it samples while the next step's rollout is in flight
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", engine="native", sample_ahead=True, max_steps=3, eval_size=2,
                   eval_samples=1, eval_steps=1))
    assert len(started) == 2  # steps 2 and 3, each started in the step before; the last starts none
    assert [ahead for _, ahead in received] == [False, True, True]
    assert [seed for seed, _ in received][1:] == started
    assert taken == started  # steps 2 and 3 trained on the rollouts started ahead, not on new ones
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/greedy_accuracy" in r] == [0, 1, 2, 3]
    records = [r for r in records if "step_time" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("gap/logp_abs_mean" in r and not r["skipped"] for r in records)


@pytest.mark.slow
def test_a_run_on_fp8_weights_samples_ahead_through_a_copy_of_the_adapters(tiny_llama_dir, tmp_path, monkeypatch):
    built, taken = [], []
    init, received_ahead = SampleAhead.__init__, SampleAhead._received

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    def spy_received(self, job):
        taken.append(job.request[2].seed)
        return received_ahead(self, job)

    monkeypatch.setattr(SampleAhead, "__init__", spy_init)
    monkeypatch.setattr(SampleAhead, "_received", spy_received)
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", engine="native", sample_ahead=True, load_in_fp8=True,
                   max_steps=2))
    [ahead] = built
    assert not ahead.folded and any(type(m) is FP8Linear for m in ahead.model.modules())
    assert len(taken) == 1  # step 2 trained on the rollout started in step 1
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step_time" in r]
    assert [r["step"] for r in records] == [1, 2] and not any(r["skipped"] for r in records)


_answers: list[list[str]] = []


def record_answers(completions, answers, **columns):
    """A reward that differs between completions, keeping each step's reference answers (one call a step)."""
    _answers.append(list(answers))
    return [(len(text) % 7) / 7 for text in completions]


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_prompts_the_uninterrupted_one_did(tiny_llama_dir, tmp_path):
    # The checkpoint of step 2 is written while step 3's rollout is in flight; the resumed run drops nothing: its
    # step 3 samples the same prompts (from the policy it resumes), because sampling ahead only peeks at the stream
    kw = dict(engine="native", sample_ahead=True, max_steps=4, save_steps=2, log_completions_steps=0,
              reward=("test_sample_ahead:record_answers",))
    _answers.clear()
    train(tiny_cfg(tiny_llama_dir, tmp_path / "a", **kw))
    straight = list(_answers)
    _answers.clear()
    train(tiny_cfg(tiny_llama_dir, tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"), **kw))
    assert len(straight) == 4 and len({tuple(a) for a in straight}) == 4
    assert _answers == straight[2:]


def train(cfg):
    from grpo.trainer import train as run

    return run(cfg)
