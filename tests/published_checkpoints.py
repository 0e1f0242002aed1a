"""Small checkpoints in the low-precision formats models are published in, and their exact
float32 copies.

`publish(src, dst, copy, fmt)` reads a float32 checkpoint written by tests/checkpoints.py
and writes two checkpoints with the same shards and tensor order:

- `dst`: the published format: FP8 with 128x128 block scales (`fp8-block`, DeepSeek-V3),
  FP8 E5M2 or E4M3 with per-channel / per-tensor scales and an `input_scale` (`fp8-channel`,
  `fp8-tensor`), MXFP4 stacked experts (`mxfp4`, gpt-oss), or compressed-tensors int4
  pack-quantized (`int4`, Kimi K2 Thinking), with the config's `quantization_config`;
- `copy`: every quantized tensor replaced by its dequantized float32 values, computed here
  independently of turboquant.stages.dequant (ml_dtypes for FP8 and FP4, plain numpy for
  E8M0 and the int4 words).

Scales can go to a shard of their own (`scales_apart`), as partners do in big releases.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

FORMATS = ("fp8-block", "fp8-channel", "fp8-tensor", "mxfp4", "int4")
TAGS = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
        np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
        np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2"}
FP8_MAX = {"F8_E4M3": 448.0, "F8_E5M2": 57344.0}
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
            block=(128, 128), fp8_dtype: str | None = None, zero_point: bool = False) -> None:
    """Write `dst` (published) and `copy` (its exact float32 copy) from float32 `src`."""
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
    config["quantization_config"] = _quant_config(fmt, block, zero_point)
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
