# One start: the suite's bench step on main now (the prefill from CUDA graphs, the decode kernels' epilogue loads
# before the K loop) against c11f2f1 (.ab/old), alternating; the CUDA tests of the changed code; the FP8 decode
# GEMM groups and engine step, new kernels against old.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
R=/tmp/r; mkdir -p $R
export HF_HUB_OFFLINE=1 GRPO_CACHE=/tmp/gc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)"
run() { local dir=$1 name=$2 limit=$3; shift 3
  echo "== $(date -u +%T) $name"
  (cd $dir && timeout -k 10 $limit env PYTHONPATH=.:/tmp/site "$@") > $R/$name.log 2>&1; echo "rc=$?"; tail -2 $R/$name.log; tar -czf $OUT/r.tgz -C $R .; }
S="python3 -m pytest -p no:cacheprovider -q benchmarks/test_bench_step.py --benchmark"
T="python3 benchmarks/probes/decode_gemm_tiles.py --pairs gate_up:fp8 down:fp8 qkv:fp8 o:fp8 --budget-s 15 --engine"
run . step-new 150 $S -k at_bench_config --bench-results-dir $R/step-new
run .ab/old step-old 150 $S -k at_bench_config --bench-results-dir $R/step-old
run . cuda-tests 150 python3 -m pytest -p no:cacheprovider -q -m cuda tests/test_decode_gemm.py tests/test_native_engine.py -k "prefill or cuda_graph or folded or beside or released or FP8 or fp8 or lora"
run . tiles-new 70 $T --out $R/tiles-new
run .ab/old tiles-old 70 $T --out $R/tiles-old
run . step-new2 100 $S -k "at_bench_config and fp8" --bench-results-dir $R/step-new2
run .ab/old step-old2 100 $S -k "at_bench_config and fp8" --bench-results-dir $R/step-old2
echo "== $(date -u +%T) done"
