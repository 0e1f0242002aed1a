"""The lab's 3-bit GEMV (28672x8192) launched on MLX's buffers and on cuMemAlloc'd ones, in
one process: is the ~25% the kernel loses under MLX in its memory or in MLX's launch?
(Its memory: the small operands', see kernels/cuda_memory.py and
benchmarks/results/gemv-in-mlx-h200.txt.)

The same CUBIN (`bash lab/run.sh` builds /tmp/tq_lab_nvrtc.cubin from
`python tools/cuda_lab.py --emit lab`) runs through the driver API (ctypes) on three
sets of operands with the same values, two copies each alternating as the lab does:
device memory from cuMemAlloc, MLX arrays made from host data (mx.array of numpy), and MLX
arrays written by the GPU (mx.random, as benchmarks/kernels.py makes them). CUDA events
time 200 launches of each, round after round.

usage (GPU machine, MLX CUDA build): python tools/gemv_in_mlx.py /tmp/tq_lab_nvrtc.cubin
"""

from __future__ import annotations

import ctypes as C
import sys

import mlx.core as mx
import numpy as np

ROWS, COLS, BLOCK_ROWS, THREADS, SHARED = 28672, 8192, 16, 128, 16384
# words per copy: 2-bit plane, 1-bit plane, fp16 scales (one per 32 weights... as the lab)
COUNTS = {"codes": ROWS * COLS // 16, "hplane": ROWS * COLS // 32, "scales": ROWS * COLS // 64}
DTYPES = {"codes": np.uint32, "hplane": np.uint32, "scales": np.float16}

cu = C.CDLL("libcuda.so.1")


def check(result: int, what: str) -> None:
    if result != 0:
        name = C.c_char_p()
        cu.cuGetErrorName(result, C.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode() if name.value else result}")


def driver(name: str):
    for symbol in (name + "_v2", name):
        if hasattr(cu, symbol):
            return getattr(cu, symbol)
    raise AttributeError(name)


def make_current() -> None:
    dev, ctx = C.c_int(), C.c_void_p()
    check(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def kernel(cubin: str, name: str) -> C.c_void_p:
    """The kernel whose mangled name holds `<len>name E` (as lab/main.cu finds it)."""
    mod, n = C.c_void_p(), C.c_uint()
    check(cu.cuModuleLoad(C.byref(mod), cubin.encode()), f"cuModuleLoad {cubin}")
    check(cu.cuModuleGetFunctionCount(C.byref(n), mod), "cuModuleGetFunctionCount")
    functions = (C.c_void_p * n.value)()
    check(cu.cuModuleEnumerateFunctions(functions, n, mod), "cuModuleEnumerateFunctions")
    token = f"{len(name)}{name}E".encode()
    for f in functions:
        mangled = C.c_char_p()
        check(cu.cuFuncGetName(C.byref(mangled), C.c_void_p(f)), "cuFuncGetName")
        if token in mangled.value:
            return C.c_void_p(f)
    raise SystemExit(f"no kernel {name} in {cubin}")


def host_operands(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {k: rng.integers(0, 2**32, size=2 * n, dtype=np.uint64).astype(np.uint32)
           for k, n in COUNTS.items() if DTYPES[k] is np.uint32}
    out["scales"] = (rng.random(2 * COUNTS["scales"]) * 0.02 + 0.01).astype(np.float16)
    out["x"] = (rng.random(COLS) * 2 - 1).astype(np.float16)
    out["levels"] = np.array([-2.15, -1.34, -0.76, -0.25, 0.25, 0.76, 1.34, 2.15], np.float32)
    out["pair_expert"] = np.zeros(1, np.int32)
    out["pair_row"] = np.zeros(1, np.int32)
    out["bias"] = np.zeros(1, np.float32)
    out["out"] = np.zeros(ROWS, np.float16)
    return out


def device_pointers(host: dict[str, np.ndarray]) -> dict[str, int]:
    out = {}
    for k, a in host.items():
        ptr = C.c_uint64()
        check(driver("cuMemAlloc")(C.byref(ptr), C.c_size_t(a.nbytes)), f"cuMemAlloc {k}")
        check(driver("cuMemcpyHtoD")(ptr, a.ctypes.data_as(C.c_void_p), C.c_size_t(a.nbytes)),
              f"cuMemcpyHtoD {k}")
        out[k] = ptr.value
    return out


def mlx_pointer(a: mx.array, keep: list) -> int:
    """The address of an evaluated MLX array's buffer (CUDA managed memory is addressable
    from the host); two views must agree, or it is a copy."""
    mx.eval(a)
    views = [np.asarray(a), np.asarray(a)]
    keep.extend([a, *views])
    p, q = (v.__array_interface__["data"][0] for v in views)
    if p != q:
        raise SystemExit("np.asarray copies MLX's buffer here: no pointer to test")
    return p


def mlx_pointers(host: dict[str, np.ndarray], gpu_written: bool, keep: list) -> dict[str, int]:
    out = {}
    for k, a in host.items():
        if gpu_written and k in ("codes", "hplane"):
            arr = mx.random.randint(0, 2**31, shape=a.shape, dtype=mx.int32).view(mx.uint32)
        else:
            arr = mx.array(a)
        out[k] = mlx_pointer(arr, keep)
    return out


def time_launches(fn: C.c_void_p, ptrs: dict[str, int], launches: int = 200) -> float:
    """Microseconds per launch (CUDA events), the two weight copies alternating."""
    def launch(copy: int) -> None:
        args = [ptrs["x"], ptrs["codes"] + 4 * copy * COUNTS["codes"],
                ptrs["hplane"] + 4 * copy * COUNTS["hplane"],
                ptrs["scales"] + 2 * copy * COUNTS["scales"], ptrs["levels"],
                ptrs["pair_expert"], ptrs["pair_row"], ptrs["bias"], ptrs["out"]]
        cargs = [C.c_uint64(v) for v in args]
        params = (C.c_void_p * len(cargs))(*[C.cast(C.byref(a), C.c_void_p) for a in cargs])
        check(cu.cuLaunchKernel(fn, ROWS // BLOCK_ROWS, 1, 1, THREADS, 1, 1, SHARED, None,
                                params, None), "cuLaunchKernel")

    start, end = C.c_void_p(), C.c_void_p()
    check(cu.cuEventCreate(C.byref(start), 0), "cuEventCreate")
    check(cu.cuEventCreate(C.byref(end), 0), "cuEventCreate")
    for i in range(20):
        launch(i % 2)
    check(cu.cuEventRecord(start, None), "cuEventRecord")
    for i in range(launches):
        launch(i % 2)
    check(cu.cuEventRecord(end, None), "cuEventRecord")
    check(cu.cuEventSynchronize(end), "cuEventSynchronize")
    ms = C.c_float()
    check(driver("cuEventElapsedTime")(C.byref(ms), start, end), "cuEventElapsedTime")
    return 1000.0 * ms.value / launches


def output(ptrs: dict[str, int]) -> np.ndarray:
    out = np.zeros(ROWS, np.float16)
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    check(driver("cuMemcpyDtoH")(out.ctypes.data_as(C.c_void_p), C.c_uint64(ptrs["out"]),
                                 C.c_size_t(out.nbytes)), "cuMemcpyDtoH")
    return out.astype(np.float32)


RANGE_ATTRIBUTES = {"read_mostly": 1, "preferred_location": 2, "last_prefetch_location": 4}


def describe(ptr: int, nbytes: int) -> str:
    """What the driver says of one buffer: managed or not, its memory advice, alignment."""
    managed, kind = C.c_uint(), C.c_uint()
    check(cu.cuPointerGetAttribute(C.byref(managed), 8, C.c_uint64(ptr)), "IS_MANAGED")
    check(cu.cuPointerGetAttribute(C.byref(kind), 2, C.c_uint64(ptr)), "MEMORY_TYPE")
    parts = [f"managed={managed.value}", f"memory_type={kind.value}",
             f"offset_in_2MB={ptr % (2 << 20)}"]
    if managed.value:
        for name, attr in RANGE_ATTRIBUTES.items():
            value = C.c_int(-99)
            check(cu.cuMemRangeGetAttribute(C.byref(value), C.c_size_t(4), attr, C.c_uint64(ptr),
                                            C.c_size_t(nbytes)), name)
            parts.append(f"{name}={value.value}")
        by = (C.c_int * 4)(-99, -99, -99, -99)
        check(cu.cuMemRangeGetAttribute(by, C.c_size_t(16), 3, C.c_uint64(ptr), C.c_size_t(nbytes)),
              "accessed_by")
        parts.append(f"accessed_by={[v for v in by if v != -2]}")
    return " ".join(parts)


def advise(ptrs: dict[str, int], host: dict[str, np.ndarray], advice: int, device: int) -> None:
    for k, ptr in ptrs.items():
        check(cu.cuMemAdvise(C.c_uint64(ptr), C.c_size_t(host[k].nbytes), advice, device),
              f"cuMemAdvise {advice} {k}")


def prefetch(ptrs: dict[str, int], host: dict[str, np.ndarray]) -> None:
    for k, ptr in ptrs.items():
        check(cu.cuMemPrefetchAsync(C.c_uint64(ptr), C.c_size_t(host[k].nbytes), 0, None),
              f"cuMemPrefetchAsync {k}")
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


def main() -> None:
    cubin = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tq_lab_nvrtc.cubin"
    mx.eval(mx.zeros(1) + 1)  # MLX's context first
    make_current()
    fn = kernel(cubin, "gemv_28672x8192_b3_r4")
    host = host_operands(np.random.default_rng(0))
    keep: list = []
    sets = {"cuMemAlloc": device_pointers(host),
            "MLX from host data": mlx_pointers(host, False, keep),
            "MLX written by the GPU": mlx_pointers(host, True, keep)}
    mx.synchronize()
    reference = None
    for name, ptrs in sets.items():
        time_launches(fn, ptrs, 20)
        got = output(ptrs)
        if name != "MLX written by the GPU":  # other codes: other outputs
            reference = got if reference is None else reference
            diff = np.abs(got - reference).max() / max(np.abs(reference).max(), 1e-30)
            print(f"{name}: output vs cuMemAlloc's, max rel. diff {diff:.2e}")
    print("us per launch, 200 launches a round (CUDA events)")
    for rnd in range(3):
        print(f"round {rnd}: " + "  ".join(f"{name} {time_launches(fn, ptrs):6.2f}"
                                          for name, ptrs in sets.items()), flush=True)
    for name, ptrs in sets.items():
        print(f"{name}: codes {describe(ptrs['codes'], host['codes'].nbytes)}")
    mlx_set = sets["MLX written by the GPU"]
    steps = [("advise preferred location GPU + prefetch", lambda: (advise(mlx_set, host, 3, 0), prefetch(mlx_set, host))),
             ("unset accessed-by CPU", lambda: advise(mlx_set, host, 6, -1)),
             ("advise accessed-by GPU", lambda: advise(mlx_set, host, 5, 0)),
             ("unset read-mostly", lambda: advise(mlx_set, host, 2, 0))]
    for what, step in steps:
        try:
            step()
        except RuntimeError as e:
            print(f"{what}: {e}")
            continue
        print(f"after {what}: MLX written by the GPU {time_launches(fn, mlx_set):6.2f} "
              f"(cuMemAlloc {time_launches(fn, sets['cuMemAlloc']):6.2f}); "
              f"{describe(mlx_set['codes'], host['codes'].nbytes)}", flush=True)
    # does MLX's own use of the arrays undo the advice? an MLX op reads each of them, then
    # the same launches again
    mx.eval([mx.sum(a) for a in keep if isinstance(a, mx.array)])
    mx.synchronize()
    print(f"after MLX ops read them: MLX written by the GPU {time_launches(fn, mlx_set):6.2f} "
          f"(cuMemAlloc {time_launches(fn, sets['cuMemAlloc']):6.2f}); "
          f"{describe(mlx_set['codes'], host['codes'].nbytes)}", flush=True)
    print("reproduce: python tools/cuda_lab.py --emit lab && bash lab/run.sh && "
          "python tools/gemv_in_mlx.py /tmp/tq_lab_nvrtc.cubin")


if __name__ == "__main__":
    main()
