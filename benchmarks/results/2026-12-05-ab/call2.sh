# After call 1 on the same machine (/tmp/site installed): the CUDA tests of the engine, its GEMM and sampler
# kernels, then the suite's bench step (bf16 and FP8).
R=/tmp/r2; mkdir -p $R
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 GRPO_CACHE=/tmp/gc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d /tmp/site/bitsandbytes ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
run() { local name=$1 limit=$2; shift 2
  echo "== $(date -u +%T) $name"
  timeout -k 10 $limit "$@" > $R/$name.log 2>&1; echo "rc=$?"; tail -4 $R/$name.log; tar -czf $OUT/r2.tgz -C $R .; }
run cuda-tests ${T1:-300} python3 -m pytest -p no:cacheprovider -q -m cuda tests/test_native_engine.py \
  tests/test_decode_gemm.py tests/test_race_sample.py
run step ${T2:-270} python3 -m pytest -p no:cacheprovider -q benchmarks/test_bench_step.py --benchmark \
  -k "${STEP_K:-at_bench_config}" --bench-results-dir $R/step
echo "== $(date -u +%T) done"
