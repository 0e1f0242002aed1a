# Source on the GPU machine (no pip build there): exposes the checkout as the `turboquant`
# package through a folder of symlinks, next to the MLX CUDA build in /tmp/site.
#   . benchmarks/device_env.sh && python3 benchmarks/kernels.py
root=$(pwd)
rm -rf /tmp/tqpkg && mkdir -p /tmp/tqpkg/turboquant
for f in "$root"/turboquant/*; do ln -s "$f" /tmp/tqpkg/turboquant/; done
for p in stages manifests pipeline kernels runtime; do ln -s "$root/$p" /tmp/tqpkg/turboquant/$p; done
export PYTHONPATH=/tmp/site:/tmp/tqpkg:$root
export PYTHONUNBUFFERED=1
