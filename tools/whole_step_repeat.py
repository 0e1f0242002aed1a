"""The whole step against the per-layer step, repeated in one process: which rows of the
first layer's K/V cache differ from mlx-lm's cache, and whether they are all zeros (a row
the in-place store never wrote). Written for the intermittent `[llama-launch]` failure of
`tests/test_kernels_cuda_attend.py` (the two-launch merge, `cuda_attend.MERGE = "launch"`):
on the H200 run it for both merges and compare.

    python tools/whole_step_repeat.py --merge launch --runs 12 --json OUT/launch.jsonl
    python tools/whole_step_repeat.py --tiny --runs 1 --steps 20   # CPU smoke run

Each run: a 3-layer Llama of random TQ3 weights (decode.py's builder) decodes `--steps`
greedy tokens per layer, then the same tokens fed through the whole step; one JSON line a
run (the differing rows of keys and values, at most 40 named, and the seconds it took).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from turboquant.kernels import cuda_attend  # noqa: E402
from turboquant.runtime import whole_step  # noqa: E402

SMALL = dict(num_hidden_layers=3, hidden_size=1024, intermediate_size=2048,
             num_attention_heads=16, num_key_value_heads=4, vocab_size=1024)
PROMPT = list(range(1, 40))


def decode_with(model, whole: bool, steps: int, forced=None):
    """Greedy tokens (or `forced` ones fed in) after PROMPT, and the cache."""
    whole_step.WHOLE_STEP = whole
    cache = make_prompt_cache(model)
    logits = model(mx.array([PROMPT]), cache=cache)[:, -1]
    tokens = []
    for i in range(steps):
        y = mx.argmax(logits, axis=-1) if forced is None else mx.array([forced[i]])
        tokens.append(y.item())
        logits = model(y[:, None], cache=cache)[:, -1]
    mx.eval(logits)
    return tokens, cache


def differing_rows(want: mx.array, got: mx.array, rows: int, atol: float = 1e-2) -> dict:
    """Rows 0..rows-1 of two (B, heads, S, D) caches whose largest difference passes
    `atol`: their indices (40 at most), how many, and which of them are all zeros in `got`."""
    a, b = want[:, :, :rows].astype(mx.float32), got[:, :, :rows].astype(mx.float32)
    diff = mx.max(mx.abs(a - b), axis=(0, 1, 3)).tolist()
    peak = mx.max(mx.abs(b), axis=(0, 1, 3)).tolist()
    bad = [i for i, d in enumerate(diff) if d > atol]
    return {"rows": bad[:40], "count": len(bad), "zero_rows": [i for i in bad[:40] if peak[i] == 0]}


def one_run(steps: int) -> dict:
    """The per-layer decode, then the whole step fed its tokens: the first layer's rows."""
    started = time.perf_counter()
    model = decode.build("tq3")
    tokens, layered = decode_with(model, False, steps)
    _, whole = decode_with(model, True, steps, forced=tokens)
    rows = len(PROMPT) + steps
    return {"merge": cuda_attend.MERGE, "offset": whole[0].offset,
            "keys": differing_rows(layered[0].keys, whole[0].keys, rows),
            "values": differing_rows(layered[0].values, whole[0].values, rows),
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--merge", default=cuda_attend.MERGE, choices=["block", "launch"])
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=300, help="decoded tokens a run (past "
                    "mlx-lm's 256 rows and several buffer growths)")
    ap.add_argument("--grow", type=int, default=64, help="whole_step.GROW: rows a growth")
    ap.add_argument("--tiny", action="store_true", help="decode.py's 2-layer model (CPU)")
    ap.add_argument("--json", help="also append each run's line to this file")
    args = ap.parse_args(argv)
    decode.LLAMA3_8B.update(decode.TINY_LLAMA if args.tiny else SMALL)
    whole_step.GROW = args.grow
    cuda_attend.MERGE = args.merge
    for _ in range(args.runs):
        line = json.dumps(one_run(args.steps))
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
