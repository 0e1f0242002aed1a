"""Encode's speed on the chunks a conversion job codes: each weight width of the common
model shapes, 4 bits, group 64, random column scales (W / t, as the recipe's column rule
codes it), chunks of rows as the job cuts them, one thread. Against another tree (the peer
'before', e.g. `git worktree add /tmp/old REV`) in a process of its own, alternating.

    python benchmarks/encode_chunks.py --old-tree /tmp/old --rounds 3

Prints ns a weight per width and tree (the best of each round, then the median of the
rounds) and the ratio old / new. The older tree runs through a PYTHONPATH package
assembled from its folders (convert_column_scales.old_package); a tree whose job module
has no `_scalar_chunk_rows` cuts CHUNK_ELEMENTS // width rows, as its jobs did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WIDTHS = (2048, 3072, 4096, 5632, 8192, 11008, 14336)  # hidden and MLP widths of 1-70B
CHILD = r"""
import json, sys, time
import numpy as np
from turboquant.pipeline import job
from turboquant.stages import encode
rows_of = getattr(job, "_scalar_chunk_rows", lambda n: max(1, job.CHUNK_ELEMENTS // n))
out = {}
for n in json.loads(sys.argv[1]):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((rows_of(n), n)).astype(np.float32)
    t = np.exp(rng.normal(0.0, 0.3, n)).astype(np.float16)
    for _ in range(3):
        encode(x, 4, 64, seed=7, in_scales=t)
    best, reps = float("inf"), max(4, (1 << 23) // x.size)
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            encode(x, 4, 64, seed=7, in_scales=t)
        best = min(best, (time.perf_counter() - t0) / reps / x.size * 1e9)
    out[n] = [x.shape[0], best]
print(json.dumps(out))
"""


def run_tree(env: dict, widths: list[int]) -> dict[int, tuple[int, float]]:
    res = subprocess.run([sys.executable, "-P", "-c", CHILD, json.dumps(widths)], env=env,
                         capture_output=True, text=True, check=True)
    return {int(k): tuple(v) for k, v in json.loads(res.stdout.splitlines()[-1]).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-tree", type=Path, help="another tree's root (the peer 'before')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    trees = {"this tree": dict(os.environ)}
    if args.old_tree:
        from convert_column_scales import old_package

        pkg = old_package(args.old_tree.resolve(), Path(tempfile.mkdtemp(prefix="tq-enc-")))
        trees["old tree"] = dict(os.environ, PYTHONPATH=str(pkg))
    seen: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            seen[name].append(run_tree(trees[name], widths))
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{n} {seen[name][-1][n][1]:.2f}" for n in widths), flush=True)
    print("\n| width | rows a chunk | " + " | ".join(f"{n} ns/w" for n in trees)
          + (" | old / new |" if len(trees) > 1 else " |"))
    print("|---:|---:|" + "---:|" * len(trees) + ("---:|" if len(trees) > 1 else ""))
    for n in widths:
        med = {name: statistics.median(s[n][1] for s in seen[name]) for name in trees}
        rows = " / ".join(str(seen[name][0][n][0]) for name in trees)
        line = f"| {n} | {rows} | " + " | ".join(f"{med[name]:.2f}" for name in trees)
        if len(trees) > 1:
            line += f" | {med['old tree'] / med['this tree']:.2f}x"
        print(line + " |")
    print(f"\nreproduce: python benchmarks/encode_chunks.py --rounds {args.rounds}"
          + (f" --old-tree {args.old_tree}" if args.old_tree else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
