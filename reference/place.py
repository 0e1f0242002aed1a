"""Place the models that reference/train.py wrote into reference/models/.

    .venv/bin/python reference/place.py SRC        # SRC holds dense/ moe/ [train.log]

For each of SRC/dense and SRC/moe: copies the safetensors shards, unpacks the
small JSON files that travelled inside meta.json (config.json,
generation_config.json, model.safetensors.index.json), adds the tokenizer files
from reference/tokenizer/, writes training_metrics.json and a model card
README.md. With mlx-lm installed it also evaluates each model with MLX
(reference/mlx_eval.py) and records that in the card.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = {"dense": "pystd-dense", "moe": "pystd-moe"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _arch_lines(cfg: dict, m: dict) -> list[str]:
    lines = [
        f"- `{cfg['architectures'][0]}` (`model_type: {cfg['model_type']}`), {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} query heads / {cfg['num_key_value_heads']} "
        f"KV heads (GQA), head_dim {cfg['head_dim']}, RoPE theta {cfg['rope_theta']:g}, RMSNorm, SwiGLU, "
        f"tied input/output embeddings, vocabulary {cfg['vocab_size']}.",
    ]
    if cfg["model_type"] == "qwen3_moe":
        lines.append(
            f"- Mixture of experts in every layer: {cfg['num_experts']} experts, top-{cfg['num_experts_per_tok']} "
            f"routing with normalised top-k weights, moe_intermediate_size {cfg['moe_intermediate_size']}, "
            "no shared expert; QK-norm as in Qwen3. Experts are stored one tensor per expert and projection "
            "(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`), as on the Hub."
        )
        lines.append(f"- Parameters: {m['params']:,} total, {m['params_active_per_token']:,} active per token.")
    else:
        lines.append(f"- MLP intermediate size {cfg['intermediate_size']}.")
        lines.append(f"- Parameters: {m['params']:,} ({m['params_non_embedding']:,} without the embedding).")
    lines.append(
        "- Every linear layer's input dimension is a multiple of 64, so group-64 quantization applies to all of them."
    )
    return lines


def model_card(name: str, cfg: dict, m: dict, mlx: dict | None) -> str:
    moe = cfg["model_type"] == "qwen3_moe"
    tags = ["python", "code", "tiny", "reference-model", "turboquant", "safetensors", "mlx",
            "moe" if moe else "dense", cfg["model_type"]]
    size_mb = m["export_bytes"] / 1e6
    mlx_rows = ""
    if mlx:
        mlx_rows = (
            f"| heldout.txt, first {mlx['chunks']} rows of {mlx['seq']} tokens, MLX (mlx-lm, CPU, float32) "
            f"| {mlx['heldout_txt_loss']:.4f} | {math.exp(mlx['heldout_txt_loss']):.2f} |\n"
        )
    samples = (mlx or {}).get("samples") or [m.get("sample_greedy") or ""]
    shown = "\n".join(f"```python\n{t.rstrip()}\n```\n" for t in samples)
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
{chr(10).join('- ' + t for t in tags)}
---

# {name}

A tiny {'Mixture-of-Experts (Qwen3-MoE)' if moe else 'dense Llama-architecture'} language model of Python source
code, trained from scratch by the TurboQuant project as a **reference model**: a small but real model on which
quantizers can be compared (random weights cannot tell a good quantizer from a bad one). It is not meant for
any other use.

- Weights: Apache-2.0 (the project's license). Training data: the CPython standard library, PSF-2.0.
- Format: bfloat16 safetensors ({len(m['shards'])} shard(s), {size_mb:.1f} MB), Hugging Face layout;
  loads with `transformers` (`AutoModelForCausalLM`) and with `mlx_lm.load`.

## Architecture

{chr(10).join(_arch_lines(cfg, m))}

## Data

The `*.py` files of the CPython {m.get('cpython', '3.11')} standard library (test suite included; `site-packages`,
`encodings/`, `pydoc_data/`, build configuration and non-UTF-8 files excluded), split by file with a stable hash
of the relative path: about 2 % of the files are held out and never trained on (`reference/split.json` lists
both sides and states the rule). {m['train_tokens']:,} training tokens. Byte-level BPE tokenizer, vocabulary
8192, trained on the training split only; `<|endoftext|>` (id 0) separates files and is BOS/EOS, `<|pad|>` is 1.

## Training

AdamW (betas 0.9/0.95, weight decay {m['weight_decay']}), peak learning rate {m['lr']:g} with {m['warmup']}
warm-up steps and a cosine decay to {m['lr_min']:g}, gradient clipping 1.0, bf16 autocast over float32 master
weights, batch {m['batch']} x {m['seq_len']} tokens, {m['steps']:,} steps = {m['tokens_seen']:,} tokens
({m['epochs']} epochs), {m['wall_time_s']:.0f} s on one {m['versions']['device']}
(torch {m['versions']['torch']}, transformers {m['versions']['transformers']}).
{'Router load-balancing loss coefficient 0.01.' if moe else ''}

| loss (nats/token) | value | perplexity |
| --- | --- | --- |
| train, mean of the last 100 steps | {m['final_train_loss_last100']:.4f} | {math.exp(m['final_train_loss_last100']):.2f} |
| train split, {m['heldout_tokens_eval']:,} tokens sampled, exported weights | {m['train_split_eval_loss']:.4f} | {math.exp(m['train_split_eval_loss']):.2f} |
| held-out split, all {m['heldout_tokens_eval']:,} tokens in rows of {m['seq_len']}, exported weights (torch) | {m['heldout_loss']:.4f} | {m['heldout_ppl']:.2f} |
| heldout.txt, all rows (torch) | {m['heldout_txt_loss']:.4f} | {math.exp(m['heldout_txt_loss']):.2f} |
| heldout.txt, first {m['heldout_txt_first_chunks']} rows of {m['seq_len']} tokens (torch) | {m['heldout_txt_loss_first_chunks']:.4f} | {math.exp(m['heldout_txt_loss_first_chunks']):.2f} |
{mlx_rows}
Greedy continuations, 64 tokens (`reference/mlx_eval.py`, MLX, float32); tiny greedy models loop:

{shown}
## Reproduce

```bash
.venv/bin/python reference/corpus.py          # tokenizer, split, heldout.txt, .refdata/*.npy
python3 reference/train.py --data .refdata --out OUT   # on a CUDA machine with torch + transformers
.venv/bin/python reference/place.py OUT       # this folder
.venv/bin/python reference/mlx_eval.py        # MLX check
```

GPU training is not bitwise reproducible; the corpus, split and tokenizer are.
"""


def place(src: Path, dest_root: Path, names: list[str], run_mlx: bool) -> dict:
    results = {}
    for key in names:
        name = NAMES[key]
        s = src / key
        meta = json.loads((s / "meta.json").read_text())
        d = dest_root / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        for f in sorted(s.glob("*.safetensors")):
            shutil.copyfile(f, d / f.name)
        for fname, text in meta["files"].items():
            (d / fname).write_text(text)
        for fname in TOKENIZER_FILES:
            shutil.copyfile(HERE / "tokenizer" / fname, d / fname)
        m = meta["metrics"]
        m["cpython"] = json.loads((HERE / "split.json").read_text())["source"].split()[1]
        mlx = None
        if run_mlx:
            sys.path.insert(0, str(HERE))
            import mlx_eval as ev

            model, tok = ev.load_f32(d)
            ids = ev.heldout_ids(d)
            loss = ev.heldout_loss(model, ids, m["heldout_txt_first_chunks"])
            mlx = {"heldout_txt_loss": round(loss, 5), "chunks": m["heldout_txt_first_chunks"], "seq": ev.SEQ,
                   "samples": [p + ev.greedy(model, tok, p, 64) for p in (ev.PROMPT, ev.CODE_PROMPT)]}
            m["mlx"] = mlx
            print(f"{name}: MLX heldout.txt[:{mlx['chunks']}] {loss:.5f} vs torch {m['heldout_txt_loss_first_chunks']:.5f}")
        (d / "training_metrics.json").write_text(json.dumps(m, indent=1) + "\n")
        cfg = json.loads((d / "config.json").read_text())
        (d / "README.md").write_text(model_card(name, cfg, m, mlx))
        results[name] = m
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--dest", type=Path, default=HERE / "models")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--no-mlx", action="store_true")
    args = ap.parse_args(argv)
    place(args.src, args.dest, args.models.split(","), not args.no_mlx)
    log = args.src / "train.log"
    if log.exists():
        shutil.copyfile(log, HERE / "train.log")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
