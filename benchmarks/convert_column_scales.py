"""What the column-scales pre-pass costs the converter: `turboquant convert` of this tree
(the default recipe: column_scales = "auto") against the same command of another tree
(e.g. the commit before, `git archive REV | tar -x -C DIR`) and of this tree with
`--column-scales off`, alternating (the order rotates every round), on the same synthetic
bf16 checkpoint as benchmarks/convert.py, the source read once before each run.

    python benchmarks/convert_column_scales.py --shapes 1.1b --rounds 2 --old-tree /tmp/old

Prints each run's wall and CPU seconds (the process tree's, sampled every 50 ms: on a
loaded machine the CPU seconds compare, the wall times less) and per variant the median
and its ratio to this tree's default. The older tree runs through a PYTHONPATH package
assembled from its folders (the editable install maps this tree's; `python -P` keeps the
working directory, which may hold this tree's `turboquant/`, off the path).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import (SHAPES, load, make_checkpoint, measure, warm_numba_cache,  # noqa: E402
                     warm_page_cache)

FOLDERS = ("kernels", "manifests", "pipeline", "runtime", "stages")


def old_package(tree: Path, into: Path) -> Path:
    """A `turboquant` package of another tree's folders (symlinks), for PYTHONPATH."""
    pkg = into / "turboquant"
    if not pkg.exists():
        shutil.copytree(tree / "turboquant", pkg)
        for d in FOLDERS:
            (pkg / d).symlink_to(tree / d)
        (pkg / "bundled").symlink_to(tree / "reference" / "models")
    return into


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1.1b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old-tree", type=Path, help="another tree's root (the peer 'before')")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tq-colscales-"))
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    print(warm_numba_cache(env), flush=True)
    variants = {"auto": ([], env), "off": (["--column-scales", "off"], env)}
    if args.old_tree:
        pkg = old_package(args.old_tree.resolve(), work / "old-pkg")
        old_env = dict(env, PYTHONPATH=str(pkg))
        warm_numba_cache(old_env)
        variants["before"] = ([], old_env)
    for shape in args.shapes.split(","):
        src = work / shape
        made = not (src / "config.json").exists()  # a checkpoint found there is kept
        if made:
            make_checkpoint(src, SHAPES[shape])
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        names = list(variants)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for v in order:
                extra, e = variants[v]
                out = work / f"{shape}-{v}"
                shutil.rmtree(out, ignore_errors=True)
                warm_page_cache(src)
                cmd = [sys.executable, "-P", "-m", "turboquant", "convert", str(src), str(out),
                       "--bits", "4", "--group-size", "64", *extra]
                m = measure(cmd, e)
                runs[v].append(m)
                print(f"{shape} round {r + 1} {v:>6}: {m['seconds']:.1f} s wall, "
                      f"{m['cpu']:.1f} CPU s, peak RSS {m['peak_rss'] / 2**20:.0f} MiB; {load()}",
                      flush=True)
                shutil.rmtree(out, ignore_errors=True)
        base_w = statistics.median(m["seconds"] for m in runs["auto"])
        base_c = statistics.median(m["cpu"] for m in runs["auto"])
        print(f"\n| {shape} | wall s (median) | CPU s (median) | this / auto (wall, CPU) |")
        print("|---|---:|---:|---:|")
        for v, ms in runs.items():
            w = statistics.median(m["seconds"] for m in ms)
            c = statistics.median(m["cpu"] for m in ms)
            print(f"| {v} | {w:.1f} | {c:.1f} | {w / base_w:.3f} / {c / base_c:.3f} |")
        print("(this / auto >= 0.91: the default's column scales cost at most 10%)")
        if made:
            shutil.rmtree(src, ignore_errors=True)
    print("\nreproduce: python benchmarks/convert_column_scales.py " + " ".join(
        sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
