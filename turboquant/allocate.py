"""`turboquant allocate REPO --target-bits B --out RECIPE.toml`: bits per tensor for a size.

Reads a converted repo's manifest (each coded tensor's `out_error`, shape, group size and
stored bytes), predicts each tensor's out_error at the other candidate bit widths with the
codec's distortion on a rotated Gaussian, and gives bits greedily, the largest predicted
drop per extra byte first, until the repo's bits per weight (every stored byte: codes,
scales, in_scales and 16-bit tensors, as the convert summary and `verify` count them)
reaches B without passing it. Writes the repo's recipe plus a `[tensor_bits]` table;
`turboquant convert SRC OUT --recipe RECIPE.toml` then converts with those bits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _choices(text: str) -> list[int]:
    try:
        bits = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        bits = []
    if len(bits) < 2 or any(b not in (2, 3, 4) for b in bits):
        raise argparse.ArgumentTypeError(f"{text!r}: give two or more of 2, 3, 4, e.g. 3,4")
    return bits


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant allocate",
        description="Choose bits per tensor for a size: from a converted repo's out_error "
        "(the manifest's data-free loss proxy), spend a bits-per-weight budget where the "
        "predicted output error drops most per byte, and write a recipe for "
        "`turboquant convert SRC OUT --recipe RECIPE.toml`.",
        epilog="Example: turboquant convert SRC tq3 --bits 3 --embeddings-bits 3 "
        "--protect-layers 0; turboquant allocate tq3 --target-bits 3.5 --out r.toml; "
        "turboquant convert SRC tq35 --recipe r.toml. Measured on SmolLM2-135M "
        "(docs/quality.md, \"Choosing bits per tensor\"): trimming a 4-bit repo it chose "
        "better than cutting one class; adding bits to a 3-bit one it did no better than "
        "the recipe's own rule (4-bit embedding, first and last layers).")
    p.add_argument("repo", help="a TurboQuant repo folder converted by this turboquant (its "
                   "manifest records out_error)")
    p.add_argument("--target-bits", type=float, required=True, metavar="B",
                   help="bits per weight of the whole repo, scales and 16-bit tensors "
                   "included (the result is at most B, short of it by less than one "
                   "tensor's step)")
    p.add_argument("--choices", type=_choices, default=[3, 4], metavar="3,4",
                   help="bit widths a tensor may get (default 3,4; with 2 the summed "
                   "out_error stops predicting the loss: measured far worse)")
    p.add_argument("--out", required=True, metavar="RECIPE.toml",
                   help="the recipe file to write: the repo's recipe plus [tensor_bits]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from turboquant.pipeline.allocate import AllocateError, allocate_repo, class_table, to_toml

    try:
        a = allocate_repo(args.repo, args.target_bits, args.choices)
    except AllocateError as e:
        print(f"turboquant allocate: error: {e}", file=sys.stderr)
        return 2
    a.recipe["description"] = (f"{a.recipe.get('description', '')} Bits per tensor by "
                               f"turboquant allocate {args.repo} --target-bits "
                               f"{args.target_bits:g}.").strip()
    Path(args.out).write_text(to_toml(a.recipe))
    print(f"{args.repo}: {len(a.candidates)} tensors allocated over "
          f"{','.join(map(str, args.choices))} bits; predicted out_error by class:")
    print("\n".join(class_table(a)))
    print(f"bits/w {a.bits_per_weight:.3f} (target {args.target_bits:g}); wrote {args.out}: "
          f"turboquant convert SRC OUT --recipe {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
