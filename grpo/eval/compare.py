"""Two held-out evaluations of the same problems, compared problem by problem: McNemar's exact test.

    python -m grpo.eval.compare ours.jsonl trl.jsonl [--key greedy_strict greedy_lenient greedy_format]

Each file is `python -m grpo.eval --per-problem FILE.jsonl` output: one line per problem with its `id`.
Problems pair by id; both files must hold the same set. Per key (a boolean of each record): both accuracies,
the discordant counts b (right in A only) and c (right in B only), and McNemar's exact two-sided p-value,
the binomial test of b against Bin(b + c, 1/2):

    p = min(1, 2 * sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c))      (p = 1 when b + c = 0)

Only discordant problems carry evidence; with 319 problems and one greedy sample each, a 2-3 point gap is
often not significant. What it deliberately is not: a test over sampled pass@1 counts (use the greedy keys).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from grpo.cli import OneLineParser
from grpo.run.failures import report
from grpo.run.plots import json_lines

KEYS = ("greedy_strict", "greedy_lenient", "greedy_format")
EPISODE_KEYS = ("greedy_tool_use", "greedy_success")  # in the records of episodes: with tools, an environment


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of b and c discordant pairs (the binomial test at 1/2)."""
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact: discordant counts must be 0 or more, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))  # exact integers: no rounding before the divide
    return min(1.0, 2 * tail / 2**n)


def read_records(path: str | Path) -> dict[str, dict]:
    """The per-problem records of one evaluation, by problem id; a bad line or a repeated id is one error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; write it with python -m grpo.eval --per-problem {path}")
    records: dict[str, dict] = {}
    for n, record in json_lines(path):
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(f"{path}:{n}: a record without an id; is it python -m grpo.eval --per-problem output?")
        if record["id"] in records:
            raise ValueError(f"{path}:{n}: problem {record['id']} appears twice; evaluate each problem once")
        records[record["id"]] = record
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def compare(a: dict[str, dict], b: dict[str, dict], key: str) -> dict:
    """Accuracies of A and B on `key`, the discordant counts and McNemar's exact p over the shared problems."""
    if set(a) != set(b):
        only_a, only_b = len(set(a) - set(b)), len(set(b) - set(a))
        raise ValueError(f"the two evaluations cover different problems ({only_a} only in A, {only_b} only in B); "
                         "evaluate both with the same --dataset, --eval-size and --max-prompt-length")
    for name, records in (("A", a), ("B", b)):
        missing = [pid for pid, r in records.items() if key not in r]
        if missing:
            raise ValueError(f"--key {key}: {len(missing)} records of {name} lack it; choose one of {', '.join(KEYS)}")
    right_a = {pid for pid, r in a.items() if r[key]}
    right_b = {pid for pid, r in b.items() if r[key]}
    only_a, only_b = len(right_a - right_b), len(right_b - right_a)
    return {"key": key, "problems": len(a), "accuracy_a": len(right_a) / len(a), "accuracy_b": len(right_b) / len(b),
            "both": len(right_a & right_b), "only_a": only_a, "only_b": only_b,
            "neither": len(a) - len(right_a | right_b), "p_value": mcnemar_exact(only_a, only_b)}


def format_row(row: dict) -> str:
    diff = 100 * (row["accuracy_a"] - row["accuracy_b"])
    return (f"{row['key']:<15} A {100 * row['accuracy_a']:5.1f}%  B {100 * row['accuracy_b']:5.1f}%  "
            f"A-B {diff:+5.1f} pts  both {row['both']}  only A {row['only_a']}  only B {row['only_b']}  "
            f"neither {row['neither']}  McNemar exact p = {row['p_value']:.4g}")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m grpo.eval.compare", description=__doc__.splitlines()[0])
    parser.add_argument("a", help="Per-problem JSONL of evaluation A (python -m grpo.eval --per-problem).")
    parser.add_argument("b", help="Per-problem JSONL of evaluation B, over the same problems.")
    parser.add_argument("--key", nargs="+", default=list(KEYS), help="Which boolean of each record to compare "
                        f"(default: {' '.join(KEYS)}; records of episodes also have {' and '.join(EPISODE_KEYS)}).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object per key instead of a line.")
    args = parser.parse_args(argv)
    try:
        a, b = read_records(args.a), read_records(args.b)
        rows = [compare(a, b, key) for key in args.key]
    except (ValueError, FileNotFoundError) as err:
        return report(err, message=str(err))
    print(f"A = {args.a}\nB = {args.b}\n{rows[0]['problems']} problems")
    for row in rows:
        print(json.dumps(row) if args.json else format_row(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
