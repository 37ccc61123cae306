#!/usr/bin/env bash
# Issue 30 on the H200 machine: the peers in one suite run (benchmarks/README.md, "The peers in one run"), and
# on request the CUDA tests of the vLLM and Unsloth paths or issue 31's suite, as one background chain of the
# stages STAGES names, so that no stage waits for a call.
#
# The machine has no network, takes at most 64 MiB per call, is handed back 30 s after a call ends and after
# 30 minutes held, and runs a command for at most 10 minutes. Here: .whl/ (scripts/trl_comparison.sh pack:
# the Llama 3.2 tokenizer the tests read, TRL 1.16 for the colocated peer) and .vx/ (the vLLM kit). There, each
# a `run` call begun within 30 s of the previous one's end:
#   call  1     carry .whl, .jit/autotune.tgz   engine_peers.sh wheels      installs .whl into /tmp/site; while
#                                                                           the kit is carried, the idle GPU
#                                                                           runs the joined run's first process,
#                                                                           ours native bf16 and FP8, and the
#                                                                           RMSNorm kernel's CUDA test (~3 min;
#                                                                           SIDE=1: issue 31's bench and long
#                                                                           steps unfolded; probe: the token
#                                                                           step's profile; memory: the bench
#                                                                           step's peak; 0: none)
#   calls 2-12  carry .vx/part-NN      scripts/engine_peers.sh vllm-part    (call 12 also carries .vx/SHA and
#                                                                            .vx/kit.sh: installs, starts the chain)
#   call  13    carry .jit/flashinfer-ops.tgz   engine_peers.sh status 360  (where an earlier hold left it) puts
#                                                                           FlashInfer's kernels in place, waits
#   calls 14-   (nothing carried)      scripts/engine_peers.sh status 360   waits, shows the chain, copies results
#               (on 2026-12-04 the first machine of three holds running went back 12-16 minutes after its start,
#               after polls of 540, 540 and 330 s or between two: plan a machine's stages to end by then, and
#               copy what each poll brings before the next; one call that day was told the machine was
#               "taken back for other work")
#   any later   STAGES="..." scripts/engine_peers.sh restart                 stops the chain, runs STAGES instead
# Every call copies what the chain has written so far to $OUT (results.tgz: the stages' logs, their results, and
# compilers.log, the compiler processes seen while they ran), Triton's autotuning results
# (autotune.tgz) and the kernels FlashInfer built (flashinfer-ops.tgz); the last poll, with WARM=1, also every
# kernel Triton compiled and vLLM's compiled graphs (warm-caches.tgz: start-ups spent minutes compiling). Keep the
# last of each in .jit/ for the next hold: call 13 carries flashinfer-ops.tgz and warm-caches.tgz. A new checkout
# has no .jit/: commit autotune.tgz (a few KB of JSON) with the hold's results, where call 1 finds it.
#
# STAGES (default: the suite's peers after ours native, the joined run's anchor, in the side slot; the CUDA tests
# passed in full on 2026-12-02). Each runs under its own timeout (the chain is not held to a call's 10 minutes),
# a failed one does not stop the next. The default stages took 14.2 minutes on 2026-12-04 (12:37-12:52, .jit/
# carried: ours-vllm 2.9, unsloth-fp8 3.5, unsloth-grpo 3.5, unsloth-bf16 2.6, trl-vllm 1.7) once the kit was in
# (~5.5-8.5 minutes into a hold, the machine's start included; unsloth-grpo 10.3 without .jit/autotune.tgz), so
# a hold has a few minutes to spare at most: give the last poll's wait at most the device time left less 2
# minutes (a poll cut by the budget returns nothing), and begin each call within 30 s of the last one's end (else
# the machine, the chain with it, goes back: on 2026-12-04 a second call begun late found a fresh machine and
# lost call 1's install and side slot). What a hold does not reach goes to the next (STAGES=...):
#   ours-vllm      bench: ours --engine vllm (ours native runs in the side slot, SIDE=ours, the default, so
#                  that the chain starts 2-2.5 minutes shorter)                                           ~3
#   ours           bench: ours native bf16 and FP8, ours --engine vllm (4.4-4.6; vLLM's start-up 2 of them) ~5
#   unsloth-fp8    bench: ours --engine unsloth on FP8-Block. On a fresh machine FlashInfer compiles its FP8
#                  block-scale GEMM for batches under 32 rows (nvcc, inside vLLM's CUDA-graph capture: 139 s of
#                  capture on 2026-12-03), so vLLM's start-up alone took ~5 minutes; now the chain builds it
#                  beside the first stage, or the first poll brings an earlier hold's (flashinfer-ops.tgz) ~6
#   unsloth-grpo   bench: Unsloth's own GRPO (TRL 1.15, FP8-Block, standby; 4.6 with .jit/autotune.tgz
#                  carried, first step 50 s; 10.3 without, first step 233 s of Triton's FP8 autotuning) ~5-10
#   unsloth-bf16   bench: ours --engine unsloth on bf16 (3.9)                                             ~4
#   trl-vllm       bench: TRL 1.16 with vllm_mode="colocate" (1.9)                                        ~2
#   folded         bench and long (micro-batches of 4): ours native bf16 with the adapters not folded in
#                  decode (--no-engine-fold-adapter; the product folds since 2026-12-04), their step time and
#                  sampler-trainer gap, and the long step folded; not a default stage since the side slot runs it
#                  while the kit is carried (the chain's `ours` holds the bench step folded)                ~2.5
# and on request:
#   unsloth-share  bench: ours --engine unsloth on bf16 with vLLM at the peers' share 0.35 (A/B for the
#                  share sized for the run, whose vLLM generate took 1.73 s where 0.35's took 1.26)    ~4
#   speed          issue 31's suite in one process: the bench step (bf16, FP8, with the adapters unfolded,
#                  --lora-compute float32, torch's sdpa in decode, micro-batches of 8), the long config (and in
#                  micro-batches of 4, with the kernel and sdpa), 64 and 256 rows, and the sampler at 16, 64
#                  and 256 rows (ours with sdpa and with the attention kernel, ours without the adapter, plain
#                  vLLM with the adapter and without: what vLLM's LoRA kernels cost, which TRL's colocated mode
#                  merges away)                                                                            ~17
#   sampler        the sampler alone at 16, 64 and 256 rows (issue 31's sweep): ours with the adapter (sdpa, the
#                  attention kernel, folded; past 64 rows peft's modules in the packed layers' place) and without,
#                  plain vLLM with the adapter and without (what vLLM's LoRA costs, which TRL's colocated mode
#                  merges away), in one process (9 minutes on 2026-12-04)                                ~10
#   vllm-cuda      tests/test_vllm_cuda.py -k "not unsloth": plain vLLM on bf16, then the FP8-Block child
#                  (DeepGEMM's warm-up skipped; 5.8)                                                       ~6
#   unsloth-cuda   tests/test_vllm_cuda.py -k unsloth: two GRPO steps of --engine unsloth on FP8-Block
#                  (7.4: Unsloth's load 2, its first step 3.6 with FP8 autotuning)                        ~8
#   probe-unsloth  benchmarks/probes/engine_sampling.py --engine unsloth: what Unsloth's vLLM samples from the
#                  tests' model as FP8-Block, without an adapter and with ours, against the trainer    ~3
#   probe-vllm     the same for plain vLLM (VLLMEngine) on the FP8-Block model                          ~2
# The bench stages join one results file (--bench-join): results/peers.json, and each process's own file.
set -euo pipefail
cd "$(dirname "$0")/.."

EP=${EP:-/tmp/ep}
STAGES=${STAGES:-ours-vllm unsloth-fp8 unsloth-grpo unsloth-bf16 trl-vllm}
export GRPO_CACHE=${GRPO_CACHE:-/tmp/grpo-cache} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# FlashInfer's kernels in one place for every stage: Unsloth points FlashInfer's workspace at its own compile
# folder where this is unset (unsloth_zoo's vllm_utils), so its first vLLM start on a machine built FlashInfer's
# FP8 block-scale GEMM again there, with nvcc, after the graph capture (89-106 s; compilers.log, 2026-12-04)
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME}

stage() {  # stage NAME TIMEOUT_S ENV COMMAND...: ENV is `vllm` or `unsloth` (the kit's site on the path)
  local name=$1 limit=$2 site=$3; shift 3
  echo "$(date -u +%T) start $name" >> $EP/stages.log
  local rc=0
  (export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=$EP/triton-cache TRITON_CACHE_AUTOTUNING=1
   source $EP/kit.sh env ${site/vllm/} && timeout -k 30 $limit "$@") > $EP/$name.log 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then echo "$(date -u +%T) end   $name" >> $EP/stages.log
  else
    echo "$(date -u +%T) FAILED $name (exit $rc): tail of $name.log follows" >> $EP/stages.log
    tail -5 $EP/$name.log >> $EP/stages.log
  fi
}

bench() {  # bench NAME SITE -k EXPR: one process of the joined suite run (LIMIT: its timeout, default 900 s)
  local name=$1 site=$2; shift 2
  stage $name ${LIMIT:-900} $site python3 -m pytest -p no:cacheprovider benchmarks/test_bench_step.py --benchmark \
    --bench-join $EP/results/peers.json --bench-results-dir $EP/results/$name "$@"
}

side() {  # the GPU that idles while the kit is carried (the file copies cost the host, not the device; the
  # chain waits for this, ~3 minutes at most). SIDE=ours (default): the joined run's ours native, bf16 and FP8,
  # then tests/test_rmsnorm.py's CUDA test (issue 31); SIDE=1: issue 31's bench and long steps with the
  # adapters not folded in decode, and the long step folded, in one process (results/side/); SIDE=probe: where the
  # bench's token step goes inside its CUDA graph (benchmarks/probes/native_engine.py --plan bench: the product's
  # engine at 16 rows without the adapter, with it, folded, and with the rotaries and the K/V write apart;
  # kernels by family, the GPU's idle time); with PROBE_PLAN=wide, the same at 64 and 256 rows and FP8's at 16;
  # SIDE=memory: what the bench step's bf16 peak is made of (benchmarks/probes/step_memory.py)
  export PYTHONPATH=$PWD:/tmp/site
  echo "$(date -u +%T) start side (${SIDE:-ours})" >> $EP/stages.log
  if [ "${SIDE:-ours}" = ours ]; then  # the first process of the joined run, then the RMSNorm kernel's CUDA test
    mkdir -p $EP/results/ours
    timeout -k 5 300 python3 -m pytest -p no:cacheprovider benchmarks/test_bench_step.py --benchmark \
      --bench-join $EP/results/peers.json --bench-results-dir $EP/results/ours -k bench_config \
      > $EP/ours.log 2>&1 || echo "$(date -u +%T) FAILED ours (ours.log)" >> $EP/stages.log
    tail -n 3 $EP/ours.log | cut -c1-300 >> $EP/stages.log || true
    timeout -k 5 120 python3 -m pytest -p no:cacheprovider -m cuda tests/test_rmsnorm.py \
      > $EP/results/side/rmsnorm-cuda.log 2>&1 || true
    tail -n 1 $EP/results/side/rmsnorm-cuda.log | cut -c1-200 >> $EP/stages.log || true
  elif [ "${SIDE:-ours}" = memory ]; then
    timeout -k 5 240 python3 benchmarks/probes/step_memory.py --out $EP/results/side \
      > $EP/results/side/step-memory.log 2>&1 || true
    grep -h "peaks\|replayed" $EP/results/side/step-memory.log | cut -c1-220 >> $EP/stages.log || true
  elif [ "${SIDE:-ours}" = probe ]; then
    timeout -k 5 200 python3 benchmarks/probes/native_engine.py --budget-s 150 --plan ${PROBE_PLAN:-bench} \
      --out $EP/results/side > $EP/results/side/native-engine.log 2>&1 || true
    grep -h '"kind": "graph_step"\|"kind": "engine"' $EP/results/side/native_engine-*.jsonl 2>/dev/null \
      | cut -c1-220 >> $EP/stages.log || true
  else
    timeout -k 5 240 python3 -m pytest -p no:cacheprovider benchmarks/test_bench_step.py --benchmark \
      --bench-results-dir $EP/results/side -k "adapters_unfolded or long_config_in_micro" \
      > $EP/results/side/levers.log 2>&1 || true
    tail -n 3 $EP/results/side/levers.log | cut -c1-300 >> $EP/stages.log || true
  fi
  echo "$(date -u +%T) end   side" >> $EP/stages.log
  touch $EP/side.done
}

snapshot() {  # snapshot DIR: this tree, without the carried parts (later calls rewrite the tree under a run)
  rm -rf $1 && mkdir -p $1
  tar --exclude=./.vx --exclude=./.qw --exclude=./.whl --exclude=./outputs -cf - . | tar -xf - -C $1
}

prebuild_flashinfer() {  # FlashInfer's FP8 block-scale GEMM for batches under 32 rows, built with nvcc in the
  # background while the first stage runs, so that vLLM's FP8-Block start-up finds it built (139 s of its CUDA-graph
  # capture on 2026-12-03). CPU only: no GPU is visible to it (a CUDA context would show in the running stage's
  # nvidia-smi figure), the arch is named; 4 compile jobs, niced. Not where the first poll has put an earlier
  # hold's build into FlashInfer's AOT directory (flashinfer_aot).
  sleep 45
  if [ -f $EP/flashinfer-aot.done ]; then return 0; fi
  echo "$(date -u +%T) flashinfer: building its small-batch FP8 GEMM beside the stages" >> $EP/stages.log
  if (export CUDA_VISIBLE_DEVICES= FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=4 \
        PYTHONPATH=/tmp/vsite:/tmp/vsite/nvidia_cutlass_dsl/dsl_packages
      timeout 900 nice -n 10 python3 -c "from flashinfer.jit.gemm.fp8_blockscale import \
gen_fp8_blockscale_gemm_sm90_module as spec; spec().build(verbose=False)") > $EP/flashinfer-build.log 2>&1; then
    echo "$(date -u +%T) flashinfer: built" >> $EP/stages.log
  else
    echo "$(date -u +%T) flashinfer: its build failed (flashinfer-build.log); vLLM's start-up builds it" \
      >> $EP/stages.log
  fi
}

watch_compilers() {  # which compilers run, and on what, while the stages start engines (FlashInfer's nvcc,
  # DeepGEMM's JIT, TensorRT-LLM's GEMMs, Triton's ptxas): it named the 89-106 s that vLLM's start-up on Unsloth's
  # engine waited after its graph capture, FlashInfer's FP8 GEMM built a second time in Unsloth's folder
  # (FLASHINFER_WORKSPACE_BASE above). A line each time the set of compiler processes changes.
  local last="" now
  while true; do
    now=$(ps -eo args= | grep -E '^[^ ]*(nvcc|ptxas|cicc|ninja|nvrtc)|flashinfer/jit|deep_gemm' | grep -v grep \
          | cut -c1-240 | sort | uniq -c | sort -rn | head -5 || true)
    if [ "$now" != "$last" ]; then
      { echo "$(date -u +%T)"; echo "${now:-  (none)}"; } >> $EP/compilers.log
      last=$now
    fi
    sleep 5
  done
}

chain() {
  mkdir -p $EP/results
  # (two holds lost 47-60 s between the kit's install and the first stage's start: this line splits them)
  echo "$(date -u +%T) chain begins: $STAGES" >> $EP/stages.log
  watch_compilers & local watcher=$!
  case " $STAGES " in *fp8* | *grpo* | *cuda* | *probe*) prebuild_flashinfer & ;; esac
  if [ -f $EP/side.log ]; then  # the side probes first: nothing shares the GPU with a timed run
    for _ in $(seq 120); do [ -f $EP/side.done ] && break; sleep 5; done
  fi
  for s in $STAGES; do
    case $s in
      probe-unsloth) stage $s 400 unsloth python3 benchmarks/probes/engine_sampling.py --engine unsloth --out $EP/results ;;
      probe-vllm) stage $s 300 vllm python3 benchmarks/probes/engine_sampling.py --engine vllm --out $EP/results ;;
      vllm-cuda) stage $s 720 vllm python3 -m pytest -x -s -p no:cacheprovider tests/test_vllm_cuda.py -k "not unsloth" ;;
      unsloth-cuda) stage $s 1000 unsloth python3 -m pytest -x -s -p no:cacheprovider tests/test_vllm_cuda.py -k unsloth ;;
      ours) bench $s vllm -k "bench_config or vllm_engine" ;;
      ours-vllm) bench $s vllm -k vllm_engine ;;
      folded) bench $s vllm -k "adapters_unfolded or long_config_in_micro" ;;
      unsloth-grpo) bench $s unsloth -k unsloth_grpo ;;
      # -s: vLLM's own lines (its KV cache); faulthandler_timeout: every thread's stack in the log past 600 s
      unsloth-fp8) LIMIT=720 bench $s unsloth -s -o faulthandler_timeout=600 -k "unsloth_path and fp8" ;;
      trl-vllm) bench $s vllm -k vllm_colocated ;;
      unsloth-bf16) bench $s unsloth -s -k "unsloth_path and bf16" ;;
      unsloth-share) bench $s unsloth -s -k peers_share ;;
      sampler) stage $s 900 vllm python3 -m pytest -p no:cacheprovider benchmarks/test_bench_sampler.py --benchmark \
        --bench-results-dir $EP/results/sampler -k sampler_at_rows ;;
      speed) stage $s 1500 vllm python3 -m pytest -p no:cacheprovider benchmarks/test_bench_step.py \
        benchmarks/test_bench_sampler.py --benchmark --bench-results-dir $EP/results/speed \
        -k "bench_config or adapters_unfolded or multiplying_in_float32 or micro_batches_of_8 or long_config \
            or more_rows or sdpa_attention or sampler" ;;
      *) echo "unknown stage $s" >> $EP/stages.log ;;
    esac
  done
  kill $watcher 2>/dev/null || true
  echo "$(date -u +%T) chain stopped" >> $EP/stages.log
}

start_chain() {  # in the background, from a snapshot of this tree
  mkdir -p $EP && cp /tmp/cmp/kit.sh $EP/kit.sh && snapshot $EP/src
  setsid nohup env STAGES="$STAGES" EP=$EP bash $EP/src/scripts/engine_peers.sh chain >> $EP/chain.log 2>&1 < /dev/null &
  echo $! > $EP/chain.pid
  echo "chain started: $STAGES"
}

collect() {  # what the chain has written so far, to $OUT as one results.tgz (a call returns only a few files),
  # and Triton's autotuning results as autotune.tgz: kept as .jit/autotune.tgz, the next hold's call 1 carries
  # them back (Unsloth's FP8 GEMM autotunes each shape for ~20 s, a stage's first step for minutes)
  if [ -z "${OUT:-}" ] || [ ! -d $EP ]; then return 0; fi
  (cd $EP && tar -czf "$OUT/results.tgz" *.log results 2>/dev/null) || true
  if [ -d $EP/triton-cache ]; then
    (cd $EP/triton-cache && find . -name '*.autotune.json' | tar -czf "$OUT/autotune.tgz" -T - 2>/dev/null) || true
  fi
  if [ "${WARM:-0}" = 1 ]; then  # the last poll: the compiled kernels and graphs too, for the next hold's call 13
    mkdir -p $EP/warm-out && ln -sfn $EP/triton-cache $EP/warm-out/triton
    ln -sfn $HOME/.cache/vllm $EP/warm-out/vllm
    (cd $EP/warm-out && tar -czhf "$OUT/warm-caches.tgz" --exclude='*.lock' triton vllm 2>/dev/null) || true
    ls -l "$OUT/warm-caches.tgz" 2>/dev/null || true
  fi
  # FlashInfer's kernels as ./NAME/NAME.so (flashinfer_aot's layout), from the kit's one version and arch; only
  # those a minute old (a build in progress is left for a later poll), and no archive where there are none
  local ops=($HOME/.cache/flashinfer/*/*/cached_ops) built
  if [ -d "${ops[0]}" ]; then
    built=$(cd "${ops[0]}" && find . -name '*.so' -mmin +1)
    if [ -n "$built" ]; then (cd "${ops[0]}" && echo "$built" | tar -czf "$OUT/flashinfer-ops.tgz" -T -) || true; fi
  fi
}

flashinfer_aot() {  # the kernels FlashInfer built in an earlier hold (.jit/flashinfer-ops.tgz) into its AOT
  # directory, from which it loads a kernel without building it (flashinfer/jit/core.py: `is_aot`): vLLM 0.26
  # runs FP8 block-scale linears under 32 rows through FlashInfer's swap-AB GEMM, whose nvcc build took 139 s
  # of vLLM's start-up on FP8-Block checkpoints (2026-12-03). Once per hold, after the kit is in.
  if [ -f .jit/warm-caches.tgz ] && [ ! -f $EP/warm.done ] && [ -f /tmp/cmp/vllm.ready ]; then
    mkdir -p $EP/warm $EP/triton-cache $HOME/.cache/vllm && tar -xzf .jit/warm-caches.tgz -C $EP/warm \
      && cp -rn $EP/warm/triton/. $EP/triton-cache/ && cp -rn $EP/warm/vllm/. $HOME/.cache/vllm/ \
      && echo "$(date -u +%T) warm caches of an earlier hold in place (Triton's kernels, vLLM's compiled graphs)" \
        >> $EP/stages.log
    touch $EP/warm.done
  fi
  if [ ! -f .jit/flashinfer-ops.tgz ] || [ -f $EP/flashinfer-aot.done ] || [ ! -f /tmp/cmp/vllm.ready ]; then
    return 0
  fi
  local dir n=0
  mkdir -p $EP
  for dir in /tmp/vsite/flashinfer /tmp/usite/flashinfer; do
    if [ -d $dir ]; then mkdir -p $dir/data/aot && tar -xzf .jit/flashinfer-ops.tgz -C $dir/data/aot && n=$((n + 1)); fi
  done
  echo "$(date -u +%T) flashinfer: $(tar -tzf .jit/flashinfer-ops.tgz | grep -c '\.so$') kernels of an earlier" \
    "hold into $n AOT directories" >> $EP/stages.log
  touch $EP/flashinfer-aot.done
}

case "${1:-}" in
  wheels)  # call 1 (with .jit/autotune.tgz carried too where an earlier hold left one)
    bash scripts/trl_comparison.sh wheels
    # Triton's autotuning of an earlier hold: this machine's own .jit/, else the newest committed with results
    tuned=$(ls .jit/autotune.tgz 2>/dev/null || ls benchmarks/results/*/autotune.tgz 2>/dev/null | sort | tail -1 \
            || true)
    if [ -n "$tuned" ]; then
      mkdir -p $EP/triton-cache && tar -xzf $tuned -C $EP/triton-cache && echo "autotuning of an earlier hold: $tuned"
    fi
    if [ "${SIDE:-ours}" != 0 ] && [ ! -f $EP/side.log ]; then
      mkdir -p $EP/results/side && snapshot $EP/side-src
      (cd $EP/side-src && setsid nohup env EP=$EP bash scripts/engine_peers.sh side > $EP/side.log 2>&1 < /dev/null &)
      echo "side probes started"
    fi ;;
  vllm-part)  # calls 2-12
    bash scripts/trl_comparison.sh vllm-part
    if [ -f /tmp/cmp/vllm.ready ] && [ ! -f $EP/chain.pid ]; then start_chain; fi ;;
  restart)  # stop the chain (its whole session: `timeout` puts each stage in a process group of its own)
    # and start STAGES from this call's tree
    mkdir -p $EP
    if [ -f $EP/chain.pid ]; then
      sid=$(cat $EP/chain.pid)
      pkill -TERM -s "$sid" || true; sleep 5; pkill -KILL -s "$sid" || true
    fi
    echo "$(date -u +%T) restarted: $STAGES" >> $EP/stages.log
    start_chain ;;
  status)  # polls: wait up to $2 s (default 300; less if the chain ends), then show where it is
    if [ ! -f $EP/stages.log ] && [ ! -f $EP/side.log ]; then  # at once: a fresh machine holds no chain
      echo "no chain in $EP: this machine is new (the last went back, the chain with it); start a hold again"
      exit 3
    fi
    flashinfer_aot
    end=$(( $(date +%s) + ${2:-300} ))
    while [ "$(date +%s)" -lt $end ] && ! tail -n 1 $EP/stages.log 2>/dev/null | grep -q "chain stopped"; do sleep 5; done
    cat $EP/stages.log 2>/dev/null || echo "no chain in $EP"
    running=$(tail -n 1 $EP/stages.log 2>/dev/null | awk '$2 == "start" {print $3}' || true)
    if [ -n "$running" ]; then echo "--- $running.log:"; tail -n 3 $EP/$running.log 2>/dev/null | cut -c1-300 || true; fi
    grep -h "\[vllm-cuda\]\|passed\|failed\|answer " $EP/*-cuda.log 2>/dev/null | tail -12 || true
    grep -h '"kind": "case"' $EP/probe-*.log 2>/dev/null | cut -c1-600 || true
    collect ;;
  chain) chain ;;
  side) side ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
