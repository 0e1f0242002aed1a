"""GPU time per decode token, by kernel, from `ncu --print-summary per-kernel --csv` output.

`tools/steady_token_profile.sh ncu` (device_check.sh ncu-steady) writes one CSV per variant
for the steady tokens of `launch_cost.py` (4 tokens of an 8-layer cut: TQ_PROFILER_RANGE
brackets them). This prints, per kernel, microseconds a token (invocations x average /
tokens), largest first, and the total.

    python tools/ncu_summary.py OUT/ncu-kv-k4v3.csv [--tokens 4]
"""

from __future__ import annotations

import argparse
import csv
import re


def rows(path: str) -> list[dict]:
    """The CSV's kernel rows (ncu prints its log lines before them)."""
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    return list(csv.DictReader(lines))


def per_token(rows: list[dict], tokens: int) -> list[tuple[float, str, str, int, float]]:
    """(us a token, kernel, grid, invocations, us each), largest first."""
    out = []
    for r in rows:
        n, avg_ns = int(r["Invocations"]), float(r["Average"].replace(",", ""))
        name = re.sub(r"\(.*", "", r["Kernel Name"])
        out.append((n * avg_ns / tokens / 1e3, name, r["Grid Size"], n, avg_ns / 1e3))
    return sorted(out, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--tokens", type=int, default=4, help="steady tokens the run profiled")
    args = ap.parse_args()
    for path in args.csv:
        table = per_token(rows(path), args.tokens)
        print(f"== {path}")
        for us, name, grid, n, each in table:
            print(f"{us:8.1f} us/token  {n:4d} x {each:7.1f} us  grid {grid:14s} {name[:72]}")
        print(f"total GPU time a token: {sum(t[0] for t in table):.1f} us")


if __name__ == "__main__":
    main()
