"""scripts/bench_ab.sh, the part that runs here: a patch for each named ref, and the trees the GPU machine benches
(the working tree, and each patch applied to a copy of it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the project as a git checkout")
def test_pack_and_trees_give_each_named_ref_its_own_copy_of_the_working_tree(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=clone, check=True)

    git("checkout", "-q", "-b", "lever")
    init = clone / "grpo" / "__init__.py"
    init.write_text(init.read_text() + "# the lever\n")
    git("commit", "-q", "-am", "the lever")
    git("checkout", "-q", "-")
    env = dict(os.environ, BENCH_AB_NO_WHEELS="1")
    script = ["bash", "scripts/bench_ab.sh"]
    packed = subprocess.run([*script, "pack", "lever=lever", "same=HEAD"], cwd=clone, env=env, capture_output=True,
                            text=True, check=True)
    assert ".ab/lever.patch: HEAD -> lever" in packed.stdout
    subprocess.run([*script, "trees", str(tmp_path / "trees")], cwd=clone, check=True)
    trees = tmp_path / "trees"
    assert sorted(p.name for p in trees.iterdir()) == ["head", "lever", "same"]
    assert (trees / "lever" / "grpo" / "__init__.py").read_text().endswith("# the lever\n")
    for name in ("head", "same"):  # the clone's working tree, back on the commit it was cloned at
        assert (trees / name / "grpo" / "__init__.py").read_text() == init.read_text()
    assert (trees / "head" / "benchmarks" / "test_bench_step.py").is_file()
    bad = subprocess.run([*script, "pack", "head=lever"], cwd=clone, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "'head=lever' is not NAME=REF" in bad.stderr
