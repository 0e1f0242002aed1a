"""Rerunning a finished conversion: `turboquant convert SRC OUT` (found finished before
Prefect is imported) against the same rerun through the Prefect flow (what the command
did before: start Prefect and its API, skip every job, rewrite the repo files).

Each measurement is a fresh process; the two alternate, PAIRS times, in one run. Prints
wall and CPU seconds of each and the ratio.

    python benchmarks/convert_noop.py [--pairs 3] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import write_llama_checkpoint  # noqa: E402

FLOW = """
import sys
from turboquant.pipeline.flow_env import configure_prefect_env
configure_prefect_env()
from turboquant.pipeline.convert import ConvertOptions
from turboquant.pipeline.flow import run_convert_flow
s = run_convert_flow(ConvertOptions(sys.argv[1], sys.argv[2], progress=False))
assert s.jobs_run == 0, s.text()
"""


def measure(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one command, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env.update(PREFECT_HOME=str(tmp / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
        src = write_llama_checkpoint(tmp / "src", layers=args.layers, shards=2)
        out = tmp / "out"
        subprocess.run([sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q",
                        "--no-prefect"], env=env, check=True, stdout=subprocess.DEVNULL)
        new_cmd = [sys.executable, "-m", "turboquant", "convert", str(src), str(out), "-q"]
        flow_cmd = [sys.executable, "-c", FLOW, str(src), str(out)]
        rows = {"found before Prefect": [], "through the Prefect flow": []}
        for _ in range(args.pairs):
            rows["through the Prefect flow"].append(measure(flow_cmd, env))
            rows["found before Prefect"].append(measure(new_cmd, env))
    print(f"rerun of a finished conversion ({args.layers}-layer llama, 2 shards), "
          f"{args.pairs} alternate pairs; load average {os.getloadavg()[0]:.1f}")
    for name, runs in rows.items():
        walls = ", ".join(f"{w:.2f}" for w, _ in runs)
        cpus = ", ".join(f"{c:.2f}" for _, c in runs)
        print(f"  {name:26s} wall {walls} s; CPU {cpus} s")
    new, old = rows["found before Prefect"], rows["through the Prefect flow"]
    ratios = sorted(o[0] / n[0] for n, o in zip(new, old))
    print(f"  flow / found-before wall time, per pair: {', '.join(f'{r:.1f}x' for r in ratios)}")
    print(f"reproduce: python benchmarks/convert_noop.py --pairs {args.pairs} "
          f"--layers {args.layers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
