"""`turboquant verify REPO`: re-read a TurboQuant repo, check checksums, decode a sample.

With `--source`, the sampled tensors' errors are recomputed against the original weights
and must match the manifest's `rel_mse`, and where the conversion's ledger is still in the
repo each checked tensor's source bytes must match the CRC-32 it recorded; without it, decoded tensors must be finite and the
recorded errors within the codec's bounds. Exit status 0 when everything checks out.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant verify",
        description="Check a TurboQuant repo: structure, per-tensor checksums, and decoded "
        "errors of a sample of tensors.",
    )
    p.add_argument("repo", help="TurboQuant repo folder")
    p.add_argument("--source", help="the source checkpoint folder: recompute errors exactly "
                   "and compare the source CRCs the conversion's ledger recorded")
    p.add_argument("--full", action="store_true", help="decode every coded tensor")
    p.add_argument("--sample", type=int, default=8, help="coded tensors to decode (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from turboquant.pipeline.verify import verify_repo

    report = verify_repo(args.repo, source=args.source, full=args.full, sample=args.sample,
                         seed=args.seed)
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
