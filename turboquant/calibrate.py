"""`turboquant calibrate SRC --text FILE --out STATS`: input statistics from a small text
(or `--from-weights`: estimated from the weights, no text).

Optional, off by default (the converter is data-free): runs the source model (mlx-lm, whole
in memory, float32) over the text and writes each linear layer's input second moments.
`turboquant convert SRC OUT --input-stats STATS` then records each coded tensor's output
error (`out_error`, docs/FORMAT.md), the figure that orders tensors by the loss they cause
(docs/quality.md); the codes are the same bytes with or without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant calibrate",
        description="Measure a model's linear-layer input statistics on a small text (for "
        "`convert --input-stats`); optional: the converter itself uses no data.")
    p.add_argument("source", help="local Hugging Face folder of the model (loaded whole)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--text", help="a UTF-8 text file (a few thousand tokens of the kind of "
                     "text the model will see)")
    how.add_argument("--from-weights", action="store_true", help="no text: estimate the "
                     "inputs' second moments from the weights alone (Llama layout; orders "
                     "tensors about as well here, docs/quality.md)")
    p.add_argument("--out", required=True, help="the statistics file to write (safetensors)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the text to use "
                   "(default 8192)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from turboquant.pipeline.calibrate import from_weights, measure, write_stats

    src = Path(args.source)
    if not (src / "config.json").is_file():
        print(f"turboquant calibrate: error: {src}: no config.json; give a local Hugging Face "
              "model folder", file=sys.stderr)
        return 2
    text = None if args.from_weights else Path(args.text)
    try:
        if text is None:
            stats = from_weights(src)
        else:
            stats = measure(src, text.read_text(encoding="utf-8"), args.tokens, args.seq)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        where = "" if text is None else f"{text}: "
        print(f"turboquant calibrate: error: {where}{e}", file=sys.stderr)
        return 2
    write_stats(args.out, stats)
    source = (f"estimated from the weights of {src}" if text is None
              else f"over {stats.meta['tokens']} tokens of {text}")
    print(f"{args.out}: input statistics of {len(stats.energy)} tensors {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
