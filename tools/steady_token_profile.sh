#!/usr/bin/env bash
# Where one steady decode token's time goes on the GPU machine (after the MLX install call),
# 8 layers of the 8B shape (first used 2026-11 for the KV cache and the fused linears).
#   profile: cProfile of graph building, steady tokens only (launch_cost.py --profile)
#   ncu:     GPU time of every kernel of the steady tokens (TQ_PROFILER_RANGE=1 brackets
#            them with cuProfilerStart/Stop; ncu --profile-from-start off), summed per
#            kernel name: fp16 cache vs K4V3 at 1K, affine-4 vs TQ3 weights
#   bash tools/steady_token_profile.sh [profile] [ncu]
set -u
. benchmarks/device_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MLX_USE_CUDA_GRAPHS=0
lc() { python3 tools/launch_cost.py --layers 8 "$@"; }
for part in "$@"; do
  case $part in
    profile)
      timeout 150 lc --kv 1024 --tokens 104 --profile > "$OUT/kv-profile.txt" 2>&1
      timeout 150 lc --decode-only --tokens 72 --profile > "$OUT/dec-profile.txt" 2>&1 ;;
    ncu)
      export TQ_PROFILER_RANGE=1
      for run in "kv-fp16 --kv 1024 --kv-caches fp16" "kv-k4v3 --kv 1024 --kv-caches K4V3" \
                 "dec-affine4 --decode-only --variants affine4" \
                 "dec-tq3 --decode-only --variants tq3"; do
        set -- $run
        name=$1; shift
        timeout 120 ncu --profile-from-start off --metrics gpu__time_duration.sum \
          --print-summary per-kernel --csv python3 tools/launch_cost.py --layers 8 \
          --tokens 12 "$@" > "$OUT/ncu-$name.csv" 2>&1
        echo "rc=$?" >> "$OUT/ncu-$name.csv"
      done ;;
  esac
done
