"""Published releases as they are: the plan of each, and the memory of converting a
full-size slice of each.

1. Writes the header-exact layouts (tests/arch_checkpoints.py FLAGSHIPS) of DeepSeek-V3.1
   and Kimi K2 (FP8, 128x128 block scales), GLM-4.6 (BF16), Qwen3.5-397B-A17B (BF16,
   experts fused per layer), MiniMax-M2 (FP8) and gpt-oss-120b (MXFP4) as sparse files and
   runs `turboquant plan` on each (a subprocess): parameters, source bytes, coded weights,
   verdict, seconds.
2. Writes a slice of each with full-size tensors (the first layer, the last, and an expert
   layer; the first 8 routed experts where mlx-lm's sanitize reads a subset, all of them
   otherwise) with random codes, converts it in a subprocess with `--no-prefect`
   and reports the largest peak RSS of any process in its tree (a job's worker), read
   from /proc every 0.1 s. DeepSeek-V3.1's
   slice also as BF16 (the peer a BF16 release would be). Each slice is deleted after.

    python benchmarks/published.py                  # both parts
    python benchmarks/published.py --skip-slice     # plans only (seconds)
    python benchmarks/published.py --slices GLM-4.6,MiniMax-M2
    python benchmarks/published.py --skip-plan --slices Qwen3.5-397B-A17B --sparse

CPU machine; RSS is what bounds the conversion of the whole release.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from published_checkpoints import LAYOUTS, write_layout  # noqa: E402

RECIPES = {"Kimi-K2": "deepseek_v2"}  # kimi_k2 is DeepSeek-V3's architecture
# release -> (layers: the first, an expert layer, the last; routed experts kept: the first 8
# where mlx-lm's sanitize reads a subset (DeepSeek-V3's), else all of them)
SLICES = {"DeepSeek-V3.1": ([0, 3, 60], 8), "Kimi-K2": ([0, 1, 60], 8),
          "GLM-4.6": ([0, 91], None), "MiniMax-M2": ([0, 61], None),
          "gpt-oss-120b": ([0, 35], None), "Qwen3.5-397B-A17B": ([0, 59], None)}


def _turboquant(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turboquant", *args], capture_output=True,
                          text=True, check=False)


def plans(root: Path, memory_gb: float) -> None:
    print(f"{'release':<19}{'parameters':>12}{'source':>12}{'coded':>11}  verdict"
          f"{'plan s':>14}")
    for name in LAYOUTS:
        src = write_layout(root / name, name)
        args = ["plan", str(src), "--json", "--memory-gb", str(memory_gb)]
        if name in RECIPES:
            args += ["--recipe", RECIPES[name]]
        t0 = time.perf_counter()
        r = _turboquant(*args)
        wall = time.perf_counter() - t0
        if r.returncode not in (0, 1):
            print(f"{name}: plan failed: {r.stderr.strip()}")
            continue
        d = json.loads(r.stdout)
        shutil.rmtree(src)
        print(f"{name:<19}{d['source']['parameters'] / 1e9:>11.3f}B"
              f"{d['source']['bytes'] / 1e9:>9.2f} GB{d['weights'] / 1e9:>8.2f} GB  "
              f"{d['verdict']:<10}{d['seconds']:>6.2f} ({wall:.1f} with the process start)")


def _tree(root: int) -> list[int]:
    """root and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def run_peak(cmd: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    """Runs `cmd`; the largest peak RSS (VmHWM, KiB) of any process in its tree, read every
    0.1 s. (RUSAGE_CHILDREN misses the job workers: they are the fork server's children.)"""
    peak = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        while proc.poll() is None:
            for pid in _tree(proc.pid):
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak = max(peak, int(line.split()[1]))
                except OSError:
                    pass
            time.sleep(0.1)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak


def slice_rss(root: Path, names: list[str], sparse: bool = False) -> None:
    runs = [(n, False) for n in names]
    if "DeepSeek-V3.1" in names:
        runs.insert(names.index("DeepSeek-V3.1") + 1, ("DeepSeek-V3.1", True))
    for name, bf16 in runs:
        layers, experts = SLICES[name]
        label = name + (" BF16 peer" if bf16 else "")
        src, out = root / "slice", root / "out"
        write_layout(src, name, layers=layers, experts=experts, fill=not sparse, bf16=bf16)
        cmd = [sys.executable, "-m", "turboquant", "convert", str(src), str(out),
               "--no-prefect", "-q"]
        if name in RECIPES:  # a slice of 8 experts: mlx-lm's sanitize cannot read it
            cmd += ["--recipe", RECIPES[name]]
        r, peak_kib = run_peak(cmd)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        shutil.rmtree(src)
        shutil.rmtree(out, ignore_errors=True)
        if r.returncode != 0:
            print(f"{label}: convert failed: {r.stderr.strip()[-2000:]}")
            continue
        lines = r.stdout.strip().splitlines()
        speed = next((x.strip() for x in lines if x.strip().startswith("time:")), "")
        kept = (f", first {experts} experts" if experts else ", all experts") + \
            (", zeros (sparse)" if sparse else "")
        print(f"{label:<24} layers {','.join(map(str, layers))}{kept}: source "
              f"{size / 1e9:.2f} GB, peak RSS {peak_kib / 1024:.0f} MiB; {speed}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory-gb", type=float, default=512)
    p.add_argument("--skip-slice", action="store_true")
    p.add_argument("--skip-plan", action="store_true")
    p.add_argument("--slices", default=",".join(SLICES),
                   help="comma-separated releases whose slice to convert")
    p.add_argument("--sparse", action="store_true",
                   help="slices of zeros left as holes (no disk for the source)")
    a = p.parse_args(argv)
    print("reproduce: python " + " ".join(["benchmarks/published.py", *(argv or sys.argv[1:])]))
    with tempfile.TemporaryDirectory(prefix="tq-published-") as tmp:
        if not a.skip_plan:
            plans(Path(tmp), a.memory_gb)
            print(flush=True)
        if not a.skip_slice:
            slice_rss(Path(tmp), a.slices.split(","), a.sparse)
    return 0


if __name__ == "__main__":
    sys.exit(main())
