"""tools/smollm2_folder.py: a tiny llama GGUF written by the `gguf` package -> an HF folder
that mlx-lm loads, with the same weights (q/k un-permuted) and a working tokenizer."""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # optional: the `quality` extra

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("smollm2_folder", ROOT / "tools" / "smollm2_folder.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

HIDDEN, FF, LAYERS, HEADS, KV = 64, 96, 2, 4, 2
BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # printable byte-level symbols
VOCAB = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *BYTES, "ab"]


def tiny_weights(rng):
    hd = HIDDEN // HEADS
    w = {"model.embed_tokens.weight": rng.standard_normal((len(VOCAB), HIDDEN)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
              p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
              p + "self_attn.q_proj.weight": rng.standard_normal((HEADS * hd, HIDDEN)),
              p + "self_attn.k_proj.weight": rng.standard_normal((KV * hd, HIDDEN)),
              p + "self_attn.v_proj.weight": rng.standard_normal((KV * hd, HIDDEN)),
              p + "self_attn.o_proj.weight": rng.standard_normal((HIDDEN, HEADS * hd)),
              p + "mlp.gate_proj.weight": rng.standard_normal((FF, HIDDEN)),
              p + "mlp.up_proj.weight": rng.standard_normal((FF, HIDDEN)),
              p + "mlp.down_proj.weight": rng.standard_normal((HIDDEN, FF))}
    return {k: (0.1 * v).astype(np.float32) for k, v in w.items()}


def write_gguf(path: Path, weights: dict) -> None:
    hf_to_gguf = {v: k for k, v in tool.BLOCK_NAMES.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(VOCAB)
    w.add_token_types([3, 3, 3] + [1] * (len(VOCAB) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            g = f"blk.{i}.{hf_to_gguf[rest.rsplit('.', 1)[0]]}.weight"
        else:
            g = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight"}[name]
        if name.endswith("q_proj.weight"):
            t = tool.permute(t, HEADS)
        elif name.endswith("k_proj.weight"):
            t = tool.permute(t, KV)
        w.add_tensor(g, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_names_and_permutation_round_trip():
    assert tool.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert tool.hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert tool.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    np.testing.assert_array_equal(tool.unpermute(tool.permute(w, 3), 3), w)
    assert not np.array_equal(tool.permute(w, 3), w)


def test_tiny_gguf_becomes_a_loadable_folder(tmp_path):
    weights = tiny_weights(np.random.default_rng(0))
    write_gguf(tmp_path / "tiny.gguf", weights)
    out = tool.convert(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == KV and config["tie_word_embeddings"] is True
    got = mx.load(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    for name, w in weights.items():  # F32 tensors come back exactly, q/k un-permuted
        np.testing.assert_array_equal(np.asarray(got[name]), w, err_msg=name)

    from mlx_lm import load

    model, tok = load(str(out))
    ids = tok.encode("<|im_start|>ab!")
    assert ids == [1, VOCAB.index("ab"), VOCAB.index("!")]  # special token, one merge
    assert tok.decode(ids[1:]) == "ab!"
    logits = model(mx.array([ids]))
    assert logits.shape == (1, 3, len(VOCAB)) and mx.isfinite(logits).all().item()
