"""Compiled CUDA kernels kept on disk between processes (TURBOQUANT_KERNEL_CACHE=1).

MLX 0.32.4 compiles every `mx.fast.cuda_kernel` with NVRTC in each new process and keeps
nothing on disk: on the H200 TurboQuant's kernels cost 14-18 s before a process's first
token (affine-4: 0.3-0.45 s). `cuda_kernel` here takes `mx.fast.cuda_kernel`'s arguments
and returns a kernel called the same way. With the cache off (the default, the proven
path) it is `mx.fast.cuda_kernel` itself. With it on, each specialisation (input dtypes
and ranks, template arguments, output dtypes) is written out as a whole CUDA function
(`precompiled_source`: MLX's signature, the shapes it would pass as `Shape` structs passed
as int scalars), compiled once per machine to a cubin (nvcc where on PATH, else NVRTC
through ctypes) and run by `mx.fast.precompiled_cuda_kernel`.

The cache (`cache_dir()`: $TURBOQUANT_CACHE_DIR, else $XDG_CACHE_HOME/turboquant/kernels,
else ~/.cache/turboquant/kernels) holds one file an entry, named by the SHA-256 of the
source, the GPU architecture, MLX's version and the compiler's (`entry_key`), starting
with MAGIC and the SHA-256 of the cubin: a file that fails the check is refused, removed
and built again. An entry is written to a temporary file and renamed into place, and
built under a lock of its own (`fcntl.flock`), so processes starting together build it
once and never read half a file.

What a GPU run must still show (none could be run when this was written): that
`precompiled_cuda_kernel` runs these cubins with the kernels' results (the CUDA test
files with TURBOQUANT_KERNEL_CACHE=1), and the first token of a second process
(`benchmarks/first_token.py`). Kernels that read an input's strides without
`ensure_row_contiguous` (MLX's strides of a view are not visible from Python) always
take MLX's path. Each call of a precompiled kernel hands MLX the cubin (a copy per call):
inside the compiled steps that is at trace time only; eager paths pay it every call.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

CACHE = os.environ.get("TURBOQUANT_KERNEL_CACHE", "0") == "1"
MAGIC = b"TQCUBIN1\n"  # an entry's first bytes; then the cubin's SHA-256 (32 bytes), the cubin
MAX_NDIM = 10  # MLX's Shape and Strides hold this many

log = logging.getLogger("turboquant.kernels")

_CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
               mx.uint32: "uint32_t", mx.int32: "int32_t", mx.uint8: "uint8_t",
               mx.int8: "int8_t", mx.uint16: "uint16_t", mx.int64: "int64_t",
               mx.uint64: "uint64_t", mx.bool_: "bool"}

# what MLX puts in front of a kernel (mlx/backend/cuda/device/utils.cuh's Shape and
# Strides, cooperative groups, `inf`): all the kernels here use of it
DEFAULT_HEADER = r"""
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def cache_dir() -> Path:
    """Where entries live: $TURBOQUANT_CACHE_DIR, else the user's cache folder."""
    given = os.environ.get("TURBOQUANT_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "turboquant" / "kernels"


# ------------------------------------------------------------------------ entries on disk


@dataclass(frozen=True)
class Toolchain:
    """What a cubin depends on besides its source."""

    arch: str  # "sm_90"
    mlx: str  # MLX's version (the kernel signature it launches)
    compiler: str  # "nvcc 13.0.88", "nvrtc 12.8"


def entry_key(source: str, toolchain: Toolchain) -> str:
    """The SHA-256 naming an entry: the source, the GPU architecture, MLX's and the
    compiler's versions, and the entry format."""
    h = hashlib.sha256(MAGIC)
    for part in (toolchain.arch, toolchain.mlx, toolchain.compiler, source):
        h.update(len(part.encode()).to_bytes(8, "little") + part.encode())
    return h.hexdigest()


def entry_path(key: str, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / key[:2] / f"{key}.cubin"


def read_entry(path: Path) -> bytes | None:
    """An entry's cubin; None when there is none, or (removed, with a warning) when it
    fails its checksum: a torn or corrupted file is never handed to the GPU."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(MAGIC)
    binary = data[head + 32:]
    if data[:head] == MAGIC and hashlib.sha256(binary).digest() == data[head:head + 32] \
            and binary:
        return binary
    log.warning("turboquant: compiled kernel %s is corrupt (checksum): removed, building it "
                "again", path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return None


def write_entry(path: Path, binary: bytes) -> None:
    """The entry written to a temporary file beside it, synced, renamed into place: a
    reader sees the whole entry or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(binary).digest() + binary)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock of `path`'s entry among processes (a .lock file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def load_or_build(source: str, toolchain: Toolchain, build, folder: Path | None = None,
                  what: str = "a kernel") -> bytes:
    """The cubin of `source` from the cache, else `build(source, arch)`'s, stored: built
    by one process at a time (the others wait, then read it)."""
    path = entry_path(entry_key(source, toolchain), folder)
    binary = read_entry(path)
    if binary is not None:
        return binary
    with _locked(path):
        binary = read_entry(path)  # another process may have built it while we waited
        if binary is None:
            _notice("build", f"turboquant: compiling {what} for {toolchain.arch} with "
                    f"{toolchain.compiler} (once on this machine; kept in {path.parent.parent})")
            binary = build(source, toolchain.arch)
            write_entry(path, binary)
    return binary


_NOTICED = set()


def _notice(kind: str, message: str) -> None:
    """Say what a process is doing while it compiles (once a process a kind), on stderr
    through logging's last resort when the program set no handler (`turboquant generate`),
    else through its handlers (`serve`)."""
    if kind not in _NOTICED:
        _NOTICED.add(kind)
        log.warning(message)


# ------------------------------------------------------------------------------ compilers


def compile_nvcc(source: str, arch: str) -> bytes:
    """A cubin of `source` for `arch` ("sm_90") by nvcc."""
    with tempfile.TemporaryDirectory(prefix="tq_nvcc_") as folder:
        cu, cubin = Path(folder) / "k.cu", Path(folder) / "k.cubin"
        cu.write_text(source)
        res = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-cubin", str(cu), "-o",
                              str(cubin)], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on a TurboQuant kernel ({arch}):\n"
                               f"{res.stderr[-4000:]}")
        return cubin.read_bytes()


def nvcc_version() -> str | None:
    if shutil.which("nvcc") is None:
        return None
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    last = [w for w in out.split() if w.startswith("V")]
    return f"nvcc {last[-1][1:] if last else out.strip()[-40:]}"


def _nvidia_dirs(pattern: str) -> list[str]:
    """Folders matching `pattern` under the nvidia (and torch) wheels on sys.path, and the
    CUDA toolkit's."""
    found = []
    for root in sys.path + [os.environ.get("CUDA_HOME", "/usr/local/cuda")]:
        for base in ("nvidia/*", "nvidia", "torch", ""):
            found += glob.glob(os.path.join(root, base, pattern))
    return sorted(set(found))


@functools.cache
def _nvrtc():
    """libnvrtc through ctypes (the CUDA wheels MLX's and torch's builds install carry it),
    or None."""
    names = [ctypes.util.find_library("nvrtc")] + _nvidia_dirs("lib/libnvrtc.so*")
    for name in names:
        if name and "builtins" not in name and "alt" not in name:
            with contextlib.suppress(OSError):
                return ctypes.CDLL(name)
    return None


def nvrtc_version() -> str | None:
    lib = _nvrtc()
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"nvrtc {major.value}.{minor.value}"


def compile_nvrtc(source: str, arch: str) -> bytes:
    """A cubin of `source` for `arch` by NVRTC (as MLX builds its kernels: the
    architecture and include paths), the CUDA and CCCL headers from the wheels or the
    toolkit."""
    lib = _nvrtc()
    if lib is None:
        raise RuntimeError("no libnvrtc found: install the CUDA wheels (pip install "
                           "'mlx[cuda13]') or put nvcc on PATH")
    includes = [d for d in _nvidia_dirs("include") + _nvidia_dirs("include/cccl")
                if os.path.exists(os.path.join(d, "cuda_fp16.h"))
                or os.path.isdir(os.path.join(d, "cuda", "std"))]
    options = [f"--gpu-architecture={arch}", "-std=c++17"] + [f"-I{d}" for d in includes]
    prog = ctypes.c_void_p()
    check = _nvrtc_check(lib)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"tq_kernel.cu", 0,
                                 None, None), "create")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC failed on a TurboQuant kernel ({arch}, include paths "
                               f"{includes}):\n{text.value.decode(errors='replace')[-4000:]}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        out = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, out), "cubin")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(lib):
    def check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"NVRTC {what} failed with code {code}")
    return check


@functools.cache
def toolchain() -> tuple[Toolchain, object] | None:
    """(Toolchain, compile function) on this machine: the GPU's architecture, nvcc where
    on PATH, else NVRTC; None without a CUDA device or a compiler."""
    from . import cuda_memory

    capability = cuda_memory.compute_capability()
    if capability is None:
        return None
    arch = f"sm_{capability[0]}{capability[1]}"
    version = nvcc_version()
    if version is not None:
        return Toolchain(arch, mx.__version__, version), compile_nvcc
    version = nvrtc_version()
    if version is not None:
        return Toolchain(arch, mx.__version__, version), compile_nvrtc
    return None


# ------------------------------------------------------------------------- the kernels


def precompiled_source(symbol: str, header: str, source: str, input_names, input_dtypes,
                       input_ndims, output_names, output_dtypes, template) -> str:
    """The whole CUDA function `mx.fast.cuda_kernel` would build for these inputs,
    outputs and template arguments (mlx/backend/cuda/custom_kernel.cpp), `extern "C"` as
    `symbol`, with what MLX passes as `Shape` / `Strides` / ndim arguments passed as int
    scalars after the outputs (`scalars`' order) and rebuilt into those names."""
    params, rebuild = [], []
    for name, dt in zip(input_names, input_dtypes):
        params.append(f"    const {_CUDA_TYPES[dt]}* {name}")
    params += [f"    {_CUDA_TYPES[dt]}* {n}" for n, dt in zip(output_names, output_dtypes)]
    for name, ndim in zip(input_names, input_ndims):
        for kind, struct in (("shape", "Shape"), ("strides", "Strides")):
            if f"{name}_{kind}" in source:
                dims = [f"{name}_{kind}{d}" for d in range(ndim)]
                params += [f"    int {d}" for d in dims]
                rebuild.append(f"  {struct} {name}_{kind}{{}};\n" + "".join(
                    f"  {name}_{kind}[{d}] = {v};\n" for d, v in enumerate(dims)))
        if f"{name}_ndim" in source:
            params.append(f"    int {name}_ndim")
    body = "".join(rebuild)
    for k, v in template:
        if isinstance(v, bool):
            body += f"  constexpr bool {k} = {'true' if v else 'false'};\n"
        elif isinstance(v, int):
            body += f"  constexpr int {k} = {v};\n"
        else:
            body += f"  using {k} = {_CUDA_TYPES[v]};\n"
    return (DEFAULT_HEADER + header + "\nnamespace mlx::core::cu {\n\n"
            "namespace cg = cooperative_groups;\n\n"
            f'extern "C" __global__ void {symbol}(\n' + ",\n".join(params) + ") {\n"
            + body + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")


def scalars(source: str, input_names, inputs) -> list[int]:
    """The int scalars `precompiled_source`'s function takes for these inputs: each
    shape (and row-major strides) its source reads, each ndim."""
    out = []
    for name, x in zip(input_names, inputs):
        if f"{name}_shape" in source:
            out += [int(d) for d in x.shape]
        if f"{name}_strides" in source:
            step, strides = 1, []
            for d in reversed(x.shape):
                strides.append(step)
                step *= int(d)
            out += strides[::-1]
        if f"{name}_ndim" in source:
            out.append(x.ndim)
    return out


class CachedKernel:
    """`mx.fast.cuda_kernel`'s kernel, its specialisations compiled once per machine and
    run by `mx.fast.precompiled_cuda_kernel`."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, shared_memory=0):
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.ensure_row_contiguous, self.shared_memory = ensure_row_contiguous, shared_memory
        self._built: dict = {}  # specialisation -> (symbol, cubin)
        self._lock = threading.Lock()

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(),
                 init_value=None, verbose=False, stream=None):
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        spec = (tuple(x.dtype for x in inputs), tuple(x.ndim for x in inputs),
                tuple(template), tuple(output_dtypes))
        built = self._built.get(spec)
        if built is None:
            built = self._build(spec)
        symbol, binary = built
        return mx.fast.precompiled_cuda_kernel(
            name=symbol, compiled_source=binary, inputs=inputs,
            output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes),
            scalars=scalars(self.source, self.input_names, inputs),
            grid=grid, threadgroup=threadgroup, shared_memory=self.shared_memory,
            init_value=init_value, ensure_row_contiguous=self.ensure_row_contiguous,
            stream=stream)

    def _build(self, spec):
        dtypes, ndims, template, out_dtypes = spec
        with self._lock:
            if spec in self._built:
                return self._built[spec]
            found = toolchain()
            if found is None:
                raise RuntimeError("TURBOQUANT_KERNEL_CACHE=1 needs a CUDA device and nvcc "
                                   "or libnvrtc; unset it to let MLX compile the kernels")
            chain, build = found
            draft = precompiled_source("SYMBOL", self.header, self.source, self.input_names,
                                       dtypes, ndims, self.output_names, out_dtypes, template)
            symbol = f"tq_{self.name}_{entry_key(draft, chain)[:16]}"
            text = draft.replace('extern "C" __global__ void SYMBOL(',
                                 f'extern "C" __global__ void {symbol}(')
            binary = load_or_build(text, chain, build, what=f"the CUDA kernel {self.name}")
            self._built[spec] = (symbol, binary)
            return self._built[spec]


def cuda_kernel(name: str, input_names, output_names, source: str, header: str = "",
                ensure_row_contiguous: bool = True, shared_memory: int = 0, **kwargs):
    """`mx.fast.cuda_kernel(...)`, or with TURBOQUANT_KERNEL_CACHE=1 a `CachedKernel`
    called the same way (kernels reading strides of inputs MLX does not make contiguous
    stay MLX's: their strides are not visible here)."""
    reads_strides = any(f"{n}_strides" in source for n in input_names)
    if CACHE and not (reads_strides and not ensure_row_contiguous):
        return CachedKernel(name, input_names, output_names, source, header,
                            ensure_row_contiguous, shared_memory)
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        _notice("mlx", "turboquant: MLX compiles the CUDA kernels at the first token of each "
                "process (14-18 s on an H200 for an 8B model; TURBOQUANT_KERNEL_CACHE=1 keeps "
                "them on disk: docs/run.md)")
    return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                               source=source, header=header,
                               ensure_row_contiguous=ensure_row_contiguous,
                               shared_memory=shared_memory, **kwargs)
