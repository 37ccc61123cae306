"""The calls grpo/rollout/vllm.py and grpo/rollout/unsloth.py make to vLLM and Unsloth, checked against fakes
(no vllm needed).

tests/test_vllm.py runs the same engine against a real vLLM (scripts/test-vllm.sh); this file
pins down the contract where vLLM is absent, and the pieces that are pure logic: Sampling ->
SamplingParams, per-prompt seeds, one fresh adapter per call, outputs -> Rollout, stop sequences,
sleep/wake, the log-softmax logits processor's arithmetic, and the error messages.
"""

from __future__ import annotations

import abc
import enum
import importlib.machinery
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import grpo.rollout.unsloth as ru
import grpo.rollout.vllm as rv
from grpo.rollout.base import Engine, Sampling


# --- fakes of the vLLM surface the backend uses -------------------------------------------------

class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        if kw.get("temperature", 1.0) < 1e-5 and kw.get("n", 1) > 1:  # as vLLM: greedy needs n=1
            raise ValueError(f"n must be 1 when using greedy sampling, got {kw['n']}.")


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    index: int
    token_ids: list
    logprobs: list
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list


def fake_tokens(seed: int, length: int) -> list[int]:
    return [(seed * 7 + 3 * j) % 97 + 1 for j in range(length)]


@dataclass
class FakeLLM:
    """Records every call; generates tokens from each request's seed, stops at stop_token_ids."""

    kwargs: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    logprobs_mode: str = "processed_logits"

    def __post_init__(self):
        llm = self
        self.llm_engine = types.SimpleNamespace(
            remove_lora=lambda i: llm.removed.append(i) or True,
            model_config=types.SimpleNamespace(logprobs_mode=self.logprobs_mode, enable_sleep_mode=False),
        )

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append(("generate", prompts, params, lora_request))
        outs = []
        for prompt, p in zip(prompts, params):
            comps = []
            for k in range(p.n):
                ids = fake_tokens(p.seed + k, p.max_tokens)
                reason = "length"
                for j, t in enumerate(ids):
                    if t in p.stop_token_ids:
                        ids, reason = ids[: j + 1], "stop"
                        break
                logprobs = [{t: Logprob(-0.01 * (j + 1) - k)} for j, t in enumerate(ids)]
                comps.append(Completion(k, ids, logprobs, reason))
            outs.append(RequestOutput(comps[::-1]))  # out of index order on purpose
        return outs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))


class FakeLogitsProcessorBase(abc.ABC):
    pass


class FakeMoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm, vllm.lora.request and vllm.v1.sample.logits_processor as fakes; LLM() builds a FakeLLM."""
    built: list[FakeLLM] = []

    def LLM(**kwargs):
        llm = FakeLLM(kwargs=kwargs)
        built.append(llm)
        return llm

    mods = {
        "vllm": _module("vllm", LLM=LLM, SamplingParams=FakeSamplingParams, __version__="0.32.0"),
        "vllm.lora": _module("vllm.lora"),
        "vllm.lora.request": _module("vllm.lora.request", LoRARequest=FakeLoRARequest),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.sample": _module("vllm.v1.sample"),
        "vllm.v1.sample.logits_processor": _module(
            "vllm.v1.sample.logits_processor", LogitsProcessor=FakeLogitsProcessorBase,
            MoveDirectionality=FakeMoveDirectionality),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "grpo.vllm_logits", raising=False)  # imported against these fakes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return built


class FakePolicy:
    """A peft model as far as the engine cares: save_pretrained(path, ...) writes an adapter."""

    def __init__(self):
        self.saved: list[str] = []
        self.with_embeddings: list = []  # each save's save_embedding_layers

    def save_pretrained(self, path, save_embedding_layers="auto"):
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_config.json").write_text(json.dumps({"r": 8, "use_rslora": True}))
        (Path(path) / "adapter_model.safetensors").write_bytes(b"weights")
        self.saved.append(str(path))
        self.with_embeddings.append(save_embedding_layers)


def make_engine(tmp_path, **kw):
    policy = FakePolicy()
    engine = rv.VLLMEngine(policy, "some/base-model", lora_rank=kw.pop("lora_rank", 32), max_model_len=64,
                           dtype="bf16", seed=3407, work_dir=str(tmp_path / "work"), **kw)
    return engine, policy


# --- LLM construction ---------------------------------------------------------------------------

def test_llm_is_built_with_lora_processed_logits_and_our_logits_processor(fake_vllm, tmp_path):
    engine, _ = make_engine(tmp_path, lora_rank=4, gpu_memory_utilization=0.4)
    kw = fake_vllm[0].kwargs
    assert kw["model"] == "some/base-model" and kw["dtype"] == "bfloat16" and kw["seed"] == 3407
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 8  # 4 rounded up to vLLM's next rank
    assert kw["max_model_len"] == 64 and kw["gpu_memory_utilization"] == 0.4
    assert kw["logprobs_mode"] == "processed_logits"
    assert kw["logits_processors"] == ["grpo.vllm_logits:LogSoftmaxAtTemperature"]
    assert kw["enforce_eager"] is True  # no CUDA here
    assert "enable_sleep_mode" not in kw  # vLLM's CPU build rejects it
    assert isinstance(engine, Engine)


def test_cuda_turns_on_sleep_mode_and_cuda_graphs(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    make_engine(tmp_path)
    kw = fake_vllm[0].kwargs
    assert kw["enable_sleep_mode"] is True and kw["enforce_eager"] is False


def test_extra_llm_kwargs_override_the_defaults(fake_vllm, tmp_path):
    make_engine(tmp_path, max_loras=2, max_num_seqs=8)
    assert fake_vllm[0].kwargs["max_loras"] == 2 and fake_vllm[0].kwargs["max_num_seqs"] == 8


def test_the_logits_processor_fqcn_resolves_to_a_vllm_logits_processor(fake_vllm):
    module_name, qualname = rv.LOGITS_PROCESSOR.split(":")
    cls = getattr(importlib.import_module(module_name), qualname)
    assert issubclass(cls, FakeLogitsProcessorBase) and cls.__module__ == "grpo.vllm_logits"
    assert cls(None, torch.device("cpu"), False).is_argmax_invariant() is False


# --- generate: the calls made and the Rollout built -------------------------------------------

def test_generate_sends_token_prompts_one_seeded_params_per_prompt_and_one_adapter(fake_vllm, tmp_path):
    engine, policy = make_engine(tmp_path)
    llm = fake_vllm[0]
    sampling = Sampling(max_new_tokens=5, temperature=0.9, top_p=0.95, top_k=0, min_p=0.1,
                        stop_token_ids=(128009,))
    prompts = [[1, 2, 3], [1, 2, 3], [4]]
    rollout = engine.generate(prompts, 2, sampling)

    kind, sent, params, lora = llm.calls[-1]
    assert kind == "generate"
    assert sent == [{"prompt_token_ids": p} for p in prompts]
    assert isinstance(lora, FakeLoRARequest) and lora.lora_int_id == 1 and lora.lora_name == "grpo-1"
    assert lora.lora_path == policy.saved[-1] and Path(lora.lora_path).name == "adapter-1"
    p = params[0]
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (2, 0.9, 0.95, 0, 0.1, 5)
    assert p.logprobs == 0 and p.stop_token_ids == [128009] and p.ignore_eos is True
    assert p.detokenize is False
    seeds = [q.seed for q in params]
    assert seeds == [rv.prompt_seed(3407, 1, i) for i in range(3)]
    assert len(set(seeds)) == 3  # identical prompts still get their own stream

    assert rollout.completion_ids.shape == (6, 5) and rollout.num_generations == 2
    assert rollout.prompt_ids == prompts
    # Group order: row 2*i + k is prompt i's k-th sample (the fake returned them reversed).
    for i in range(3):
        for k in range(2):
            assert rollout.completions()[2 * i + k] == fake_tokens(seeds[i] + k, 5)
            assert rollout.sampler_logp[2 * i + k, 0].item() == pytest.approx(-0.01 - k)
    assert rollout.sampler_logp.dtype == torch.float32 and rollout.mask.all()
    assert not rollout.finished.any()
    assert {"adapter_sync", "generate"} <= set(rollout.timings)


def test_each_call_saves_a_new_adapter_with_a_new_id_and_drops_the_old_one(fake_vllm, tmp_path):
    engine, policy = make_engine(tmp_path)
    llm = fake_vllm[0]
    for _ in range(3):
        engine.generate([[1, 2]], 2, Sampling(max_new_tokens=3))
    ids = [c[3].lora_int_id for c in llm.calls if c[0] == "generate"]
    names = [c[3].lora_name for c in llm.calls if c[0] == "generate"]
    assert ids == [1, 2, 3] and names == ["grpo-1", "grpo-2", "grpo-3"]
    assert llm.removed == [1, 2]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["adapter-3"]
    assert len(policy.saved) == 3 and policy.with_embeddings == [False] * 3  # the LoRA weights only


def test_seeds_change_per_call_unless_sampling_fixes_one(fake_vllm, tmp_path):
    engine, _ = make_engine(tmp_path)
    llm = fake_vllm[0]
    engine.generate([[1]], 2, Sampling(max_new_tokens=3))
    engine.generate([[1]], 2, Sampling(max_new_tokens=3))
    engine.generate([[1]], 2, Sampling(max_new_tokens=3, seed=11))
    engine.generate([[1]], 2, Sampling(max_new_tokens=3, seed=11))
    seeds = [c[2][0].seed for c in llm.calls if c[0] == "generate"]
    assert seeds[0] != seeds[1]
    assert seeds[2] == seeds[3] == rv.prompt_seed(11, None, 0)


def test_greedy_with_n_above_one_sends_each_prompt_n_times(fake_vllm, tmp_path):
    engine, _ = make_engine(tmp_path)
    rollout = engine.generate([[1], [2]], 3, Sampling(max_new_tokens=4, temperature=0.0))
    _, sent, params, _ = fake_vllm[0].calls[-1]
    assert sent == [{"prompt_token_ids": [1]}] * 3 + [{"prompt_token_ids": [2]}] * 3
    assert all(p.n == 1 and p.temperature == 0.0 for p in params)
    assert rollout.completion_ids.shape == (6, 4)
    assert rollout.completions()[0] == fake_tokens(params[0].seed, 4)
    assert rollout.completions()[3] == fake_tokens(params[3].seed, 4)


def test_stop_tokens_pad_and_mask_and_stop_sequences_cut_after_the_first_match(fake_vllm, tmp_path):
    engine, _ = make_engine(tmp_path, pad_id=128004)
    seed0 = rv.prompt_seed(5, None, 0)
    tokens = fake_tokens(seed0, 8)  # what the fake makes for sample 0
    sampling = Sampling(max_new_tokens=8, seed=5, stop_token_ids=(tokens[2],))
    rollout = engine.generate([[1]], 2, sampling)
    assert rollout.completions()[0] == tokens[:3] and rollout.finished[0]
    assert rollout.completion_ids[0, 3:].eq(128004).all() and rollout.sampler_logp[0, 3:].eq(0).all()
    assert rollout.mask[0].tolist() == [True] * 3 + [False] * (rollout.mask.shape[1] - 3)

    seq = (tokens[4], tokens[5])
    cut = engine.generate([[1]], 2, Sampling(max_new_tokens=8, seed=5, stop_sequences=((999,), seq)))
    assert cut.completions()[0] == tokens[:6] and cut.finished[0]
    assert cut.sampler_logp[0, :6].tolist() == pytest.approx([-0.01 * (j + 1) for j in range(6)])
    ignore = engine.generate([[1]], 2, Sampling(max_new_tokens=8, seed=5, stop_sequences=(seq,),
                                                 stop_token_ids=(tokens[2],), ignore_eos=True))
    assert fake_vllm[0].calls[-1][2][0].stop_token_ids == []
    assert ignore.completions()[0] == tokens and not ignore.finished[0]


def test_release_memory_sleeps_on_cuda_and_generate_wakes_first(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine, _ = make_engine(tmp_path)
    llm = fake_vllm[0]
    engine.generate([[1]], 2, Sampling(max_new_tokens=2))
    engine.release_memory()
    engine.release_memory()  # already asleep: no second sleep
    engine.generate([[1]], 2, Sampling(max_new_tokens=2))
    assert [c[0] for c in llm.calls] == ["generate", "sleep", "wake_up", "generate"]
    assert llm.calls[1] == ("sleep", 1)


def test_release_memory_is_a_no_op_on_cpu(fake_vllm, tmp_path):
    engine, _ = make_engine(tmp_path)
    engine.generate([[1]], 2, Sampling(max_new_tokens=2))
    engine.release_memory()
    assert [c[0] for c in fake_vllm[0].calls] == ["generate"]


@pytest.mark.parametrize("sleeps, in_process_pool, collects", [(True, 2**30, True), (True, 0, False),
                                                                (False, 2**30, False)])
def test_the_engine_says_it_collects_every_step_only_where_it_sleeps_in_this_process(
        fake_vllm, tmp_path, monkeypatch, sleeps, in_process_pool, collects):
    from grpo.rollout import vllm as vllm_engines

    monkeypatch.setattr(torch.cuda, "is_available", lambda: sleeps)  # sleep mode is CUDA's
    monkeypatch.setattr(vllm_engines, "in_process_vllm_pool_bytes", lambda: in_process_pool)
    engine, _ = make_engine(tmp_path)
    assert engine.full_gc_each_step is collects  # vLLM's sleep and wake run gc.collect() where they run


def test_bad_inputs_raise_one_line_value_errors(fake_vllm, tmp_path):
    engine, _ = make_engine(tmp_path)
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], 2, Sampling())
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([[1], []], 2, Sampling())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 64], 2, Sampling())
    with pytest.raises(ValueError, match="dtype"):
        rv.VLLMEngine(FakePolicy(), "m", lora_rank=8, max_model_len=8, dtype="int4", seed=0, work_dir=str(tmp_path))
    with pytest.raises(ValueError, match="up to 512"):
        rv.vllm_lora_rank(1024)


def test_an_llm_with_raw_logprobs_refuses_temperatures_other_than_0_and_1(fake_vllm, tmp_path):
    llm = FakeLLM(logprobs_mode="raw_logprobs")
    engine, _ = make_engine(tmp_path, llm=llm)
    assert not fake_vllm  # the given LLM is used, none built
    engine.generate([[1]], 2, Sampling(max_new_tokens=2, temperature=1.0))
    engine.generate([[1]], 2, Sampling(max_new_tokens=2, temperature=0.0))
    with pytest.raises(ValueError, match="temperature 1"):
        engine.generate([[1]], 2, Sampling(max_new_tokens=2, temperature=0.7))


# --- the logits processor: arithmetic and batch bookkeeping -------------------------------------

def test_logits_processor_makes_logits_over_t_equal_log_softmax_at_t_for_each_row(fake_vllm):
    cls = importlib.import_module("grpo.vllm_logits").LogSoftmaxAtTemperature
    proc = cls(None, torch.device("cpu"), False)
    P = types.SimpleNamespace
    added = [(0, P(temperature=0.7), None, []), (1, P(temperature=0.0), None, []),
             (2, P(temperature=1.3), None, [])]
    proc.update_state(P(removed=[], added=added, moved=[], batch_size=3))
    torch.manual_seed(0)
    logits = torch.randn(4, 50, dtype=torch.float64) * 3  # row 3: no request state -> T = 1
    out = proc.apply(logits.clone())
    temps = torch.tensor([0.7, 1.0, 1.3, 1.0], dtype=torch.float64)[:, None]  # greedy reports at T = 1
    torch.testing.assert_close(out / temps, torch.log_softmax(logits / temps, -1))
    # Truncation afterwards only masks other tokens: the kept token's value is unchanged.
    masked = (out / temps).masked_fill(torch.arange(50) > 10, float("-inf"))
    torch.testing.assert_close(masked[:, :11], torch.log_softmax(logits / temps, -1)[:, :11])


def test_logits_processor_follows_removes_adds_moves_and_swaps(fake_vllm):
    cls = importlib.import_module("grpo.vllm_logits").LogSoftmaxAtTemperature
    proc = cls(None, torch.device("cpu"), False)
    P = types.SimpleNamespace
    SWAP, ONE_WAY = FakeMoveDirectionality.SWAP, FakeMoveDirectionality.UNIDIRECTIONAL
    proc.update_state(P(removed=[], moved=[], batch_size=3, added=[
        (0, P(temperature=0.5), None, []), (1, P(temperature=2.0), None, []), (2, P(temperature=0.8), None, [])]))
    proc.update_state(P(removed=[1], added=[], moved=[(2, 1, ONE_WAY)], batch_size=2))
    assert proc.temperature == {0: 0.5, 1: 0.8}
    proc.update_state(P(removed=[], added=[(2, P(temperature=1.5), None, [])], moved=[(0, 2, SWAP)],
                        batch_size=3))
    assert proc.temperature == {0: 1.5, 1: 0.8, 2: 0.5}
    proc.update_state(P(removed=[], added=[], moved=[(2, 1, ONE_WAY)], batch_size=2))  # replaces 1's request
    assert proc.temperature == {0: 1.5, 1: 0.5}
    proc.update_state(P(removed=[], moved=[], batch_size=3, added=[(2, P(temperature=0.5), None, [])]))
    proc.update_state(None)  # no change
    logits = torch.randn(3, 20, dtype=torch.float64)
    temps = torch.tensor([1.5, 0.5, 0.5], dtype=torch.float64)[:, None]
    torch.testing.assert_close(proc.apply(logits.clone()) / temps, torch.log_softmax(logits / temps, -1))


# --- errors without vllm, FP8 on old GPUs -----------------------------------------------------

def test_engine_without_vllm_says_which_extra_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rv.vllm_available() is False
    with pytest.raises(ImportError, match=r"pip install 'grpo\[vllm\]'"):
        rv.VLLMEngine(FakePolicy(), "m", lora_rank=8, max_model_len=64, dtype="bf16", seed=0, work_dir=str(tmp_path))


@pytest.mark.slow
def test_importing_the_engines_imports_neither_vllm_nor_unsloth():
    import subprocess

    code = ("import sys, grpo.rollout; "
            "print(any(k == 'vllm' or k.startswith('vllm.') or k == 'unsloth' for k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")


def test_fp8_below_sm89_says_to_use_the_bf16_checkpoint(monkeypatch):
    _fake_gpu(monkeypatch, (8, 6))
    with pytest.raises(ValueError, match="sm_86.*bf16 checkpoint.*unsloth/Llama-3.2-1B-Instruct"):
        rv.check_fp8_supported(True)
    rv.check_fp8_supported(False)  # bf16: fine anywhere
    _fake_gpu(monkeypatch, (8, 9))
    rv.check_fp8_supported(True)


def test_fp8_checkpoints_are_recognised_by_config_or_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert rv.is_fp8_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert not rv.is_fp8_checkpoint(str(tmp_path))
    assert rv.is_fp8_checkpoint("unsloth/Llama-3.2-1B-Instruct-FP8-Block")
    assert not rv.is_fp8_checkpoint("unsloth/Llama-3.2-1B-Instruct")


def test_vllm_engine_refuses_an_fp8_checkpoint_below_sm89(fake_vllm, monkeypatch, tmp_path):
    _fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(ValueError, match="bf16 checkpoint"):
        rv.VLLMEngine(FakePolicy(), "unsloth/Llama-3.2-1B-Instruct-FP8-Block", lora_rank=32, max_model_len=64,
                      dtype="bf16", seed=0, work_dir=str(tmp_path))
    assert not fake_vllm  # refused before vLLM was started


# --- Unsloth --------------------------------------------------------------------------------------

class FakeUnslothModel:
    def __init__(self, llm):
        self.vllm_engine = llm
        self.loaded: list = []
        self.peft_kwargs: dict = {}

    def load_lora(self, path, load_tensors=False):
        self.loaded.append((path, load_tensors))
        return FakeLoRARequest(str(len(self.loaded)), len(self.loaded), path)

    def fast_generate(self, prompts, sampling_params=None, lora_request=None, use_tqdm=True):
        return self.vllm_engine.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)


@pytest.fixture
def fake_unsloth(fake_vllm, monkeypatch):
    seen: dict = {}
    llm = FakeLLM(logprobs_mode="raw_logprobs")
    llm.llm_engine.model_config.enable_sleep_mode = True
    model = FakeUnslothModel(llm)

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kw):
            seen["from_pretrained"] = kw
            seen["util_override_at_load"] = __import__("os").environ.get("UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE")
            return model, "tokenizer"

        @staticmethod
        def get_peft_model(m, **kw):
            seen["get_peft_model"] = kw
            return m

    mod = _module("unsloth")

    def module_getattr(name):  # `from unsloth import X` lands here: record the env at import time
        if name == "FastLanguageModel":
            seen["standby_at_import"] = __import__("os").environ.get("UNSLOTH_VLLM_STANDBY")
            return FastLanguageModel
        raise AttributeError(name)

    mod.__getattr__ = module_getattr
    monkeypatch.setitem(sys.modules, "unsloth", mod)
    monkeypatch.delenv("UNSLOTH_VLLM_STANDBY", raising=False)
    monkeypatch.delenv("UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE", raising=False)
    monkeypatch.setenv("UNSLOTH_RETURN_LOGITS", "1")  # monkeypatch restores it afterwards
    _fake_gpu(monkeypatch, (9, 0))
    return seen, model, llm


def _load(tmp_path, **kw):
    """(policy, tokenizer, engine) as `--engine unsloth` builds them: the engine loads its own policy."""
    from grpo.rollout import build_engine

    sizes = dict(max_seq_len=kw.pop("max_seq_length", 1024), max_batch=kw.pop("rows", 16))
    args = dict(model=kw.pop("model_name", "unsloth/Llama-3.2-1B-Instruct"), load_in_fp8=True, lora_rank=32,
                lora_alpha=64, use_rslora=True, target_modules=("q_proj", "v_proj"), gpu_memory_utilization=0.6,
                seed=3407, work_dir=str(tmp_path / "u"))
    args.update(kw)
    engine = build_engine("unsloth", None, pad_id=0, **sizes, unsloth=ru.UnslothOptions(**args))
    return engine.policy, engine.tokenizer, engine


def test_unsloth_loads_with_standby_fast_inference_fp8_and_rslora(fake_unsloth, tmp_path):
    seen, model, _ = fake_unsloth
    got_model, tokenizer, engine = _load(tmp_path)
    assert seen["standby_at_import"] == "1"
    fp = seen["from_pretrained"]
    assert fp["fast_inference"] is True and fp["load_in_fp8"] is True and fp["max_lora_rank"] == 32
    assert fp["max_seq_length"] == 1024 and fp["gpu_memory_utilization"] == 0.6 and fp["load_in_4bit"] is False
    peft = seen["get_peft_model"]
    assert (peft["r"], peft["lora_alpha"], peft["use_rslora"]) == (32, 64, True)
    assert peft["target_modules"] == ["q_proj", "v_proj"] and peft["random_state"] == 3407
    assert got_model is model and tokenizer == "tokenizer" and isinstance(engine, ru.UnslothEngine)
    assert isinstance(engine, Engine)


@pytest.mark.parametrize("load_in_fp8", [True, False])
def test_unsloth_leaves_a_prequantized_fp8_block_checkpoint_to_its_own_quantization_config(
        fake_unsloth, tmp_path, load_in_fp8):
    # vLLM refuses load_in_fp8 (fp8_per_channel) on top of a checkpoint whose config says fp8 blocks
    seen, _, _ = fake_unsloth
    _load(tmp_path, model_name="unsloth/Llama-3.2-1B-Instruct-FP8-Block", load_in_fp8=load_in_fp8)
    assert seen["from_pretrained"]["load_in_fp8"] is False
    assert seen["from_pretrained"]["model_name"] == "unsloth/Llama-3.2-1B-Instruct-FP8-Block"


def test_unsloth_engine_sends_the_live_lora_tensors_with_a_fresh_request_each_call(fake_unsloth, tmp_path):
    _, model, llm = fake_unsloth
    _, _, engine = _load(tmp_path)
    for _ in range(2):
        rollout = engine.generate([[1, 2], [3]], 2, Sampling(max_new_tokens=4, temperature=1.0, min_p=0.1))
        engine.release_memory()
    assert model.loaded == [(str(tmp_path / "u" / "unsloth-adapter"), True)] * 2
    gens = [c for c in llm.calls if c[0] == "generate"]
    assert [g[3].lora_int_id for g in gens] == [1, 2]
    assert [c[0] for c in llm.calls] == ["generate", "sleep", "wake_up", "generate", "sleep"]
    assert rollout.completion_ids.shape == (4, 4) and gens[-1][2][0].logprobs == 0


def test_unsloth_engine_refuses_temperatures_its_raw_logprobs_cannot_report(fake_unsloth, tmp_path):
    _, _, engine = _load(tmp_path)
    with pytest.raises(ValueError, match="temperature 1"):
        engine.generate([[1]], 2, Sampling(max_new_tokens=2, temperature=0.8))


def test_unsloth_fp8_below_sm89_and_no_gpu_give_clear_errors(fake_unsloth, tmp_path, monkeypatch):
    seen, _, _ = fake_unsloth
    _fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(ValueError, match="bf16 checkpoint"):
        _load(tmp_path)
    assert "from_pretrained" not in seen
    _load(tmp_path, load_in_fp8=False)  # bf16 on the A100: fine
    assert seen["from_pretrained"]["load_in_fp8"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        _load(tmp_path)


def test_unsloth_missing_says_what_to_install(fake_vllm, monkeypatch, tmp_path):
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "unsloth", None)
    monkeypatch.delenv("UNSLOTH_VLLM_STANDBY", raising=False)
    monkeypatch.delenv("UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE", raising=False)
    monkeypatch.setenv("UNSLOTH_RETURN_LOGITS", "1")
    with pytest.raises(ImportError, match=r"grpo\[unsloth,vllm\]"):
        _load(tmp_path)


def test_the_engine_flag_alone_chooses_unsloth_and_only_unsloth_loads_its_own_policy():
    from grpo.config import Config
    from grpo.rollout import build_engine, loads_its_own_policy

    assert loads_its_own_policy("unsloth")
    assert not any(loads_its_own_policy(name) for name in ("vllm", "native", "hf", "auto"))
    assert Config(engine="unsloth").engine == "unsloth"
    with pytest.raises(ValueError, match=r"--engine unsloth: build_engine needs unsloth=UnslothOptions"):
        build_engine("unsloth", None, pad_id=0, max_seq_len=8, max_batch=1)
    options = ru.UnslothOptions(model="m", lora_rank=8, lora_alpha=8, target_modules=("q_proj",), seed=0,
                                work_dir="w")
    with pytest.raises(ValueError, match="the engine loads the policy itself"):  # never over another policy
        build_engine("unsloth", FakePolicy(), pad_id=0, max_seq_len=8, max_batch=1, unsloth=options)


def test_build_engine_takes_the_vllm_options_as_one_value_and_says_when_they_are_missing():
    from grpo.rollout import build_engine

    with pytest.raises(ValueError, match=r"--engine vllm: build_engine needs vllm=VLLMOptions"):
        build_engine("vllm", None, pad_id=0, max_seq_len=8, max_batch=1)
    with pytest.raises(TypeError):  # another engine's options are not taken loose any more
        build_engine("hf", None, pad_id=0, max_seq_len=8, max_batch=1, lora_rank=8)


# --- memory: the share the user chose, and vLLM's pool apart from the trainer's --------------------

def test_unsloth_keeps_the_users_vllm_share_under_standby_and_can_run_eager(fake_unsloth, tmp_path):
    seen, _, _ = fake_unsloth
    _, _, engine = _load(tmp_path, gpu_memory_utilization=0.3, enforce_eager=True)
    fp = seen["from_pretrained"]
    assert fp["gpu_memory_utilization"] == 0.3 and fp["enforce_eager"] is True
    # Without the override, Unsloth's standby replaces the share by its own (0.88 on an H200).
    assert seen["standby_at_import"] == "1" and seen["util_override_at_load"] == "1"
    assert engine.gpu_memory_utilization == 0.3
    _load(tmp_path)
    assert seen["from_pretrained"]["enforce_eager"] is False  # CUDA graphs unless asked


def _checkpoint(directory, *, weight_bytes: int):
    """A Llama checkpoint's folder as the share's sizing reads it: config.json, and a safetensors file of
    `weight_bytes` (sparse: nothing is written)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 128256}))
    with open(directory / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)
    return directory


def test_unsloths_share_is_sized_for_the_runs_rows_by_default(fake_unsloth, tmp_path, monkeypatch):
    GiB = 2**30
    _fake_device(monkeypatch, total_gib=100.0, peak_gib=0.0, in_process_gib=None)
    ckpt = _checkpoint(tmp_path / "ckpt", weight_bytes=int(2.3 * GiB))  # the 1B model in bf16
    seen, _, _ = fake_unsloth
    _, _, engine = _load(tmp_path, model_name=str(ckpt), gpu_memory_utilization=None, rows=16, max_seq_length=640)
    fp = seen["from_pretrained"]
    # 2.3 GiB of weights + 384 MiB of KV cache (16 rows of 640 tokens, rounded to 768) + the overhead of 5 GiB:
    # 7.675 GiB of 100, rounded up to a hundredth
    assert ru.UNSLOTH_ENGINE_OVERHEAD_BYTES == 5 * GiB
    assert fp["gpu_memory_utilization"] == engine.gpu_memory_utilization == 0.08
    assert fp["max_num_seqs"] == 16  # else Unsloth picks 8-256 by what its share leaves for the KV cache
    # 1024 rows of 2048 tokens need 64 GiB of KV cache: the share grows with them
    _load(tmp_path, model_name=str(ckpt), gpu_memory_utilization=None, rows=1024, max_seq_length=2048)
    assert seen["from_pretrained"]["gpu_memory_utilization"] == 0.72
    assert seen["from_pretrained"]["max_num_seqs"] == 1024
    # A share the user gives is kept, and the rows still cap vLLM's sequences
    _load(tmp_path, model_name=str(ckpt), gpu_memory_utilization=0.3, rows=16)
    assert (seen["from_pretrained"]["gpu_memory_utilization"], seen["from_pretrained"]["max_num_seqs"]) == (0.3, 16)


def test_unsloths_share_sized_past_the_whole_gpu_names_the_flags_to_change(fake_unsloth, tmp_path, monkeypatch):
    _fake_device(monkeypatch, total_gib=7.5, peak_gib=0.0, in_process_gib=None)
    ckpt = _checkpoint(tmp_path / "ckpt", weight_bytes=2**30)  # + 2 GiB of KV cache + the 5 GiB overhead
    with pytest.raises(ValueError, match=r"vLLM needs 8\.0 GiB for 64 rows of 1024 tokens.*7\.5 GiB.*"
                                         r"--max-seq-length.*--vllm-gpu-memory-utilization"):
        _load(tmp_path, model_name=str(ckpt), gpu_memory_utilization=None, rows=64, max_seq_length=1024)


def test_vllm_engine_runs_eager_on_cuda_only_when_asked(fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    graphs = rv.vllm_llm_kwargs("m", lora_rank=8, max_model_len=64, dtype="bf16", seed=0)
    eager = rv.vllm_llm_kwargs("m", lora_rank=8, max_model_len=64, dtype="bf16", seed=0, enforce_eager=True)
    assert graphs["enforce_eager"] is False and eager["enforce_eager"] is True


def _fake_device(monkeypatch, *, total_gib: float, peak_gib: float, in_process_gib: float | None):
    """A CUDA device of `total_gib`, torch's peak allocated, and vLLM's sleep-mode allocator in this process
    holding `in_process_gib` (None: never started here)."""
    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=total_gib * GiB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: int(peak_gib * GiB))

    class CuMemAllocator:
        instance = None if in_process_gib is None else types.SimpleNamespace(
            get_current_usage=lambda: int(in_process_gib * GiB))

    monkeypatch.setitem(sys.modules, "vllm.device_allocator", _module("vllm.device_allocator"))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", _module("vllm.device_allocator.cumem",
                                                                            CuMemAllocator=CuMemAllocator))


@pytest.mark.parametrize("in_process_gib, trainer_gib", [(40.0, 5.0), (None, 45.0)],
                         ids=["engine-core-in-this-process", "engine-core-in-its-own-process"])
def test_the_trainers_peak_leaves_out_the_part_of_vllms_pool_that_torch_counts(
        fake_vllm, tmp_path, monkeypatch, in_process_gib, trainer_gib):
    from grpo.run.log import step_memory_gib

    engine, _ = make_engine(tmp_path, gpu_memory_utilization=0.4)
    _fake_device(monkeypatch, total_gib=100.0, peak_gib=45.0, in_process_gib=in_process_gib)
    assert step_memory_gib(torch.device("cuda"), engine) == pytest.approx((trainer_gib, 40.0))
    # The share vLLM says it runs with wins over the one asked (Unsloth may have changed it).
    engine.llm.llm_engine.vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(gpu_memory_utilization=0.88))
    assert step_memory_gib(torch.device("cuda"), engine)[1] == pytest.approx(88.0)


LLAMA_1B = types.SimpleNamespace(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                 hidden_size=2048)


def test_the_kv_cache_for_the_run_holds_every_row_at_full_length_and_no_more():
    # Llama 3.2 1B: K and V x 16 layers x 8 KV heads x 64 dims x 2 bytes = 32 KiB a token; the bench's
    # 16 rows of 128 + 512 tokens, each rounded up to 768: 384 MiB (a share of 0.35 is 48.9 GiB of an H200)
    assert rv.kv_cache_bytes_for(LLAMA_1B, rows=16, max_model_len=640, dtype="bf16") == 16 * 768 * 32768
    assert rv.kv_cache_bytes_for(LLAMA_1B, rows=16, max_model_len=768, dtype="auto") == 16 * 768 * 32768
    assert rv.kv_cache_bytes_for(LLAMA_1B, rows=1, max_model_len=769, dtype="fp32") == 1024 * 65536
    qwen3 = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=None,
                                  hidden_size=1024, head_dim=128)  # a head_dim of its own; KV heads = heads
    per_token = 2 * 2 * 16 * 128 * 2
    assert rv.kv_cache_bytes_for(qwen3, rows=3, max_model_len=256, dtype="bfloat16") == 3 * 256 * per_token
    nested = types.SimpleNamespace(text_config=qwen3)  # a multimodal model's config holds the language model's
    assert rv.kv_cache_bytes_for(nested, rows=3, max_model_len=256, dtype="bf16") == 3 * 256 * per_token


def test_without_a_share_build_engine_sizes_vllms_kv_cache_for_its_rows(fake_vllm, tmp_path):
    from grpo.rollout import VLLMOptions, build_engine

    policy = FakePolicy()
    policy.config = LLAMA_1B
    options = dict(model_path="some/base-model", lora_rank=32, dtype="bf16", seed=0, work_dir=str(tmp_path))
    build_engine("vllm", policy, pad_id=0, max_seq_len=640, max_batch=16, vllm=VLLMOptions(**options))
    kw = fake_vllm[-1].kwargs
    assert kw["kv_cache_memory_bytes"] == 16 * 768 * 32768
    assert kw["gpu_memory_utilization"] == rv.GPU_MEMORY_UTILIZATION  # only vLLM's start-up check then
    build_engine("vllm", policy, pad_id=0, max_seq_len=640, max_batch=16,
                 vllm=VLLMOptions(**options, gpu_memory_utilization=0.5))
    assert "kv_cache_memory_bytes" not in fake_vllm[-1].kwargs
    assert fake_vllm[-1].kwargs["gpu_memory_utilization"] == 0.5


def test_a_kv_cache_sized_for_the_run_reports_what_vllm_took_at_start_up(fake_vllm, tmp_path, monkeypatch):
    from grpo.run.log import step_memory_gib

    GiB = 2**30
    _fake_device(monkeypatch, total_gib=100.0, peak_gib=6.0, in_process_gib=None)
    # Before vLLM: 10 GiB in use, 4 of them torch's; after: 20 GiB, 5 of them torch's. vLLM's process took 9.
    readings = iter([((90 * GiB, 100 * GiB), 4 * GiB), ((80 * GiB, 100 * GiB), 5 * GiB)])
    current = {}

    def mem_get_info(device=None):
        current.update(zip(("info", "reserved"), next(readings)))
        return current["info"]

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: current["reserved"])
    engine, _ = make_engine(tmp_path, kv_cache_bytes=GiB)
    assert engine.pool_bytes() == 9 * GiB
    assert step_memory_gib(torch.device("cuda"), engine) == pytest.approx((6.0, 9.0))


def test_an_engine_without_a_pool_and_a_cpu_run_report_the_trainers_memory_alone(fake_vllm, tmp_path, monkeypatch):
    from grpo.run.log import step_memory_gib

    engine, _ = make_engine(tmp_path)
    _fake_device(monkeypatch, total_gib=100.0, peak_gib=6.0, in_process_gib=None)
    assert step_memory_gib(torch.device("cuda"), object()) == (pytest.approx(6.0), None)  # native, hf: ours
    peak, pool = step_memory_gib(torch.device("cpu"), engine)  # vLLM's CPU build: no GPU pool to report
    assert pool is None and peak > 0


# --- Unsloth's log-probs: raw asked for, processed ones refused where they are not the trainer's ------

def test_unsloth_is_asked_for_raw_logprobs_not_its_training_default(fake_unsloth, tmp_path):
    seen, _, _ = fake_unsloth
    _, _, engine = _load(tmp_path)
    # load_vllm(training=True) would report processed_logprobs: renormalised over what min_p keeps
    assert seen["from_pretrained"]["training"] is False and engine.logprob_semantics == "raw"


def test_an_engine_reporting_processed_logprobs_refuses_truncation_and_serves_without_it(fake_unsloth, tmp_path):
    _, _, llm = fake_unsloth
    llm.llm_engine.model_config.logprobs_mode = "processed_logprobs"
    _, _, engine = _load(tmp_path)
    assert engine.logprob_semantics == "processed"
    for cut in (dict(min_p=0.1), dict(top_k=50), dict(top_p=0.9)):
        with pytest.raises(ValueError, match="renormalised over the kept tokens"):
            engine.generate([[1]], 2, Sampling(max_new_tokens=2, temperature=1.0, **cut))
    # untruncated, processed log-probs are log softmax(logits / T): any temperature
    assert engine.generate([[1]], 2, Sampling(max_new_tokens=2, temperature=0.7)).num_generations == 2
