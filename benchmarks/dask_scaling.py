"""Conversion on Dask: 1 worker process against 2, on the same checkpoint, in the same run.

Writes a synthetic Llama-shaped bf16 checkpoint (about 300 MB in 8 shards, random Gaussian
weights) and converts it with the Prefect flow, one job per shard:

- the peer: the flow's own process pool (`--workers 1`, no Dask);
- on a local Dask cluster started for the run (`--dask-workers 1`, then `2`);
- on an existing, warm Dask cluster (`--dask-address`, 1 worker, then 2): the "existing
  engine" case, where the workers have imported Prefect and MLX already.

Each is run `--repeat` times into a fresh folder (the best is kept), every output checked
byte-identical to the first. The Prefect API server is started once, before the timed
runs. Three times are reported: the wall time of the call; the run's own time (planning to
repo files; Prefect's flow start and end, about 1 s, left out: its heartbeat thread is
joined on a 1-second sleep); and the jobs' span (first job started to last job done, from
the run's events.jsonl), the part that more workers divide. The rest (planning, the
cluster's start and stop, the repo files) is fixed.

    python benchmarks/dask_scaling.py                   # prints and writes results/dask.txt
    python benchmarks/dask_scaling.py --layers 4 --repeat 1

Scaling is bounded by the cores: this machine has 2, so 2 workers can at best halve the
jobs' span. Times count only on the machine they were measured on (and its load, printed
with each run); the speedups are the claim.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def jobs_span(out: Path) -> float:
    """Seconds from the first job's start to the last job's end, from events.jsonl."""
    lines = (out / ".turboquant" / "events.jsonl").read_text().splitlines()
    events = [json.loads(x) for x in lines]
    starts = [e["t"] for e in events if e["event"] in ("job_start", "job_resume")]
    ends = [e["t"] for e in events if e["event"] == "job_done"]
    return max(ends) - min(starts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dask.txt"))
    ap.add_argument("--workdir", help="where the checkpoint and outputs go (default: a "
                    "temporary folder, deleted at the end)")
    args = ap.parse_args()

    from turboquant.pipeline.flow_env import configure_prefect_env

    configure_prefect_env()
    from checkpoints import write_llama_checkpoint
    from distributed import LocalCluster

    from turboquant.pipeline.convert import ConvertOptions
    from turboquant.pipeline.distributed import _quiet, cluster_kwargs
    from turboquant.pipeline.flow import run_convert_flow

    base = Path(args.workdir or tempfile.mkdtemp(prefix="tq-dask-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    _quiet()
    try:
        src = write_llama_checkpoint(base / "src", layers=args.layers, hidden=1024,
                                     intermediate=2816, heads=16, kv_heads=4, vocab=16000,
                                     dtype="bfloat16", shards=args.shards, fast_random=True)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))

        def run(name: str, **kw) -> tuple[float, float, float]:
            out = base / name
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            s = run_convert_flow(ConvertOptions(str(src), str(out), min_job_bytes=0,
                                                progress=False, **kw))
            return time.monotonic() - t0, s.seconds, jobs_span(out)

        run("warmup", workers=1)  # starts Prefect's API server, warms the page cache
        reference = snapshot(base / "warmup")
        with LocalCluster(**cluster_kwargs(1)) as c1, LocalCluster(**cluster_kwargs(2)) as c2:
            configs = [("process pool, 1 worker (no Dask)", {"workers": 1}),
                       ("Dask, new local cluster, 1 worker", {"dask_workers": 1}),
                       ("Dask, new local cluster, 2 workers", {"dask_workers": 2}),
                       ("Dask, existing cluster, 1 worker", {"dask_address": c1.scheduler_address}),
                       ("Dask, existing cluster, 2 workers",
                        {"dask_address": c2.scheduler_address})]
            for _, kw in configs[3:]:
                run("warm-cluster", **kw)  # the workers import Prefect, MLX, turboquant
            best: dict[str, tuple[float, ...]] = {}
            for rep in range(args.repeat):
                for i, (label, kw) in enumerate(configs):
                    times = run(f"out-{i}", **kw)
                    assert snapshot(base / f"out-{i}") == reference, f"{label}: other bytes"
                    best[label] = tuple(map(min, zip(best.get(label, times), times)))
                    print(f"  run {rep + 1}: {label}: {times[0]:.2f} s, run {times[1]:.2f} s, "
                          f"jobs {times[2]:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)

    labels = [c[0] for c in configs]
    lines = [
        f"Dask scaling: {size / 1e6:.0f} MB bf16 checkpoint ({args.layers} layers, hidden "
        f"1024, {args.shards} shards = {args.shards} jobs), {os.cpu_count()} CPU cores, "
        f"best of {args.repeat}; load average at the end {os.getloadavg()[0]:.1f}",
        "",
        f"{'configuration':<36} {'wall s':>7} {'run s':>6} {'MB/s':>6} {'jobs s':>7}",
    ]
    for label in labels:
        wall, own, span = best[label]
        lines.append(f"{label:<36} {wall:>7.2f} {own:>6.2f} {size / 1e6 / own:>6.0f} "
                     f"{span:>7.2f}")

    def ratio(a: str, b: str, k: int) -> float:
        return best[a][k] / best[b][k]

    lines += [
        "",
        f"speedup 2 workers vs 1, new local cluster: {ratio(labels[1], labels[2], 1):.2f}x "
        f"run, {ratio(labels[1], labels[2], 2):.2f}x jobs",
        f"speedup 2 workers vs 1, existing cluster:  {ratio(labels[3], labels[4], 1):.2f}x "
        f"run, {ratio(labels[3], labels[4], 2):.2f}x jobs",
        f"Dask, 1 worker, vs the process pool: {ratio(labels[1], labels[0], 1):.2f}x the run "
        f"time (new cluster), {ratio(labels[3], labels[0], 1):.2f}x (existing cluster)",
        "(MB/s: source bytes over the run's own time)",
        "every output byte-identical to a single-process conversion",
        "",
        f"reproduce: python benchmarks/dask_scaling.py --layers {args.layers} "
        f"--shards {args.shards} --repeat {args.repeat}",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
