"""Two evaluations compared problem by problem: McNemar's exact p-value against hand-computed cases."""

from __future__ import annotations

import json

import pytest

from grpo.eval import compare as compare_evals


def test_mcnemar_exact_matches_hand_computed_binomial_tails():
    # b=1, c=5: n=6, P(X <= 1) = (C(6,0) + C(6,1)) / 2^6 = 7/64, two-sided 14/64
    assert compare_evals.mcnemar_exact(1, 5) == pytest.approx(14 / 64, abs=1e-15)
    assert compare_evals.mcnemar_exact(5, 1) == compare_evals.mcnemar_exact(1, 5)  # symmetric
    # b=0, c=6: 2 * 1/64
    assert compare_evals.mcnemar_exact(0, 6) == pytest.approx(2 / 64, abs=1e-15)
    # b=2, c=10: n=12, (1 + 12 + 66) / 4096 = 79/4096, two-sided 158/4096 = 0.0386
    assert compare_evals.mcnemar_exact(2, 10) == pytest.approx(158 / 4096, abs=1e-15)
    assert compare_evals.mcnemar_exact(3, 3) == 1.0 and compare_evals.mcnemar_exact(0, 0) == 1.0  # capped at 1
    # large n stays exact (integers), no overflow: 40 vs 60 of 100 discordant pairs
    assert compare_evals.mcnemar_exact(40, 60) == pytest.approx(0.0569, abs=5e-4)
    with pytest.raises(ValueError, match="b=-1"):
        compare_evals.mcnemar_exact(-1, 2)


def _write(path, rows):
    path.write_text("".join(json.dumps({"id": pid, "greedy_strict": s, "greedy_lenient": lenient}) + "\n"
                            for pid, s, lenient in rows))
    return path


def test_compare_pairs_problems_by_id_and_counts_the_discordant_ones(tmp_path, capsys):
    # A right on p1 p2 p3; B right on p3 p4 (order differs between files: pairing is by id)
    a = _write(tmp_path / "a.jsonl", [("p1", True, True), ("p2", True, True), ("p3", True, True), ("p4", False, True),
                                      ("p5", False, False)])
    b = _write(tmp_path / "b.jsonl", [("p5", False, False), ("p4", True, True), ("p3", True, True), ("p2", False, True),
                                      ("p1", False, False)])
    row = compare_evals.compare(compare_evals.read_records(a), compare_evals.read_records(b), "greedy_strict")
    assert (row["both"], row["only_a"], row["only_b"], row["neither"]) == (1, 2, 1, 1)
    assert row["accuracy_a"] == 0.6 and row["accuracy_b"] == 0.4
    assert row["p_value"] == 1.0  # b=2, c=1: 2 * (1 + 3) / 8 = 1
    assert compare_evals.main([str(a), str(b), "--key", "greedy_strict", "greedy_lenient"]) == 0
    out = capsys.readouterr().out
    assert "5 problems" in out and "only A 2  only B 1" in out and "greedy_lenient" in out


def test_compare_refuses_evaluations_of_different_problems_in_one_line(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [("p1", True, True), ("p2", True, True)])
    b = _write(tmp_path / "b.jsonl", [("p1", True, True), ("p3", True, True)])
    assert compare_evals.main([str(a), str(b)]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error:") and "1 only in A, 1 only in B" in line
    assert compare_evals.main([str(a), str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"id": "p1", "greedy_strict": true}\n{"id": "p1", "greedy_strict": true}\n')
    assert compare_evals.main([str(a), str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:2: problem p1 appears twice" in capsys.readouterr().err
