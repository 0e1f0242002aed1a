"""Published releases (FP8, MXFP4) as they are: the plan of each, and the memory of
converting a full-size slice against the same slice published in BF16.

1. Writes the header-exact layouts of DeepSeek-V3.x (FP8, 128x128 block scales), Kimi K2
   (FP8, 384 experts) and gpt-oss-120b (MXFP4) as sparse files and runs `turboquant plan`
   on each (a subprocess): parameters, source bytes, coded weights, verdict, seconds.
2. Writes a DeepSeek-V3 slice with full-size tensors (layers 0, 3 and 60: the first, a MoE
   layer and the last; the first 8 routed experts and the shared one) in FP8 with random
   codes, and the same slice in BF16 (the peer), converts each in a subprocess with
   `--no-prefect` and reports the peak RSS of the largest process (the job's worker).

    python benchmarks/published.py                  # both parts
    python benchmarks/published.py --skip-slice     # plans only (seconds)

CPU machine; RSS is what bounds the conversion of the whole release.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from published_checkpoints import LAYOUTS, write_layout  # noqa: E402

RECIPES = {"kimi_k2": "deepseek_v2"}  # kimi_k2 is DeepSeek-V3's architecture


def _turboquant(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turboquant", *args], capture_output=True,
                          text=True, check=False)


def plans(root: Path, memory_gb: float) -> None:
    print(f"{'release':<14}{'parameters':>14}{'source':>12}{'coded':>11}  verdict"
          f"{'plan s':>14}")
    for name, config in LAYOUTS.items():
        src = write_layout(root / name, config)
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
        print(f"{name:<14}{d['source']['parameters'] / 1e9:>13.3f}B"
              f"{d['source']['bytes'] / 1e9:>9.2f} GB{d['weights'] / 1e9:>8.2f} GB  "
              f"{d['verdict']:<10}{d['seconds']:>6.2f} ({wall:.1f} with the process start)")


# Runs a command and prints the largest RSS (KiB) of any process under it: on Linux a
# process's RUSAGE_CHILDREN ru_maxrss is the largest of the descendants it waited for.
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def slice_rss(root: Path) -> None:
    for label, bf16 in (("FP8", False), ("BF16 peer", True)):
        src = write_layout(root / f"slice-{label[:3]}", LAYOUTS["deepseek_v3"],
                           layers=[0, 3, 60], experts=8, fill=True, bf16=bf16)
        cmd = [sys.executable, "-c", _PEAK, sys.executable, "-m", "turboquant", "convert",
               str(src), str(root / f"out-{label[:3]}"), "--no-prefect", "-q"]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            print(f"{label}: convert failed: {r.stderr.strip()}")
            return
        lines = r.stdout.strip().splitlines()
        peak_kib = int(lines[-1])
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        speed = next((x.strip() for x in lines if x.strip().startswith("time:")), "")
        print(f"{label:<10} source {size / 1e9:.2f} GB: peak RSS {peak_kib / 1024:.0f} MiB; "
              f"{speed}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory-gb", type=float, default=512)
    p.add_argument("--skip-slice", action="store_true")
    a = p.parse_args(argv)
    print("reproduce: python benchmarks/published.py" + (" --skip-slice" if a.skip_slice else "")
          + (f" --memory-gb {a.memory_gb:g}" if a.memory_gb != 512 else ""))
    with tempfile.TemporaryDirectory(prefix="tq-published-") as tmp:
        plans(Path(tmp), a.memory_gb)
        if not a.skip_slice:
            print()
            slice_rss(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
