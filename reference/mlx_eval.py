"""Evaluate the reference models with MLX (mlx-lm): held-out loss and a greedy sample.

Protocol (the same as ``reference/train.py``'s torch evaluation): tokenize
``reference/heldout.txt`` with the model's ``tokenizer.json`` (no special
tokens added), cut it into consecutive rows of 512 tokens, and take the mean
next-token negative log-likelihood (nats) of each row as an independent
sequence (inputs ``row[:-1]``, targets ``row[1:]``). Computed in float32:
MLX's CPU ``gather_mm`` (the MoE layers) supports float32 only.

    .venv/bin/python reference/mlx_eval.py [--chunks 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = {"pystd-dense": HERE / "models" / "pystd-dense", "pystd-moe": HERE / "models" / "pystd-moe"}
HELDOUT = HERE / "heldout.txt"
SEQ = 512
PROMPT = "def fibonacci(n):\n"
CODE_PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"


def load_f32(path):
    """mlx_lm.load, then cast every floating parameter to float32."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, tokenizer


def heldout_ids(path: Path, text_path: Path = HELDOUT) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return tok.encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False).ids


def heldout_loss(model, ids: list[int], chunks: int, seq: int = SEQ, batch: int = 4) -> float:
    """Mean NLL (nats/token) over the first ``chunks`` rows of ``seq`` tokens."""
    import mlx.core as mx
    import mlx.nn as nn

    n = min(chunks, len(ids) // seq)
    rows = mx.array(ids[: n * seq], dtype=mx.int32).reshape(n, seq)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        x = rows[i : i + batch]
        logits = model(x[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")
        total += nll.item()
        count += x[:, 1:].size
    return total / count


def greedy(model, tokenizer, prompt: str = PROMPT, max_tokens: int = 64) -> str:
    """Greedy continuation of prompt (argmax; the seed is fixed all the same).

    Decodes the generated ids in one piece: mlx-lm's streaming BPE detokenizer
    drops the leading space of the first generated token, which would eat one
    column of the first line's indentation.
    """
    import mlx.core as mx
    from mlx_lm import stream_generate

    mx.random.seed(0)
    ids = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    return tokenizer.decode(ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    out = {}
    for name, path in MODELS.items():
        model, tok = load_f32(path)
        ids = heldout_ids(path)
        loss = heldout_loss(model, ids, args.chunks)
        sample = greedy(model, tok, PROMPT, args.max_tokens)
        out[name] = {"heldout_txt_loss": round(loss, 5), "heldout_txt_ppl": round(math.exp(loss), 3),
                     "chunks": args.chunks, "seq": SEQ, "sample": PROMPT + sample}
        print(f"== {name}: heldout.txt[:{args.chunks}x{SEQ}] loss {loss:.5f} ppl {math.exp(loss):.3f}")
        print(PROMPT + sample)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
