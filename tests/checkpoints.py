"""Write small synthetic Hugging Face checkpoints: dense (Llama-shaped) and MoE.

The files are what a real Hub repo holds: `config.json` (one mlx-lm can instantiate),
safetensors shards (with `model.safetensors.index.json` when sharded, or one
`model.safetensors`), and a tiny byte-level tokenizer. Weights are random (seeded), written
one tensor at a time through a streaming safetensors writer, so a checkpoint of billions of
parameters can be generated without holding it in memory.

    write_llama_checkpoint(path, layers=2, hidden=64, intermediate=128, heads=4,
                           kv_heads=2, vocab=320, dtype="bfloat16", shards=2)
    write_moe_checkpoint(path, style="qwen3_moe", layers=2, hidden=64, intermediate=32,
                         experts=4, ...)

Used by the pipeline's tests, the runtime's tests and benchmarks/convert.py.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

# safetensors dtype tag, bytes per element, for the dtypes a checkpoint may use.
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32",
            "f32": "float32", "BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _dtype(name: str) -> str:
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return name


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode_values(x: np.ndarray, dtype: str) -> bytes:
    """float32 values -> the little-endian bytes of `dtype`."""
    dtype = _dtype(dtype)
    if dtype == "bfloat16":
        return float32_to_bf16_bits(x).tobytes()
    return np.ascontiguousarray(x, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


# --------------------------------------------------------------------------- safetensors


@dataclass
class TensorSpec:
    """One tensor to write: float32 values from `fill(start, count)` (flat element range)."""

    name: str
    shape: tuple[int, ...]
    fill: Callable[[int, int], np.ndarray]
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[_dtype(self.dtype)][1]


def safetensors_header(tensors: list[TensorSpec], metadata: dict | None = None) -> bytes:
    """The 8-byte length plus the JSON header (space-padded to 8 bytes) for `tensors`."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": DTYPES[_dtype(t.dtype)][0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_header_shards(path: str | os.PathLike, shards: list, itemsize: dict, *,
                        metadata: dict | None = None, write_data=None) -> tuple[dict, int]:
    """Safetensors files with exact headers whose data is a hole (sparse: full size, no
    disk) unless `write_data(f, name, dtype, shape)` writes it. `shards`: [(file name,
    [(tensor, dtype tag, shape), ...])]. Returns (weight map, bytes of tensor data)."""
    weight_map, total = {}, 0
    for file, group in shards:
        header, off = ({"__metadata__": metadata} if metadata else {}), 0
        for name, dtype, shape in group:
            n = math.prod(shape) * itemsize[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(Path(path) / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            if write_data is not None:
                for name, dtype, shape in group:
                    write_data(f, name, dtype, shape)
            f.truncate(8 + len(raw) + off)
        total += off
    return weight_map, total


def write_safetensors(
    path: str | os.PathLike,
    tensors: list[TensorSpec],
    metadata: dict | None = None,
    chunk_elements: int = 1 << 22,
) -> int:
    """Stream `tensors` into a safetensors file, `chunk_elements` values at a time.

    Returns the file size. Memory stays at one chunk whatever the tensor sizes.
    """
    path = Path(path)
    with open(path, "wb") as f:
        f.write(safetensors_header(tensors, metadata or {"format": "pt"}))
        for t in tensors:
            for start in range(0, t.numel, chunk_elements):
                n = min(chunk_elements, t.numel - start)
                values = np.asarray(t.fill(start, n), dtype=np.float32).reshape(-1)
                if values.size != n:
                    raise ValueError(f"fill for {t.name} returned {values.size} values, wanted {n}")
                f.write(encode_values(values, t.dtype))
    return path.stat().st_size


# --------------------------------------------------------------------------- value sources


def random_fill(seed: int, name: str, std: float, mean: float = 0.0):
    """Seeded N(mean, std^2) values; each chunk is drawn from its own stream (stable)."""
    key = int.from_bytes(name.encode()[:16].ljust(16, b"\0"), "little") ^ (len(name) << 7)

    def fill(start: int, count: int) -> np.ndarray:
        rng = np.random.default_rng([seed, key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF, start])
        out = rng.standard_normal(count, dtype=np.float32)
        out *= np.float32(std)
        if mean:
            out += np.float32(mean)
        return out

    return fill


class PoolFill:
    """Fast pseudo-random values for huge checkpoints: slices of one random pool.

    Drawing billions of normals costs minutes; slicing a 32M-value pool at a per-tensor
    offset costs a copy, and the values are still Gaussian (what the codec's timing and
    error depend on).
    """

    def __init__(self, seed: int = 0, size: int = 1 << 25, std: float = 0.02):
        self.pool = np.random.default_rng(seed).standard_normal(size, dtype=np.float32) * std
        self.size = size

    def __call__(self, name: str, mean: float = 0.0):
        offset = (sum(name.encode()) * 7919) % self.size

        def fill(start: int, count: int) -> np.ndarray:
            idx = (offset + start) % self.size
            if idx + count <= self.size:
                out = self.pool[idx : idx + count].copy()
            else:
                out = np.resize(np.roll(self.pool, -idx), count)
            if mean:
                out += np.float32(mean)
            return out

        return fill


# --------------------------------------------------------------------------- checkpoints


def shard_names(shards: int) -> list[str]:
    if shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]


def split_into_shards(tensors: list[TensorSpec], shards: int) -> list[list[TensorSpec]]:
    """Consecutive groups of roughly equal bytes (every shard gets at least one tensor)."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if shards > len(tensors):
        raise ValueError(f"{shards} shards for only {len(tensors)} tensors")
    total = sum(t.nbytes for t in tensors)
    groups: list[list[TensorSpec]] = [[] for _ in range(shards)]
    acc, last = 0, 0
    for i, t in enumerate(tensors):
        k = min(shards - 1, int(acc * shards / max(total, 1)), last + 1)
        k = max(k, last, shards - (len(tensors) - i))  # leave a tensor for each later shard
        groups[k].append(t)
        acc, last = acc + t.nbytes, k
    return groups


def write_checkpoint(
    path: str | os.PathLike,
    config: dict,
    tensors: list[TensorSpec],
    *,
    shards: int = 1,
    index: bool | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write config.json, the shards (and the index when sharded), and a tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = shard_names(shards)
    groups = split_into_shards(tensors, shards)
    weight_map: dict[str, str] = {}
    total = 0
    for name, group in zip(names, groups):
        write_safetensors(path / name, group)
        for t in group:
            weight_map[t.name] = name
            total += t.nbytes
    if index if index is not None else shards > 1:
        with open(path / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer and config.get("vocab_size", 0) >= 259:
        write_tokenizer(path, config["vocab_size"])
        config = {**config, "bos_token_id": 256, "eos_token_id": 257}
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return path


def write_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) plus <s>, </s>, <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    if vocab_size < 259:
        raise ValueError("a byte-level tokenizer needs vocab_size >= 259")
    alphabet = ByteLevel.alphabet()
    # GPT-2 byte order: printable bytes map to themselves, so ids are stable and readable
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    chat = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "model_max_length": 4096,
                "chat_template": chat,
            },
            f,
            indent=2,
        )
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f, indent=2)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 256, "eos_token_id": 257}, f, indent=2)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class _Tensors:
    """Collects TensorSpecs with random (or pool) values."""

    def __init__(self, dtype: str, seed: int, pool: PoolFill | None):
        self.dtype, self.seed, self.pool = _dtype(dtype), seed, pool
        self.specs: list[TensorSpec] = []

    def add(self, name: str, *shape: int, std: float = 0.02, mean: float = 0.0) -> None:
        if self.pool is not None and mean == 0.0:
            fill = self.pool(name)
        else:
            fill = random_fill(self.seed, name, std, mean)
        self.specs.append(TensorSpec(name, tuple(shape), fill, self.dtype))

    def norm(self, name: str, n: int) -> None:
        self.add(name, n, std=0.05, mean=1.0)

    def linear(self, prefix: str, out: int, inp: int, bias: bool = False) -> None:
        self.add(f"{prefix}.weight", out, inp, std=1.0 / math.sqrt(inp))
        if bias:
            self.add(f"{prefix}.bias", out, std=0.02)


def llama_config(
    *, layers, hidden, intermediate, heads, kv_heads, vocab, model_type="llama",
    head_dim=None, tie_word_embeddings=False, dtype="bfloat16", **extra,
) -> dict:
    head_dim = head_dim or hidden // heads
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
                          .get(model_type, "LlamaForCausalLM")],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": _dtype(dtype),
    }
    if model_type == "qwen2":
        cfg["attention_bias"] = True  # informative; Qwen2 always has q/k/v biases
    cfg.update(extra)
    return cfg


def write_llama_checkpoint(
    path: str | os.PathLike,
    *,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 320,
    dtype: str = "bfloat16",
    shards: int = 2,
    model_type: str = "llama",
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    index: bool | None = None,
    tokenizer: bool = True,
    seed: int = 0,
    fast_random: bool = False,
    extra_tensors: Iterable[tuple[str, tuple[int, ...]]] = (),
) -> Path:
    """A dense decoder checkpoint in Hugging Face layout.

    model_type "llama"/"mistral" (plain), "qwen2" (q/k/v biases), "qwen3" (q/k norms).
    `fast_random` fills big tensors from a shared random pool (for benchmarks).
    `extra_tensors` adds (name, shape) tensors the architecture does not have (for tests of
    unmatched names).
    """
    head_dim = head_dim or hidden // heads
    t = _Tensors(dtype, seed, PoolFill(seed) if fast_random else None)
    t.add("model.embed_tokens.weight", vocab, hidden, std=0.02)
    for i in range(layers):
        p = f"model.layers.{i}"
        t.norm(f"{p}.input_layernorm.weight", hidden)
        qkv_bias = model_type == "qwen2"
        t.linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden, bias=qkv_bias)
        t.linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden, bias=qkv_bias)
        t.linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden, bias=qkv_bias)
        t.linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim)
        if model_type == "qwen3":
            t.norm(f"{p}.self_attn.q_norm.weight", head_dim)
            t.norm(f"{p}.self_attn.k_norm.weight", head_dim)
        t.norm(f"{p}.post_attention_layernorm.weight", hidden)
        t.linear(f"{p}.mlp.gate_proj", intermediate, hidden)
        t.linear(f"{p}.mlp.up_proj", intermediate, hidden)
        t.linear(f"{p}.mlp.down_proj", hidden, intermediate)
    t.norm("model.norm.weight", hidden)
    if not tie_word_embeddings:
        t.linear("lm_head", vocab, hidden)
    for name, shape in extra_tensors:
        t.add(name, *shape)
    cfg = llama_config(
        layers=layers, hidden=hidden, intermediate=intermediate, heads=heads,
        kv_heads=kv_heads, vocab=vocab, model_type=model_type, head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype,
    )
    return write_checkpoint(path, cfg, t.specs, shards=shards, index=index, tokenizer=tokenizer)


MOE_STYLES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "gpt_oss")


def write_moe_checkpoint(
    path: str | os.PathLike,
    *,
    style: str = "qwen3_moe",
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 32,
    experts: int = 4,
    experts_per_tok: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 320,
    dtype: str = "bfloat16",
    shards: int = 2,
    shared_intermediate: int | None = None,
    dense_intermediate: int | None = None,
    first_dense_layers: int = 0,
    index: bool | None = None,
    tokenizer: bool = True,
    seed: int = 0,
    fast_random: bool = False,
) -> Path:
    """A Mixture-of-Experts checkpoint in one of the Hugging Face layouts.

    - "qwen3_moe": mlp.experts.E.{gate,up,down}_proj, router mlp.gate, q/k norms;
    - "qwen2_moe": as above plus mlp.shared_expert.* and mlp.shared_expert_gate, qkv biases;
    - "mixtral": block_sparse_moe.experts.E.w1/w2/w3, router block_sparse_moe.gate;
    - "deepseek_v2": MLA attention (q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj),
      mlp.experts.E.*, mlp.shared_experts.*, router mlp.gate; the first
      `first_dense_layers` layers have a dense MLP;
    - "gpt_oss": fused stacked experts mlp.experts.gate_up_proj (E, hidden, 2*inter,
      gate/up interleaved) and down_proj (E, inter, hidden) with biases, router
      mlp.router (weight and bias), attention sinks; the BF16 layout.
    `intermediate` is the per-expert size.
    """
    if style not in MOE_STYLES:
        raise ValueError(f"style must be one of {MOE_STYLES}, got {style!r}")
    head_dim = hidden // heads
    shared_intermediate = shared_intermediate or intermediate * 2
    dense_intermediate = dense_intermediate or intermediate * 4
    t = _Tensors(dtype, seed, PoolFill(seed) if fast_random else None)
    t.add("model.embed_tokens.weight", vocab, hidden, std=0.02)
    for i in range(layers):
        p = f"model.layers.{i}"
        t.norm(f"{p}.input_layernorm.weight", hidden)
        if style == "deepseek_v2":
            kv_lora, rope_d, nope_d, v_d = 32, 8, head_dim, head_dim
            t.linear(f"{p}.self_attn.q_proj", heads * (nope_d + rope_d), hidden)
            t.linear(f"{p}.self_attn.kv_a_proj_with_mqa", kv_lora + rope_d, hidden)
            t.norm(f"{p}.self_attn.kv_a_layernorm.weight", kv_lora)
            t.linear(f"{p}.self_attn.kv_b_proj", heads * (nope_d + v_d), kv_lora)
            t.linear(f"{p}.self_attn.o_proj", hidden, heads * v_d)
        else:
            bias = style in ("qwen2_moe", "gpt_oss")
            t.linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden, bias=bias)
            t.linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden, bias=bias)
            t.linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden, bias=bias)
            t.linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim, bias=style == "gpt_oss")
            if style == "qwen3_moe":
                t.norm(f"{p}.self_attn.q_norm.weight", head_dim)
                t.norm(f"{p}.self_attn.k_norm.weight", head_dim)
            if style == "gpt_oss":
                t.add(f"{p}.self_attn.sinks", heads, std=0.5)
        t.norm(f"{p}.post_attention_layernorm.weight", hidden)
        if style == "deepseek_v2" and i < first_dense_layers:
            t.linear(f"{p}.mlp.gate_proj", dense_intermediate, hidden)
            t.linear(f"{p}.mlp.up_proj", dense_intermediate, hidden)
            t.linear(f"{p}.mlp.down_proj", hidden, dense_intermediate)
            continue
        if style == "mixtral":
            t.linear(f"{p}.block_sparse_moe.gate", experts, hidden)
            for e in range(experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                t.linear(f"{q}.w1", intermediate, hidden)
                t.linear(f"{q}.w2", hidden, intermediate)
                t.linear(f"{q}.w3", intermediate, hidden)
        elif style == "gpt_oss":
            t.linear(f"{p}.mlp.router", experts, hidden, bias=True)
            q = f"{p}.mlp.experts"
            t.add(f"{q}.gate_up_proj", experts, hidden, 2 * intermediate, std=hidden**-0.5)
            t.add(f"{q}.gate_up_proj_bias", experts, 2 * intermediate, std=0.02)
            t.add(f"{q}.down_proj", experts, intermediate, hidden, std=intermediate**-0.5)
            t.add(f"{q}.down_proj_bias", experts, hidden, std=0.02)
        else:
            t.linear(f"{p}.mlp.gate", experts, hidden)
            for e in range(experts):
                q = f"{p}.mlp.experts.{e}"
                t.linear(f"{q}.gate_proj", intermediate, hidden)
                t.linear(f"{q}.up_proj", intermediate, hidden)
                t.linear(f"{q}.down_proj", hidden, intermediate)
            if style in ("qwen2_moe", "deepseek_v2"):
                q = f"{p}.mlp.shared_expert" + ("s" if style == "deepseek_v2" else "")
                t.linear(f"{q}.gate_proj", shared_intermediate, hidden)
                t.linear(f"{q}.up_proj", shared_intermediate, hidden)
                t.linear(f"{q}.down_proj", hidden, shared_intermediate)
            if style == "qwen2_moe":
                t.linear(f"{p}.mlp.shared_expert_gate", 1, hidden)
    t.norm("model.norm.weight", hidden)
    t.linear("lm_head", vocab, hidden)
    cfg = _moe_config(
        style, layers=layers, hidden=hidden, intermediate=intermediate, experts=experts,
        experts_per_tok=experts_per_tok, heads=heads, kv_heads=kv_heads, vocab=vocab,
        head_dim=head_dim, shared_intermediate=shared_intermediate,
        dense_intermediate=dense_intermediate, first_dense_layers=first_dense_layers,
        dtype=dtype,
    )
    return write_checkpoint(path, cfg, t.specs, shards=shards, index=index, tokenizer=tokenizer)


def _moe_config(style, *, layers, hidden, intermediate, experts, experts_per_tok, heads,
                kv_heads, vocab, head_dim, shared_intermediate, dense_intermediate,
                first_dense_layers, dtype) -> dict:
    base = {
        "model_type": style,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_experts_per_tok": experts_per_tok,
        "torch_dtype": _dtype(dtype),
    }
    if style == "qwen3_moe":
        base.update(architectures=["Qwen3MoeForCausalLM"], num_experts=experts,
                    moe_intermediate_size=intermediate, intermediate_size=dense_intermediate,
                    decoder_sparse_step=1, mlp_only_layers=[], head_dim=head_dim,
                    norm_topk_prob=True)
    elif style == "qwen2_moe":
        base.update(architectures=["Qwen2MoeForCausalLM"], num_experts=experts,
                    moe_intermediate_size=intermediate, intermediate_size=dense_intermediate,
                    shared_expert_intermediate_size=shared_intermediate,
                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)
    elif style == "mixtral":
        base.update(architectures=["MixtralForCausalLM"], num_local_experts=experts,
                    intermediate_size=intermediate)
    elif style == "deepseek_v2":
        base.update(architectures=["DeepseekV2ForCausalLM"], n_routed_experts=experts,
                    n_shared_experts=max(1, shared_intermediate // intermediate),
                    moe_intermediate_size=intermediate, intermediate_size=dense_intermediate,
                    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                    qk_nope_head_dim=head_dim, v_head_dim=head_dim, topk_method="greedy",
                    first_k_dense_replace=first_dense_layers, moe_layer_freq=1,
                    routed_scaling_factor=1.0, num_key_value_heads=heads,
                    rope_scaling={"type": "yarn", "factor": 1.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 4096})
    elif style == "gpt_oss":
        base.update(architectures=["GptOssForCausalLM"], num_local_experts=experts,
                    intermediate_size=intermediate, head_dim=head_dim, sliding_window=128,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(layers)], rope_theta=150000)
    return base


def checkpoint_parameters(path: str | os.PathLike) -> int:
    """Parameters in a checkpoint folder, from the safetensors headers."""
    total = 0
    for f in Path(path).glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total
