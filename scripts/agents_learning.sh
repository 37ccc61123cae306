#!/usr/bin/env bash
# Issue 64 part 5 on one GPU: the two agent presets on the packaged Qwen2.5-Coder-1.5B-Instruct, 60 steps each,
# held-out evaluation at step 0 and at the end, then each run's plot and a results text (docs/learning.md, "Agents").
#
#   qwen1.5b-gsm8k-calculator   GSM8K with the calculator tool: strict accuracy, tool use, calls, errors, turns
#   qwen1.5b-number-guess       the number-guessing game: success rate and turns
#
# Commands:
#   scripts/agents_learning.sh run [PRESET...] [-- train.py flags]   in the foreground, one preset after the other
#   scripts/agents_learning.sh start [PRESET...] [-- flags]          in the background (setsid), all at once on the
#                                                                    one GPU; returns at once
#   scripts/agents_learning.sh status [SECONDS]                      waits up to SECONDS (default 300) or until the
#                                                                    runs end, shows where they are, collects results
#   scripts/agents_learning.sh qwen-part                             see "Offline machines" below
#   scripts/agents_learning.sh results OUTPUT_DIR                    the results text of one finished run
# MODEL=DIR trains another model (a local folder) instead of the packaged Qwen, which is then not converted: a
# smoke test on a CPU, e.g. MODEL=/tmp/tiny scripts/agents_learning.sh run -- --max-steps 1 --eval-size 2 --engine hf
# PRESET: calculator, number-guess (both by default) or single (the single-turn qwen1.5b-gsm8k for 60 steps, the
# calculator's baseline in the same machine start; docs/learning.md has an earlier 60-step run of it).
#
# Writes $AGENTS_OUT/<preset>/ (default outputs/agents): config.json, metrics.jsonl, metrics.png, results.txt,
# checkpoint-N/ (every 10 steps), adapter/, and $AGENTS_OUT/<preset>.log; with $OUT set (a device call), `status` and `run` copy
# metrics.jsonl, metrics.png, results.txt and the log's tail of each run there.
#
# Why `start` runs the presets side by side: a machine command may last 10 minutes and a session holds the GPU
# 30; the calculator's episodes take one engine call per turn (up to 5) and the game's up to 7, so one after the
# other may not fit. Their step times then say nothing (this measures learning, not speed). On an 80 GB card the
# three presets at once did not fit (the calculator ran out of memory at its first step beside the other two).
#
# Offline machines (no network, at most 64 MiB carried per call): here, `scripts/trl_comparison.sh pack` (.whl/:
# gguf, bitsandbytes and the GSM8K wheel; .qw/part-00..21: the Qwen GGUF in 50 MiB parts). There, one call each,
# in order: `scripts/trl_comparison.sh wheels` (carry .whl), then 22 calls `scripts/agents_learning.sh qwen-part`
# (carry .qw/part-NN): the 22nd joins the GGUF and runs `start`, which converts it once (about 2.5 minutes) and
# trains; then `scripts/agents_learning.sh status 540` until it says "all runs ended".
set -euo pipefail
cd "$(dirname "$0")/.."

QWEN=qwen2.5-coder-1.5b-instruct
GGUF=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
QW_PARTS=22
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
export GRPO_CACHE=${GRPO_CACHE:-/tmp/grpo-cache} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # /tmp/site: trl_comparison.sh wheels installs there
AGENTS_OUT=$(realpath -m "${AGENTS_OUT:-outputs/agents}")
SRC=/tmp/agents-src  # `start` runs from a snapshot of the tree: a later device call rewrites the tree under it

preset_of() {
  case $1 in
    calculator) echo qwen1.5b-gsm8k-calculator ;;
    number-guess) echo qwen1.5b-number-guess ;;
    single) echo qwen1.5b-gsm8k ;;
    *) echo "unknown preset $1: calculator, number-guess or single" >&2; return 2 ;;
  esac
}

train_one() {  # train_one NAME [train.py flags]: the preset for 60 steps, eval at 0 and at the end, then results
  local name=$1; shift
  local out=$AGENTS_OUT/$name
  local extra=()
  if [ "$name" = single ]; then extra=(--max-steps 60 --eval-steps 0 --eval-size 319); fi  # as the calculator's
  mkdir -p "$AGENTS_OUT"
  if [ -n "${MODEL:-}" ]; then extra+=(--model "$MODEL"); fi
  $py train.py --preset "$(preset_of "$name")" "${extra[@]}" --output-dir "$out" --overwrite "$@" \
    > "$AGENTS_OUT/$name.log" 2>&1 || { echo "[agents] $name FAILED: tail of $AGENTS_OUT/$name.log"
                                       tail -5 "$AGENTS_OUT/$name.log"; return 1; }
  results "$out" | tee "$out/results.txt"
}

results() {  # results OUTPUT_DIR: before/after figures of the held-out evaluations in its metrics.jsonl
  $py - "$1" <<'EOF'
import sys
from pathlib import Path
from grpo.run.plots import read_metrics

out = Path(sys.argv[1])
train, evals = read_metrics(out / "metrics.jsonl")
figures = [("greedy strict accuracy", "eval/greedy_accuracy"), ("greedy format", "eval/greedy_format"),
           ("pass@1 strict (sampled)", "eval/pass@1"), ("greedy tool use (episodes with a call)", "eval/greedy_tool_use"),
           ("greedy tool calls per episode", "eval/greedy_tool_calls"),
           ("greedy tool errors per episode", "eval/greedy_tool_errors"),
           ("greedy success rate", "eval/greedy_success"), ("sampled success rate", "eval/sampled_success"),
           ("greedy model turns per episode", "eval/greedy_turns")]
if len(evals) < 2:
    sys.exit(f"{out}: {len(evals)} evaluation(s) in metrics.jsonl; the run has not ended")
first, last = evals[0], evals[-1]
print(f"{out.name}: {len(train)} steps; held out: {int(last['eval/prompts'])} prompts")
print(f"| held out | step {first['step']} | step {last['step']} |\n|---|---:|---:|")
game = "eval/greedy_success" in last  # the answer format's figures say nothing of a game
for label, key in figures:
    if key in first and key in last and not (game and "turns" not in key and "success" not in key):
        print(f"| {label} | {first[key]:.3f} | {last[key]:.3f} |")
if train:
    time = sum(r["step_time"] for r in train) / len(train)
    peak = max(r.get("peak_mem_gib", 0.0) for r in train)
    print(f"{time:.2f} s a step on average, peak memory {peak:.1f} GiB, "
          f"skipped steps {sum(bool(r.get('skipped')) for r in train)}")
EOF
}

collect() {  # each run's files so far, to $OUT (a device call's folder) where it is set
  if [ -z "${OUT:-}" ]; then return 0; fi
  for name in calculator number-guess single; do
    local dir=$AGENTS_OUT/$name
    [ -d "$dir" ] || [ -f "$dir.log" ] || continue
    mkdir -p "$OUT/$name"
    for f in metrics.jsonl metrics.png results.txt config.json; do [ -f "$dir/$f" ] && cp "$dir/$f" "$OUT/$name/"; done
    [ -f "$dir.log" ] && tail -c 20000 "$dir.log" > "$OUT/$name/train.log.tail"
  done
  for f in stages.log convert.log; do [ -f "$AGENTS_OUT/$f" ] && cp "$AGENTS_OUT/$f" "$OUT/"; done
  return 0
}

names_or_default() { if [ $# -gt 0 ]; then echo "$@"; else echo calculator number-guess; fi; }

case "${1:-}" in
  run)
    shift
    names=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do names+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    [ -n "${MODEL:-}" ] || $py -m grpo.model.packaged $QWEN  # converted once into $GRPO_CACHE
    rc=0
    for name in $(names_or_default "${names[@]}"); do train_one "$name" "$@" || rc=1; done
    collect; exit $rc ;;
  start)
    shift
    mkdir -p "$AGENTS_OUT" && : > "$AGENTS_OUT/stages.log"
    given=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do given+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    flags=$(printf '%q ' "$@")
    names=$(names_or_default "${given[@]}")
    for name in $names; do preset_of "$name" > /dev/null; done  # an unknown name fails here, before anything runs
    rm -rf $SRC && mkdir -p $SRC
    tar --exclude=./.qw --exclude=./.whl --exclude=./.vx --exclude=./outputs --exclude=./.git -cf - . | tar -xf - -C $SRC
    cd $SRC
    setsid nohup bash -c "
      echo \"\$(date -u +%T) convert\" >> $AGENTS_OUT/stages.log
      [ -n \"${MODEL:-}\" ] || $py -m grpo.model.packaged $QWEN > $AGENTS_OUT/convert.log 2>&1 \
        || { echo 'convert FAILED' >> $AGENTS_OUT/stages.log; exit 1; }
      for name in $names; do
        ( echo \"\$(date -u +%T) start \$name\" >> $AGENTS_OUT/stages.log
          AGENTS_OUT=$AGENTS_OUT bash $SRC/scripts/agents_learning.sh run-one \$name $flags && echo \"\$(date -u +%T) end \$name\" >> $AGENTS_OUT/stages.log \
            || echo \"\$(date -u +%T) FAILED \$name\" >> $AGENTS_OUT/stages.log ) &
      done
      wait; echo \"\$(date -u +%T) all runs ended\" >> $AGENTS_OUT/stages.log" > "$AGENTS_OUT/chain.log" 2>&1 < /dev/null &
    echo "started: $names (in $AGENTS_OUT; scripts/agents_learning.sh status to follow)" ;;
  run-one) shift; train_one "$@" ;;  # what `start` runs for each preset
  status)
    end=$(( $(date +%s) + ${2:-300} ))
    while [ "$(date +%s)" -lt $end ] && ! grep -q "all runs ended\|convert FAILED" "$AGENTS_OUT/stages.log" 2>/dev/null; do
      sleep 10
    done
    cat "$AGENTS_OUT/stages.log" 2>/dev/null || echo "nothing started in $AGENTS_OUT"
    for name in calculator number-guess single; do
      dir=$AGENTS_OUT/$name
      [ -f "$dir/metrics.jsonl" ] || continue
      echo "$name: $(grep -c '"step_time"' "$dir/metrics.jsonl" || true) steps logged"
      if [ -f "$dir/results.txt" ]; then cat "$dir/results.txt"; fi
    done
    collect ;;
  qwen-part)  # one of the GGUF's 50 MiB parts carried in .qw/; with the last, join them and `start`
    mkdir -p /tmp/qw && mv .qw/part-* /tmp/qw/ && ls /tmp/qw | tr '\n' ' ' && echo
    if [ "$(ls /tmp/qw | wc -l)" -eq $QW_PARTS ]; then
      mkdir -p "$GRPO_CACHE/assets" && cat /tmp/qw/part-* > "$GRPO_CACHE/assets/$GGUF" && rm -rf /tmp/qw
      ls -l "$GRPO_CACHE/assets/$GGUF"  # grpo.model.packaged checks its size and sha256 before converting
      bash scripts/agents_learning.sh start
    fi ;;
  results) results "$2" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
