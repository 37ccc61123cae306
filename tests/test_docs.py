"""The README as a newcomer reads it: every column of the step line explained, every command one that works
from a fresh clone, short enough to read; what runs write (outputs/, exports/) stays out of git. The results
page stays one page of today's figures, and benchmarks/results/ and docs/ hold only what the pages cite."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_column_of_the_step_line_is_explained_in_the_readme():
    from grpo.run.log import step_line

    line = step_line({"step": 3, "reward": -2.5, "reward_std": 0.5, "accuracy": 0.0, "format": 1.0, "kl": 0.0,
                      "completion_length": 22.0, "step_time": 21.0, "peak_mem_gib": 4.7}, max_steps=16)
    columns = re.findall(r"\b([a-z]+) +[-\d.]", line)
    assert columns == ["step", "reward", "acc", "fmt", "kl", "len", "mem"]
    explained = README[README.index("One line per step"):README.index("## Outputs")]
    assert all(f"`{name}`" in explained for name in columns[1:]), [c for c in columns if f"`{c}`" not in explained]


def test_every_readme_command_runs_from_a_fresh_clone():
    verbs = set(re.search(r'case "\$\{1:-help\}" in ([\w|-]+)\)', (ROOT / "dev").read_text())[1].split("|"))
    code = re.findall(r"```bash\n(.*?)```", README, re.S) + re.findall(r"`([^`\n]+)`", README)
    used = [verb for text in code for verb in re.findall(r"\./dev ([\w-]+)", text)]
    assert used and set(used) <= verbs, set(used) - verbs
    commands = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S) for ln in block.splitlines()]
    assert not [c for c in commands if c.startswith(("pytest", "python "))], "outside .venv these lack grpo's packages"


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 100


RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [ROOT / "README.md", RESULTS, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEPT = [ROOT / "benchmarks" / "results", ROOT / "docs"]


def test_the_results_page_is_one_page_of_todays_figures():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 200
    assert "## The measured defaults" in text and "## GRPO step: the latest suite run" in text


def test_results_and_docs_hold_only_the_files_the_pages_cite():
    cited = "\n".join(page.read_text() for page in PAGES)
    files = [f for folder in KEPT for f in folder.rglob("*") if f.is_file()]
    uncited = [str(f.relative_to(ROOT)) for f in files if f.suffix != ".md" and f.name not in cited]
    assert not uncited, uncited
    assert sum(f.stat().st_size for f in files) < 1.5e6


def test_every_file_the_pages_name_exists():
    missing = []
    for page in PAGES:
        for name in re.findall(r"[(`]((?:\.\./)?(?:docs|benchmarks|results|learning|scripts)/[\w./-]+\.\w+)[)`]",
                               page.read_text()):
            if not any((base / name).exists() for base in (page.parent, ROOT, ROOT / "benchmarks", ROOT / "docs")):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, missing


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_what_runs_and_exports_write_stays_out_of_git():
    paths = ["outputs/quickstart/metrics.jsonl", "exports/quickstart/merged/model.safetensors"]
    done = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == paths
