"""./dev, the entry point of a fresh clone: train and python run in the caller's folder, so that relative
paths are the user's; ./dev bench runs the benchmark suite. Skipped where ./dev has not set up .venv (it
would install it first): CI runs ./dev test, which has."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "dev"


def _dev_ready() -> bool:
    digest = hashlib.sha1((ROOT / "pyproject.toml").read_bytes() + DEV.read_bytes()).hexdigest()[:12]
    return (ROOT / ".venv" / f".installed-{digest}").is_file()


pytestmark = pytest.mark.skipif(not _dev_ready(), reason="./dev has not set up .venv for this checkout")


def _dev(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEV), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_dev_python_runs_in_the_callers_folder(tmp_path):
    done = _dev(["python", "-c", "import os, grpo.config; print(os.getcwd())"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path)


@pytest.mark.slow
def test_dev_train_writes_a_relative_output_dir_in_the_callers_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    done = _dev(["train", "--model", str(missing), "--output-dir", "myrun", "--max-steps", "1"], tmp_path)
    assert done.returncode == 1
    assert (tmp_path / "myrun" / "config.json").is_file() and not (ROOT / "myrun").exists()


def test_dev_bench_finds_the_benchmark_suite_from_a_fresh_clone(tmp_path):
    done = _dev(["bench", "--collect-only", "-q"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "benchmarks/test_bench_step.py" in done.stdout
