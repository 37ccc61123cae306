#!/usr/bin/env bash
# The bench step of several versions of the code side by side in one GPU machine start: the A/B a lever needs
# before it becomes the default (benchmarks/RESULTS.md compares only figures of one start).
#
# Here (project root, a git checkout): scripts/bench_ab.sh pack NAME=REF ...
#   writes .ab/NAME.patch, the diff from HEAD to REF, for each (the machine gets the working tree, not .git), and
#   fetches .whl/ (../shared/device/fetch-wheels.sh) if it is missing.
# There (carry [".whl", ".ab"]): scripts/bench_ab.sh run [ROUNDS] [-k EXPR] [-- PYTEST_ARGS]
#   builds /tmp/ab/trees/head (the working tree) and /tmp/ab/trees/NAME (each patch applied to it), then ROUNDS
#   rounds (default 2) of `pytest benchmarks/test_bench_step.py --benchmark -k EXPR PYTEST_ARGS` (EXPR default
#   at_bench_config; PYTEST_ARGS e.g. --bench-steps 12) for every tree, one process a tree and round, in order
#   then reversed; one line a run into $OUT/summary.txt as it comes, so a call cut short keeps what it measured.
#   Install and trees are kept for later calls while the machine stays warm.
#   scripts/bench_ab.sh trees DIR    only builds the trees, in DIR (the CPU test does this)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

build_trees() {  # build_trees DIR: DIR/head and DIR/NAME for each .ab/NAME.patch
  local dir=$1 patch name
  mkdir -p "$dir"
  if [ ! -d "$dir/head" ]; then
    mkdir "$dir/head"
    cp -r grpo benchmarks tests docs pyproject.toml train.py README.md "$dir/head/"
  fi
  for patch in .ab/*.patch; do
    [ -e "$patch" ] || continue
    name=$(basename "$patch" .patch)
    [ -d "$dir/$name" ] && continue
    cp -r "$dir/head" "$dir/$name.part"
    [ ! -s "$patch" ] || (cd "$dir/$name.part" && git apply "$root/$patch") || {
      echo "bench_ab: $patch does not apply to the working tree" >&2; exit 1; }
    mv "$dir/$name.part" "$dir/$name"
  done
}

summarize() {  # summarize NAME RESULTS_DIR: one line per step record
  python3 - "$1" "$2" <<'PY'
import glob, json, sys
name, results = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(results + "/*.json")):
    for record in json.load(open(path))["records"]:
        info = record.get("extra_info", {})
        if "step_time_s" not in info:
            continue
        phases = info.get("phases_s", {})
        gap = info.get("gap", {}).get("logp_abs_mean")
        steady = (info.get("step_times_s") or [])[info.get("warmup_steps", 0):]
        mean = sum(steady) / len(steady) if steady else 0.0  # a collection's stall shows here, not in the median
        print(f"{name} {record.get('dtype')}: step {info['step_time_s']:.4f} s, steady mean {mean:.4f}, "
              f"generate {phases.get('generate', 0):.4f}, train {phases.get('train', 0):.4f}, "
              f"reference {phases.get('reference', 0):.4f}, peak {info.get('peak_alloc_gib', 0):.3f} GiB, gap {gap}, "
              f"steps {info.get('step_times_s')}, gc {info.get('step_gc_s')}")
PY
}

case "${1:-}" in
  pack)
    shift
    [ $# -gt 0 ] || { echo "usage: scripts/bench_ab.sh pack NAME=REF ..." >&2; exit 2; }
    grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
    rm -rf .ab && mkdir .ab
    for pair in "$@"; do
      name=${pair%%=*} ref=${pair#*=}
      [[ $pair == *=* && $name =~ ^[A-Za-z0-9_-]+$ && $name != head ]] || {
        echo "bench_ab: '$pair' is not NAME=REF (NAME: letters, digits, - or _; not head)" >&2; exit 2; }
      git diff --binary HEAD "$ref" -- grpo benchmarks tests docs pyproject.toml train.py README.md > ".ab/$name.patch"
      echo "[bench_ab] .ab/$name.patch: HEAD -> $ref ($(wc -c < ".ab/$name.patch") bytes)"
    done
    if [ -z "${BENCH_AB_NO_WHEELS:-}" ] && [ ! -d .whl ]; then ../shared/device/fetch-wheels.sh; fi ;;
  trees)
    build_trees "${2:?usage: scripts/bench_ab.sh trees DIR}" ;;
  run)
    shift
    rounds=2
    if [[ ${1:-} =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
    expr=at_bench_config
    if [ "${1:-}" = -k ]; then expr=${2:?-k needs an expression}; shift 2; fi
    if [ "${1:-}" = -- ]; then shift; fi
    extra=("$@")  # more of pytest's arguments for every run (--bench-steps N)
    out=${OUT:-/tmp/ab/out}
    mkdir -p "$out" /tmp/ab/results
    if [ ! -d /tmp/ab/site ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ab/site $(ls .whl/*.whl | grep -v trl)
    fi
    build_trees /tmp/ab/trees
    names=(head $(for p in .ab/*.patch; do [ -e "$p" ] && basename "$p" .patch; done))
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    echo "== $gpu, -k '$expr' ${extra[*]}" | tee -a "$out/summary.txt"
    for ((r = 1; r <= rounds; r++)); do
      order=("${names[@]}")
      if ((r % 2 == 0)); then order=($(printf '%s\n' "${names[@]}" | tac)); fi
      for name in "${order[@]}"; do
        results=/tmp/ab/results/$name-$r
        rm -rf "$results"  # a later call on the warm machine (another -k) starts this run's records afresh
        (cd /tmp/ab/trees/$name && HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ab/trees/$name:/tmp/ab/site python3 -m pytest -q \
           -p no:cacheprovider benchmarks/test_bench_step.py --benchmark -k "$expr" --bench-results-dir "$results" \
           "${extra[@]}" \
           > "$results.log" 2>&1) || echo "$name round $r failed: $(tail -2 "$results.log")" | tee -a "$out/summary.txt"
        summarize "$name" "$results" | sed "s/^/round $r: /" | tee -a "$out/summary.txt"
      done
    done ;;
  *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
