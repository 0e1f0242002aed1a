#!/usr/bin/env bash
# Session 9 diagnostics on the GPU machine (after the MLX install call): where one steady
# decode token's time goes, 8 layers of the 8B shape. cProfile of graph building (steady
# tokens only), and with Nsight Systems the GPU kernel time of the steady tokens alone
# (TQ_PROFILER_RANGE=1: cuProfilerStart/Stop around them) per variant, one process each.
set -u
. benchmarks/device_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MLX_USE_CUDA_GRAPHS=0
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}" > "$OUT/nsys-where.txt"
lc() { timeout 150 python3 benchmarks/launch_cost.py --layers 8 "$@"; }
lc --kv 1024 --tokens 104 --profile > "$OUT/kv-profile.txt" 2>&1
lc --decode-only --tokens 72 --profile > "$OUT/dec-profile.txt" 2>&1
[ -z "$NSYS" ] && exit 0
export TQ_PROFILER_RANGE=1
nsys_run() {  # name, launch_cost arguments...
  local name=$1; shift
  timeout 150 "$NSYS" profile -t cuda --capture-range=cudaProfilerApi --capture-range-end=stop \
    --cuda-um-gpu-page-faults=true --cuda-um-cpu-page-faults=true \
    -o "/tmp/$name" --force-overwrite true python3 benchmarks/launch_cost.py --layers 8 "$@" \
    > "$OUT/nsys-$name.txt" 2>&1
  timeout 60 "$NSYS" stats -r cuda_gpu_kern_sum,cuda_api_sum,um_total_sum,um_cpu_page_faults_sum \
    -f csv -o "$OUT/$name" "/tmp/$name.nsys-rep" >> "$OUT/nsys-$name.txt" 2>&1
}
nsys_run kv-fp16 --kv 1024 --kv-caches fp16 --tokens 104
nsys_run kv-k4v3 --kv 1024 --kv-caches K4V3 --tokens 104
nsys_run dec-affine4 --decode-only --variants affine4 --tokens 72
nsys_run dec-tq3 --decode-only --variants tq3 --tokens 72
