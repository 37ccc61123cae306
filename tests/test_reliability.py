"""Nothing a user did is lost: a used output folder is refused, signals and errors save, I/O faults are
one line, and kills at random moments of checkpoint writes and metrics appends leave a run that resumes.

The runs use the tiny character-level Llama (tests/conftest.py) with 16 prompts and one CPU thread, so
each takes a second or two. The kill tests run in a child process (see the bottom of this file) that
forks writers and SIGKILLs them; forking is safe there because that process never starts a thread pool.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# one worker runs this module: its straight and killed runs (module fixtures) then run once
pytestmark = pytest.mark.xdist_group("reliability")

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# Reward functions, referenced as --reward test_reliability:<name>
# --------------------------------------------------------------------------------------------------
_batches = {"n": 0}  # batch calls of the current run (single-completion calls re-run a failing batch)


def text_signal(completions, answers, **columns):
    """Rewards that differ between completions, so every step updates the adapter (test_train's)."""
    return [(len(text) % 7) / 7 for text in completions]


def _count_batch(completions) -> int:
    if len(completions) > 1:
        _batches["n"] += 1
    return _batches["n"]


def sigterm_on_third_call(completions, answers, **columns):
    """text_signal, and a SIGTERM to this process while step 3 is scored (what Slurm or `timeout` send)."""
    if _count_batch(completions) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return text_signal(completions, answers)


def sighup_on_third_call(completions, answers, **columns):
    """text_signal, and a SIGHUP (a closed terminal) while step 3 is scored."""
    if _count_batch(completions) == 3:
        os.kill(os.getpid(), signal.SIGHUP)
    return text_signal(completions, answers)


def raises_at_step_three(completions, answers, **columns):
    """text_signal for steps 1 and 2, then an exception from step 3 on."""
    if _count_batch(completions) >= 3:
        raise ZeroDivisionError("boom")
    return text_signal(completions, answers)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and a loaded machine does not stall them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fresh_counter():
    _batches["n"] = 0


def flags(model_dir: Path, out: Path, **changes) -> list[str]:
    """train.py's command line for a 4-step run of the tiny char model; `changes` add or replace flags."""
    values = dict(model=model_dir, dataset="arithmetic", engine="hf", max_steps=4, prompts_per_step=2,
                  num_generations=2, max_completion_length=8, num_train_examples=16, learning_rate=1e-3,
                  warmup_ratio=0, lora_rank=4, lora_alpha=8, optim="adamw_torch", log_completions_steps=0,
                  save_steps=0, seed=11, reward="test_reliability:text_signal", output_dir=out)
    values.update(changes)
    argv = []
    for name, value in values.items():
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def train_main(argv: list[str]) -> int:
    """train.py's main(), in this process (the CLI as a user runs it, without a new interpreter)."""
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def assert_same_adapter(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(char_llama_dir, tmp_path_factory) -> Path:
    """The uninterrupted 4-step run, with checkpoints after steps 2 and 4."""
    from grpo.config import parse_args
    from grpo.trainer import train

    out = tmp_path_factory.mktemp("straight") / "run"
    train(parse_args(flags(char_llama_dir, out, save_steps=2, save_total_limit=0)))
    return out


@pytest.fixture(scope="module")
def straight_adapter(straight) -> dict[str, torch.Tensor]:
    adapter = adapter_tensors(straight / "adapter")
    assert any(torch.count_nonzero(t) for k, t in adapter.items() if "lora_B" in k), "nothing was learned"
    return adapter


# --------------------------------------------------------------------------------------------------
# Runs never overwrite runs
# --------------------------------------------------------------------------------------------------
def test_a_second_run_into_a_used_output_dir_is_refused_and_the_first_runs_files_stay_byte_identical(
        char_llama_dir, straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = snapshot(out)
    argv = flags(char_llama_dir, out, save_steps=2)
    assert train_main(argv) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert str(out) in line and "--resume latest" in line and "--output-dir" in line and "--overwrite" in line
    assert snapshot(out) == before

    # --overwrite moves the old run aside, whole, and starts afresh.
    assert train_main(argv + ["--overwrite"]) == 0
    assert snapshot(tmp_path / "run.old-1") == before
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_an_output_dir_holding_only_a_config_from_a_run_that_never_stepped_is_reused(tmp_path):
    from grpo.run.checkpoint import claim_output_dir
    from grpo.config import Config
    from grpo.distributed import World

    out = tmp_path / "run"
    Config(output_dir=str(out), max_steps=7).save(out)  # a run that stopped while loading its model
    claimed = claim_output_dir(Config(output_dir=str(out), max_steps=9), World())
    assert claimed.moved is None
    claimed.claim.release()
    assert json.loads((out / "config.json").read_text())["max_steps"] == 9
    (out / "metrics.jsonl").write_text("{}\n")  # now it holds something of a run
    with pytest.raises(ValueError, match="already holds a run"):
        claim_output_dir(Config(output_dir=str(out)), World())


# --------------------------------------------------------------------------------------------------
# Every stop saves
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how, signum", [("sigterm_on_third_call", signal.SIGTERM),
                                         ("sighup_on_third_call", signal.SIGHUP)])
def test_sigterm_or_sighup_mid_run_saves_the_step_exits_128_plus_signal_and_resumes_as_if_never_stopped(
        char_llama_dir, straight_adapter, tmp_path, capsys, how, signum):
    out = tmp_path / "run"
    assert train_main(flags(char_llama_dir, out, reward=f"test_reliability:{how}")) == 128 + signum
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"]  # step 3 finished, then saved
    assert train_main(flags(char_llama_dir, out, resume="latest")) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert_same_adapter(adapter_tensors(out / "adapter"), straight_adapter)


def test_a_reward_raising_at_step_three_leaves_a_checkpoint_2_that_resumes_as_if_never_stopped(
        char_llama_dir, straight_adapter, tmp_path, capsys):
    out = tmp_path / "run"
    assert train_main(flags(char_llama_dir, out, reward="test_reliability:raises_at_step_three")) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert "raises_at_step_three raised ZeroDivisionError" in line  # what failed
    assert f"saved {out / 'checkpoint-2'}" in line and "--resume latest" in line  # where, and how on
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    # Saved as step 3 found the run: the stream and RNG as they were before it, so resuming is exact.
    assert train_main(flags(char_llama_dir, out, resume="latest")) == 0
    assert_same_adapter(adapter_tensors(out / "adapter"), straight_adapter)


def test_an_error_while_logging_a_finished_step_saves_that_step(char_llama_dir, straight_adapter, tmp_path, capsys,
                                                                 monkeypatch):
    from grpo.run.log import MetricsLog

    real_write = MetricsLog.write

    def disk_full_at_step_three(self, record):
        if record.get("step") == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        real_write(self, record)

    monkeypatch.setattr(MetricsLog, "write", disk_full_at_step_three)
    out = tmp_path / "run"
    assert train_main(flags(char_llama_dir, out)) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {out / 'metrics.jsonl'}: no space left") and "checkpoint-3" in line
    monkeypatch.setattr(MetricsLog, "write", real_write)
    assert train_main(flags(char_llama_dir, out, resume="latest")) == 0
    assert_same_adapter(adapter_tensors(out / "adapter"), straight_adapter)


# --------------------------------------------------------------------------------------------------
# I/O faults are one line
# --------------------------------------------------------------------------------------------------
def test_an_output_dir_that_is_a_file_is_one_line_and_the_file_is_untouched(char_llama_dir, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert train_main(flags(char_llama_dir, out)) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert str(out) in line and "is a file" in line
    assert out.read_text() == "mine"


def test_a_read_only_output_dir_is_one_line(char_llama_dir, tmp_path, capsys, monkeypatch):
    # Root writes through chmod, so the kernel's answer is stood in for: every mkdir and every open for
    # writing under the folder fails with EROFS, as on a read-only mount. What this exercises is the
    # trainer's handling of that errno (the real mount is in the next test, where mounting is allowed).
    folder = tmp_path / "ro"
    folder.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(path) -> None:
        if str(path).startswith(str(folder)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def ro_open(path, flags_, *args, **kwargs):
        if flags_ & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_open(path, flags_, *args, **kwargs)

    def ro_mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    for out in (folder / "new-run", folder):  # a folder to create, and an existing empty one
        assert train_main(flags(char_llama_dir, out)) == 1
        [line] = error_lines(capsys.readouterr().err)
        assert line.startswith(f"error: --output-dir {out}: cannot write there") and "read-only file system" in line
    assert list(folder.iterdir()) == []


@contextmanager
def tmpfs(path: Path, options: str):
    """A real tmpfs at `path`; skips the test where this process may not mount (not root, no CAP_SYS_ADMIN)."""
    path.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_real_read_only_mount_and_a_real_full_disk_are_one_line(char_llama_dir, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert train_main(flags(char_llama_dir, ro / "run")) == 1
        [line] = error_lines(capsys.readouterr().err)
        assert f"--output-dir {ro / 'run'}: cannot write there" in line and "read-only file system" in line

    from grpo.run.checkpoint import CheckpointWriteError, RunState, list_checkpoints, load_checkpoint, save_checkpoint
    from grpo.config import Config
    from grpo.distributed import World
    from test_checkpoint import _parts

    parts = _parts()
    with tmpfs(tmp_path / "small", "size=2m") as disk:
        cfg = Config(output_dir=str(disk), save_total_limit=0)
        save_checkpoint(disk, RunState(step=1), parts, cfg, [])
        size = sum(p.stat().st_size for p in (disk / "checkpoint-1").iterdir())
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - size // 2))  # room for half a checkpoint
        with pytest.raises(CheckpointWriteError, match=f"could not write checkpoint {disk / 'checkpoint-2'} "
                                                       r"\(.*\); fix: free space"):
            save_checkpoint(disk, RunState(step=2), parts, cfg, [])
        assert sorted(p.name for p in disk.iterdir()) == ["checkpoint-1", "filler"]  # the partial one is gone
        assert load_checkpoint(disk / "checkpoint-1", _parts(seed=1), World()).step == 1


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_checkpoint(
        char_llama_dir, tmp_path, capsys, monkeypatch):
    # torch.save on a full disk raises this RuntimeError (seen on a 64 KiB tmpfs); the writer is patched
    # to raise it for the second checkpoint, after writing part of the file as the real one does.
    import grpo.run.checkpoint as checkpoint

    real_save = torch.save

    def full_at_step_two(obj, path, *args, **kwargs):
        if f"{checkpoint.TMP_PREFIX}2" in str(path) and Path(path).name == "optimizer.pt":
            Path(path).write_bytes(b"PK\x03\x04partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_at_step_two)
    out = tmp_path / "run"
    assert train_main(flags(char_llama_dir, out, max_steps=3, save_steps=1)) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert f"could not write checkpoint {out / 'checkpoint-2'}" in line and "full disk" in line
    assert f"the last checkpoint is {out / 'checkpoint-1'}" in line
    assert sorted(p.name for p in out.iterdir()) == [".claim", "checkpoint-1", "config.json", "metrics.jsonl"]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert train_main(flags(char_llama_dir, out, max_steps=3, save_steps=1, resume="latest")) == 0


def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_intact_one_and_says_so(
        char_llama_dir, straight, straight_adapter, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    broken = out / "checkpoint-4" / "adapter_model.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    # Named explicitly, it is refused in one line naming the broken file.
    assert train_main(flags(char_llama_dir, out, resume=out / "checkpoint-4")) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert str(broken) in line and "unreadable" in line
    # `latest` skips it, says so, and continues from checkpoint-2 to the uninterrupted run's adapter.
    (out / "adapter").rename(out / "adapter.first")
    assert train_main(flags(char_llama_dir, out, resume="latest")) == 0
    shown = capsys.readouterr().out.replace("\n", "")  # the console wraps long paths at its width
    assert "skipped checkpoint-4" in shown and "checkpoint-2" in shown
    assert_same_adapter(adapter_tensors(out / "adapter"), straight_adapter)


# --------------------------------------------------------------------------------------------------
# Validation before anything loads
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--learning-rate", "-1"), ("--learning-rate", "nan"), ("--beta", "inf"),
                                         ("--max-grad-norm", "-1"), ("--lora-dropout", "1.5"),
                                         ("--warmup-ratio", "nan"), ("--adam-beta2", "1"), ("--weight-decay", "-0.1"),
                                         ("--save-total-limit", "-1"), ("--seed", "-1"),
                                         ("--max-nonfinite-steps", "0"), ("--num-train-examples", "0")])
def test_an_impossible_flag_value_is_one_line_naming_the_flag_and_nothing_is_written(tmp_path, capsys, flag, value):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--model", "no/such-model", "--output-dir", str(out), flag, value])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{flag} " in line and "--help" in line
    assert not out.exists()


def test_every_float_setting_refuses_nan_and_inf_naming_its_flag():
    import dataclasses

    from grpo.config import Config

    from grpo.loss.terms import POLICY_TERMS

    floats = [f.name for f in dataclasses.fields(Config) if "float" in str(f.type)]
    assert len(floats) > 10
    for name in floats:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} {bad}: must be a finite number"):
                Config(**{name: bad})
    # the loss's knobs live on its policy terms, each refused with its flag
    knobs = [(term, f.name) for term in POLICY_TERMS.values() for f in dataclasses.fields(term) if "float" in str(f.type)]
    assert len(knobs) >= 12
    for term, name in knobs:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=rf"\({name}={bad}\), flag {term.flag(name)}: must be a finite number"):
                term(**{name: bad})


def test_a_null_answer_in_a_jsonl_dataset_has_its_own_message(tmp_path):
    from grpo.data import load_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": null}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: 'answer' is null; fix"):
        load_jsonl(path)
    path.write_text('{"question": "2+2"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: no 'answer' field"):
        load_jsonl(path)


# --------------------------------------------------------------------------------------------------
# Kills at random moments (the child process does the killing; see the bottom)
# --------------------------------------------------------------------------------------------------
KILLS = 60


@pytest.fixture(scope="module")
def kill_results(char_llama_dir, tmp_path_factory) -> dict:
    from grpo.config import parse_args

    work = tmp_path_factory.mktemp("kills")
    cfg = parse_args(flags(char_llama_dir, work / "run", save_steps=1, save_total_limit=2))
    cfg.save(work)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, str(Path(__file__)), "kills", str(work), str(KILLS)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return {**json.loads((work / "summary.json").read_text()), "work": work}


@pytest.mark.slow
def test_sigkill_at_random_moments_of_checkpoint_writes_and_appends_always_leaves_a_resumable_run(kill_results):
    # After each kill: `find_checkpoint("latest")` loads whole, its adapters are the ones written for
    # its step, no step already saved was lost, and metrics.jsonl reads back as steps 1..latest.
    assert kill_results["kills"] >= 50 and kill_results["failures"] == [], kill_results["failures"][:5]
    assert kill_results["mid_checkpoint"] >= 10, kill_results  # the kills did land inside writes
    assert kill_results["final_step"] >= 10  # the writers got on: kills landed in late steps too


def test_a_training_run_killed_mid_checkpoint_resumes_to_the_uninterrupted_runs_adapter(
        kill_results, char_llama_dir, straight_adapter):
    out = kill_results["work"] / "run"
    assert kill_results["train_killed_by"] == signal.SIGKILL
    assert (out / ".tmp-checkpoint-3").is_dir() and not (out / "checkpoint-3").exists()  # cut short mid-save
    assert train_main(flags(char_llama_dir, out, save_steps=1, save_total_limit=2, resume="latest")) == 0
    assert not (out / ".tmp-checkpoint-3").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert_same_adapter(adapter_tensors(out / "adapter"), straight_adapter)


# --------------------------------------------------------------------------------------------------
# The child process: `python tests/test_reliability.py kills WORK N`
# --------------------------------------------------------------------------------------------------
def _expected_adapter_value(step: int, index: int) -> float:
    return step + index / 1000


def _write_steps_forever(out: Path, parts) -> None:
    """A writer as the trainer writes: from the newest checkpoint on, per step a metrics line, then a
    checkpoint (keeping 2) whose adapters hold values that tell the step."""
    from grpo.run.checkpoint import RunState, list_checkpoints, load_checkpoint, rng_state, save_checkpoint
    from grpo.config import Config
    from grpo.distributed import World
    from grpo.run.log import MetricsLog

    cfg = Config(output_dir=str(out), save_total_limit=2)
    state = load_checkpoint(list_checkpoints(out)[-1], parts, World()) if list_checkpoints(out) else RunState()
    state.run_id = state.run_id or "kills"
    log = MetricsLog(out, cfg, state.step)
    lora = [p for n, p in parts.policy.named_parameters() if "lora_" in n]
    while True:
        state.step += 1
        log.write({"step": state.step, "reward": float(state.step), "padding": "x" * 3000})
        with torch.no_grad():
            for i, p in enumerate(lora):
                p.fill_(_expected_adapter_value(state.step, i))
        save_checkpoint(out, state, parts, cfg, [rng_state()])


def _check_after_kill(out: Path, saved_before: int, parts) -> tuple[int, list[str]]:
    """(the newest step saved, what is wrong) after a kill; `parts` take the checkpoint that loads."""
    from grpo.run.checkpoint import find_checkpoint, list_checkpoints, load_checkpoint
    from grpo.config import Config
    from grpo.distributed import World
    from grpo.run.log import MetricsLog

    if not list_checkpoints(out):
        return 0, ([] if saved_before == 0 else [f"every checkpoint gone after step {saved_before} was saved"])
    problems = []
    latest = find_checkpoint("latest", out)
    try:
        state = load_checkpoint(latest, parts, World())
    except Exception as err:
        return saved_before, [f"{latest} does not load: {err}"]
    if state.step < saved_before:
        problems.append(f"newest checkpoint went back from step {saved_before} to {state.step}")
    lora = [p for n, p in parts.policy.named_parameters() if "lora_" in n]
    if any(not torch.all(p == _expected_adapter_value(state.step, i)) for i, p in enumerate(lora)):
        problems.append(f"{latest} holds adapters of another step")
    MetricsLog(out, Config(), state.step)  # what a resume does: drop a torn line and records past the checkpoint
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    if steps != list(range(1, state.step + 1)):
        problems.append(f"metrics.jsonl steps {steps[-5:]} after checkpoint-{state.step}")
    return state.step, problems


def _warm_up(folder: Path, parts) -> float:
    """Saves and loads before forking, so that no child spends its life on first-call set-up; returns
    the seconds a save and a load take here (the kills are timed by it, whatever the machine's speed)."""
    import time

    from grpo.run.checkpoint import RunState, load_checkpoint, rng_state, save_checkpoint
    from grpo.config import Config
    from grpo.distributed import World

    folder.mkdir()
    load_checkpoint(save_checkpoint(folder, RunState(step=1), parts, Config(), [rng_state()]), parts, World())
    start = time.perf_counter()
    for step in (2, 3, 4):
        load_checkpoint(save_checkpoint(folder, RunState(step=step), parts, Config(), [rng_state()]), parts, World())
    shutil.rmtree(folder)
    return (time.perf_counter() - start) / 3


def _kill_loop(work: Path, kills: int) -> dict:
    import random
    import time

    from test_checkpoint import _parts

    out = work / "writes"
    out.mkdir()
    rng = random.Random(1234)
    writer_parts, checker_parts = _parts(), _parts(seed=1)
    step_time = _warm_up(work / "warm-up", writer_parts)
    saved, failures, mid_checkpoint = 0, [], 0
    for k in range(kills):
        pid = os.fork()
        if pid == 0:
            try:
                _write_steps_forever(out, writer_parts)
            finally:
                os._exit(1)
        time.sleep(rng.random() * 3 * step_time)  # anywhere in the child's start-up or its first steps
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mid_checkpoint += any(out.glob(".tmp-checkpoint-*"))
        saved, problems = _check_after_kill(out, saved, checker_parts)
        failures += [f"kill {k}: {p}" for p in problems]
    return {"kills": kills, "failures": failures, "mid_checkpoint": mid_checkpoint, "final_step": saved}


def _train_killed_mid_checkpoint(config_json: Path) -> int:
    """Trains in a forked child that SIGKILLs itself halfway through writing checkpoint-3's optimizer;
    returns the signal that ended it."""
    import io

    import grpo.run.checkpoint as checkpoint
    from grpo.config import Config
    from grpo.trainer import train

    pid = os.fork()
    if pid == 0:
        real_save = torch.save

        def die_mid_write(obj, path, *args, **kwargs):
            if f"{checkpoint.TMP_PREFIX}3" in str(path) and Path(path).name == "optimizer.pt":
                buffer = io.BytesIO()
                real_save(obj, buffer)
                Path(path).write_bytes(buffer.getvalue()[:buffer.tell() // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(obj, path, *args, **kwargs)

        checkpoint.torch.save = die_mid_write
        try:
            train(Config.load(config_json))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


if __name__ == "__main__":
    mode, work, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    assert mode == "kills"
    torch.set_num_threads(1)  # before any torch work: no thread pool, so forking is safe
    summary = _kill_loop(work, count)
    summary["train_killed_by"] = _train_killed_mid_checkpoint(work / "config.json")
    (work / "summary.json").write_text(json.dumps(summary))


# --------------------------------------------------------------------------------------------------
# Resuming a finished run, or from another run's checkpoint
# --------------------------------------------------------------------------------------------------
def test_resume_latest_of_a_finished_run_says_it_is_done_and_changes_nothing(char_llama_dir, straight, tmp_path,
                                                                              capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = snapshot(out)
    assert train_main(flags(char_llama_dir, out, resume="latest")) == 0
    said = capsys.readouterr()
    assert said.out.strip() == (f"nothing to do: --resume latest: {out}/checkpoint-4 holds step 4 of --max-steps 4: "
                                f"the run is done; its adapter is {out}/adapter; to train on, pass a larger --max-steps")
    assert snapshot(out) == before


def test_a_new_folder_started_from_another_runs_checkpoint_trains_on_there_or_is_refused_before_anything_runs(
        char_llama_dir, straight, tmp_path, capsys):
    new = tmp_path / "new"
    assert train_main(flags(char_llama_dir, new, resume=straight / "checkpoint-4")) == 0  # nothing left to train
    assert "nothing to do: " in capsys.readouterr().out and not new.exists()
    assert train_main(flags(char_llama_dir, new, resume=straight / "checkpoint-2", max_steps=3)) == 0
    assert [json.loads(line)["step"] for line in (new / "metrics.jsonl").read_text().splitlines()] == [3]
    assert (new / "adapter" / "adapter_model.safetensors").is_file() and (new / "checkpoint-3").is_dir()
