#!/usr/bin/env bash
# The quick start over several seeds, two runs at a time (one torch thread each), as docs/measurements.md
# records it: does every seed reach the answer format by the last step?
#   scripts/quickstart_sweep.sh OUT_DIR [SEED ...] [-- extra train.py flags]
# Each run goes to OUT_DIR/seed-N (its log beside it); at the end one line per seed: fmt by step, the
# last step's fmt, the run's minutes. Seeds default to 3407 (the preset's) and 1 to 5.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1; shift
seeds=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do seeds+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#seeds[@]} -gt 0 ] || seeds=(3407 1 2 3 4 5)
mkdir -p "$out"
run_one() {  # seed, then the extra flags
  local seed=$1; shift
  local start=$SECONDS
  ./dev train --seed "$seed" --output-dir "$out/seed-$seed" --overwrite "$@" >"$out/seed-$seed.log" 2>&1 || true
  echo "$((SECONDS - start))" >"$out/seed-$seed.seconds"
}
echo "[sweep] $(date -u +%FT%TZ) on $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg): seeds ${seeds[*]} $*"
for ((i = 0; i < ${#seeds[@]}; i += 2)); do
  run_one "${seeds[i]}" "$@" &
  [ $((i + 1)) -lt ${#seeds[@]} ] && run_one "${seeds[i + 1]}" "$@" &
  wait
  echo "[sweep] $(date -u +%TZ) done: ${seeds[i]} ${seeds[i + 1]:-}, load $(cut -d' ' -f1-3 /proc/loadavg)"
done
for seed in "${seeds[@]}"; do
  .venv/bin/python - "$out/seed-$seed" "$(cat "$out/seed-$seed.seconds")" "$seed" <<'PY'
import json, sys
folder, seconds, seed = sys.argv[1:]
try:
    rows = [json.loads(line) for line in open(f"{folder}/metrics.jsonl") if '"step"' in line and '"reward"' in line]
except FileNotFoundError:
    rows = []
fmt = " ".join(f"{r['format']:.2f}" for r in rows)
last = rows[-1]["format"] if rows else float("nan")
times = [r["step_time"] for r in rows]
span = f"steps {min(times):.0f}-{max(times):.0f} s" if times else "no steps"
print(f"seed {seed:>5}: last fmt {last:.2f} | {int(seconds) / 60:.1f} min, {span} | fmt by step: {fmt}")
PY
done
