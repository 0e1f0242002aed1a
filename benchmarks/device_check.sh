#!/usr/bin/env bash
# The GPU checks and measurements, in the order NOTES.md gives them, for the second device
# call (after `bash .mlxcuda/a/stash.sh` in the first):
#   bash .mlxcuda/b/install.sh >/dev/null 2>&1; bash benchmarks/device_check.sh STEP...
# Steps (each with its own time limit; output under $OUT/<step>.txt, a summary at the end):
#   gpu-suite (every test file that needs CUDA, one pytest run, three times in a row;
#   gpu-suite-once: one run, for a call whose 10 minutes cannot hold three)  gpu-files
#   determinism  first-token-cache
#   tests-linear  tests-kv  first-token  graphs  decode  decode-ab  kv-decode  layer
#   launch-cost  ncu-linear  ncu-kv  kernels  lab  gemv-loop  gemv-loop-only  decode-moe
#   tests-new  decode-tq3x3  ncu-gemv-full  constants  decode-graphs  compact  kv-candidates
#   bound-calls  kv-fp-chunks  kv-vec  ncu-steady  kv-rounds  tests-kv-b8  kv-b8  kv-affine
#   kv-table  trellis  trellis-bench  decode-moe-gpt-oss  launch-repeat
# GPU_SUITE_LIMIT: seconds for one suite run (590); GPU_SUITE_WORKERS (8); GPU_SUITE_ARGS.
# A call has 10 minutes: tests-* take ~2.5-3 min each, decode ~1.5 min, kv-decode ~2 min.
set -u
. benchmarks/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NCU_SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy --section LaunchStats --section SchedulerStats"

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.txt"
  timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/$name.txt"
}

gpu_files() {  # every test file with a test that needs CUDA, on stdout: marked `cuda`, or
  # skipped off CUDA (a skipif whose reason names CUDA); found by collecting tests/
  python3 -P - <<'PY'
import contextlib
import sys

import pytest


class NeedsCuda:
    def __init__(self):
        self.files = set()

    def pytest_collection_modifyitems(self, items):
        for item in items:
            for mark in item.iter_markers():
                reason = str(mark.kwargs.get("reason", mark.args[1] if len(mark.args) > 1 else ""))
                if mark.name == "cuda" or (mark.name == "skipif" and "CUDA" in reason):
                    self.files.add(str(item.path.relative_to(item.config.rootpath)))


found = NeedsCuda()
with contextlib.redirect_stdout(sys.stderr):  # the device has no Prefect: files that import
    # it fail to collect there, and hold no CUDA test (their errors are in the -collect file)
    code = pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider",
                        "--continue-on-collection-errors", "tests"], plugins=[found])
if code not in (0, 1, 5) or not found.files:
    sys.exit(f"gpu_files: collecting tests/ failed (pytest exit {code}): {sorted(found.files)}")
print(" ".join(sorted(found.files)))
PY
}

gpu_suite() {  # runs, name: the CUDA test files in ONE pytest invocation, `runs` times
  local files extra
  # pytest-xdist, unpacked into lab/pylib here and carried (the device image lacks it):
  # eight workers: one run ~8 minutes (2026-12-05); fourteen starved the CPU emulation
  # tests (a C++ thread per CUDA thread) past their 300 s limit
  if [ -d lab/pylib/xdist ]; then cp -r lab/pylib/* /tmp/site/; fi
  local workers=""
  python3 -c "import xdist" 2>/dev/null && workers="-p xdist -n ${GPU_SUITE_WORKERS:-8}"
  eval "extra=($workers ${GPU_SUITE_ARGS:-})"  # a shell word list: -k "not emulated"
  files=$(gpu_files 2>"$OUT/$2-collect.txt") || { echo "no CUDA test files: $OUT/$2-collect.txt"; return 1; }
  echo "CUDA test files: $files" | tee "$OUT/$2-files.txt"
  for i in $(seq 1 "$1"); do
    # GPU_SUITE_ARGS: more pytest arguments, e.g. -k "not emulated" when the CPU emulation
    # of the attention kernel would push one run past a call's 10 minutes
    step "$2-$i" "${GPU_SUITE_LIMIT:-590}" python3 -P -m pytest -q -p no:cacheprovider -rfE --durations=10 \
      "${extra[@]}" $files
    grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|error)" "$OUT/$2-$i.txt" | tail -40 \
      > "$OUT/$2-$i-summary.txt"
  done
}

for s in "$@"; do
  case $s in
    first-token-cache)  # issue 35: TQ3 and affine-4, fresh processes, first and second; MLX
      # compiling (the peer) then the compiled cache (kernels/compiled.py), then its tests
      step first-token-mlx 280 python3 benchmarks/first_token.py --kernel-cache off
      step first-token-cached 280 python3 benchmarks/first_token.py --kernel-cache on
      step tests-kernel-cache 400 env TURBOQUANT_KERNEL_CACHE=1 python3 -P -m pytest -q \
        -p no:cacheprovider tests/test_kernels_cuda_compiled.py tests/test_kernels_cuda_attend.py ;;
    determinism)  # issue 35: the same decode twice, bit-identical, and the whole step against
      # the per-layer step, both merges
      step determinism 400 python3 -P -m pytest -q -p no:cacheprovider -k \
        "same_logits_every_time or whole_step_decodes or pipelined or slot_serves" \
        tests/test_kernels_cuda_attend.py ;;
    gpu-files) gpu_files > "$OUT/gpu-files.txt" 2>"$OUT/gpu-files-collect.txt" ;;
    gpu-suite) gpu_suite 3 gpu-suite ;;
    gpu-suite-once) gpu_suite 1 "gpu-suite-$(date -u +%H%M%S)" ;;
    tests-linear) step tests-linear 330 python3 -P -m pytest -q -x tests/test_kernels_cuda_linear.py ;;
    tests-kv) step tests-kv 240 python3 -P -m pytest -q -x tests/test_kernels_cuda_kv.py ;;
    first-token)  # twice: does MLX's disk cache of compiled kernels remove the first-token cost?
      step first-token-1 120 env MLX_USE_CUDA_GRAPHS=0 python3 tools/launch_cost.py --kv 1024 --layers 8
      step first-token-2 120 env MLX_USE_CUDA_GRAPHS=0 python3 tools/launch_cost.py --kv 1024 --layers 8
      step first-token-layers 120 python3 tools/kv_first_token.py --per-layer ;;
    graphs)  # the CUDA-graphs hypothesis of NOTES.md: graph size against TQ3's slowdown
      for ops in 20 200 1000; do
        step "graphs-ops$ops" 200 env MLX_USE_CUDA_GRAPHS=1 MLX_MAX_OPS_PER_BUFFER=$ops \
          python3 benchmarks/decode.py --variants affine4,tq3
      done ;;
    kv-candidates)  # the split merge and the wave plan (cuda_kv KV_MERGE_SPLIT, KV_PLAN_WAVES,
      # default since 2026-11): the KV GPU tests with both on, then decode beside fp16
      step tests-kv-candidates 240 env TURBOQUANT_CUDA_KV_MERGE_SPLIT=1 \
        TURBOQUANT_CUDA_KV_PLAN_WAVES=1 python3 -P -m pytest -q -x tests/test_kernels_cuda_kv.py
      step kv-decode-candidates 330 env MLX_USE_CUDA_GRAPHS=0 TURBOQUANT_CUDA_KV_MERGE_SPLIT=1 \
        TURBOQUANT_CUDA_KV_PLAN_WAVES=1 python3 benchmarks/kv.py --gpu-decode \
        --contexts 1024 32768 --gpu-configs fp16 K4V3 ;;
    compact)  # the gathered experts' broadcast path (kernels/cuda.py COMPACT_GATHER=0; the
      # compact one is the default since 2026-11): GPU tests, then MoE decode with and
      # without the compact path, alternating in one process
      step tests-compact 240 env TURBOQUANT_CUDA_COMPACT_GATHER=0 python3 -P -m pytest -q \
        -k "gather" tests/test_kernels_cuda_linear.py
      step decode-moe-compact 420 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py --moe \
        --variants affine4,tq3-broadcast,tq3-compact,affine4,tq3-broadcast,tq3-compact \
        --tokens 64 ;;
    decode-graphs)  # CUDA graphs on for both (2026-11: they helped affine-4, hurt TQ3;
      # was that the small operands' pages, kernels/cuda_memory.py?)
      step decode-graphs 330 env MLX_USE_CUDA_GRAPHS=1 python3 benchmarks/decode.py \
        --variants affine4,tq3,affine4,tq3 --tokens 96 ;;
    decode) step decode 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py --variants affine4,tq3 ;;
    bound-calls)  # the bound group calls and the compiled MLP half on the GPU, then decode
      # with and without the compiled step (COMPILE_STEP) beside affine-4, kv-decode with the new KV defaults
      step tests-bound-calls 200 python3 -P -m pytest -q -k \
        "loaded_model or compiled_step or extras or bias_and_batch or ternary_group" \
        tests/test_kernels_cuda_linear.py
      step decode-compiled 240 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py \
        --variants affine4,tq3-eager,tq3-compiled,affine4,tq3-eager,tq3-compiled
      step kv-decode-defaults 240 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py \
        --gpu-decode --contexts 1024 32768 --gpu-configs fp16 K4V3 ;;
    kv-fp-chunks)  # 2026-11's ncu: at 1K the partial kernel took 92 us with the fp16 tail
      # (132-196 tokens: 2 tiles) in one block; fp16 chunks of a tile (kv.py :f128) beside
      # the default, and with the vector-key partial kernel (run kv-vec's tests first);
      # first the GPU tests of several fp16 chunks (none had run on the GPU before)
      step tests-kv-fp 200 python3 -P -m pytest -q -x -k "fp_chunks or window400" \
        tests/test_kernels_cuda_kv.py
      step kv-fp-chunks 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py --gpu-decode \
        --contexts 1024 32768 --gpu-configs fp16 K4V3 K4V3:f128 K4V3:vec:f128 ;;
    kv-vec)  # the partial kernel with 16-byte key loads (cuda_kv KV_PARTIAL_VEC): the KV GPU
      # tests with it on, then decode beside the default partial kernel
      step tests-kv-vec 240 env TURBOQUANT_CUDA_KV_PARTIAL_VEC=1 python3 -P -m pytest -q -x \
        tests/test_kernels_cuda_kv.py
      step kv-decode-vec 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py --gpu-decode \
        --contexts 1024 32768 --gpu-configs fp16 K4V3 K4V3:vec ;;
    kv-mma)  # the 2026-11 check of the tensor-core partial kernel (cuda_kv KV_PARTIAL_MMA)
      # with fp16 chunks of a tile, both defaults since: the KV GPU tests with both, then
      # decode with them (K4V3 and K4V3:f128 are the old default's figures only when run with
      # TURBOQUANT_CUDA_KV_PARTIAL_MMA=0 TURBOQUANT_CUDA_KV_FP_TOKENS=256)
      step tests-kv-mma 240 env TURBOQUANT_CUDA_KV_PARTIAL_MMA=1 TURBOQUANT_CUDA_KV_FP_TOKENS=128 \
        python3 -P -m pytest -q -x tests/test_kernels_cuda_kv.py
      step kv-decode-mma 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py --gpu-decode \
        --contexts 1024 32768 --gpu-configs fp16 K4V3 K4V3:f128 K4V3:mma:f128 ;;
    kv-rounds)  # the first figures of kv-h200-2026-11.txt's five-round table: generation as mlx-lm runs it, 5 alternating
      # rounds, graphs off (what `turboquant generate` uses), then on (MLX's default)
      step kv-rounds-nographs 300 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py \
        --gpu-decode --contexts 1024 32768 --gpu-configs fp16 K4V3 --gpu-rounds 5
      step kv-rounds-graphs 300 env MLX_USE_CUDA_GRAPHS=1 python3 benchmarks/kv.py \
        --gpu-decode --contexts 1024 32768 --gpu-configs fp16 K4V3 --gpu-rounds 5 ;;
    tests-kv-b8)  # the KV GPU tests with value codes staged 8 loads at a time (KV_STAGE_BATCH)
      step tests-kv-b8 260 env TURBOQUANT_CUDA_KV_STAGE_BATCH=1 python3 -P -m pytest -q -x \
        tests/test_kernels_cuda_kv.py ;;
    kv-b8)  # decode with it, the protected 8-bit layers (:p2) included
      step kv-b8 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py --gpu-decode \
        --contexts 32768 --gpu-configs fp16 K4V3 K4V3:b8 K4V3:p2 K4V3:p2:b8 --gpu-rounds 3 ;;
    kv-affine)  # does mlx-lm's QuantizedKVCache run on MLX's CUDA build? (a process of its own)
      step kv-affine 200 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py --gpu-decode \
        --contexts 1024 32768 --gpu-configs fp16 affine4 --gpu-rounds 1 ;;
    kv-table)  # the KV table of docs/kv-cache.md (kv-h200-2026-11.txt): the issue's four contexts, the unprotected and the
      # default (protected) cache, 5 alternating generation rounds, graphs on then off
      for g in 1 0; do
        step "kv-table-g$g" 300 env MLX_USE_CUDA_GRAPHS=$g python3 benchmarks/kv.py --gpu-decode \
          --contexts 1024 4096 16384 32768 --gpu-configs fp16 K4V3 K4V3:p2 --gpu-rounds 5
      done ;;
    ncu-steady)  # GPU time of each kernel of 4 steady decode tokens, per kernel name
      step ncu-steady 230 bash tools/steady_token_profile.sh ncu ;;
    decode-ab3)  # affine-4 and TQ3 (fused blocks), three alternating rounds in one process
      step decode-ab3 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py \
        --variants affine4,tq3,affine4,tq3,affine4,tq3 ;;
    decode-moe)  # a Qwen3-30B-A3B-shaped MoE (12 layers): experts through the gathered GEMV
      step decode-moe 420 env MLX_USE_CUDA_GRAPHS=0 python3 \
        benchmarks/decode.py --moe --variants affine4,tq3,tq3-refgather,affine4,tq3,tq3-refgather ;;
    launch-repeat)  # issue 35: the intermittent [llama-launch] K/V mismatch: the whole step
      # against the per-layer step 12 times with the two-launch merge, then 4 with the block
      step launch-repeat 400 sh -c "python3 tools/whole_step_repeat.py --merge launch --runs 12 \
        --json $OUT/launch-repeat.jsonl && python3 tools/whole_step_repeat.py --merge block \
        --runs 4 --json $OUT/launch-repeat.jsonl" ;;
    decode-moe-gpt-oss)  # a gpt-oss-120b-shaped MoE (12 of 36 layers; biases, sinks,
      # sliding and full attention alternating): TQ3 against affine-4, alternating
      step decode-moe-gpt-oss 420 env MLX_USE_CUDA_GRAPHS=0 python3 \
        benchmarks/decode.py --moe gpt-oss --variants affine4,tq3,affine4,tq3 ;;
    decode-ab)  # end-to-end figures vary by up to 30% between runs: alternate, in one process
      step decode-ab 420 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py \
        --variants affine4,tq3,tq3-grouped,affine4,tq3,tq3-grouped,affine4,tq3,tq3-grouped ;;
    ncu-linear)  # Nsight Compute on one fused TQ3 linear per shape (benchmarks/results/ncu-h200.txt)
      for shape in "28672 8192" "4096 4096" "4096 14336"; do
        step "ncu-linear-${shape// /x}" 120 ncu --clock-control none --kernel-name regex:tq_linear --launch-skip 4 \
          --launch-count 1 $NCU_SECTIONS python3 -P benchmarks/kernels.py --one-linear $shape
      done ;;
    ncu-kv) step ncu-kv 200 ncu --kernel-name regex:partial --launch-skip 3 --launch-count 1 \
      $NCU_SECTIONS python3 benchmarks/kv.py --gpu-attention --contexts 32768 --gpu-configs K4V3 ;;
    kv-decode) step kv-decode 330 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kv.py --gpu-decode \
      --contexts 1024 32768 --gpu-configs fp16 K4V3 ;;
    gemv-loop)  # the GEMV under MLX, 200 launches per evaluation; then ncu over them
      step gemv-loop 120 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --loop
      step ncu-gemv-loop 200 env MLX_USE_CUDA_GRAPHS=0 ncu --clock-control none \
        --kernel-name regex:tq_gemv --launch-skip 400 --launch-count 5 --section SpeedOfLight \
        --section LaunchStats --section Occupancy python3 -P benchmarks/kernels.py --loop ;;
    tests-new)  # the gathered experts and ternary codes on CUDA (passed 15/15 on the H200, 2026-11)
      step tests-new 240 python3 -P -m pytest -q -k "ternary or gathered or gather" \
        tests/test_kernels_cuda_linear.py tests/test_kernels_cuda_launch.py ;;
    ncu-gemv-full)  # the GEMV under MLX with the sections lab/profile.sh reads in the lab
      step ncu-gemv-full 200 env MLX_USE_CUDA_GRAPHS=0 ncu --clock-control none \
        --kernel-name regex:tq_gemv --launch-skip 400 --launch-count 1 $NCU_SECTIONS \
        --section SourceCounters python3 -P benchmarks/kernels.py --loop ;;
    constants)  # small kernel operands in pages of their own (kernels/cuda_memory.py)
      step tests-constants 60 python3 -P -m pytest -q -x tests/test_cuda_memory.py
      step gemv-loop 60 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --loop
      step decode-ab2 150 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py \
        --variants affine4,tq3,affine4,tq3 --tokens 96 ;;
    ncu-gemv-advised)  # the GEMV under MLX before (launches 400-401) and after (1400-1401)
      # kernels.py --loop advises its operands to live on the GPU
      for skip in 400 1400; do
        step "ncu-gemv-skip$skip" 200 env MLX_USE_CUDA_GRAPHS=0 ncu --clock-control none \
          --kernel-name regex:tq_gemv --launch-skip $skip --launch-count 2 --section SpeedOfLight \
          --section WarpStateStats python3 -P benchmarks/kernels.py --loop
      done ;;
    gemv-loop-only) step gemv-loop 150 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --loop ;;
    decode-tq3x3)  # does TQ3's rate fall from round to round in one process? (SM clock,
      # power and temperature logged beside it: TQ's kernels are partly ALU-bound, so a
      # clock that drops under sustained load would slow them more than affine's)
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 500 > "$OUT/decode-tq3x3-clocks.csv" 2>&1 &
      smi=$!
      step decode-tq3x3 300 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/decode.py \
        --variants tq3,affine4,tq3,affine4,tq3
      kill $smi 2>/dev/null ;;
    trellis)  # issue 39: the trellis GPU tests (GEMV, tile decode, the Viterbi against the
      # CPU encoder at L = 16, bit for bit), then kernels.py --trellis: the GEMV at 3 bits
      # (28672x8192, 4096x4096) against TQ3 and affine-3, single and pipelined, and the GPU
      # encode of a 4096x4096 matrix at 2/3/4 bits against the CPU encoder on a slice
      step tests-trellis 130 python3 -P -m pytest -q -p no:cacheprovider -rfE -k gpu \
        tests/test_kernels_cuda_trellis.py tests/test_kernels_cuda_trellis_encode.py
      step trellis 160 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --trellis \
        --json "$OUT/trellis.json" ;;
    trellis-bench)  # kernels.py --trellis alone (its tests ran in a gpu-suite of the same call)
      step trellis 170 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --trellis \
        --json "$OUT/trellis.json" ;;
    kernels) step kernels 300 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --layer ;;
    lab)  # the kernels' GPU time alone (CUDA events, no MLX host time): tools/cuda_lab.py
      step lab 240 bash -c "python3 tools/cuda_lab.py --emit /tmp/tq_lab_src && bash /tmp/tq_lab_src/run.sh" ;;
    layer) step layer 120 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/kernels.py --layer-only ;;
    launch-cost) step launch-cost 170 env MLX_USE_CUDA_GRAPHS=0 python3 tools/launch_cost.py ;;
    *) echo "unknown step $s" ;;
  esac
done
for f in "$OUT"/*.txt; do echo "--- $f"; tail -6 "$f"; done
