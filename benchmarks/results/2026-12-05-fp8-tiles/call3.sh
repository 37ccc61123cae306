# FP8's decode GEMM tiles at 16 rows swept again with today's kernels (pdl, bit unpacking), then the engine's
# decode step with the picks (bf16, FP8, both with rsLoRA r32).
R=/tmp/r3; mkdir -p $R
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 10 ${T:-480} python3 benchmarks/probes/decode_gemm_tiles.py --formats fp8 --full --budget-s ${B:-330} \
  --engine --out $R > $R/tiles.log 2>&1; echo "rc=$?"; tail -25 $R/tiles.log
tar -czf $OUT/r3.tgz -C $R .
