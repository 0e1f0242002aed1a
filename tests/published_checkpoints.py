"""Small checkpoints in the low-precision formats models are published in, and their exact
float32 copies.

`publish(src, dst, copy, fmt)` reads a float32 checkpoint written by tests/checkpoints.py
and writes two checkpoints with the same shards and tensor order:

- `dst`: the published format: FP8 with 128x128 block scales (`fp8-block`, DeepSeek-V3;
  stacked experts `X.experts.gate_up_proj` (E, out, in) get `X_scale_inv` (E, r, c)),
  FP8 E5M2 or E4M3 with per-channel / per-tensor scales and an `input_scale` (`fp8-channel`,
  `fp8-tensor`), MXFP4 stacked experts (`mxfp4`, gpt-oss), or compressed-tensors int4
  pack-quantized (`int4`, Kimi K2 Thinking; stacked experts `X` (E, out, in) get
  `X_packed`, `X_scale`, `X_zero_point`, `X_shape`), with the config's `quantization_config`;
- `copy`: every quantized tensor replaced by its dequantized float32 values, computed here
  independently of turboquant.stages.dequant (ml_dtypes for FP8 and FP4, plain numpy for
  E8M0 and the int4 words).

Scales can go to a shard of their own (`scales_apart`), as partners do in big releases.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from arch_checkpoints import FLAGSHIPS, ITEMSIZE, flagship_tensors
from checkpoints import write_header_shards

FORMATS = ("fp8-block", "fp8-channel", "fp8-tensor", "mxfp4", "int4")
TAGS = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
        np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
        np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2"}
FP8_MAX = {"F8_E4M3": 448.0, "F8_E5M2": 57344.0}
STACKED = (".experts.gate_up_proj", ".experts.down_proj")  # Qwen3.5's fused experts
LINEAR = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
          ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def write_tensors(path: Path, tensors: list[tuple[str, np.ndarray]]) -> None:
    """A safetensors file with the tensors in the given order (no sorting)."""
    header, off = {}, 0
    for name, a in tensors:
        header[name] = {"dtype": TAGS[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a).tobytes())


# --------------------------------------------------------------------------- quantizers


def fp8_block(w: np.ndarray, block=(128, 128), dtype="F8_E4M3"):
    """(codes, scale_inv (ceil(out/b0), ceil(in/b1)) float32, float32 copy)."""
    out_f, in_f = w.shape
    rows, cols = math.ceil(out_f / block[0]), math.ceil(in_f / block[1])
    scale = np.empty((rows, cols), np.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = max(np.abs(blk).max(), 1e-12) / FP8_MAX[dtype]
    full = np.kron(scale, np.ones(block, np.float32))[:out_f, :in_f]
    codes = (w / full).astype(_ml(dtype))
    return codes, scale, codes.astype(np.float32) * full


def fp8_scaled(w: np.ndarray, per_channel: bool, dtype="F8_E5M2"):
    """(codes, scale (out, 1) or (1,) float32, float32 copy)."""
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max().reshape(1)
    scale = (np.maximum(amax, 1e-12) / FP8_MAX[dtype]).astype(np.float32)
    codes = (w / (scale if per_channel else scale[0])).astype(_ml(dtype))
    return codes, scale, codes.astype(np.float32) * (scale if per_channel else scale[0])


def _ml(dtype: str):
    return {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}[dtype]


def mxfp4(w: np.ndarray):
    """w (..., n) with n % 32 == 0 -> (blocks (..., n/32, 16) U8, scales (..., n/32) U8,
    float32 copy (..., n))."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.maximum(np.abs(g).max(axis=-1), 2.0 ** -100)
    exp = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127).astype(np.int32)
    fp4 = (g / (2.0 ** exp)[..., None]).astype(ml_dtypes.float4_e2m1fn)
    nib = fp4.view(np.uint8) & 0x0F
    blocks = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    scales = (exp + 127).astype(np.uint8)
    copy = fp4.astype(np.float32) * np.power(2.0, scales.astype(np.float64) - 127)[..., None]
    return blocks, scales, copy.astype(np.float32).reshape(w.shape)


def int4_pack(w: np.ndarray, group: int = 32, zero_point: bool = False):
    """(packed (out, in/8) I32, scale (out, in/group) BF16, zero point or None, copy)."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    if zero_point:
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        scale = np.maximum(hi - lo, 1e-8) / 15.0
    else:
        scale = np.maximum(np.abs(g).max(axis=-1), 1e-8) / 7.0
    scale = scale.astype(ml_dtypes.bfloat16)
    s32 = scale.astype(np.float32)
    zp = np.clip(np.round(-8 - lo / s32), -8, 7).astype(np.int32) if zero_point else None
    q = np.round(g / s32[..., None]) + (zp[..., None] if zero_point else 0)
    q = np.clip(q, -8, 7).astype(np.int64).reshape(out_f, in_f)
    packed = _pack8(q)
    zpk = None
    if zero_point:
        zpk = _pack8(np.pad(zp, ((0, -out_f % 8), (0, 0))).T.astype(np.int64)).T.copy()
    deq = (q.reshape(out_f, in_f // group, group) - (zp[..., None] if zero_point else 0))
    copy = (deq.astype(np.float32) * s32[..., None]).reshape(out_f, in_f)
    return packed, scale, zpk, copy


def _pack8(q: np.ndarray) -> np.ndarray:
    """(rows, n) ints in [-8, 7] -> (rows, n / 8) int32: value j at bits 4j, stored q + 8."""
    u = (q + 8).astype(np.uint64).reshape(q.shape[0], -1, 8)
    words = np.zeros(u.shape[:2], np.uint64)
    for j in range(8):
        words |= u[..., j] << np.uint64(4 * j)
    return words.astype(np.uint32).view(np.int32)


# --------------------------------------------------------------------------- checkpoints


def publish(src: Path, dst: Path, copy: Path, fmt: str, *, scales_apart: bool = False,
            block=(128, 128), fp8_dtype: str | None = None, zero_point: bool = False,
            config_key: str = "quantization_config") -> None:
    """Write `dst` (published) and `copy` (its exact float32 copy) from float32 `src`;
    `config_key` "compression_config" is how older compressed-tensors releases name it."""
    assert fmt in FORMATS, fmt
    src, dst, copy = Path(src), Path(dst), Path(copy)
    for d in (dst, copy):
        d.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if p.suffix != ".safetensors" and p.name not in ("model.safetensors.index.json",
                                                               "config.json"):
                shutil.copy(p, d / p.name)
    config = json.loads((src / "config.json").read_text())
    files = sorted(p.name for p in src.glob("*.safetensors"))
    wm_pub, wm_copy, apart = {}, {}, []
    for f in files:
        pub, cp = [], []
        for name, w in load_file(src / f).items():  # written in order by tests/checkpoints.py
            parts, dq = _quantize(name, w, fmt, block, fp8_dtype, zero_point)
            if parts is None:
                pub.append((name, w))
                cp.append((name, w))
                continue
            cp.append((name, dq))
            main, *partners = parts
            pub.append(main)
            (apart if scales_apart else pub).extend(partners)
        write_tensors(dst / f, pub)
        write_tensors(copy / f, cp)
        wm_pub.update({n: f for n, _ in pub})
        wm_copy.update({n: f for n, _ in cp})
    if apart:
        name = "scales.safetensors"
        write_tensors(dst / name, apart)
        wm_pub.update({n: name for n, _ in apart})
    for d, wm in ((dst, wm_pub), (copy, wm_copy)):
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": wm}, indent=2))
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    config[config_key] = _quant_config(fmt, block, zero_point)
    (dst / "config.json").write_text(json.dumps(config, indent=2))



def _quantize(name, w, fmt, block, fp8_dtype, zero_point):
    """([(name, codes), partners...], float32 copy), or (None, None) to keep the tensor."""
    if fmt == "mxfp4":
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return None, None
        # stored as the release does: (E, out, in / 32, 16), from the (E, in, out) layout
        blocks, scales, dq = mxfp4(np.ascontiguousarray(w.transpose(0, 2, 1)))
        return [(name + "_blocks", blocks), (name + "_scales", scales)], \
            np.ascontiguousarray(dq.transpose(0, 2, 1))
    if fmt == "fp8-block" and w.ndim == 3 and name.endswith(STACKED):
        # experts stacked (E, out, in), one block grid each: X and X_scale_inv (E, r, c)
        each = [fp8_block(x, block, fp8_dtype or "F8_E4M3") for x in w]
        return [(name, np.stack([c for c, _, _ in each])),
                (name + "_scale_inv", np.stack([s for _, s, _ in each]))], \
            np.stack([d for _, _, d in each])
    if fmt == "int4" and w.ndim == 3 and name.endswith(STACKED):
        # experts stacked (E, out, in) pack-quantized: X_packed, X_scale (E, out, groups),
        # X_zero_point (E, ceil(out / 8), groups), X_shape (E, out, in)
        each = [int4_pack(x, zero_point=zero_point) for x in w]
        parts = [(name + "_packed", np.stack([p for p, _, _, _ in each])),
                 (name + "_scale", np.stack([s for _, s, _, _ in each]))]
        if zero_point:
            parts.append((name + "_zero_point", np.stack([z for _, _, z, _ in each])))
        parts.append((name + "_shape", np.array(w.shape, np.int32)))
        return parts, np.stack([d for _, _, _, d in each])
    if not name.endswith(LINEAR):
        return None, None
    base = name[: -len("weight")]
    if fmt == "fp8-block":
        codes, s, dq = fp8_block(w, block, fp8_dtype or "F8_E4M3")
        return [(name, codes), (base + "weight_scale_inv", s)], dq
    if fmt in ("fp8-channel", "fp8-tensor"):
        codes, s, dq = fp8_scaled(w, fmt == "fp8-channel", fp8_dtype or "F8_E5M2")
        return [(name, codes), (base + "weight_scale", s),
                (base + "input_scale", np.ones(1, np.float32))], dq
    packed, s, zp, dq = int4_pack(w, zero_point=zero_point)
    parts = [(base + "weight_packed", packed), (base + "weight_scale", s)]
    if zp is not None:
        parts.append((base + "weight_zero_point", zp))
    parts.append((base + "weight_shape", np.array(w.shape, np.int32)))
    return parts, dq


def _quant_config(fmt: str, block, zero_point: bool) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    if fmt.startswith("fp8"):
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "symmetric": True,
                    "strategy": "channel" if fmt == "fp8-channel" else "tensor"}}}}
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.embed_tokens",
                                                                    "lm_head"]}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": not zero_point,
                "strategy": "group", "group_size": 32}}}}


# --------------------------------------------------------------------------- flagship layouts
# The big releases (tests/arch_checkpoints.py FLAGSHIPS: names, shapes, dtypes, shard
# counts). `write_layout` writes the headers and leaves the data sparse (zeros, no disk):
# enough for `turboquant plan`. With `layers` and `fill`, a full-size slice with random
# codes that a conversion can read.

LAYOUTS = tuple(FLAGSHIPS)
TAG_SIZE = ITEMSIZE


def layout(name: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of the release, in file order."""
    return [(t, dtype, shape) for t, shape, dtype in flagship_tensors(name)]


def as_bf16(tensors):
    """The same layout as a BF16 release: FP8 weights in BF16, their scales gone."""
    return [(n, "BF16" if d == "F8_E4M3" else d, s) for n, d, s in tensors
            if not n.endswith("_scale_inv")]


def write_layout(path: Path, name: str, *, layers: list[int] | None = None,
                 experts: int | None = None, fill: bool = False, bf16: bool = False,
                 seed: int = 0) -> Path:
    """Header-exact shards of release `name` (data sparse, or random codes with `fill`),
    cut at the release's shard size; with `layers`, only those decoder layers
    (num_hidden_layers unchanged: a slice); with `experts`, only the first routed experts
    of each layer (per-expert tensors; stacked ones stay whole); with `bf16`, FP8 weights
    as BF16 (the peer a BF16 release would be)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config, _, shard_count = FLAGSHIPS[name]
    full = layout(name)
    shard_bytes = -(-sum(math.prod(s) * TAG_SIZE[d] for _, d, s in full) // shard_count)
    tensors = as_bf16(full) if bf16 else full
    if bf16:
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    if experts is not None:
        tensors = [t for t in tensors if not re.search(r"\.experts\.(\d+)\.", t[0])
                   or int(re.search(r"\.experts\.(\d+)\.", t[0]).group(1)) < experts]
    if layers is not None:
        tensors = [t for t in tensors if _layer(t[0]) in (None, *layers)]
        if fill:  # a slice of decoder layers only: the 1 GB embeddings are not its point
            tensors = [t for t in tensors if _layer(t[0]) is not None]
    shards, cur, size = [], [], 0
    for t in tensors:
        nbytes = math.prod(t[2]) * TAG_SIZE[t[1]]
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nbytes
    shards.append(cur)
    names = [f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors" for i in range(len(shards))]
    rng = np.random.default_rng(seed)
    fill_with = (lambda f, t, dtype, shape: _write_random(f, t, dtype, shape, rng)) if fill \
        else None
    wm, total = write_header_shards(path, list(zip(names, shards)), TAG_SIZE,
                                    metadata={"format": "pt"}, write_data=fill_with)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": wm}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _layer(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _write_random(f, name: str, dtype: str, shape, rng) -> None:
    """Random values a few rows at a time: FP8 codes of N(0, 1), scales of 1/(16 sqrt(in)),
    MXFP4 bytes with exponents near 2^-4, BF16 N(0, 0.02) (norms 1)."""
    n = math.prod(shape)
    per = n // shape[0] if len(shape) > 1 else n
    step = max(1, (1 << 22) // max(per, 1))
    for r0 in range(0, shape[0] if len(shape) > 1 else 1, step):
        count = min(step, (shape[0] if len(shape) > 1 else 1) - r0) * per
        if dtype == "F8_E4M3":
            a = rng.standard_normal(count, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
        elif dtype == "F32" and name.endswith("scale_inv"):
            a = np.full(count, 1 / (16 * math.sqrt(128 * shape[1])), np.float32)
        elif dtype == "U8" and name.endswith("_scales"):
            a = rng.integers(121, 125, size=count, dtype=np.uint8)
        elif dtype == "U8":
            a = rng.integers(0, 256, size=count, dtype=np.uint8)
        else:
            v = rng.standard_normal(count, dtype=np.float32) * 0.02
            if name.endswith("norm.weight"):
                v += 1
            a = v.astype(ml_dtypes.bfloat16) if dtype == "BF16" else v
        f.write(a.tobytes())


def main(argv=None) -> int:
    """python tests/published_checkpoints.py RELEASE DIR [--layers 0,3,60] [--experts 8]
    [--fill] [--bf16]"""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("release", choices=LAYOUTS)
    p.add_argument("dir")
    p.add_argument("--layers", help="comma-separated decoder layers (a slice)")
    p.add_argument("--experts", type=int, help="only the first N routed experts (per-expert "
                   "layouts)")
    p.add_argument("--fill", action="store_true", help="random codes instead of sparse zeros")
    p.add_argument("--bf16", action="store_true", help="FP8 weights as BF16, no scales")
    a = p.parse_args(argv)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else None
    write_layout(Path(a.dir), a.release, layers=layers, experts=a.experts, fill=a.fill,
                 bf16=a.bf16)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
