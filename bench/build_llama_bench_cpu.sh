#!/usr/bin/env bash
# Build llama.cpp's llama-bench for this machine's CPU (GGML_NATIVE: AVX2/AVX-512/VNNI as the CPU has them), the
# anchor of `lucekv bench decode --llama-bench PATH`. Sources come from the llama-cpp-python sdist on PyPI (the same
# version as ../shared/tools/prepare_llamacpp_anchor.sh uses for CUDA); nothing here is committed.
# usage: bash bench/build_llama_bench_cpu.sh [DIR]   (default DIR=${LUCEKV_HOME:-~/.cache/lucekv}/llama.cpp-cpu)
# prints the binary's path last; ~10 min on 2 idle cores.
set -euo pipefail
VERSION=0.3.36
DIR=${1:-${LUCEKV_HOME:-$HOME/.cache/lucekv}/llama.cpp-cpu}
BIN="$DIR/build/bin/llama-bench"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
PY=${PYTHON:-python3}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
tar xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
mkdir -p "$DIR" && cp -a "$TMP"/llama_cpp_python-*/vendor/llama.cpp/. "$DIR"/
cd "$DIR"
# AMX off: ggml's AMX matmul faults on virtual machines that list AMX in cpuinfo without granting its tile state.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" -DGGML_CUDA=OFF -DGGML_METAL=OFF \
  -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF > build.log 2>&1 || { tail -30 build.log; exit 1; }
cmake --build build -j"$(nproc)" --target llama-bench >> build.log 2>&1 || { tail -30 build.log; exit 1; }
echo "$BIN"
