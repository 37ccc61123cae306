"""Data-parallel GRPO under torchrun, on CPU with gloo: 2 ranks train what 1 process trains.

The two-rank runs are real `torchrun --nproc-per-node 2` launches of this file (see the bottom), on the
tiny character-level Llama. Their sampler is a stand-in whose completions depend only on the prompt and
the sample's place in its group, so that a prompt gets the same completions whichever rank samples it,
and a 1-process run with twice the prompts per step can be compared with the 2-rank run exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from grpo.config import Config
from grpo.distributed import NCCL_ENV_DEFAULTS, init_world, nccl_env_defaults
from grpo.rollout import Rollout, Sampling

# one worker runs this module (and test_dynamic_sampling's two-rank test): their two-rank launch then runs once
pytestmark = pytest.mark.xdist_group("two_rank_run")

ROOT = Path(__file__).resolve().parents[1]
FIRST_CHAR, LAST_CHAR = 7, 70  # ids of the char tokenizer: digits, then letters (tests/conftest.py)


# --------------------------------------------------------------------------------------------------
# The stand-in sampler and the reward (both also imported by the torchrun workers)
# --------------------------------------------------------------------------------------------------
class PromptHashEngine:
    """Completion k of a prompt: random characters and a random length (1..max_new_tokens) drawn from a
    hash of (prompt ids, k); the same on every rank, in every step, whatever else is in the batch."""

    needs_importance_correction = False  # its log-probs are zeros: no ratio to correct

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def release_memory(self) -> None:
        pass

    def standby_bytes(self) -> None:
        return None

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollout:
        T = sampling.max_new_tokens
        ids, lengths = [], []
        for p in prompt_ids:
            for k in range(n):
                g = torch.Generator().manual_seed(zlib.crc32(repr((list(p), k)).encode()))
                lengths.append(int(torch.randint(1, T + 1, (), generator=g)))
                ids.append(torch.randint(FIRST_CHAR, LAST_CHAR, (T,), generator=g))
        lengths_t = torch.tensor(lengths)
        mask = torch.arange(T) < lengths_t[:, None]  # (P*n, T)
        completion_ids = torch.stack(ids).masked_fill(~mask, self.pad_id)  # (P*n, T)
        return Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completion_ids, mask=mask,
                       sampler_logp=torch.zeros(mask.shape), finished=lengths_t < T, num_generations=n)


def prompt_hash_engine(name, policy, *, pad_id, **kwargs) -> PromptHashEngine:
    """Stands in for grpo.rollout.build_engine inside grpo.trainer."""
    return PromptHashEngine(pad_id)


def digit_share(completions, answers, **columns):
    """The share of characters that are digits: rewards that differ within a group."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def dist_cfg(model_dir, out, **kw) -> Config:
    # Token-level loss normalisation and batch-std advantages: the two places where a rank alone does not
    # know the normaliser. mu=2 and micro-batches of 3 rows (not a multiple of G) exercise accumulation.
    base = dict(model=str(model_dir), dataset="arithmetic", num_train_examples=16, engine="hf", max_steps=2,
                prompts_per_step=2, num_generations=2, max_completion_length=8, max_seq_length=1024,
                micro_batch_size=3, num_iterations=2, beta=0.04, loss_norm="token", scale_rewards="batch",
                reward=("test_distributed:digit_share",), lora_rank=4, lora_alpha=8, optim="adamw_torch",
                learning_rate=1e-3, warmup_ratio=0.0, lr_scheduler="constant", save_steps=1, save_total_limit=3,
                log_completions_steps=0, output_dir=str(out), seed=5)
    base.update(kw)
    return Config(**base)


def torchrun(mode: str, arg: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(Path(__file__)), mode, str(arg)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    return result


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------------
# One process: nothing distributed happens
# --------------------------------------------------------------------------------------------------
def test_without_torchrun_env_there_is_no_process_group_and_every_collective_is_the_identity(monkeypatch):
    import torch.distributed as dist

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *NCCL_ENV_DEFAULTS):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    world = init_world()
    assert (world.rank, world.size, world.is_main) == (0, 1, True)
    assert not (dist.is_available() and dist.is_initialized())
    assert dict(os.environ) == before
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("nan"), 3.0])
    grad = p.grad.clone()
    assert world.sum_grads_([p], nonfinite=False) is False and world.sum_grads_([p], nonfinite=True) is True
    torch.testing.assert_close(p.grad, grad, equal_nan=True)  # untouched, nan and all
    rows = torch.arange(6.0).view(3, 2)
    assert world.gather_rows(rows) is rows and world.gather_objects("x") == ["x"]
    assert world.reduce_stats({"kl": 0.5, "ratio_min": 0.9}) == {"kl": 0.5, "ratio_min": 0.9}
    world.barrier()
    world.close()


def test_nccl_env_defaults_turn_nvlink_multicast_off_unless_the_user_set_it():
    assert nccl_env_defaults({}) == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                     "NVSHMEM_DISABLE_NVLS": "1"}
    assert nccl_env_defaults({"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"}) == {
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_world_size_without_the_rest_of_torchruns_env_is_refused_with_the_launch_command(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        init_world()


def test_default_device_is_the_local_ranks_gpu_under_torchrun(monkeypatch):
    from grpo.model.load import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert default_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# Two ranks over gloo
# --------------------------------------------------------------------------------------------------
def flat_cfg(model_dir, out) -> Config:
    """dist_cfg on a model whose adapters take the flat buffer of 8-bit AdamW (grpo.flat_params)."""
    return dist_cfg(model_dir, out, optim="adamw_8bit", lora_rank=32, lora_alpha=64)


PER_TENSOR = "forced per tensor by test_distributed"  # the last run's reason, in its optimizer line


def launch_two_rank_suite(char_llama_dir: Path, aligned_char_llama_dir: Path, out: Path) -> Path:
    """The two_rank_run fixture's (tests/conftest.py) one torchrun launch (its start and its workers' imports cost
    more than a step), whose workers run in turn: the collectives into `collectives/`; 2 steps on 2 ranks into
    `run/`, P=2 per rank, checkpoints after each step; a resume of that run's checkpoint-1 into `resumed/`;
    test_dynamic_sampling's two-rank run into `dynamic/`; 2 steps of 8-bit AdamW on the flat buffer into `flat/`,
    and the same one tensor at a time into `per_tensor/`."""
    from test_dynamic_sampling import two_rank_kw

    dist_cfg(char_llama_dir, out / "run").save(out / "configs" / "run")
    resumed = dist_cfg(char_llama_dir, out / "resumed", resume=str(out / "run" / "checkpoint-1"))
    resumed.save(out / "configs" / "resumed")
    dist_cfg(char_llama_dir, out / "dynamic", prompts_per_step=1, **two_rank_kw(out)).save(out / "configs" / "dynamic")
    for run in ("flat", "per_tensor"):
        flat_cfg(aligned_char_llama_dir, out / run).save(out / "configs" / run)
    result = torchrun("suite", out)
    (out / "stdout.txt").write_text(result.stdout)
    return out


@pytest.mark.slow
def test_collectives_on_two_gloo_ranks_sum_gather_and_agree_on_a_nonfinite_step(two_rank_run):
    results = [json.loads((two_rank_run / "collectives" / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(results):
        assert got["world"] == [r, 2]
        assert got["sum"] == 3.0  # 1 + 2
        assert got["gather_rows"] == [[0.0, 0.0], [0.0, 0.0], [10.0, 10.0], [10.0, 10.0]]  # rank order
        assert got["objects"] == [{"rank": 0}, {"rank": 1}]
        assert got["stats"] == {"kl": 3.0, "ratio_min": 0.5, "ratio_max": 2.0}
        assert got["nonfinite"] is True  # only rank 1 saw it
        assert got["grad"] == [3.0, 5.0, 7.0] and got["grad_none"] is True
        assert got["broadcast"] == [0.0, 0.0]  # rank 0's values
        assert not any(k in got["env"] for k in NCCL_ENV_DEFAULTS)  # gloo leaves NCCL's env alone
        assert got["caller_group_left_open"]  # init_world found the worker's group: closing the World keeps it


def test_two_ranks_train_the_adapter_that_one_process_trains_on_the_same_prompts(two_rank_run, char_llama_dir,
                                                                                  tmp_path, monkeypatch):
    from grpo import trainer

    monkeypatch.setattr(trainer, "build_engine", prompt_hash_engine)
    one = dist_cfg(char_llama_dir, tmp_path / "one", prompts_per_step=4)  # N*P prompts in one process
    trainer.train(one)
    two = two_rank_run / "run"
    a, b = adapter_tensors(two / "adapter"), adapter_tensors(tmp_path / "one" / "adapter")
    after_one_step = adapter_tensors(two / "checkpoint-1")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], after_one_step[k]) for k in a), "step 2 changed nothing"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    # The logged step is the whole batch of both ranks: the same numbers as the one-process run.
    for r2, r1 in zip(records(two), records(tmp_path / "one"), strict=True):
        for key in ("reward", "reward_std", "rewards/digit_share", "accuracy", "format", "completion_length",
                    "frac_finished", "frac_zero_std", "loss", "policy_loss", "kl", "ratio_min", "ratio_max",
                    "grad_norm"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), (r2["step"], key)


def test_two_ranks_step_the_flat_optimizer_bit_for_bit_as_the_per_tensor_one(two_rank_run):
    # Each rank sums the adapters' own gradients over the ranks, then gathers them into the flat buffer's: the
    # same update as bitsandbytes one tensor at a time (the launch's last run, forced per tensor).
    stdout = (two_rank_run / "stdout.txt").read_text()
    assert "over a flat buffer of 14 adapter tensors" in stdout and f"per adapter tensor ({PER_TENSOR})" in stdout
    flat, per_tensor = (adapter_tensors(two_rank_run / run / "adapter") for run in ("flat", "per_tensor"))
    after_one_step = adapter_tensors(two_rank_run / "flat" / "checkpoint-1")
    assert flat.keys() == per_tensor.keys() and any(not torch.equal(flat[k], after_one_step[k]) for k in flat)
    for k in flat:
        assert torch.equal(flat[k], per_tensor[k]), k
    assert [r["grad_norm"] for r in records(two_rank_run / "flat")] == [
        r["grad_norm"] for r in records(two_rank_run / "per_tensor")]


def test_rank_zero_alone_prints_logs_and_saves_with_every_ranks_rng(two_rank_run):
    run = two_rank_run / "run"
    assert [r["step"] for r in records(run)] == [1, 2]  # not once per rank
    stdout = (two_rank_run / "stdout.txt").read_text()
    assert stdout.count("step 2/2 ") == 5 and stdout.count("done") == 5  # once for each of the launch's five runs
    assert sorted(p.name for p in run.iterdir()) == [".claim", "adapter", "checkpoint-1", "checkpoint-2", "config.json",
                                                     "metrics.jsonl", "metrics.png"]
    assert (run / ".claim").read_text() == ""  # rank 0's claim, released at the end
    ckpt = run / "checkpoint-1"
    assert (ckpt / "rng.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["stream"]["per_step"] == 4  # the global stream, N*P


def test_resume_on_two_ranks_continues_as_the_uninterrupted_two_rank_run(two_rank_run):
    run, resumed = two_rank_run / "run", two_rank_run / "resumed"
    a, b = adapter_tensors(run / "adapter"), adapter_tensors(resumed / "adapter")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7)
    [step2] = records(resumed)
    assert step2["step"] == 2 and step2["loss"] == pytest.approx(records(two_rank_run / "run")[1]["loss"], rel=1e-5)


def test_resuming_a_two_rank_checkpoint_in_one_process_is_refused(two_rank_run, char_llama_dir, tmp_path):
    from grpo.trainer import train

    cfg = dist_cfg(char_llama_dir, tmp_path / "one", resume=str(two_rank_run / "run" / "checkpoint-1"))
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\), this run has 1.*--nproc-per-node 2"):
        train(cfg)


# --------------------------------------------------------------------------------------------------
# What each torchrun worker runs: `python -m torch.distributed.run ... tests/test_distributed.py MODE ARG`
# --------------------------------------------------------------------------------------------------
def _collectives(out: Path) -> None:
    out.mkdir(exist_ok=True)
    world = init_world()
    r = world.rank
    grad = torch.nn.Parameter(torch.zeros(3))
    grad.grad = torch.tensor([1.0, 2.0, 3.0]) if r == 0 else torch.tensor([2.0, 3.0, 4.0])
    no_grad = torch.nn.Parameter(torch.zeros(2))
    nonfinite = world.sum_grads_([grad, no_grad], nonfinite=r == 1)
    shared = torch.nn.Parameter(torch.full((2,), float(r)))
    world.broadcast_([shared])
    got = {
        "world": [world.rank, world.size],
        "sum": float(world.sum(torch.tensor(r + 1.0))),
        "gather_rows": world.gather_rows(torch.full((2, 2), 10.0 * r)).tolist(),
        "objects": world.gather_objects({"rank": r}),
        "stats": world.reduce_stats({"kl": 1.0 + r, "ratio_min": 0.5 + r, "ratio_max": 1.0 + r}),
        "nonfinite": nonfinite, "grad": grad.grad.tolist(), "grad_none": no_grad.grad is None,
        "broadcast": shared.tolist(), "env": sorted(os.environ),
    }
    world.close()
    got["caller_group_left_open"] = not world.owns_group and torch.distributed.is_initialized()
    (out / f"rank{r}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    mode, arg = sys.argv[1], Path(sys.argv[2])
    from grpo import optim, trainer

    trainer.build_engine = prompt_hash_engine  # the stand-in sampler, in this worker only
    if mode == "suite":  # two_rank_run's: the runs in turn, in one process group made here, which each of them
        # finds and leaves open (World.owns_group): a default group made again after one was destroyed reads the
        # old group's addresses from torchrun's store, and gloo's ranks then failed to connect
        import torch.distributed as dist

        dist.init_process_group("gloo")
        _collectives(arg / "collectives")
        trainer.train(Config.load(arg / "configs" / "run" / "config.json"))
        trainer.train(Config.load(arg / "configs" / "resumed" / "config.json"))
        trainer.train(Config.load(arg / "configs" / "dynamic" / "config.json"))
        trainer.train(Config.load(arg / "configs" / "flat" / "config.json"))
        optim.flat_refusal = lambda params: PER_TENSOR
        trainer.train(Config.load(arg / "configs" / "per_tensor" / "config.json"))
        dist.destroy_process_group()
    else:
        trainer.train(Config.load(arg))
