# A/B on one machine start: main now (the tree) against 011a54c (.ab/old), the sampler folded and the attention.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=/tmp/r; mkdir -p $R
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 GRPO_CACHE=/tmp/gc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)"
run() { local dir=$1 name=$2 limit=$3; shift 3
  echo "== $(date -u +%T) $name"
  (cd $dir && timeout -k 10 $limit "$@") > $R/$name.log 2>&1; echo "rc=$?"; tail -4 $R/$name.log; tar -czf $OUT/r.tgz -C $R .; }
S="python3 -m pytest -p no:cacheprovider -q benchmarks/test_bench_sampler.py --benchmark"
run . attention-new 90 env PYTHONPATH=.:/tmp/site python3 benchmarks/probes/attention_tiles.py --default-only --out $R/att-new
run .ab/old attention-old 90 env PYTHONPATH=.:/tmp/site python3 benchmarks/probes/attention_tiles.py --default-only --out $R/att-old
run . sampler-new 260 $S -k "native_sampler_at_rows and folded" --bench-results-dir $R/new
run .ab/old sampler-old 200 $S -k "native_sampler_at_rows and folded" --bench-results-dir $R/old
echo "== $(date -u +%T) done"
