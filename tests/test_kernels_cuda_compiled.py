"""kernels/compiled.py: the CUDA kernels' compiled cache on disk (TURBOQUANT_KERNEL_CACHE=1).

Everywhere: the entry key, the atomic write, the checksum that refuses a corrupt entry,
processes building one entry at once (one build), the cache off by default (MLX's own
kernel). Where nvcc is installed: the whole functions `precompiled_source` writes for
every kernel a dense and an MoE model launch through the runtime (prefill, the whole
step in both merges, the compressed KV cache's decode; recorded as `mx.fast.cuda_kernel`
would get them) compile to sm_90 cubins holding their symbol. On the GPU: a cached kernel's
values equal MLX's, and a second kernel object reads the entry instead of compiling.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from turboquant.kernels import compiled, cuda, cuda_attend

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
on_gpu = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA backend")
CHAIN = compiled.Toolchain("sm_90", "0.32.4", "nvcc 13.0.88")


def test_the_key_names_the_source_the_gpu_mlx_and_the_compiler():
    key = compiled.entry_key("src", CHAIN)
    assert key == compiled.entry_key("src", compiled.Toolchain("sm_90", "0.32.4", "nvcc 13.0.88"))
    others = {compiled.entry_key("src ", CHAIN),
              compiled.entry_key("src", compiled.Toolchain("sm_80", "0.32.4", "nvcc 13.0.88")),
              compiled.entry_key("src", compiled.Toolchain("sm_90", "0.33.0", "nvcc 13.0.88")),
              compiled.entry_key("src", compiled.Toolchain("sm_90", "0.32.4", "nvrtc 13.0"))}
    assert key not in others and len(others) == 4 and len(key) == 64
    # the parts are length-prefixed: moving text from one to the next is another key
    assert compiled.entry_key("b", compiled.Toolchain("sm_90", "a", "c")) != \
        compiled.entry_key("cb", compiled.Toolchain("sm_90", "a", ""))


def test_the_cache_folder_is_the_users(monkeypatch, tmp_path):
    monkeypatch.delenv("TURBOQUANT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiled.cache_dir() == tmp_path / "xdg" / "turboquant" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compiled.cache_dir() == tmp_path / "home" / ".cache" / "turboquant" / "kernels"
    monkeypatch.setenv("TURBOQUANT_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.cache_dir() == tmp_path / "mine"


def test_an_entry_is_written_whole_and_read_back(tmp_path):
    path = compiled.entry_path(compiled.entry_key("x", CHAIN), tmp_path)
    compiled.write_entry(path, b"\x7fELF cubin bytes")
    assert compiled.read_entry(path) == b"\x7fELF cubin bytes"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    compiled.write_entry(path, b"another")  # replaced in place
    assert compiled.read_entry(path) == b"another"


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty", "no-cubin"])
def test_a_corrupt_entry_is_refused_removed_and_built_again(tmp_path, caplog, damage):
    built = []

    def build(source, arch):
        built.append(arch)
        return b"cubin of " + source.encode()

    got = compiled.load_or_build("k", CHAIN, build, tmp_path)
    path = compiled.entry_path(compiled.entry_key("k", CHAIN), tmp_path)
    data = path.read_bytes()
    damaged = {"flip": data[:-1] + bytes([data[-1] ^ 1]), "truncate": data[:-3],
               "magic": b"X" + data[1:], "empty": b"",
               "no-cubin": data[:len(compiled.MAGIC) + 32]}[damage]
    path.write_bytes(damaged)
    assert compiled.read_entry(path) is None and not path.exists()
    assert "corrupt" in caplog.text and str(path) in caplog.text
    path.write_bytes(damaged)
    assert compiled.load_or_build("k", CHAIN, build, tmp_path) == got == b"cubin of k"
    assert built == ["sm_90", "sm_90"] and compiled.read_entry(path) == got


def _build_slowly(source: str, arch: str) -> bytes:
    """A build that takes a while and leaves a mark per run (for the processes below)."""
    marks = Path(os.environ["TQ_TEST_MARKS"])
    with open(marks, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    return f"{arch}:{source}".encode() * 1000


def _one_process(folder: str, start: float) -> bytes:
    while time.time() < start:  # every process asks at once
        time.sleep(0.001)
    return compiled.load_or_build("same", CHAIN, _build_slowly, Path(folder))


def test_processes_starting_together_build_an_entry_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TQ_TEST_MARKS", str(tmp_path / "marks"))
    start = time.time() + 1.0
    with multiprocessing.get_context("fork").Pool(6) as pool:
        got = pool.starmap(_one_process, [(str(tmp_path / "cache"), start)] * 6)
    assert len(set(got)) == 1 and got[0] == b"sm_90:same" * 1000
    assert len((tmp_path / "marks").read_text().split()) == 1  # built by one of the six
    entry = compiled.entry_path(compiled.entry_key("same", CHAIN), tmp_path / "cache")
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".lock"]


def test_the_cache_is_off_by_default_and_mlxs_kernel_is_made(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "TURBOQUANT_KERNEL_CACHE"}
    out = subprocess.run([sys.executable, "-P", "-c", "from turboquant.kernels import compiled as c; "
                          "print(c.CACHE)"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or "mlx's")
    assert compiled.cuda_kernel("k", ["a"], ["b"], "body", shared_memory=64) == "mlx's"
    assert made == [dict(name="k", input_names=["a"], output_names=["b"], source="body",
                         header="", ensure_row_contiguous=True, shared_memory=64)]
    monkeypatch.setattr(compiled, "CACHE", True)
    kernel = compiled.cuda_kernel("k", ["a"], ["b"], "a_shape[0]")
    assert isinstance(kernel, compiled.CachedKernel)
    # strides of an input MLX does not make contiguous are not visible here: MLX's kernel
    assert compiled.cuda_kernel("k", ["a"], ["b"], "a_strides[0]",
                                ensure_row_contiguous=False) == "mlx's"


def test_the_function_passes_shapes_as_scalars_in_mlxs_order():
    text = compiled.precompiled_source(
        "tq_sym", "// header\n", "out[0] = x_shape[1] + (int)y_strides[0] + x_ndim + N;",
        ["x", "y"], [mx.bfloat16, mx.float32], [3, 2], ["out"], [mx.int32],
        [("N", 4), ("T", mx.float16), ("F", False)])
    assert 'extern "C" __global__ void tq_sym(\n    const __nv_bfloat16* x,\n' \
           '    const float* y,\n    int32_t* out,\n    int x_shape0,\n    int x_shape1,\n' \
           '    int x_shape2,\n    int x_ndim,\n    int y_strides0,\n    int y_strides1) {' in text
    assert "constexpr int N = 4;" in text and "using T = __half;" in text
    assert "constexpr bool F = false;" in text and "// header" in text
    x, y = mx.zeros((2, 5, 7), mx.bfloat16), mx.zeros((3, 4))
    assert compiled.scalars("x_shape x_ndim y_strides", ["x", "y"], [x, y]) == \
        [2, 5, 7, 3, 4, 1]


class _Recording:
    """`mx.fast.cuda_kernel` recording each launch's specialisation (zeros out)."""

    def __init__(self):
        self.kernels, self.launches = {}, set()

    def __call__(self, *, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, shared_memory=0):
        def launch(*, inputs, grid, threadgroup, output_shapes, output_dtypes, template=(),
                   init_value=None, stream=None):
            spec = (tuple(x.dtype for x in inputs), tuple(x.ndim for x in inputs),
                    tuple(template), tuple(output_dtypes))
            self.launches.add((name, spec))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        self.kernels[name] = (input_names, output_names, source, header)
        return launch


def _forget_kernels():
    from turboquant.kernels import cuda_dequant, cuda_gemv, cuda_kv, cuda_linear, cuda_rotate

    for built in (cuda_attend._kernel, cuda_attend._join_kernel, cuda_gemv._kernel,
                  cuda_linear._kernel, cuda_rotate._kernel, cuda_dequant._kernel,
                  cuda_kv._kernel):
        built.cache_clear()
    cuda._PREPARED.clear()


@pytest.fixture
def launches(monkeypatch):
    """Every kernel specialisation a TQ3 Llama and Qwen3-MoE (2 layers) launch through the
    runtime with the CUDA kernels (prefill, decode through the whole step in both merges,
    the compressed KV cache's decode), recorded as `mx.fast.cuda_kernel` would get them."""
    import decode
    from mlx_lm.models.cache import make_prompt_cache

    from turboquant.kernels import dispatch
    from turboquant.runtime.kvcache import kv_cache_from_args

    from turboquant.runtime import kv_attention

    rec = _Recording()
    _forget_kernels()
    # the KV decode kernel as a fresh process finds it (an earlier test in this process may
    # have registered or settled another one for "cuda")
    monkeypatch.setattr(kv_attention, "_KERNELS", {})
    monkeypatch.setattr(kv_attention, "_SETTLED", set())
    monkeypatch.setattr(mx.fast, "cuda_kernel", rec)
    monkeypatch.setattr(dispatch, "backend", lambda: "cuda")
    monkeypatch.setattr(decode, "LLAMA3_8B", dict(decode.LLAMA3_8B, **decode.TINY_LLAMA))
    monkeypatch.setattr(decode, "QWEN3_30B_A3B", dict(decode.QWEN3_30B_A3B, **decode.TINY_MOE))
    dispatch._changed()
    try:
        for moe, merge, kv in ((False, "block", False), (True, "launch", False),
                               (False, "block", True)):
            monkeypatch.setattr(cuda_attend, "MERGE", merge)
            model = decode.build("tq3", moe=moe)
            cache = kv_cache_from_args(model, 4, 3, 4, 16) if kv else make_prompt_cache(model)
            y = model(mx.array([list(range(1, 81))]), cache=cache)  # > 64 rows: the merge
            for _ in range(3):
                y = model(mx.array([[5]]), cache=cache)
            mx.eval(y)
        yield rec
    finally:
        _forget_kernels()
        dispatch._changed()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_every_kernel_a_decode_launches_compiles_to_a_cubin(launches, tmp_path):
    """Each recorded specialisation as `precompiled_source` writes it, compiled by nvcc
    for sm_90 (in parallel), the cubin holding its symbol: the kernels TURBOQUANT_KERNEL_CACHE
    would build for these models."""
    names = " ".join(sorted(n for n, _ in launches.launches))
    for kind in ("tq_linear1", "tq_linear3", "tq_rotate", "tq_dequant", "tq_attend_",
                 "tq_attend_split", "tq_attend_join", "tq_kv"):
        assert kind in names, names
    runs = []
    for i, (name, (dtypes, ndims, template, out_dtypes)) in enumerate(sorted(
            launches.launches, key=str)):
        ins, outs, source, header = launches.kernels[name]
        symbol = f"tq_cached_{i}"
        path = tmp_path / f"{symbol}.cu"
        path.write_text(compiled.precompiled_source(symbol, header, source, ins, dtypes, ndims,
                                                    outs, out_dtypes, template))
        runs.append((symbol, name, subprocess.Popen(
            ["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", str(path), "-o",
             str(tmp_path / f"{symbol}.cubin")], stderr=subprocess.PIPE, text=True)))
        while sum(p.poll() is None for _, _, p in runs) >= (os.cpu_count() or 1):
            time.sleep(0.2)
    for symbol, name, run in runs:
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, f"{name}: {err[-3000:]}"
        # the unmangled name, whole, in the string table: what MLX asks the module for
        assert b"\0" + symbol.encode() + b"\0" in (tmp_path / f"{symbol}.cubin").read_bytes()


# ---------------------------------------------------------------------------- on the GPU


@on_gpu
def test_a_cached_kernel_gives_mlxs_values_and_the_next_process_reads_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOQUANT_CACHE_DIR", str(tmp_path))
    mx.random.seed(0)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, 8, 2048, 128)).astype(mx.bfloat16)
    pos = mx.array(1500, mx.int32)
    want = cuda_attend.buffer_attention(q, k, v, pos, 0.1)
    builds = []
    chain, build = compiled.toolchain()
    monkeypatch.setattr(compiled, "toolchain",
                        lambda: (chain, lambda s, a: builds.append(a) or build(s, a)))
    monkeypatch.setattr(compiled, "CACHE", True)
    for round_ in range(2):  # the second: new kernel objects, the entries from disk
        cuda_attend._kernel.cache_clear()
        got = cuda_attend.buffer_attention(q, k, v, pos, 0.1)
        assert mx.array_equal(got, want).item()
        assert len(builds) == 1  # one specialisation, built once
    cuda_attend._kernel.cache_clear()


def test_the_first_token_benchmark_prints_its_table_and_command():
    """`benchmarks/first_token.py --tiny` on the CPU: two fresh processes a variant, the
    table and the command (the figures count only on the GPU)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "first_token.py"), "--tiny",
                          "--kernel-cache", "off"], capture_output=True, text=True, timeout=600,
                         cwd=root, check=True).stdout
    rows = [line.split() for line in out.splitlines()  # the table's rows, not what a process said
            if line.split()[:1] in (["affine4"], ["tq3"]) and line.split()[1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("affine4", "1"), ("tq3", "1"), ("affine4", "2"),
                                            ("tq3", "2")]
    assert all(float(r[4]) > 0 for r in rows) and rows[0][-1] == "1.00x"
    assert "command: python benchmarks/first_token.py --kernel-cache off --tiny" in out
