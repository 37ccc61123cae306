"""One live run per output folder (grpo.run.claim): a second run is refused in one line naming the first,
a stale claim is taken over with a note; tested with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_as_main
from grpo.run.checkpoint import claim_output_dir
from grpo.config import Config
from grpo.distributed import World
from grpo.run.claim import CLAIM_FILE, FolderInUse, RunClaim

ROOT = Path(__file__).resolve().parents[1]

# A run that claims the folder as claim_output_dir does first (RunClaim alone: no torch to import), writes what
# its set-up and first step write, says so and waits.
HOLDER = """
import json, sys
from pathlib import Path
from grpo.run.claim import RunClaim
out = Path(sys.argv[1])
claim = RunClaim.take(out)
(out / "config.json").write_text(json.dumps({"seed": 1}))
(out / "metrics.jsonl").write_text('{"step": 1}\\n')
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """A real process holding tmp_path/run, killed with SIGKILL at the end (it never releases)."""
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert process.stdout.readline().strip() == "held"
        yield process, out
    finally:
        process.kill()
        process.wait()


def test_a_second_run_into_a_folder_a_live_run_holds_is_refused_in_one_line_naming_it(holder, monkeypatch, capsys):
    process, out = holder  # the second run: train.py in this process
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run_as_main([ROOT / "train.py", "--model", "/nonexistent", "--output-dir", out, "--seed", "2"],
                       monkeypatch) == 1
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert f"--output-dir {out} is in use by another run: pid {process.pid} on " in lines[0]
    assert "pick another --output-dir" in lines[0]
    # the first run's files are as it left them
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    assert json.loads((out / CLAIM_FILE).read_text())["pid"] == process.pid


def test_a_second_run_with_overwrite_is_refused_too_and_moves_nothing(holder, tmp_path):
    process, out = holder
    with pytest.raises(FolderInUse, match=f"pid {process.pid}"):
        claim_output_dir(Config(output_dir=str(out), overwrite=True), World())
    assert not list(tmp_path.glob("run.old-*")) and (out / "metrics.jsonl").is_file()


def test_the_claim_of_a_killed_run_is_taken_over_with_a_note_naming_it(holder):
    process, out = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    claimed = claim_output_dir(Config(output_dir=str(out), resume=None, overwrite=True), World())
    try:
        assert claimed.claim.note.startswith(f"--output-dir {out}: the run that held it (pid {process.pid} on ")
        assert "ended without releasing it" in claimed.claim.note and claimed.claim.note.endswith("taken over")
        assert json.loads((out / CLAIM_FILE).read_text())["pid"] == os.getpid()
        assert (claimed.moved / "metrics.jsonl").is_file()  # --overwrite moved the killed run aside, whole
        assert (claimed.moved / CLAIM_FILE).read_text() == ""  # and left its claim released
    finally:
        claimed.claim.release()


def test_a_released_claim_is_taken_again_without_a_note(tmp_path):
    first = RunClaim.take(tmp_path / "run")
    assert first.note is None
    first.release()
    assert (tmp_path / "run" / CLAIM_FILE).read_text() == ""
    second = RunClaim.take(tmp_path / "run")
    assert second.note is None
    second.release()


def test_a_refused_run_leaves_no_folder_it_made(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(FileNotFoundError):
        claim_output_dir(Config(output_dir=str(out), resume="latest"), World())
    assert not out.exists()


def test_a_run_whose_setup_fails_releases_its_claim(tmp_path):
    from grpo.trainer import train

    out = tmp_path / "run"
    with pytest.raises(Exception):  # the model cannot be loaded: setup fails after the folder was claimed
        train(Config(model=str(tmp_path / "no-model"), output_dir=str(out)))
    assert (out / CLAIM_FILE).read_text() == ""  # released: the next run takes it without a "killed" note
    again = RunClaim.take(out)
    assert again.note is None
    again.release()
