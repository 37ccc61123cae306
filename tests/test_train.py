"""End to end: train.py on tiny random models, offline; resume; Ctrl-C; learning; bad input."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from conftest import run_as_main
from grpo.config import Config
from grpo.trainer import NonFiniteLoss, train

ROOT = Path(__file__).resolve().parents[1]


# Reward functions referenced as --reward test_train:<name> (tests/ is on sys.path under pytest).
def digit_share(completions, answers, **columns):
    """The share of characters that are digits: a trivial reward a tiny model can learn."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]



def always_raises(completions, answers, **columns):
    raise ZeroDivisionError("boom")


def text_signal(completions, answers, **columns):
    """A reward that differs between completions, so every step updates the adapter."""
    return [(len(text) % 7) / 7 for text in completions]


_calls = {"n": 0}
_seen: list[str] = []


def record_completions(completions, answers, **columns):
    """text_signal, keeping every completion for the test to read."""
    _seen.extend(completions)
    return text_signal(completions, answers)


def ctrl_c_on_third_call(completions, answers, **columns):
    """text_signal, and a real Ctrl-C (SIGINT to this process) while step 3 is being scored."""
    _calls["n"] += 1
    if _calls["n"] == 3:
        os.kill(os.getpid(), signal.SIGINT)
    return text_signal(completions, answers)


def interrupt_on_third_call(completions, answers, **columns):
    """text_signal, and a KeyboardInterrupt in the middle of step 3, as a second Ctrl-C raises it."""
    _calls["n"] += 1
    if _calls["n"] == 3:
        raise KeyboardInterrupt
    return text_signal(completions, answers)


def tiny_cfg(model_dir, out, **kw) -> Config:
    # 64 problems: a run reads a few, and tokenizing all 5000 is a good part of a short run's set-up
    base = dict(model=str(model_dir), dataset="arithmetic", num_train_examples=64, engine="hf", max_steps=2,
                prompts_per_step=2, num_generations=2, max_completion_length=8, max_prompt_length=None,
                max_seq_length=1024,
                learning_rate=1e-3, warmup_ratio=0.0, save_steps=0, log_completions_steps=1,
                output_dir=str(out), seed=11)
    base.update(kw)
    return Config(**base)


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_help_lists_every_flag_with_text():
    from grpo.config import build_parser

    text = build_parser().format_help()
    for flag in ("--model", "--dataset", "--reward-preset", "--num-generations", "--prompts-per-step",
                 "--micro-batch-size", "--max-seq-length", "--max-prompt-length", "--max-completion-length",
                 "--lora-rank", "--lora-alpha", "--learning-rate", "--weight-decay", "--warmup-ratio", "--optim",
                 "--beta", "--epsilon", "--epsilon-high", "--num-iterations", "--temperature", "--top-p",
                 "--top-k", "--min-p", "--seed", "--engine", "--max-steps", "--output-dir", "--save-steps",
                 "--eval-steps", "--resume", "--report-to", "--load-in-fp8", "--preset"):
        assert flag in text, flag
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_the_loss_flags_offer_exactly_what_grpo_loss_accepts():
    from grpo.config import build_parser
    from grpo.loss import IS_LEVELS as LEVELS
    from grpo.loss import IS_MODES as MODES
    from grpo.loss import KL_KINDS, NORMS, POLICY_TERMS, RATIO_LEVELS, SCALES

    choices = {a.dest: tuple(a.choices) for a in build_parser()._actions if a.choices}
    assert set(choices["loss_norm"]) == set(NORMS)
    assert set(choices["ratio_level"]) == set(RATIO_LEVELS)
    assert set(choices["scale_rewards"]) == set(SCALES)
    assert set(choices["kl_estimator"]) == set(KL_KINDS)
    assert set(choices["is_correction"]) == set(MODES)
    assert set(choices["is_level"]) == set(LEVELS)
    assert set(choices["loss_type"]) == set(POLICY_TERMS)


def test_loss_type_flags_reach_the_config_and_the_defaults_are_the_loss_functions():
    import inspect

    from grpo.config import Config, parse_args
    from grpo.loss import POLICY_TERMS, Cispo, Sapo, clipped_surrogate

    cfg = parse_args(["--loss-type", "sapo", "--sapo-tau-pos", "0.5", "--sapo-tau-neg", "2"])
    assert cfg.policy_term == Sapo(tau_pos=0.5, tau_neg=2.0)
    assert parse_args(["--loss-type", "cispo", "--cispo-eps-high", "0.28"]).policy_term == Cispo(eps_high=0.28)
    # One source for every default: the config's match the loss function's, and each term's flags its own.
    defaults = inspect.signature(clipped_surrogate).parameters
    plain = Config()
    assert plain.policy_term == defaults["term"].default == parse_args([]).policy_term
    for name in ("kl_estimator", "ratio_level", "loss_norm"):
        assert getattr(plain, name) == defaults[name].default, name
    for name, term in POLICY_TERMS.items():
        assert parse_args(["--loss-type", name]).policy_term == term(), name
    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "cispo", "--delta", "3"])
    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "sapo", "--sapo-tau-neg", "0"])


def test_a_preset_term_keeps_its_knobs_under_a_flag_and_config_json_holds_the_term(tmp_path, monkeypatch):
    from grpo import config
    from grpo.loss import Clip, Sapo

    monkeypatch.setitem(config.PRESETS, "dapo-clip-higher", dict(policy_term=Clip(epsilon_high=0.28)))
    monkeypatch.setitem(config.PRESET_SUMMARIES, "dapo-clip-higher", "The recipe with DAPO's clip-higher.")
    cfg = config.parse_args(["--preset", "dapo-clip-higher", "--delta", "3"])
    assert cfg.policy_term == Clip(epsilon_high=0.28, delta=3.0)
    assert config.parse_args(["--preset", "dapo-clip-higher", "--loss-type", "sapo"]).policy_term == Sapo()
    cfg.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["policy_term"] == {
        "loss_type": "clip", "epsilon": 0.2, "epsilon_high": 0.28, "delta": 3.0}
    assert Config.load(tmp_path / "config.json") == cfg


@pytest.mark.parametrize("flat, term", [
    ({"loss_type": "cispo", "cispo_eps_low": 0.5, "cispo_eps_high": 3.0, "epsilon": 0.3}, "Cispo(eps_low=0.5, eps_high=3.0)"),
    ({"loss_type": "clip", "epsilon": 0.3, "epsilon_high": 0.28, "sapo_tau_pos": 2.0},
     "Clip(epsilon=0.3, epsilon_high=0.28, delta=None)")])
def test_a_config_json_with_the_loss_knobs_as_flat_fields_loads_its_own_term(tmp_path, flat, term):
    """config.json of a run from before the policy terms: its term's knobs were fields of Config."""
    (tmp_path / "config.json").write_text(json.dumps({**flat, "ignore_eos": False, "learning_rate": 2e-5}))
    cfg = Config.load(tmp_path / "config.json")
    assert repr(cfg.policy_term) == term and cfg.learning_rate == 2e-5


@pytest.mark.slow
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tiny_llama_dir, tmp_path):
    straight = tiny_cfg(tiny_llama_dir, tmp_path / "a", max_steps=4, save_steps=2, save_total_limit=3,
                        num_iterations=2, beta=0.04)
    train(straight)
    resumed = tiny_cfg(tiny_llama_dir, tmp_path / "b", max_steps=4, save_steps=2, num_iterations=2, beta=0.04,
                       resume=str(tmp_path / "a" / "checkpoint-2"))
    train(resumed)
    a, b = adapter_tensors(tmp_path / "a" / "adapter"), adapter_tensors(tmp_path / "b" / "adapter")
    two = adapter_tensors(tmp_path / "a" / "checkpoint-2")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], two[k]) for k in a), "steps 3 and 4 changed nothing"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def straight_four_steps(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(tiny_cfg(tiny_llama_dir, out, max_steps=4, reward=("test_train:text_signal",)))
    return adapter_tensors(out / "adapter")


@pytest.mark.xdist_group("straight_four_steps")  # one worker: the straight run trains once
@pytest.mark.parametrize("how, saved_at", [("ctrl_c_on_third_call", 3), ("interrupt_on_third_call", 2)])
def test_ctrl_c_saves_a_checkpoint_that_resumes_as_if_never_stopped(tiny_llama_dir, tmp_path, straight_four_steps,
                                                                     how, saved_at):
    # The first Ctrl-C finishes step 3 and saves it; a second one (an interrupt inside the step) saves
    # the state before step 3. Either way the resumed run ends where the uninterrupted one does.
    _calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=4, reward=(f"test_train:{how}",)))
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == [f"checkpoint-{saved_at}"]
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=4, resume="latest", reward=("test_train:text_signal",)))
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    resumed = adapter_tensors(tmp_path / "run" / "adapter")
    assert any(torch.count_nonzero(t) for k, t in resumed.items() if "lora_B" in k), "nothing was learned"
    for k in straight_four_steps:
        torch.testing.assert_close(resumed[k], straight_four_steps[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_grpo_raises_a_trivial_reward_within_a_few_dozen_steps(char_llama_dir, tmp_path):
    # A tiny model over a character vocabulary, rewarded for the share of digits it writes. GRPO must
    # raise that share clearly; a wrong sign anywhere (advantage, ratio, loss) makes it fall instead.
    cfg = tiny_cfg(char_llama_dir, tmp_path / "run", max_steps=10, prompts_per_step=4, num_generations=8,
                   max_completion_length=12, learning_rate=1e-2, lr_scheduler="constant", beta=0.0, min_p=0.0,
                   reward=("test_train:digit_share",), max_prompt_length=None, log_completions_steps=0,
                   lora_rank=8, lora_alpha=16, num_train_examples=64)
    train(cfg)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    share = [r["rewards/digit_share"] for r in records if "rewards/digit_share" in r]
    first, last = sum(share[:3]) / 3, sum(share[-3:]) / 3
    # Seen (seeds 1-3 and 11): 0.10-0.15 over the first three steps, 0.95-0.99 over the last three.
    assert last > first + 0.3 and last > 2 * first, (first, last)


def test_non_finite_losses_stop_the_run_with_the_last_good_checkpoint(tiny_llama_dir, tmp_path, monkeypatch):
    import grpo.step as step_module

    real = step_module.clipped_surrogate
    calls = {"n": 0}

    def nan_after_first_step(logp, *args, **kwargs):  # a fault injected into the loss from step 2 on
        calls["n"] += 1
        loss, stats = real(logp, *args, **kwargs)
        return (loss * float("nan") if calls["n"] > 1 else loss), stats

    monkeypatch.setattr(step_module, "clipped_surrogate", nan_after_first_step)
    cfg = tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=6, reward=("test_train:text_signal",),
                   max_nonfinite_steps=2)
    with pytest.raises(NonFiniteLoss, match="2 non-finite steps in a row"):
        train(cfg)
    (ckpt,) = (tmp_path / "run").glob("checkpoint-*")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["skipped_steps"] == 2 and state["nonfinite_in_row"] == 2
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, True]  # the last one logged, then the run stops
    assert [r["step"] for r in records] == [1, 2, 3]
    # The checkpoint holds the adapter of step 1, the last good update, and it is finite.
    saved = adapter_tensors(ckpt)
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert any(torch.count_nonzero(t) for k, t in saved.items() if "lora_B" in k)


def test_a_reward_function_that_raises_is_named_with_the_completion(tiny_llama_dir, tmp_path):
    cfg = tiny_cfg(tiny_llama_dir, tmp_path / "run", reward=("test_train:always_raises",))
    with pytest.raises(Exception, match="always_raises"):
        train(cfg)


def test_an_unreachable_model_id_suggests_a_local_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run_as_main([ROOT / "train.py", "--model", "nobody/no-such-model", "--output-dir", tmp_path / "o"],
                       monkeypatch) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nobody/no-such-model" in last and "local" in last


def test_fewer_than_two_generations_is_refused_on_the_command_line(monkeypatch, capsys):
    assert run_as_main([ROOT / "train.py", "--num-generations", "1"], monkeypatch) == 2
    assert "--num-generations 1" in capsys.readouterr().err


def test_hf_engine_samples_as_asked_whatever_the_models_generation_config(tiny_llama_dir):
    # Llama-3 instruct checkpoints ship top_k/top_p defaults; an engine that left its own knobs unset
    # would inherit them. With top_k=1 inherited, all samples of a prompt would be the same.
    from transformers import AutoModelForCausalLM

    from grpo.rollout import Sampling
    from grpo.rollout.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.generation_config.top_k, model.generation_config.top_p = 1, 0.01
    engine = HFEngine(model, pad_id=128004)
    rollout = engine.generate([[128000, 9906, 1917]], 6, Sampling(max_new_tokens=6, temperature=1.0, seed=3,
                                                                  stop_token_ids=(128009,), ignore_eos=True))
    rows = {tuple(r) for r in rollout.completions()}
    assert len(rows) > 1 and rollout.mask.all() and not rollout.finished.any()


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_stop_strings_end_completions_right_after_the_string(char_llama_dir, tmp_path, engine):
    # A random character-level model writes "e" often; with --stop e every completion either has no
    # "e" or ends with its first one. Without the stop, later characters would follow it.
    _seen.clear()
    train(tiny_cfg(char_llama_dir, tmp_path / "run", max_steps=1, prompts_per_step=4, num_generations=4,
                   max_completion_length=24, min_p=0.0, stop=("e",), reward=("test_train:record_completions",),
                   log_completions_steps=0, engine=engine, num_train_examples=None))  # prompts seen to write "e"
    assert len(_seen) == 16
    stopped = [c for c in _seen if "e" in c]
    assert stopped, "no completion wrote the stop string; the test proves nothing"
    assert all(c.endswith("e") and c.count("e") == 1 for c in stopped), stopped


def test_held_out_eval_runs_before_during_and_after_training_and_is_plotted(tiny_llama_dir, tmp_path):
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=2, eval_size=3, eval_samples=2, eval_steps=1))
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert r["eval/prompts"] == 3 and r["eval/samples"] == 2
        assert all(0.0 <= r[k] <= 1.0 for k in ("eval/greedy_accuracy", "eval/greedy_format", "eval/pass@1",
                                                  "eval/sampled_format"))
    assert (tmp_path / "run" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("standby, releases", [("release", 2), ("keep", 0), ("auto", 0)])
def test_engine_standby_releases_the_native_engine_after_each_generation_or_keeps_it(
        tiny_llama_dir, tmp_path, monkeypatch, standby, releases):
    from grpo.rollout.native import NativeEngine

    calls = []
    original = NativeEngine.release_memory
    monkeypatch.setattr(NativeEngine, "release_memory", lambda self: (calls.append(1), original(self)))
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", engine="native", engine_standby=standby,
                   log_completions_steps=0))
    assert len(calls) == releases


@pytest.mark.slow
def test_engine_attention_and_fold_reach_the_trainers_engine(tiny_llama_dir, tmp_path, monkeypatch):
    from grpo.rollout.native import NativeEngine

    seen = []
    original = NativeEngine.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.tuning.attention, self.tuning.fold_adapter))

    monkeypatch.setattr(NativeEngine, "__init__", recording_init)
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", engine="native", engine_attention="sdpa", max_steps=1,
                   engine_fold_adapter=False, log_completions_steps=0))
    train(tiny_cfg(tiny_llama_dir, tmp_path / "fold", engine="native", engine_attention="sdpa", max_steps=1,
                   log_completions_steps=0))  # folding by default
    assert seen == [("sdpa", False), ("sdpa", True)]
    if os.environ.get("TRITON_INTERPRET") != "1":  # on a CPU without the interpreter the kernel cannot run
        with pytest.raises(ValueError, match="attention='kernel' needs triton and a CUDA model"):
            train(tiny_cfg(tiny_llama_dir, tmp_path / "kernel", engine="native", engine_attention="kernel"))


def test_a_run_trains_without_cudnns_attention_and_gives_it_back_after(tiny_llama_dir, tmp_path, monkeypatch):
    from grpo import step

    enabled_in_passes = []
    original = step.sequence_logprobs

    def recording(policy, batch, temperature):
        enabled_in_passes.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(policy, batch, temperature)

    monkeypatch.setattr(step, "sequence_logprobs", recording)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # torch's default (a process that imported vLLM has it off)
    try:
        train(tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=1, log_completions_steps=0))
        assert enabled_in_passes and not any(enabled_in_passes)  # cuDNN plans each new width (grpo.model.load)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # the rest of the process as it was
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("collects,gpu", [(True, False), (False, True), (False, False)])
def test_set_up_is_frozen_where_the_engine_collects_and_the_first_steps_survivors_on_a_gpu(
        tiny_llama_dir, tmp_path, monkeypatch, collects, gpu):
    import gc

    from grpo import trainer
    from grpo.rollout.hf import HFEngine

    during = []
    original = trainer.grpo_step

    def recording(setup, index, in_flight):
        during.append((gc.get_freeze_count(), any(o is setup.policy for o in gc.get_objects())))
        return original(setup, index, in_flight)

    monkeypatch.setattr(trainer, "grpo_step", recording)
    monkeypatch.setattr(HFEngine, "full_gc_each_step", collects, raising=False)  # as Unsloth's engine says
    if gpu:  # the CPU's answer is no: this run takes the GPU's way
        assert not trainer.freezes_after_first_step(torch.device("cpu"))
        monkeypatch.setattr(trainer, "freezes_after_first_step", lambda device: True)
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=2, log_completions_steps=0))
    (frozen_first, scanned_first), (frozen_second, scanned_second) = during
    assert (frozen_first > 0, scanned_first) == ((True, False) if collects else (False, True))
    if gpu:  # the first step's objects, and set-up's, out of the collector's reach from the second step
        assert frozen_second > frozen_first and not scanned_second
    else:  # nothing frozen anew (frozen objects that die leave the count)
        assert frozen_second <= frozen_first and scanned_second == scanned_first
    assert gc.get_freeze_count() == 0  # after the run, the process collects as before


def test_padding_to_a_multiple_changes_the_widths_run_and_nothing_learned(tiny_llama_dir, tmp_path):
    runs = {}
    for multiple in (1, 16):
        out = tmp_path / f"pad-{multiple}"
        train(tiny_cfg(tiny_llama_dir, out, max_steps=1, log_completions_steps=0, micro_batch_size=2,
                       pad_to_multiple_of=multiple))
        runs[multiple] = (json.loads((out / "metrics.jsonl").read_text().splitlines()[0]),
                          adapter_tensors(out / "adapter"))
    (plain, plain_adapter), (padded, padded_adapter) = runs[1], runs[16]
    assert padded["train/real_token_frac"] < plain["train/real_token_frac"]  # the multiple reached the passes
    assert padded["reward"] == plain["reward"]
    for key in ("loss", "grad_norm"):
        assert padded[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6)
    for name, tensor in plain_adapter.items():
        torch.testing.assert_close(padded_adapter[name], tensor, rtol=1e-4, atol=1e-6)


def test_auto_standby_keeps_only_a_native_kv_cache_up_to_the_limit(monkeypatch):
    # (the trainer test above covers a small cache; this one the limit itself, without allocating it)
    from grpo import trainer
    from grpo.rollout.hf import HFEngine
    from grpo.rollout.native import NativeEngine
    from grpo.rollout.unsloth import UnslothEngine
    from grpo.rollout.vllm import VLLMEngine

    engine = NativeEngine.__new__(NativeEngine)  # only kv_cache_bytes is asked
    monkeypatch.setattr(NativeEngine, "kv_cache_bytes", lambda self: trainer.KEEP_KV_BYTES)
    assert trainer.keeps_memory_between_steps("auto", engine)
    monkeypatch.setattr(NativeEngine, "kv_cache_bytes", lambda self: trainer.KEEP_KV_BYTES + 1)
    assert not trainer.keeps_memory_between_steps("auto", engine)
    assert trainer.keeps_memory_between_steps("keep", engine)
    for other in (HFEngine, VLLMEngine, UnslothEngine):  # hf, vllm: release (vLLM sleeps)
        assert not trainer.keeps_memory_between_steps("auto", other.__new__(other))
        assert trainer.keeps_memory_between_steps("keep", other.__new__(other))


def test_only_engines_with_other_numerics_ask_for_the_importance_correction():
    from grpo.rollout.hf import HFEngine
    from grpo.rollout.unsloth import UnslothEngine
    from grpo.rollout.vllm import VLLMEngine

    assert not HFEngine.needs_importance_correction
    assert VLLMEngine.needs_importance_correction and UnslothEngine.needs_importance_correction


class _SamplerWithOtherNumerics:
    """The hf engine, claiming its log-probs come from other kernels (as vLLM's do)."""

    needs_importance_correction = True

    def __init__(self, policy, pad_id):
        from grpo.rollout.hf import HFEngine

        self.hf = HFEngine(policy, pad_id=pad_id)

    def generate(self, prompt_ids, n, sampling):
        return self.hf.generate(prompt_ids, n, sampling)

    def release_memory(self):
        self.hf.release_memory()

    def standby_bytes(self):
        return None


@pytest.mark.parametrize("other_numerics, is_correction, weighted", [(True, "truncate", True), (True, "none", False),
                                                                      (False, "truncate", False)])
def test_the_loss_weights_tokens_by_the_sampler_ratio_only_when_the_engine_asks_for_it(
        tiny_llama_dir, tmp_path, monkeypatch, other_numerics, is_correction, weighted):
    import grpo.step as step_module
    from grpo import trainer

    if other_numerics:
        monkeypatch.setattr(trainer, "build_engine",
                            lambda name, policy, *, pad_id, **kw: _SamplerWithOtherNumerics(policy, pad_id))
    real, calls = step_module.importance_weights, []
    monkeypatch.setattr(step_module, "importance_weights", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    train(tiny_cfg(tiny_llama_dir, tmp_path / "run", max_steps=1, is_correction=is_correction,
                   log_completions_steps=0))
    assert bool(calls) == weighted


@pytest.mark.parametrize("term", ["cispo", "sapo"])
def test_the_loss_type_and_its_parameters_reach_the_loss(char_llama_dir, tmp_path, monkeypatch, term):
    import grpo.step as step_module
    from grpo.loss import Cispo, Sapo

    term = {"cispo": Cispo(eps_low=0.5, eps_high=0.28), "sapo": Sapo(tau_pos=0.5, tau_neg=2.0)}[term]
    real, calls = step_module.clipped_surrogate, []
    monkeypatch.setattr(step_module, "clipped_surrogate", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    train(tiny_cfg(char_llama_dir, tmp_path / "run", max_steps=1, policy_term=term, lora_rank=4, lora_alpha=8,
                   log_completions_steps=0, loss_norm="token"))
    assert calls and all(kw["term"] == term and kw["loss_norm"] == "token" for kw in calls)


def test_a_flag_overrides_one_value_of_the_preset_and_keeps_the_rest(tmp_path):
    from grpo.config import PRESETS, parse_args

    for name in PRESETS:
        cfg = parse_args(["--preset", name, "--max-steps", "3"])
        assert cfg == Config(**{**PRESETS[name], "preset": name, "max_steps": 3}), name
    cfg = parse_args(["--max-steps", "3", "--preset", "smollm2-arithmetic", "--stop"])  # any order; empty clears
    assert (cfg.max_steps, cfg.stop, cfg.num_generations, cfg.model) == (3, (), 8, "smollm2-135m-instruct")
    assert parse_args(["--preset", "none", "--max-steps", "3"]) == Config(max_steps=3)
    cfg.save(tmp_path)  # config.json holds the values that run: the preset's, then the flags'
    assert Config.load(tmp_path / "config.json") == cfg
