"""Ends that explain themselves (what a newcomer meets): a missing --model path, train.py outside its
environment, --list-presets into a closed pipe (the bitsandbytes kernel-hub warning: test_quickstart)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_model_path_that_does_not_exist_is_called_a_missing_path_not_an_unreachable_hub_id(tmp_path):
    from grpo.model.load import resolve_model_dir

    for name in ("/nonexistent", "./my-model", str(tmp_path / "gone")):
        with pytest.raises(FileNotFoundError, match=rf"^--model {name}: no such folder; fix: check the path"):
            resolve_model_dir(name)


def test_train_py_in_a_python_without_torch_points_to_dev():
    run_without_torch = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['train.py', '--max-steps', '1']; "
                         "runpy.run_path('train.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", run_without_torch], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: torch is not installed in this Python ({sys.executable}); fix: run ./dev train (it sets up .venv "
        "first), or .venv/bin/python train.py"]


def test_list_presets_into_a_pipe_closed_early_ends_quietly():
    """As `train.py --list-presets | head` when head has gone before the list is written."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "train.py", "--list-presets"], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 0

