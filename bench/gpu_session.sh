#!/usr/bin/env bash
# Runs on the lent GPU machine, from the repo root, with .whl/ (gguf, threadpoolctl, pytest) carried.
#   bash bench/gpu_session.sh tests    every gpu test, the kernel tests, graph replay check
#   bash bench/gpu_session.sh models   CUDA-vs-CPU parity on the real models whose pieces reached /tmp
#   bash bench/gpu_session.sh bench    decode/prefill speed, lucekv, llama-bench and (real models) transformers in
#                                      the same run
#   bash bench/gpu_session.sh profile  matvec and attention speed at 8B shapes, per-kernel time of the 8B decode step
#   bash bench/gpu_session.sh moe      MoE: kernel tests at the Qwen3-30B-A3B shapes, CUDA==CPU on the upcycled
#                                      smollm2 (needs its pieces); `moe write` writes the 30B-A3B-shaped Q4_K_M file
#                                      (~17 GB in /tmp, a call of its own), then `moe bench` (lucekv decode/prefill
#                                      beside llama-bench, GPU memory) and `moe profile` (the decode step's and the
#                                      512-token prefill's kernels, each inside its graph); `moe ffn`: one layer's MoE
#                                      FFN at prefill, random experts in memory (no file; per-kernel us, ~3-5 min);
#                                      `moe speed`: one MoE layer's decode kernels at the A3B shape, random experts in
#                                      memory (no file): each kernel's µs and GB/s, a layer's chain with combine and
#                                      with routed_sum (the step's path: equal outputs) (~2 min with the compiles)
#   bash bench/gpu_session.sh spark    Spark (issue 24): `spark write` writes the 30B-A3B-shaped Q4_K_M file with a
#                                      Zipf-skewed router (~5 min, a call of its own); `spark tests`: Spark's gpu and
#                                      kernel tests (128 greedy tokens of the k-means-routed upcycled smollm2 at 30/50%
#                                      + cache == all-GPU; decode rows feeding the cache; routing counted on the
#                                      device == the CPU's; needs smollm2's pieces; ~3-4 min); `spark bench`: lucekv bench
#                                      spark at 30/50/70% resident (calibration trace recorded on the GPU) beside
#                                      llama-bench -ncmoe at the same expert VRAM (built by `depth build`); `spark
#                                      long`: the engine sized within 15 GiB of GPU memory (--gpu-memory-gib, auto
#                                      KVFlash pool; the goal: a peak under 16 GiB, scratch measured), 50% resident,
#                                      calibrated (its routing counted on the device, as --spark-record does) + cache,
#                                      decode on a 128K context (restored, not prefilled) and a 1K one (again with the
#                                      routing counted: its cost); peak GPU memory (~5-8 min)
#   bash bench/gpu_session.sh niah CTX [MODEL] [RES]  recall of the RULER-style tasks at CTX tokens (10 cases per
#                                      task), full cache vs pools of RES (default 0.0625,0.125) under quest, lru and
#                                      draft (drafter qwen2.5-coder-0.5b); MODEL qwen05 (default) or qwen15; needs
#                                      .data/niah-corpus.json (lucekv bench niah-corpus -o .data/niah-corpus.json;
#                                      git-ignored, ~8 MB) carried
#   bash bench/gpu_session.sh niah-diagnose CTX POOL  issue 29's diagnosis (bench/niah_diagnose.py) of the 0.5b's
#                                      10 cases per task at CTX tokens and a POOL-token pool: draft and the oracles
#                                      (asked needles, every needle), on pool vs full K/V; ~5 min; needs the corpus
#                                      and /tmp/qwen2.5-coder-0.5b.gguf as niah does
#   bash bench/gpu_session.sh pflash CTX [KEEP] [LAYERS]  PFlash (issue 27): lucekv bench niah on qwen2.5-coder-1.5b,
#                                      full prefill vs prompts compressed to KEEP (default 0.1) by the 0.5b drafter
#                                      (reading with its first LAYERS layers; default all 24; 16 selected as 24 on
#                                      the CPU, bench/results/cpu-pflash-layers-*, for 2/3 of the time): recall and
#                                      time to first token per case, PFLASH_N (5) cases per task at depths 0.1..0.9,
#                                      one JSON; CTX 16000 or 32000 (~4 and ~7 min: a call each); needs both models'
#                                      pieces and .data/niah-corpus.json carried
#   bash bench/gpu_session.sh spec [WORKLOADS] [qwen15|qwen05]  lucekv bench spec: qwen2.5-coder-1.5b target, 0.5b draft
#                                      (or the 0.5b alone: suffix, suffix-tree and auto; SPEC_MODES overrides), greedy,
#                                      verify forward ms by width
#                                      (matvec rows vs all matmul) and the kernels of a 17-token verify forward,
#                                      SPEC_N (20) prompts per workload (default code,edit,chat; ~2-3 min each), needs both
#                                      models' pieces (.models/qwen15.part*, .models/qwen05.part*) and
#                                      bench/prompts/spec.json (`lucekv bench spec-prompts -o bench/prompts/spec.json`)
#   bash bench/gpu_session.sh tree     draft tree verify: the kernel and gpu tests of trees (~2-3 min, no models)
#   bash bench/gpu_session.sh steps [smollm2|qwen05|8b]  lucekv bench steps in process: TTFT at 16..500 tokens,
#                                      the decode step at 1..32 concurrent requests and the host time inside it,
#                                      --gil-probe; peak GPU memory (~1-2 min; smollm2/qwen05 need their pieces);
#                                      MMQ=N before it: with --mmq-tokens N (0: no product on the integer
#                                      tensor cores; default 64), JSON named ...-mmqN
#   bash bench/gpu_session.sh mvrows   products of several tokens (verify blocks, decode rows): the tests (gpu and
#                                      tiny-shape) of the matvec, verify and batch paths, then matvec_speed
#                                      --rows 1,2,4,8,17,32 at the 8B's, the 1.5B's and the 0.5B's layer shapes:
#                                      the matvec as routed vs per-token grid rows vs the several-token kernels at
#                                      2/4/8 tokens a block vs matmul, with errors (~6-8 min)
#   bash bench/gpu_session.sh mvrows 8b   matvec_speed --rows 1,2,4,8,16,32,64 at the 8B's products only, as its
#                                      step runs them (q+k, v, o, gate+up, down): every path's µs (mmq's, x in one
#                                      int8 part and in two, too), errors, bit equality to the per-token path (~5-7
#                                      min, mostly compiling; no models)
#   bash bench/gpu_session.sh mvrows layers  mmq_speed: an 8B layer's integer tensor-core products at 8/16/32 tokens
#                                      for this tree's mmq.py beside .anchors/mmq_before.py and .anchors/mmq_mmq3.py
#                                      (git show e74b59c:lucekv/kernels/cuda/mmq.py, 490e4a4's), each with the
#                                      row tile's last block adding the splits up to 2 token tiles (today 1), and with x
#                                      quantized by before's launch (issue 25; ~4-5 min, mostly compiling in parallel)
#   bash bench/gpu_session.sh mvrows mmq  the integer tensor-core products' tests on the hardware (the s8 mma fragment
#                                      layouts, products against float64 and an exact oracle, the backend's route;
#                                      ~2-3 min)
#   bash bench/gpu_session.sh mvrows e2e  their end-to-end effect on Qwen2.5-1.5B's shape (the real file if its
#                                      pieces reached /tmp, else random weights in its Q4_K_M mix, written here in
#                                      ~1 min): the kernels of the verify forward at widths 1..32 (kernel_profile),
#                                      and lucekv bench steps, the decode step at 1..32 concurrent requests (~5 min)
#   bash bench/gpu_session.sh matmul   the prefill matmul: its tests (gpu and tiny-shape), the prompt pieces' graph
#                                      test, matmul_speed at the 8B's shapes (short, long and wide tiles and last
#                                      session's kernel at 64..2048 tokens, the q/k + v pair, errors), the 8B shape's
#                                      512-token prefill per kernel (~6-8 min); pp512 against llama-bench: `bench`
#   bash bench/gpu_session.sh depth    decode tok/s at 4K..128K context, 8B shape, pool 4096 vs full cache vs
#                                      llama-bench (~5 min); `depth build` first builds llama-bench (~4 min, a call
#                                      of its own: /tmp survives while the machine stays warm)
#   bash bench/gpu_session.sh serve 8b|05b  continuous batching: `lucekv bench serve` at 1,4,16,64 concurrent
#                                      ShareGPT streams beside llama-server -np C, on the 8B shape or the real 0.5B
#                                      (~6 min each, a call each); `serve build` first builds llama-server (~6 min).
#                                      Needs .anchors/sharegpt.json: lucekv bench serve --sample-only
#                                      --save-dataset .anchors/sharegpt.json --num-requests 128
#   bash bench/gpu_session.sh serve-host 8b|smollm2  what the serving path adds to a step, on this machine's CPU
#                                      (the GPU is not used): python -m lucekv.bench.serve_host, a server whose backend
#                                      waits the H100's step times of the 8B shape or of smollm2, over gRPC at 1..64
#                                      streams beside the same requests in process, at serve's 0.2 ms GIL switch
#                                      interval and at 1 ms (~5-6 min each, a call each)
#   bash bench/gpu_session.sh startup  lucekv bench startup on the 8B shape: the engine started in a fresh process
#                                      twice over one empty kernel cache (cold, then warm: the kernels the first
#                                      compiled, from disk), each start's time and kernels loaded / compiled, then
#                                      two 8192-token prompts in each (prefill tok/s, kernels compiled mid-request)
#                                      (~4-7 min: the cold start compiles every kernel the warm-up meets; .anchors/)
#   bash bench/gpu_session.sh prefill-long kernels|e2e  long prompts (issue 27), 8B shape. `kernels`: the flash tests
#                                      (gpu shapes and the simulator's), then attention_speed --prefill 8192,32768 in
#                                      512- and 2048-token pieces: µs per layer, ms per prompt, TFLOP/s, beside the
#                                      kernel at 4 warps x 3 blocks an SM and 8 x 1 (registers bounded for them), and
#                                      other commits' kernels carried as .anchors/flash_*.py (git show
#                                      e5a8a1f:lucekv/kernels/cuda/flash.py > .anchors/flash_before.py), and the
#                                      split and flash kernels at 16/32/64 queries (flash.MIN_TOKENS) (~3-4 min).
#                                      `e2e`: lucekv bench decode --prompt-tokens 8192, then 32768 (prefill tok/s, 2
#                                      runs each after a warm-up) beside llama-bench -p 8192,32768 -n 0 (FA, f16 KV) on
#                                      the same file (~8 min with a cold kernel cache; llama-bench from `depth build`)
# Results go to $OUT (the device tool brings them back). Prepare here first (all git-ignored):
#   .whl/     wheels the GPU machine lacks (gguf, threadpoolctl, grpcio>=1.85.1, protobuf, pytest), see shared/GPU.md
#   .anchors/ bash ../shared/tools/prepare_llamacpp_anchor.sh .anchors; cp ../shared/tools/synth_gguf.py .anchors/
#   .models/  split -b 61M -d -a 2 smollm2-135m.gguf .models/smollm2.part  (one piece per call: 64 MiB with the tree;
#             each call's piece is copied to /tmp, which lasts while the machine stays warm; also gemma3, qwen05)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LB=${TMPDIR:-/tmp}/llama.cpp/build/bin/llama-bench  # where .anchors/build_llama_bench.sh puts it
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

for p in .models/*.part*; do [ -e "$p" ] && cp "$p" /tmp/; done
MODELS="smollm2:smollm2-135m gemma3:gemma3-270m qwen05:qwen2.5-coder-0.5b qwen15:qwen2.5-coder-1.5b"
for m in $MODELS; do  # whole files from the pieces that arrived, checked against shared/tools/fetch_models.sh
  f=/tmp/${m#*:}.gguf
  [ -f "$f" ] || { ls /tmp/${m%%:*}.part* >/dev/null 2>&1 && cat /tmp/${m%%:*}.part* > "$f"; }
  [ -f "$f" ] && sha256sum "$f" | tee -a "$OUT/model_sha.txt"
done

peak_mib() {  # FILE CMD...: run CMD, sampling the GPU's memory in use; the peak above the idle level to FILE
  local idle f sampler
  idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); f=$(mktemp)
  ( while :; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 >> "$f"; sleep 0.1; done ) &
  sampler=$!
  "${@:2}"; local rc=$?
  kill $sampler; wait $sampler 2>/dev/null
  echo $(( $(sort -n "$f" | tail -1) - idle )) > "$1"; echo "peak GPU memory above idle: $(cat "$1") MiB"
  return $rc
}
run_pair() {  # NAME GGUF [--transformers]: lucekv (and transformers) then llama.cpp on the same file; then lucekv
  # and llama.cpp at the same 640-token context for memory
  python3 -m lucekv.cli bench decode --model "$2" --backend cuda --prompt-tokens 512 --gen-tokens 128 ${3:-} \
    --json "$OUT/cuda-decode-$1.json" 2>&1 | grep -E "^run|^transformers run|median|rror"
  [ -x $LB ] && $LB -m "$2" -p 512 -n 128 -fa 1 -ngl 99 -o json > "$OUT/llama-bench-$1.json" 2>/dev/null \
    && python3 -c "import json,sys; [print(r['n_prompt'], r['n_gen'], round(r['avg_ts'], 1)) for r in json.load(open(sys.argv[1]))]" "$OUT/llama-bench-$1.json"
  # one sequence's pool: the 640-token context (and the backend's 64-slot scratch block)
  peak_mib "$OUT/mem-lucekv-$1.txt" python3 -m lucekv.cli bench decode --model "$2" --backend cuda --kv-pool 640 \
    --kv-cache 640 --max-batch 1 --prompt-tokens 512 --gen-tokens 128 --repeats 1 2>&1 | grep -E "^peak|rror"
  [ -x $LB ] && peak_mib "$OUT/mem-llama-$1.txt" $LB -m "$2" -p 512 -n 128 -fa 1 -ngl 99 -r 1 -o json >/dev/null 2>&1
  [ -x $LB ] && cat "$OUT/mem-llama-$1.txt"
}

case "${1:-tests}" in
tests)
  # every gpu test (kernels, backend vs CPU, CUDA paging and sessions), then the kernel files' tiny-shape tests
  python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  python3 -m pytest -q tests/kernels/test_cuda_kernels.py tests/kernels/test_cuda_matmul.py 2>&1 | tail -3
  python3 -m lucekv.bench.cuda_graph_check --n-embd 1024 --n-layer 8 --steps 64 --out "$OUT/graph.json" 2>&1 | tail -20
  ;;
tree)
  # draft tree verify (issue 22): the split kernel with ancestor masks and copy_slots at tiny shapes, then the gpu
  # tests: tree forward (graph replay and eager) against the CPU's logits, tree rounds equal plain greedy (whole
  # cache, paging pool) on a synthetic model; ~2-3 min with the compiles, no model pieces needed
  python3 -m pytest -q tests/kernels/test_cuda_tree.py 2>&1 | tail -3
  python3 -m pytest -q tests/spec/test_spec_cuda.py -k "tree or dflash" 2>&1 | tee "$OUT/tree_tests.log" | tail -15
  ;;
models)
  for m in $MODELS; do
    f=/tmp/${m#*:}.gguf
    [ -f "$f" ] && python3 -m lucekv.bench.parity "$f" --json "$OUT/parity-${m#*:}.json" 2>&1 | grep -v -i warn | tail -22
  done
  ;;
bench)
  if [ ! -x "$LB" ] && [ -d .anchors ]; then
    timeout 420 bash .anchors/build_llama_bench.sh || tail -20 /tmp/llama_cmake.log /tmp/llama_build.log
  fi

  Q05=/tmp/qwen2.5-coder-0.5b.gguf  # the real model of the issue's figures (the others get `models` parity)
  [ -f $Q05 ] && run_pair qwen2.5-coder-0.5b $Q05 --transformers
  # the 8B-shaped anchor file of shared/tools (carried in .anchors/): raw random Q4_K/Q6_K blocks, seconds to write
  [ -f /tmp/qwen3-8b-shape.gguf ] || timeout 120 python3 .anchors/synth_gguf.py /tmp/qwen3-8b-shape.gguf qwen3-8b-shape
  [ -f /tmp/qwen3-8b-shape.gguf ] && run_pair qwen3-8b-shape /tmp/qwen3-8b-shape.gguf
  ;;
spec)
  # MODEL qwen15 (default): the 1.5b with the 0.5b drafting; qwen05: the 0.5b alone (suffix and auto: no smaller
  # drafter shares its tokenizer)
  Q15=/tmp/qwen2.5-coder-1.5b.gguf Q05=/tmp/qwen2.5-coder-0.5b.gguf W=${2:-code,edit,chat}
  if [ "${3:-qwen15}" = qwen05 ]; then T=$Q05 MODES=suffix,suffix-tree,auto DRAFT=; else T=$Q15 MODES=suffix,suffix-tree,auto,draft DRAFT="--draft-model $Q05"; fi
  MODES=${SPEC_MODES:-$MODES}  # suffix-tree: the suffix drafter's trees at the chain's verify width (tau, tok/s)
  [ -f $T ] && [ -f $Q05 ] && [ -f bench/prompts/spec.json ] || { echo "spec: needs $T, $Q05 and bench/prompts/spec.json"; exit 1; }
  # (the JSON's verify_forward_ms: a verify forward's ms by width, products of few tokens as matvec rows vs all
  # tensor-core matmuls; each mode's round_ms / verify_ms / host_ms_per_round against plain decoding's step_ms)
  python3 -m lucekv.cli bench spec --model $T $DRAFT --backend cuda --prompts bench/prompts/spec.json \
    --workloads "$W" --modes $MODES --n ${SPEC_N:-20} --max-tokens 256 \
    --json "$OUT/spec-$(basename $T .gguf)-${W//,/-}.json" 2>&1 | grep -v -i warn | tail -25
  # where a full-width verify forward's time goes after 512 tokens (max_draft 16: 17 tokens, the graph of 20)
  python3 -m lucekv.bench.kernel_profile $T --pool 4096 --verify 17 \
    --json "$OUT/kernel-profile-verify17-$(basename $T .gguf).json" 2>&1 | grep -v -i warn | head -30
  ;;
mvrows)
  if [ "${2:-}" = 8b ]; then
    python3 -m lucekv.bench.matvec_speed --rows 1,2,4,8,16,32,64 --shapes 8b --json "$OUT/matvec-rows-8b.json" 2>&1 \
      | grep -v -i warning
    exit 0
  fi
  if [ "${2:-}" = layers ]; then
    python3 -m lucekv.bench.mmq_speed --tokens 8,16,32 --module before=.anchors/mmq_before.py \
      --module mmq3=.anchors/mmq_mmq3.py --last-block-tiles 2 --quantize-from before --json "$OUT/mmq-speed-8b.json" \
      2>&1 | grep -v -i warning
    exit 0
  fi
  if [ "${2:-}" = mmq ]; then  # the integer tensor-core products on the hardware: fragment layouts, products, route
    python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kernels/test_cuda_mmq.py \
      tests/backends/test_cuda_verify.py -k "mmq or mma or integer or few_tokens" 2>&1 | tail -8
    exit 0
  fi
  if [ "${2:-}" = e2e ]; then
    M=/tmp/qwen2.5-coder-1.5b.gguf
    [ -f $M ] || { M=/tmp/qwen2.5-1.5b-shape.gguf; [ -f $M ] || timeout 240 python3 -m lucekv.model.synth qwen2.5-1.5b $M; }
    NAME=$(basename $M .gguf)
    python3 -m lucekv.bench.kernel_profile $M --pool 4096 --verify 1,2,4,8,17,32 \
      --json "$OUT/kernel-profile-verify-widths-$NAME.json" 2>&1 | grep -v -i warn | grep -E "^NVIDIA|^linear|ms by width"
    python3 -m lucekv.cli bench steps --model $M --backend cuda --concurrency 1,2,4,8,16,32 --ttft-tokens 16 \
      --json "$OUT/steps-$NAME.json" 2>&1 >/dev/null | grep --line-buffered -v -i warning | tail -15
    exit 0
  fi
  python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kernels/test_cuda_matvec.py \
    tests/backends/test_cuda_verify.py tests/backends/test_cuda_batch.py 2>&1 | tail -5
  python3 -m lucekv.bench.matvec_speed --rows 1,2,4,8,17,32 --json "$OUT/matvec-rows.json" 2>&1 | grep -v -i warning
  ;;
matmul)
  python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kernels/test_cuda_matmul.py 2>&1 | tail -5
  # the backend's products through matmuls (x staged in pooled scratch), replayed in prompt pieces' graphs
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda_kernels.py -k prompt_pieces 2>&1 | tail -3
  python3 -m lucekv.bench.matmul_speed --json "$OUT/matmul-speed.json" 2>&1 | grep -v -i warning
  [ -f /tmp/qwen3-8b-shape.gguf ] || timeout 120 python3 .anchors/synth_gguf.py /tmp/qwen3-8b-shape.gguf qwen3-8b-shape
  python3 -m lucekv.bench.kernel_profile /tmp/qwen3-8b-shape.gguf --prefill --prompt 512 \
    --json "$OUT/kernel-profile-prefill512.json" 2>&1 | grep -v -i warning | head -16
  ;;
profile)
  python3 -m lucekv.bench.matvec_speed --json "$OUT/matvec-speed.json" 2>&1 | grep -v -i warning
  python3 -m lucekv.bench.attention_speed --json "$OUT/attention-speed.json" 2>&1 | grep -v -i warning
  [ -f /tmp/qwen3-8b-shape.gguf ] || timeout 120 python3 .anchors/synth_gguf.py /tmp/qwen3-8b-shape.gguf qwen3-8b-shape
  python3 -m lucekv.bench.kernel_profile /tmp/qwen3-8b-shape.gguf --pool 131072 --json "$OUT/kernel-profile.json" \
    2>&1 | grep -v -i warning
  ;;
moe)
  A3B=/tmp/qwen3-30b-a3b-shape.gguf
  case "${2:-}" in
  write) timeout 560 python3 -m lucekv.model.synth qwen3-30b-a3b $A3B; ls -la $A3B; exit 0 ;;
  bench)
    [ -x "$LB" ] || echo "no llama-bench at $LB (build it first: bench/gpu_session.sh depth build)" >&2
    run_pair qwen3-30b-a3b-shape $A3B; exit 0 ;;
  profile)
    python3 -m lucekv.bench.kernel_profile $A3B --json "$OUT/kernel-profile-qwen3-30b-a3b-shape.json" 2>&1 \
      | grep -v -i warning | tail -30
    python3 -m lucekv.bench.kernel_profile $A3B --prefill --prompt 512 --pool 1024 \
      --json "$OUT/kernel-profile-prefill512-qwen3-30b-a3b-shape.json" 2>&1 | grep -v -i warning | tail -30
    exit 0 ;;
  ffn)
    python3 -m lucekv.bench.moe_speed --tokens 64,512 --json "$OUT/moe-ffn-speed-a3b.json" 2>&1 | grep -v -i warning
    exit 0 ;;
  speed)
    python3 -m lucekv.bench.moe_decode_speed --json "$OUT/moe-decode-speed-a3b.json" 2>&1 | grep -v -i warning
    exit 0 ;;
  esac
  LUCEKV_TEST_MODELS_DIR=/tmp python3 -m pytest -q -s -m gpu tests/kernels/test_cuda_moe.py 2>&1 \
    | tee "$OUT/moe-gpu-tests.log" | grep -E "error|passed|failed|FAIL|tokens:" | tail -30
  S=/tmp/smollm2-135m.gguf
  for v in same distinct; do
    [ -f $S ] || break
    python3 -m lucekv.model.synth upcycle $S /tmp/smollm2-moe-$v.gguf $([ $v = distinct ] && echo --distinct)
    python3 -m lucekv.bench.parity /tmp/smollm2-moe-$v.gguf --json "$OUT/parity-smollm2-moe-$v.json" 2>&1 \
      | grep -v -i warn | tail -22
  done
  ;;
spark)
  A3BZ=/tmp/qwen3-30b-a3b-zipf.gguf
  case "${2:-bench}" in
  write) timeout 560 python3 -m lucekv.model.synth qwen3-30b-a3b $A3BZ --router zipf --n-ctx 262144; ls -la $A3BZ ;;
  tests)
    LUCEKV_TEST_MODELS_DIR=/tmp python3 -m pytest -q -s -p no:cacheprovider -m "gpu or slow or not slow" \
      -k "spark or routing" tests/backends/test_cuda_spark.py tests/backends/test_cuda_spark_rows.py \
      tests/backends/test_cuda_routing_counts.py tests/kernels/test_cuda_moe.py 2>&1 \
      | tee "$OUT/spark-gpu-tests.log" | grep -E "error|passed|failed|FAIL|tok/s" | tail -30 ;;
  bench)
    [ -f $A3BZ ] || { echo "no $A3BZ: run 'spark write' first" >&2; exit 1; }
    [ -x "$LB" ] || echo "no llama-bench at $LB (build it first: bench/gpu_session.sh depth build)" >&2
    python3 -m lucekv.cli bench spark $A3BZ --resident 0.3,0.5,0.7 $([ -x "$LB" ] && echo --llama-bench "$LB") \
      --json "$OUT/spark-qwen3-30b-a3b-zipf.json" 2>&1 | grep --line-buffered -v -i warning \
      | tee "$OUT/spark-bench.log" | grep -v '^ ' ;;
  long)
    [ -f $A3BZ ] || { echo "no $A3BZ: run 'spark write' first" >&2; exit 1; }
    timeout 590 python3 -m lucekv.cli bench spark $A3BZ --resident 0.5 --long-context 131072 --gpu-memory-gib 15 \
      --json "$OUT/spark-long-qwen3-30b-a3b-zipf-128k.json" 2>&1 | grep --line-buffered -v -i warning \
      | tee "$OUT/spark-long.log" | grep -v '^ ' ;;
  esac
  ;;
niah)
  CTX=${2:?context in tokens}; M=/tmp/$([ "${3:-qwen05}" = qwen15 ] && echo qwen2.5-coder-1.5b || echo qwen2.5-coder-0.5b).gguf
  [ -f "$M" ] && [ -f .data/niah-corpus.json ] || { echo "needs $M and .data/niah-corpus.json" >&2; exit 1; }
  python3 -m lucekv.cli bench niah --model "$M" --backend cuda --contexts "$CTX" \
    --tasks multikey,multivalue,vartrack --cases 10 --residencies "${4:-0.0625,0.125}" --policies quest,lru,draft \
    --kv-drafter /tmp/qwen2.5-coder-0.5b.gguf --corpus .data/niah-corpus.json \
    --json "$OUT/niah-$(basename "$M" .gguf)-$CTX-${4:-all}.json" 2>&1 >/dev/null | grep --line-buffered -v -i warning
  ;;
pflash)
  CTX=${2:?context in tokens}; KEEP=${3:-0.1}; LAYERS=${4:-0}; M=/tmp/qwen2.5-coder-1.5b.gguf
  D=/tmp/qwen2.5-coder-0.5b.gguf
  [ -f "$M" ] && [ -f "$D" ] && [ -f .data/niah-corpus.json ] || { echo "needs $M, $D and .data/niah-corpus.json" >&2; exit 1; }
  timeout 560 python3 -m lucekv.cli bench niah --model "$M" --backend cuda --contexts "$CTX" \
    --tasks multikey,multivalue,vartrack --cases "${PFLASH_N:-5}" --residencies "" --kv-drafter "$D" \
    --prefill-compression "$KEEP" --prefill-drafter-layers "$LAYERS" --corpus .data/niah-corpus.json \
    --json "$OUT/niah-pflash-qwen2.5-coder-1.5b-$CTX-keep$KEEP-layers$LAYERS.json" 2>&1 >/dev/null \
    | grep --line-buffered -v -i warning
  ;;
niah-diagnose)
  CTX=${2:?context in tokens}; POOL=${3:?pool tokens}; M=/tmp/qwen2.5-coder-0.5b.gguf
  [ -f "$M" ] && [ -f .data/niah-corpus.json ] || { echo "needs $M and .data/niah-corpus.json" >&2; exit 1; }
  for T in multikey multivalue vartrack; do
    python3 bench/niah_diagnose.py --backend cuda --model "$M" --context "$CTX" --pool "$POOL" --task $T \
      --cases 0,1,2,3,4,5,6,7,8,9 --experiments draft,oracle-asked,oracle-allneedles --kv pool,full \
      --json "$OUT/niah-diagnose-$T-$CTX-$POOL.json" 2>&1 | grep --line-buffered -v -i warning | cut -c1-160
  done
  ;;
serve)
  LS=${TMPDIR:-/tmp}/llama.cpp/build/bin/llama-server
  if [ "${2:-}" = build ]; then  # llama-server from the same sources as llama-bench: no web UI, no network
    [ -d /tmp/llama.cpp ] || tar xzf .anchors/llamacpp-slim.tgz -C /tmp
    cd /tmp/llama.cpp && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF > /tmp/llama_server_cmake.log 2>&1 \
      && timeout 560 cmake --build build -j"$(nproc)" --target llama-server > /tmp/llama_server_build.log 2>&1 \
      || tail -30 /tmp/llama_server_cmake.log /tmp/llama_server_build.log
    ls -la "$LS"; exit 0
  fi
  case "${2:-8b}" in
  8b) M=/tmp/qwen3-8b-shape.gguf; NAME=qwen3-8b-shape
      [ -f $M ] || timeout 120 python3 .anchors/synth_gguf.py $M qwen3-8b-shape ;;
  05b) M=/tmp/qwen2.5-coder-0.5b.gguf; NAME=qwen2.5-coder-0.5b ;;
  esac
  [ -x "$LS" ] || echo "no llama-server at $LS (run 'serve build' first): lucekv alone" >&2
  python3 -m lucekv.cli bench serve --model $M --backend cuda --concurrency 1,4,16,64 --num-requests 96 \
    --max-output-tokens 256 --dataset .anchors/sharegpt.json $([ -x "$LS" ] && echo --llama-server "$LS") \
    --json "$OUT/serve-$NAME.json" 2>&1 >/dev/null | grep --line-buffered -v -i warning | tee "$OUT/serve-$NAME.log"
  ;;
steps)
  # the engine's step in process: TTFT of 16..500-token prompts alone (prefill graphs by width), the decode step at
  # C concurrent requests with the backend's host time in it, and whether the device waits let go of the GIL;
  # smollm2 (default), qwen05 or 8b (the Qwen3-8B shape: its 512-wide activations, GPU memory), ~1-2 min each
  case "${2:-smollm2}" in
  smollm2) M=/tmp/smollm2-135m.gguf; NAME=smollm2-135m ;;
  qwen05) M=/tmp/qwen2.5-coder-0.5b.gguf; NAME=qwen2.5-coder-0.5b ;;
  8b) M=/tmp/qwen3-8b-shape.gguf; NAME=qwen3-8b-shape
      [ -f $M ] || timeout 120 python3 .anchors/synth_gguf.py $M qwen3-8b-shape ;;
  esac
  # MMQ=N: --mmq-tokens N (0: no integer tensor-core products; the default is 64), to compare
  [ -n "${MMQ:-}" ] && NAME=$NAME-mmq$MMQ
  peak_mib "$OUT/mem-steps-$NAME.txt" python3 -m lucekv.cli bench steps --model $M --backend cuda \
    --concurrency 1,2,4,8,16,32 --gil-probe --contend ${MMQ:+--mmq-tokens $MMQ} --json "$OUT/steps-$NAME.json" \
    2>&1 >/dev/null | grep --line-buffered -v -i warning | tee "$OUT/steps-$NAME.log"
  ;;
serve-host)
  M=/tmp/serve-host-tokenizer.gguf  # a tokenizer and a shape: no weights are read
  [ -f $M ] || python3 -c "from lucekv.model.synth import write_synthetic_gguf as w; w('$M', 'llama', n_ctx=2048)"
  case "${2:-8b}" in
  8b) DEVICE="" ;;
  smollm2) DEVICE="--step-ms 1:0.98,2:1.59,4:1.82,8:2.11,16:2.4,32:4.23,64:7.9 --prefill-ms-per-token 0.02" ;;
  esac
  for si in 0.0002 0.001; do
    python3 -m lucekv.bench.serve_host --model $M --concurrency 1,4,16,64 $DEVICE --switch-interval $si \
      --json "$OUT/serve-host-${2:-8b}-si$si.json" 2>&1 >/dev/null | grep --line-buffered "^C=" \
      | tee -a "$OUT/serve-host-${2:-8b}.log"
  done
  ;;
startup)
  M8=/tmp/qwen3-8b-shape.gguf
  [ -f $M8 ] || { echo "writing $M8" >&2; timeout 120 python3 .anchors/synth_gguf.py $M8 qwen3-8b-shape >&2; }
  python3 -m lucekv.cli bench startup --model $M8 --backend cuda --prompt-tokens 8192 --prompts 2 --gen-tokens 16 \
    --json "$OUT/startup-qwen3-8b-shape.json" 2>&1 >/dev/null | grep --line-buffered -v -i warning \
    | tee "$OUT/startup.log"
  ;;
prefill-long)
  M8=/tmp/qwen3-8b-shape.gguf
  if [ "${2:-kernels}" = kernels ]; then
    python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels/test_cuda_flash.py 2>&1 | tail -3
    python3 -m lucekv.bench.attention_speed --prefill 8192,32768 --pieces 512,2048 --shapes 4x3,8x1 \
      $(ls .anchors/flash_*.py >/dev/null 2>&1 && echo --baseline .anchors/flash_*.py) \
      --json "$OUT/attention-prefill-long.json" 2>&1 | grep -v -i warning
    # where the tensor-core kernel overtakes the split one now (flash.MIN_TOKENS: 64 queries, measured before)
    python3 -m lucekv.bench.attention_speed --depths 4096,32768 --queries 16,32,64 \
      --json "$OUT/attention-queries.json" 2>&1 | grep -v -i warning
    exit 0
  fi
  [ -f $M8 ] || { echo "writing $M8" >&2; timeout 120 python3 .anchors/synth_gguf.py $M8 qwen3-8b-shape >&2; }
  for P in 8192 32768; do
    python3 -m lucekv.cli bench decode --model $M8 --backend cuda --prompt-tokens $P --gen-tokens 16 --repeats 2 \
      --json "$OUT/cuda-prefill-$P-qwen3-8b-shape.json" 2>&1 | grep -E "^run|warm-up|rror"
  done
  [ -x "$LB" ] || { echo "no llama-bench at $LB (run 'depth build' first)" >&2; exit 1; }
  $LB -m $M8 -p 8192,32768 -n 0 -fa 1 -ngl 99 -r 3 -o json > "$OUT/llama-bench-prefill-long.json" 2>/dev/null
  python3 -c "import json,sys; [print('llama-bench pp', r['n_prompt'], round(r['avg_ts'], 1)) for r in json.load(open(sys.argv[1]))]" \
    "$OUT/llama-bench-prefill-long.json"
  ;;
depth)
  M8=/tmp/qwen3-8b-shape.gguf
  [ -f $M8 ] || { echo "writing $M8" >&2; timeout 120 python3 .anchors/synth_gguf.py $M8 qwen3-8b-shape >&2; }
  if [ "${2:-}" = build ]; then
    [ -x "$LB" ] || timeout 420 bash .anchors/build_llama_bench.sh || tail -20 /tmp/llama_cmake.log /tmp/llama_build.log
    exit 0
  fi
  [ -x "$LB" ] || echo "no llama-bench at $LB (run 'depth build' first): the anchor is recorded as missing" >&2
  # progress (stderr) to the screen and a log; the JSON result (stdout) is in the --json file
  python3 -m lucekv.cli bench depth --model $M8 --backend cuda --llama-bench "$LB" \
    --json "$OUT/depth-qwen3-8b-shape.json" --plot "$OUT/depth-qwen3-8b-shape.png" 2>&1 >/dev/null \
    | grep --line-buffered -v -i warning | tee "$OUT/depth.log"
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['summary'], indent=1))" \
    "$OUT/depth-qwen3-8b-shape.json"
  ;;
esac
