#!/usr/bin/env bash
# Runs on the lent GPU machine, from the repo root, with .whl/ (gguf, threadpoolctl, pytest) carried.
#   bash bench/gpu_session.sh tests    gpu kernel tests, graph replay check; starts the llama.cpp build
#   bash bench/gpu_session.sh models   parity and speed on the model pieces in .models/ (+ llama-bench)
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

case "${1:-tests}" in
tests)
  if [ -d .anchors ] && [ ! -x /tmp/llama.cpp/build/bin/llama-bench ]; then
    setsid nohup bash .anchors/build_llama_bench.sh > /tmp/llama_build.out 2>&1 < /dev/null &
  fi
  for p in .models/*.part*; do [ -e "$p" ] && cp "$p" /tmp/; done
  python3 -m pytest -q -m gpu tests/kernels/test_cuda_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  python3 -m lucekv.bench.cuda_graph_check --n-embd 1024 --n-layer 8 --steps 64 --out "$OUT/graph.json" 2>&1 | tail -20
  ;;
models)
  for p in .models/*.part*; do [ -e "$p" ] && cp "$p" /tmp/; done
  cat /tmp/smollm2.part* > /tmp/smollm2-135m.gguf && sha256sum /tmp/smollm2-135m.gguf | tee "$OUT/model_sha.txt"
  python3 -m lucekv.bench.parity /tmp/smollm2-135m.gguf --json "$OUT/parity-smollm2.json" 2>&1 | tail -25
  python3 -m lucekv.cli bench decode --model /tmp/smollm2-135m.gguf --backend cuda --prompt-tokens 512 \
    --gen-tokens 128 --json "$OUT/cuda-decode-smollm2.json" 2>&1 | grep -E "run|median|rror"
  if [ -x /tmp/llama.cpp/build/bin/llama-bench ]; then
    /tmp/llama.cpp/build/bin/llama-bench -m /tmp/smollm2-135m.gguf -p 512 -n 128 -fa 1 -ngl 99 -o json \
      > "$OUT/llama-bench-smollm2.json" 2> "$OUT/llama-bench.err"; tail -c 1500 "$OUT/llama-bench-smollm2.json"
  else
    echo "llama-bench not built:"; tail -5 /tmp/llama_build.out /tmp/llama_build.log 2>/dev/null
  fi
  ;;
esac
