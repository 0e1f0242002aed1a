"""Conversion as a user runs it: the default `turboquant convert` against `mlx_lm.convert`.

Writes synthetic bf16 checkpoints (random Gaussian weights, one tensor at a time) of the
shapes asked for, and converts each with the plain command a user types and with its peer,
alternating the two (the order swaps every round), on the same files, read once just before
each run so that both start with the page cache as warm as the machine's memory allows:

    turboquant convert SRC OUT --bits 4 --group-size 64          (no tuned flags)
    mlx_lm.convert --hf-path SRC -q --q-bits 4 --q-group-size 64 --mlx-path OUT

For each pair it prints both wall times, the throughput ratio (source bytes per second,
turboquant / mlx_lm), the CPU seconds of each process tree (sampled every 50 ms, so
comparable on a loaded machine where wall times are not), the peak RSS of each tree and the
bytes the machine read from disk meanwhile (a source not in the page cache); then
per shape the median ratio and its spread over the rounds, and the load average seen.

    python benchmarks/convert.py                              # 1.1b, 4b, 4.6b-wide, 3 rounds
    python benchmarks/convert.py --shapes 4b,16b --rounds 2   # 16b: 32 GB of bf16, ~45 GB disk
    python benchmarks/convert.py --shapes 1.1b --tq-args="--workers 1"   # a tuned run

Shapes: `1.1b` (TinyLlama: hidden 2048, 22 layers), `4b` (Llama-7B-like: hidden 4096,
intermediate 11008, 21 layers), `4.6b-wide` (hidden 3072 x 44 layers, intermediate 8192),
`16b` (hidden 4096, 89 layers). Targets (issue 40): >= 1.0x at 1.1B, >= 1.5x at 4B and
more, peak RSS < 1 GB. Times count only on the machine they were measured on; the ratio is
the claim.

Encode runs through numba's compiled kernels where numba is installed; their machine code
is cached on disk after the first use, so this script fills that cache in a separate
process before timing. `TURBOQUANT_NO_NUMBA=1` measures the numpy/MLX path instead.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import checkpoint_parameters, write_llama_checkpoint  # noqa: E402


SHAPES = {
    "1.1b": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000),
    "4b": dict(layers=21, hidden=4096, intermediate=11008, heads=32, kv_heads=8, vocab=32000),
    "4.6b-wide": dict(layers=44, hidden=3072, intermediate=8192, heads=24, kv_heads=8,
                      vocab=32000),
    "16b": dict(layers=89, hidden=4096, intermediate=11008, heads=32, kv_heads=8, vocab=32000),
    "tiny": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512),  # tests
}


def make_checkpoint(path: Path, shape: dict, shards_gb: float = 2.0) -> tuple[int, int]:
    est = _estimate(shape)
    shards = max(1, math.ceil(est * 2 / (shards_gb * 1e9)))
    write_llama_checkpoint(path, dtype="bfloat16", shards=shards, fast_random=True,
                           tokenizer=True, **shape)
    n = checkpoint_parameters(path)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return n, size


def _estimate(s: dict) -> int:
    h, i, hd = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    per = 2 * h * h + 2 * h * hd * s["kv_heads"] + 3 * h * i
    return s["layers"] * per + 2 * s["vocab"] * h


class TreeMonitor:
    """Peak RSS of a process and all its descendants (sum, and largest single process), and
    the CPU seconds of the tree (the last sample of each process seen)."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_sum = 0
        self.peak_one = 0
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        seen: dict[int, psutil.Process] = {}
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:  # the command ended: follow what outlives it
                procs = [p for p in seen.values() if p.is_running()]
                if not procs:
                    break
            total = 0
            for p in procs:
                seen.setdefault(p.pid, p)
                try:
                    with p.oneshot():
                        rss = p.memory_info().rss
                        t = p.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                self.cpu[p.pid] = t.user + t.system
                total += rss
                self.peak_one = max(self.peak_one, rss)
            self.peak_sum = max(self.peak_sum, total)
            self._stop.wait(self.interval)
        self.ended = time.monotonic()

    def wait(self, timeout: float) -> None:
        """Until every process of the tree has ended (a side process that outlives the
        command: turboquant's Prefect record), at most `timeout` seconds."""
        self.thread.join(timeout)

    def stop(self):
        self._stop.set()
        self.thread.join()

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu.values())

    @property
    def cpu_root(self) -> float:
        return self.cpu.get(self.root.pid, 0.0)


def disk_read_bytes() -> int:
    """Bytes read from the machine's disks so far (all processes: a source that is not in
    the page cache shows up here)."""
    io = psutil.disk_io_counters()
    return io.read_bytes if io else 0


LINGER_TIMEOUT = 300  # seconds to wait for processes that outlive the command


def measure(cmd: list[str], env: dict | None = None) -> dict:
    read0 = disk_read_bytes()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    mon = TreeMonitor(proc.pid)
    out, _ = proc.communicate()
    ended = time.monotonic()
    seconds = ended - t0
    # what outlives the command (idle workers exiting; turboquant's Prefect record, written
    # by a side process) finishes before the next run, and its CPU is counted
    mon.wait(LINGER_TIMEOUT)
    mon.stop()
    after = max(0.0, getattr(mon, "ended", ended) - ended)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out.decode()[-3000:]}")
    return {"seconds": seconds, "peak_rss": mon.peak_sum, "peak_rss_one": mon.peak_one,
            "cpu": mon.cpu_seconds, "cpu_command": mon.cpu_root, "after": after, "disk_read": disk_read_bytes() - read0,
            "output": out.decode(errors="replace")}


def folder_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*")
               if f.is_file() and ".turboquant" not in f.parts)


def warm_page_cache(folder: Path) -> None:
    """Read every file so that the timed run does not read from disk: twice where the source
    fits in half the memory (a page read twice moves to the kernel's active list; after a
    16b pair, the first 4b run read 8 GB from disk though its source had been read once just
    before). A source bigger than that is read once: it does not stay cached for either
    tool."""
    passes = 2 if folder_size(folder) < psutil.virtual_memory().total // 2 else 1
    for _ in range(passes):
        for f in sorted(folder.iterdir()):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


WARM_NUMBA = """
import numpy as np
from turboquant.stages import encode, fast_hadamard
if fast_hadamard.AVAILABLE:
    for bits in (2, 3, 4, "ternary"):
        encode(np.ones((3, 256), np.float32), bits, seed=1)
print("numba kernels (stages/fast_*.py)" if fast_hadamard.AVAILABLE
      else "numpy/MLX (no numba, or TURBOQUANT_NO_NUMBA=1)")
"""


def warm_numba_cache(env: dict) -> str:
    """Compile encode's kernels once (numba's disk cache) outside the timed runs; returns
    which encode path the conversions take."""
    out = subprocess.run([sys.executable, "-c", WARM_NUMBA], env=env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def commands(src: Path, tq_out: Path, mlx_out: Path, tq_args: list[str]) -> dict:
    tq = [sys.executable, "-m", "turboquant", "convert", str(src), str(tq_out), "--bits", "4",
          "--group-size", "64", *tq_args]
    mlx = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(src), "-q", "--q-bits",
           "4", "--q-group-size", "64", "--mlx-path", str(mlx_out)]
    return {"turboquant": tq, "mlx_lm": mlx}


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_shape(name: str, work: Path, rounds: int, tq_args: list[str], env: dict,
              keep: bool) -> dict:
    src = work / name
    if not (src / "config.json").exists():
        t = time.monotonic()
        n, size = make_checkpoint(src, SHAPES[name])
        print(f"wrote {src}: {n / 1e9:.2f}B parameters, {size / 1e9:.2f} GB bf16 "
              f"({time.monotonic() - t:.0f} s)", flush=True)
    n = checkpoint_parameters(src)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    outs = {"turboquant": work / f"{name}-tq", "mlx_lm": work / f"{name}-mlx"}
    cmds = commands(src, outs["turboquant"], outs["mlx_lm"], tq_args)
    pairs = []
    for r in range(rounds):
        order = ("turboquant", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "turboquant")
        pair = {"load_before": load()}
        for tool in order:
            shutil.rmtree(outs[tool], ignore_errors=True)
            warm_page_cache(src)  # each tool starts with the source as cached as it can be
            pair[tool] = measure(cmds[tool], env)
            pair[tool]["out_bytes"] = folder_size(outs[tool])
            shutil.rmtree(outs[tool], ignore_errors=True)
        pair["load_after"] = load()
        tq, ml = pair["turboquant"], pair["mlx_lm"]
        pair["ratio"] = ml["seconds"] / tq["seconds"]
        pairs.append(pair)
        print(f"{name} round {r + 1} ({' then '.join(order)}): turboquant {tq['seconds']:.1f} s "
              f"({tq['cpu']:.1f} CPU s, {tq['cpu_command']:.1f} in the command's process, "
              f"{tq['peak_rss'] / 2**20:.0f} MiB; after it ended {tq['after']:.1f} s more of "
              f"side processes), mlx_lm "
              f"{ml['seconds']:.1f} s ({ml['cpu']:.1f} CPU s, {ml['peak_rss'] / 2**20:.0f} MiB): "
              f"{pair['ratio']:.2f}x; read from disk {tq['disk_read'] / 1e9:.2f} / "
              f"{ml['disk_read'] / 1e9:.2f} GB; {pair['load_before']} -> {pair['load_after']}",
              flush=True)
    if not keep:
        shutil.rmtree(src, ignore_errors=True)
    return {"name": name, "params": n, "bytes": size, "pairs": pairs, "cmds": cmds}


def report(results: list[dict], argv: list[str]) -> None:
    print()
    print("| shape | params | source GB | turboquant s | mlx_lm s | ratio (median, range) | "
          "CPU s tq / mlx | peak RSS tq / mlx | output GB tq / mlx | CPU ratio | load average |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for res in results:
        pairs = res["pairs"]
        tq = [p["turboquant"] for p in pairs]
        ml = [p["mlx_lm"] for p in pairs]
        ratios = [p["ratio"] for p in pairs]
        loads = [float(p[k].split()[2]) for p in pairs for k in ("load_before", "load_after")]

        def med(rows, key):
            return statistics.median(r[key] for r in rows)

        print(f"| {res['name']} | {res['params'] / 1e9:.2f}B | {res['bytes'] / 1e9:.2f} | "
              f"{med(tq, 'seconds'):.1f} | {med(ml, 'seconds'):.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{med(tq, 'cpu'):.1f} / {med(ml, 'cpu'):.1f} | "
              f"{max(r['peak_rss'] for r in tq) / 2**20:.0f} / "
              f"{max(r['peak_rss'] for r in ml) / 2**20:.0f} MiB | "
              f"{tq[0]['out_bytes'] / 1e9:.2f} / {ml[0]['out_bytes'] / 1e9:.2f} | "
              f"{med(ml, 'cpu') / med(tq, 'cpu'):.2f}x | "
              f"{min(loads):.1f}-{max(loads):.1f} |")
    print("\nratio: mlx_lm.convert's wall time / turboquant's, per alternating pair (targets: "
          ">= 1.0x at 1.1B, >= 1.5x at 4B and more; peak RSS < 1 GiB); CPU ratio: mlx_lm's "
          "CPU seconds / turboquant's (medians; turboquant's include its Prefect record, "
          "written by a side process after the command ends); load average: the 1-minute "
          "figures seen before and after each run")
    print("\nreproduce:")
    print("  python benchmarks/convert.py " + " ".join(argv))
    for res in results[:1]:
        for tool, cmd in res["cmds"].items():
            print(f"  # {tool}: {' '.join(cmd)}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1.1b,4b,4.6b-wide",
                    help=f"comma-separated, of {', '.join(SHAPES)} (default 1.1b,4b,4.6b-wide)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating pairs per shape")
    ap.add_argument("--tq-args", default="", help="extra turboquant convert arguments (the "
                    "default command has none)")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args(argv)
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    unknown = [x for x in shapes if x not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}: use {', '.join(SHAPES)}")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tq-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    print(f"encode: {warm_numba_cache(env)}; {os.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB; {load()}", flush=True)
    results = []
    try:
        for name in shapes:
            results.append(run_shape(name, work, max(1, args.rounds), args.tq_args.split(),
                                     env, args.keep))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    report(results, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
