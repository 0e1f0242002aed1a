"""Tiny synthetic checkpoints and a second, independent TurboQuant repo writer (runtime tests).

The writer follows docs/FORMAT.md on its own (codec from turboquant.stages, files with
mlx / pyarrow / json), so the runtime is checked against the written contract, not just
against the pipeline's reading of it. The tests at the bottom check the writer itself.

Checkpoints are built from mlx-lm's own model classes with random weights and renamed to
the Hugging Face layout (experts one by one: `mlp.experts.E.up_proj`,
`block_sparse_moe.experts.E.w1`), stored in bf16 like the real thing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import pyarrow as pa
import pyarrow.parquet as pq
from mlx.utils import tree_flatten

from turboquant.stages import decode, encode, rotation_key, tensor_seed

VOCAB = 300  # 256 byte tokens + specials, padded

CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=96, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        vocab_size=VOCAB, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=48, rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=10000.0,
        tie_word_embeddings=False, max_position_embeddings=512, norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=40, shared_expert_intermediate_size=64, rms_norm_eps=1e-6,
        vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(  # biased q/k/v
        model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(  # q/k norms
        model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}

_MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def model_class(config: dict):
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def make_checkpoint(kind: str, seed: int = 0, **overrides) -> tuple[dict, dict[str, mx.array]]:
    """(config, HF-named bf16 weights) of a tiny random model of mlx-lm's `kind` architecture."""
    config = {**CONFIGS[kind], **overrides}
    model_cls, args_cls = model_class(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {}
    for name, v in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):  # norms start at ones: make them matter
            v = 1.0 + 0.1 * mx.random.normal(v.shape)
        elif name.endswith(".bias"):
            v = 0.1 * mx.random.normal(v.shape)
        weights.update(_hf_names(name, v))
    return config, {k: v.astype(mx.bfloat16) for k, v in weights.items()}


def _hf_names(name: str, v: mx.array) -> dict[str, mx.array]:
    m = re.match(r"(.*)\.switch_mlp\.(\w+)\.(weight|bias)$", name)
    if not m:
        return {name: v}
    prefix, proj, kind = m.groups()
    if prefix.endswith("block_sparse_moe"):
        proj = _MIXTRAL[proj]
    return {f"{prefix}.experts.{e}.{proj}.{kind}": v[e] for e in range(v.shape[0])}


def default_codec(name: str, v: mx.array, bits) -> str | int:
    """A plain recipe: 2-D weights quantized at `bits`, norms, routers and biases raw."""
    if v.ndim != 2 or not name.endswith(".weight"):
        return "raw"
    if "norm" in name or re.search(r"(mlp|block_sparse_moe)\.gate\.weight$", name):
        return "raw"
    if name.endswith("shared_expert_gate.weight"):
        return "raw"
    return bits


@dataclass
class Written:
    path: Path
    config: dict
    weights: dict[str, mx.array]  # source tensors
    quantized: dict[str, object] = field(default_factory=dict)  # name -> QuantizedTensor

    def decoded_weights(self) -> dict[str, mx.array]:
        """Source weights with every quantized one replaced by its decode (float32)."""
        out = dict(self.weights)
        for name, qt in self.quantized.items():
            out[name] = decode(qt)
        return out


def write_tokenizer(out: Path, chat_template: bool = True) -> None:
    """A byte-level BPE tokenizer (no merges) that encodes any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 512,
    }
    if chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


_DT = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}


def write_repo(
    out: Path,
    config: dict,
    weights: dict[str, mx.array],
    *,
    bits=4,
    group_size: int = 64,
    codec=None,
    model_seed: int = 0,
    num_shards: int = 2,
    drop: tuple[str, ...] = (),
    extra: dict[str, mx.array] | None = None,
) -> Written:
    """Write a TurboQuant repo (docs/FORMAT.md, version 1) for `weights` into `out`.

    `codec(name, tensor) -> "raw" | 2 | 3 | 4 | "ternary"` picks each tensor's codec
    (default: `default_codec` at `bits`; `bits="raw"` keeps everything in 16 bits).
    `drop` leaves tensors out and `extra` adds raw tensors, consistently in shards, index
    and manifest, to make repos the model cannot load.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pick = codec or (lambda n, v: default_codec(n, v, bits) if bits != "raw" else "raw")
    source = {k: v for k, v in weights.items() if k not in drop}
    source.update(extra or {})
    names = list(source)
    written = Written(out, config, dict(weights))

    per_shard = -(-len(names) // num_shards)
    shard_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    rows, stored_by_shard = [], [dict() for _ in range(num_shards)]
    for i, name in enumerate(names):
        v, shard = source[name], i // per_shard
        c = pick(name, v)
        row = dict(
            name=name, source_name=name, source_shard="model.safetensors",
            shape=list(v.shape), source_dtype=_DT[v.dtype], shard=shard_names[shard],
            codec="raw", bits=None, group_size=None, seed=None, padded_in=None, rel_mse=None,
            layer=_layer(name), expert=_expert(name),
        )
        if c == "raw":
            stored = {name: v}
            row["bits_per_weight"] = 8.0 * v.nbytes / v.size
        else:
            seed = tensor_seed(model_seed, rotation_key(name))
            qt = encode(v, c, group_size, seed=seed)
            written.quantized[name] = qt
            base = name[: -len(".weight")]
            stored = {f"{base}.tq_codes": qt.codes, f"{base}.tq_scales": qt.scales}
            w32, d = v.astype(mx.float32), decode(qt)
            row.update(
                codec="ternary" if c == "ternary" else "turboquant",
                bits=None if c == "ternary" else c, group_size=group_size, seed=seed,
                padded_in=qt.spec.padded_in, bits_per_weight=qt.bits_per_weight,
                rel_mse=(mx.sum((w32 - d) ** 2) / mx.sum(w32**2)).item(),
            )
        row["_stored"] = list(stored)
        stored_by_shard[shard].update(stored)
        rows.append(row)

    weight_map, total = {}, 0
    for shard, tensors in zip(shard_names, stored_by_shard):
        mx.save_safetensors(str(out / shard), tensors, metadata={"format": "turboquant"})
        header, data_start = _header(out / shard)
        blob = (out / shard).read_bytes()
        for row in rows:
            if row["shard"] != shard:
                continue
            spans = [header[t]["data_offsets"] for t in row.pop("_stored")]
            row["byte_start"] = data_start + min(s for s, _ in spans)
            row["byte_end"] = data_start + max(e for _, e in spans)
            row["checksum"] = hashlib.sha256(blob[row["byte_start"] : row["byte_end"]]).hexdigest()
        for t, meta in header.items():
            weight_map[t] = shard
            total += meta["data_offsets"][1] - meta["data_offsets"][0]

    index = {
        "metadata": {"total_size": total, "format": "turboquant", "format_version": 1},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _write_manifest(out / "manifest.parquet", rows)

    overrides = {
        r["name"][: -len(".weight")] if r["name"].endswith(".weight") else r["name"]: (
            {"codec": "raw"} if r["codec"] == "raw"
            else {"bits": r["bits"] or "ternary", "group_size": group_size}
        )
        for r in rows
        if r["codec"] == "raw" or (r["bits"] or "ternary") != bits
    }
    cfg = dict(config)
    cfg["quantization_config"] = {
        "quant_method": "turboquant", "format_version": 1, "recipe": "test",
        "recipe_hash": "0" * 64, "model_seed": model_seed,
        "bits": bits if bits != "raw" else None, "group_size": group_size,
        "overrides": overrides,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out)
    return written


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _layer(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _expert(name: str) -> int | None:
    m = re.search(r"\.experts\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _write_manifest(path: Path, rows: list[dict]) -> None:
    schema = pa.schema([
        ("name", pa.string()), ("source_name", pa.string()), ("source_shard", pa.string()),
        ("shape", pa.list_(pa.int64())), ("source_dtype", pa.string()), ("codec", pa.string()),
        ("bits", pa.int8()), ("group_size", pa.int32()), ("seed", pa.uint64()),
        ("padded_in", pa.int64()), ("shard", pa.string()), ("byte_start", pa.int64()),
        ("byte_end", pa.int64()), ("checksum", pa.string()), ("rel_mse", pa.float64()),
        ("bits_per_weight", pa.float64()), ("layer", pa.int32()), ("expert", pa.int32()),
    ])  # fmt: skip
    table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema)
    pq.write_table(table, path)


def decoded_from_repo(path: Path) -> Written:
    """Any TurboQuant repo (this writer's or the pipeline's) read back with the codec alone:
    source-named weights, quantized ones decoded. Uses only the format, not the runtime."""
    from turboquant.stages import QuantizedTensor, QuantSpec

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    arrays = {}
    for f in sorted(path.glob("*.safetensors")):
        arrays.update(mx.load(str(f)))
    written = Written(path, config, {})
    for r in pq.read_table(path / "manifest.parquet").to_pylist():
        if r["codec"] == "raw":
            written.weights[r["name"]] = arrays[r["name"]]
            continue
        base = r["name"][: -len(".weight")]
        bits = "ternary" if r["codec"] == "ternary" else r["bits"]
        spec = QuantSpec(bits, r["group_size"], r["seed"], r["shape"][1], r["padded_in"], True)
        qt = QuantizedTensor(
            arrays[f"{base}.tq_codes"], arrays[f"{base}.tq_scales"], tuple(r["shape"]), spec,
            in_scales=arrays[f"{base}.tq_in_scales"] if r.get("in_scales") else None,
        )
        written.quantized[r["name"]] = qt
        written.weights[r["name"]] = decode(qt)
    return written


def reference_model(written: Written, dtype=mx.float32):
    """mlx-lm's own model for the config, loaded with the decoded weights (the oracle)."""
    model_cls, args_cls = model_class(written.config)
    model = model_cls(args_cls.from_dict(written.config))
    weights = {k: v.astype(dtype) for k, v in written.decoded_weights().items()}
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------------------- the writer's tests


def test_writer_follows_the_format(tmp_path):
    config, weights = make_checkpoint("qwen3_moe")
    w = write_repo(tmp_path, config, weights, bits=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    rows = pq.read_table(tmp_path / "manifest.parquet").to_pylist()
    assert index["metadata"]["format_version"] == 1
    assert {r["name"] for r in rows} == set(weights)
    for r in rows:
        blob = (tmp_path / r["shard"]).read_bytes()[r["byte_start"] : r["byte_end"]]
        assert hashlib.sha256(blob).hexdigest() == r["checksum"]
        if r["codec"] != "raw":
            base = r["name"][: -len(".weight")]
            assert index["weight_map"][f"{base}.tq_codes"] == r["shard"]
            assert r["seed"] == tensor_seed(0, rotation_key(r["name"]))
    experts = [r for r in rows if r["expert"] is not None and r["layer"] == 0]
    assert len({r["seed"] for r in experts if r["name"].endswith("up_proj.weight")}) == 1
    assert len(w.quantized) > 0


def test_checkpoint_names_are_hugging_face_names():
    _, weights = make_checkpoint("mixtral")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in weights
    assert not any("switch_mlp" in k for k in weights)


def test_repo_reads_back_with_the_codec_alone(tmp_path):
    config, weights = make_checkpoint("llama")
    written = write_repo(tmp_path, config, weights, bits=2)
    again = decoded_from_repo(tmp_path)
    assert again.weights.keys() == weights.keys()
    for name, w in written.decoded_weights().items():
        assert mx.array_equal(again.decoded_weights()[name], w).item(), name
