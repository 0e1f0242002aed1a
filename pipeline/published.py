"""Checkpoints as they are published in low precision: pair each weight with its scales.

FP8 (block-scaled `weight_scale_inv`, or `weight_scale` per tensor / per channel), MXFP4
(`*_blocks` + `*_scales`) and compressed-tensors int4 (`weight_packed` + `weight_scale`)
store one weight as several tensors, possibly in different shards. `pair` reads the
headers (and config.json's `quantization_config`) and returns, for every such weight, one
logical float32 tensor that the plan treats like any BF16 one; the partners (scales,
zero points, shapes, FP8 `input_scale`) are read with it and never written. A job reads a
logical tensor a chunk of rows (or one expert) at a time through `PublishedReader`, which
dequantizes with `turboquant.stages.dequant`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from turboquant.stages import dequant

from .errors import SourceError
from .safetensors_io import FLOAT_DTYPES, SafetensorsHeader, TensorInfo, read_raw, to_float32

FP8 = ("F8_E4M3", "F8_E5M2")
DEFAULT_FP8_BLOCK = (128, 128)
GUIDE = "docs/convert.md#published-dtypes"


@dataclass(frozen=True)
class Partner:
    role: str  # "scale", "zero_point", "shape", "input_scale" (read or dropped, never written)
    file: str
    tensor: str


@dataclass(frozen=True)
class Published:
    """One logical float32 weight stored as codes + partners."""

    format: str  # "fp8", "mxfp4", "int4"
    dtype: str  # the codes tensor's safetensors dtype
    file: str
    tensor: str  # the codes tensor
    shape: tuple[int, ...]  # the logical (dequantized) shape
    partners: tuple[Partner, ...]
    block: tuple[int, int] | None = None  # fp8 block grid; int4: (1, group size)
    read_bytes: int = 0  # codes + partners

    @property
    def label(self) -> str:
        """What the manifest's source_dtype says."""
        return {"fp8": self.dtype, "mxfp4": "MXFP4", "int4": "I4"}[self.format]

    def partner(self, role: str) -> Partner | None:
        return next((p for p in self.partners if p.role == role), None)

    @property
    def files(self) -> set[str]:
        return {self.file} | {p.file for p in self.partners}


@dataclass
class Pairing:
    published: dict[str, Published] = field(default_factory=dict)  # logical name -> weight
    partners: set[str] = field(default_factory=set)  # source names read with a weight
    problems: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)  # named in problems: planned no further
    _codes: dict | None = field(default=None, repr=False)  # (file, codes tensor) -> name

    def tensors(self, file: str, header: SafetensorsHeader) -> Iterator[TensorInfo]:
        """The file's tensors as the plan sees them: partners left out, codes tensors
        replaced by their logical float32 tensor (same start; end - start = source bytes)."""
        by_codes = self._by_codes()
        for info in header.tensors.values():
            if info.name in self.partners or info.name in self.refused:
                continue
            name = by_codes.get((file, info.name))
            if name is None:
                yield info
                continue
            pub = self.published[name]
            yield TensorInfo(name, "F32", pub.shape, info.start, info.start + pub.read_bytes)

    def _by_codes(self) -> dict[tuple[str, str], str]:
        if self._codes is None:  # pair() fills `published` before anyone asks
            self._codes = {(p.file, p.tensor): n for n, p in self.published.items()}
        return self._codes

    def source_parameters(self, headers: dict[str, SafetensorsHeader]) -> int:
        """Weights of the model: logical tensors' elements, partners not counted."""
        n = 0
        for f, h in headers.items():
            n += sum(t.numel for t in self.tensors(f, h))
        return n


def pair(headers: dict[str, SafetensorsHeader], config: dict) -> Pairing:
    """Find every published low-precision weight and its partners (metadata only)."""
    where: dict[str, tuple[str, TensorInfo]] = {}
    for f, h in headers.items():
        for name, info in h.tensors.items():
            where.setdefault(name, (f, info))
    qc = _quant_config(config)
    out = Pairing()
    for name, (f, info) in where.items():
        pub = None
        try:
            if info.dtype in FP8 and (name.endswith(".weight") or len(info.shape) == 3):
                pub = _fp8(name, f, info, where, qc)
            elif name.endswith("_blocks") and (info.dtype == "U8" or (
                    len(info.shape) >= 3 and info.shape[-1] == 16)):
                pub = _mxfp4(name, f, info, where)
            elif name.endswith(".weight_packed") or (name.endswith("_packed") and len(
                    info.shape) == 3):  # `X_packed`: experts stacked as Qwen3.5's `X`
                pub = _int4(name, f, info, where, qc)
        except _Refused as e:
            out.problems.append(f"{f}: tensor {name!r} ({info.dtype} {list(info.shape)}): {e}")
            out.refused.add(name)
            continue
        if pub is None:
            continue
        logical = _logical_name(name, pub.format)
        if logical != name and logical in where:
            out.problems.append(f"{f}: tensor {name!r} dequantizes to {logical!r}, which the "
                                f"checkpoint also holds in {where[logical][0]}: keep only one")
            out.refused.add(name)
            continue
        out.published[logical] = pub
        out.partners.update(p.tensor for p in pub.partners)
    for name, (f, info) in where.items():
        if name.endswith(".weight_scale_inv") and name not in out.partners:
            weight = name[: -len("_scale_inv")]
            have = f"is {where[weight][1].dtype}" if weight in where else "is missing"
            out.problems.append(f"{f}: tensor {name!r}: an FP8 block scale whose weight "
                                f"{weight!r} {have}: the checkpoint is incomplete or mixed")
            out.refused.add(name)
        elif name.endswith("_scales") and info.dtype == "U8" and name not in out.partners \
                and name not in out.refused:
            blocks = name[: -len("_scales")] + "_blocks"
            have = "is not MXFP4" if blocks in where else "is missing"
            out.problems.append(f"{f}: tensor {name!r}: MXFP4 scales whose blocks {blocks!r} "
                                f"{have}: the checkpoint is incomplete or mixed")
            out.refused.add(name)
    return out


def _quant_config(config: dict) -> dict:
    qc = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(qc, dict) and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc if isinstance(qc, dict) else {}


class _Refused(Exception):
    pass


def _logical_name(name: str, fmt: str) -> str:
    if fmt == "mxfp4":
        return name[: -len("_blocks")]
    if fmt == "int4":
        return name[: -len("_packed")]
    return name


def _find(where, name: str, role: str) -> tuple[Partner, TensorInfo] | None:
    hit = where.get(name)
    return (Partner(role, hit[0], name), hit[1]) if hit else None


def _fp8(name, f, info, where, qc) -> Published:
    if len(info.shape) == 3:
        return _fp8_stacked(name, f, info, where, qc)
    if len(info.shape) != 2:
        raise _Refused(f"FP8 weights are read as 2-D (out, in) matrices or stacked experts "
                       f"(E, out, in); this one is {len(info.shape)}-D: convert a BF16 copy "
                       "of this tensor's model")
    base = name[: -len("weight")]
    found = _find(where, base + "weight_scale_inv", "scale") or \
        _find(where, base + "weight_scale", "scale")
    if found is None:
        raise _Refused(f"FP8 weight without a {base}weight_scale_inv or {base}weight_scale "
                       "tensor: the checkpoint is incomplete (check its index)")
    scale, sinfo = found
    _check_float(sinfo, scale)
    out_f, in_f = info.shape
    block = None
    if sinfo.numel == 1 or sinfo.shape in ((out_f,), (out_f, 1)):
        pass  # per tensor, per channel
    elif len(sinfo.shape) == 2:
        block = _fp8_grid(qc, scale, sinfo, out_f, in_f)
    else:
        raise _Refused(f"its scale {scale.tensor!r} has shape {list(sinfo.shape)}: neither "
                       "per tensor, per channel nor a 2-D block grid")
    partners = [scale]
    extra = _find(where, base + "input_scale", "input_scale")
    if extra:
        partners.append(extra[0])
    read = info.nbytes + sinfo.nbytes
    return Published("fp8", info.dtype, f, name, tuple(info.shape), tuple(partners), block, read)


def _fp8_grid(qc, scale: Partner, sinfo: TensorInfo, out_f: int, in_f: int):
    """The block size of a block-scaled weight, checked against its scale grid."""
    block = _fp8_block(qc) or DEFAULT_FP8_BLOCK
    grid = (math.ceil(out_f / block[0]), math.ceil(in_f / block[1]))
    if tuple(sinfo.shape[-2:]) != grid:
        raise _Refused(f"its scale {scale.tensor!r} has shape {list(sinfo.shape)}, but "
                       f"{block[0]}x{block[1]} blocks of a {out_f}x{in_f} weight make "
                       f"{list(grid)}: set quantization_config.weight_block_size in "
                       "config.json to the block size the checkpoint used")
    return block


def _fp8_stacked(name, f, info, where, qc) -> Published:
    """Experts stacked (E, out, in) in FP8, `X` with `X_scale_inv` (Qwen3.5 / Mistral 4
    FP8 layout) or `X.weight` with `X.weight_scale_inv`: block scales (E, out / b0,
    in / b1), one scale per expert (E,), (E, 1) or (E, 1, 1), or per channel (E, out),
    (E, out, 1)."""
    found = _find(where, name + "_scale_inv", "scale") or _find(where, name + "_scale", "scale")
    if found is None:
        raise _Refused(f"stacked FP8 experts without {name + '_scale_inv'!r} or "
                       f"{name + '_scale'!r}: the checkpoint is incomplete (check its index)")
    scale, sinfo = found
    _check_float(sinfo, scale)
    e, out_f, in_f = info.shape
    sshape = tuple(sinfo.shape)
    block = None
    if sshape in ((e,), (e, 1), (e, 1, 1), (e, out_f), (e, out_f, 1)):
        pass  # per expert, per channel
    elif len(sshape) == 3 and sshape[0] == e:
        block = _fp8_grid(qc, scale, sinfo, out_f, in_f)
    else:
        raise _Refused(f"its scale {scale.tensor!r} has shape {list(sshape)}: neither per "
                       f"expert, per channel nor a block grid of {e} experts")
    read = info.nbytes + sinfo.nbytes
    return Published("fp8", info.dtype, f, name, tuple(info.shape), (scale,), block, read)


def _fp8_block(qc: dict) -> tuple[int, int] | None:
    b = qc.get("weight_block_size")
    if b is None:  # compressed-tensors: config_groups.*.weights.block_structure
        for g in (qc.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            if w.get("block_structure"):
                b = w["block_structure"]
    if isinstance(b, list) and len(b) == 2 and all(isinstance(v, int) and v > 0 for v in b):
        return (b[0], b[1])
    return None


def _mxfp4(name, f, info, where) -> Published:
    base = name[: -len("_blocks")]
    found = _find(where, base + "_scales", "scale")
    if found is None:
        raise _Refused(f"MXFP4 blocks without {base + '_scales'!r}: the checkpoint is "
                       "incomplete (check its index)")
    scale, sinfo = found
    shape = info.shape
    if info.dtype != "U8" or len(shape) not in (3, 4) or shape[-1] != dequant.MXFP4_BLOCK // 2 \
            or sinfo.dtype != "U8" or tuple(sinfo.shape) != tuple(shape[:-1]):
        raise _Refused(f"MXFP4 blocks are U8 (..., out, groups, 16) with U8 scales "
                       f"(..., out, groups); these are {info.dtype} {list(shape)}, the scales "
                       f"{scale.tensor!r} {sinfo.dtype} {list(sinfo.shape)}: the checkpoint "
                       "is not in the gpt-oss layout")
    in_f = shape[-2] * dequant.MXFP4_BLOCK
    # stacked experts (E, out, G, 16) read as (E, in, out), the layout of the BF16 release
    logical = (shape[0], in_f, shape[1]) if len(shape) == 4 else (shape[0], in_f)
    read = info.nbytes + sinfo.nbytes
    return Published("mxfp4", "U8", f, name, logical, (scale,), None, read)


def _int4(name, f, info, where, qc) -> Published:
    """A pack-quantized int4 weight: `X.weight_packed` (out, in / 8), or experts stacked
    (E, out, in / 8) as `X.weight_packed` or `X_packed`, with `..._scale` (E,) out, groups,
    optional `..._zero_point` (E,) ceil(out / 8), groups and `..._shape`."""
    base = name[: -len("packed")]
    bits = _int_bits(qc)
    if info.dtype != "I32" or len(info.shape) not in (2, 3):
        raise _Refused("pack-quantized weights are I32 (out, in / 8) matrices or stacked "
                       "experts (E, out, in / 8)")
    if bits != 4:
        raise _Refused(f"pack-quantized with {bits}-bit values: only 4-bit is read; convert "
                       "a BF16 copy of the model")
    found = _find(where, base + "scale", "scale")
    if found is None:
        raise _Refused(f"packed int4 weight without {base + 'scale'!r}: the checkpoint is "
                       "incomplete (check its index)")
    scale, sinfo = found
    _check_float(sinfo, scale)
    lead = tuple(info.shape[:-2])  # (E,) for stacked experts
    out_f, in_f = info.shape[-2], info.shape[-1] * 8
    stacked = f"{lead[0]} experts of " if lead else ""
    if len(sinfo.shape) != len(info.shape) or tuple(sinfo.shape[:-2]) != lead \
            or sinfo.shape[-2] != out_f or in_f % sinfo.shape[-1]:
        raise _Refused(f"its scale {scale.tensor!r} has shape {list(sinfo.shape)}; a group "
                       f"scale of {stacked}a {out_f}x{in_f} weight is "
                       f"({'E, ' if lead else ''}out, in / group size)")
    groups = sinfo.shape[-1]
    partners = [scale]
    read = info.nbytes + sinfo.nbytes
    zp = _find(where, base + "zero_point", "zero_point")
    if zp:
        zinfo = zp[1]
        if zinfo.dtype != "I32" or tuple(zinfo.shape) != lead + (math.ceil(out_f / 8), groups):
            raise _Refused(f"its zero point {zp[0].tensor!r} is {zinfo.dtype} "
                           f"{list(zinfo.shape)}; packed int4 zero points are I32 "
                           f"({'E, ' if lead else ''}ceil(out / 8), groups)")
        partners.append(zp[0])
        read += zinfo.nbytes
    shp = _find(where, base + "shape", "shape")
    if shp:
        partners.append(shp[0])
        read += shp[1].nbytes
    return Published("int4", "I32", f, name, lead + (out_f, in_f), tuple(partners),
                     (1, in_f // groups), read)


def _int_bits(qc: dict) -> int:
    for g in (qc.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        if w.get("num_bits"):
            return int(w["num_bits"])
    return 4


def _check_float(sinfo: TensorInfo, p: Partner) -> None:
    if sinfo.dtype not in FLOAT_DTYPES:
        raise _Refused(f"its scale {p.tensor!r} is {sinfo.dtype}; scales are read as BF16, "
                       "F16 or F32")


def attach(item, pub: Published):
    """A plan Item of a logical tensor, marked to be read through its codes and partners."""
    return replace(item, source_dtype=pub.label, published=pub)


def files_of(item) -> set[str]:
    """Every source file an item reads."""
    pub = getattr(item, "published", None)
    return pub.files if pub is not None else {item.piece.file}


# ------------------------------------------------------------------------ reading (jobs)


class PublishedReader:
    """Reads logical tensors from open shards: `fd(file)` opens a shard, `headers` has it."""

    def __init__(self, fd: Callable[[str], int], headers: dict[str, SafetensorsHeader]):
        self.fd = fd
        self.headers = headers
        self._key = None
        self._expert = None

    def _info(self, file: str, tensor: str) -> TensorInfo:
        return self.headers[file].tensors[tensor]

    def _read(self, p: Partner | tuple[str, str], start: int, count: int) -> np.ndarray:
        file, tensor = (p.file, p.tensor) if isinstance(p, Partner) else p
        info = self._info(file, tensor)
        return read_raw(self.fd(file), info, start, count, file)

    def _floats(self, p: Partner, start: int, count: int) -> np.ndarray:
        return to_float32(self._read(p, start, count), self._info(p.file, p.tensor).dtype)

    def rows(self, pub: Published, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of a 2-D logical tensor, float32."""
        if len(pub.shape) != 2:
            raise SourceError(pub.file, f"stacked {pub.format} experts {list(pub.shape)} are "
                              "read one expert at a time: add a [[split]] rule for them",
                              pub.tensor)
        n = r1 - r0
        codes = self._info(pub.file, pub.tensor)
        width = codes.numel // codes.shape[0]
        raw = self._read((pub.file, pub.tensor), r0 * width, n * width)
        scale = pub.partner("scale")
        sinfo = self._info(scale.file, scale.tensor)
        if pub.format == "fp8":
            q = raw.reshape(n, width)
            if pub.block is not None:
                b0, b1 = r0 // pub.block[0], (r1 - 1) // pub.block[0] + 1
                cols = sinfo.shape[1]
                s = self._floats(scale, b0 * cols, (b1 - b0) * cols).reshape(b1 - b0, cols)
                return dequant.dequant_fp8(q, s, pub.dtype, pub.block, r0)
            if sinfo.numel == 1:
                return dequant.dequant_fp8(q, self._floats(scale, 0, 1), pub.dtype)
            return dequant.dequant_fp8(q, self._floats(scale, r0, n), pub.dtype)
        if pub.format == "int4":
            self._check_shape(pub)
            groups = sinfo.shape[1]
            s = self._floats(scale, r0 * groups, n * groups).reshape(n, groups)
            zp = None
            zpart = pub.partner("zero_point")
            if zpart is not None:
                z0, z1 = r0 // 8, (r1 - 1) // 8 + 1
                words = self._read(zpart, z0 * groups, (z1 - z0) * groups).view("<i4")
                zp = dequant.unpack_int4(words.reshape(z1 - z0, groups), axis=0)
                zp = zp[r0 - z0 * 8: r1 - z0 * 8]
            return dequant.dequant_int4(raw.view("<i4").reshape(n, width), s, pub.shape[1], zp)
        # mxfp4, 2-D: (out, G, 16) blocks
        g = sinfo.shape[-1]
        blocks = raw.reshape(n, g, dequant.MXFP4_BLOCK // 2)
        scales = self._read(scale, r0 * g, n * g).reshape(n, g)
        return dequant.dequant_mxfp4(blocks, scales)

    def expert(self, pub: Published, e: int) -> np.ndarray:
        """Expert e of a stacked logical tensor, float32, in the logical layout: (in, out)
        for MXFP4 (gpt-oss), (out, in) for FP8."""
        key = (pub.file, pub.tensor, e)
        if key != self._key:
            self._expert = None  # free before reading the next one
            if pub.format in ("fp8", "int4") and len(pub.shape) == 3:
                read = self._fp8_expert if pub.format == "fp8" else self._int4_expert
                self._expert = read(pub, e)
                self._key = key
                return self._expert
            if pub.format != "mxfp4" or len(pub.shape) != 3:
                raise SourceError(pub.file, f"{pub.format} weights of stacked experts are "
                                  "not read; convert a BF16 copy of the model", pub.tensor)
            codes = self._info(pub.file, pub.tensor)
            _, out_f, g, b = codes.shape
            per = out_f * g * b
            blocks = self._read((pub.file, pub.tensor), e * per, per).reshape(out_f, g, b)
            scale = pub.partner("scale")
            scales = self._read(scale, e * out_f * g, out_f * g).reshape(out_f, g)
            self._key = key
            self._expert = dequant.dequant_mxfp4(blocks, scales).T
        return self._expert

    def _fp8_expert(self, pub: Published, e: int) -> np.ndarray:
        _, out_f, in_f = pub.shape
        q = self._read((pub.file, pub.tensor), e * out_f * in_f, out_f * in_f)
        scale = pub.partner("scale")
        sinfo = self._info(scale.file, scale.tensor)
        per = sinfo.numel // sinfo.shape[0]
        s = self._floats(scale, e * per, per)
        if pub.block is not None:
            s = s.reshape(sinfo.shape[1:])
        return dequant.dequant_fp8(q.reshape(out_f, in_f), s, pub.dtype, pub.block)

    def _int4_expert(self, pub: Published, e: int) -> np.ndarray:
        """Expert e (out, in) of stacked int4 experts: its rows of the codes, scales and
        zero points, nothing of the other experts."""
        self._check_shape(pub)
        _, out_f, in_f = pub.shape
        width = self._info(pub.file, pub.tensor).shape[-1]
        packed = self._read((pub.file, pub.tensor), e * out_f * width, out_f * width)
        scale = pub.partner("scale")
        groups = self._info(scale.file, scale.tensor).shape[-1]
        s = self._floats(scale, e * out_f * groups, out_f * groups).reshape(out_f, groups)
        zp = None
        zpart = pub.partner("zero_point")
        if zpart is not None:
            zrows = math.ceil(out_f / 8)
            zp = self._read(zpart, e * zrows * groups, zrows * groups).view("<i4")
            zp = zp.reshape(zrows, groups)
        return dequant.dequant_int4_expert(packed.view("<i4").reshape(out_f, width), s, in_f,
                                           zp)

    def _check_shape(self, pub: Published) -> None:
        """A `weight_shape` partner agrees with the codes (for stacked experts it may give
        the whole (E, out, in) or one expert's (out, in))."""
        p = pub.partner("shape")
        if p is None:
            return
        info = self._info(p.file, p.tensor)
        raw = self._read(p, 0, info.numel)
        dtype = {4: "<i4", 8: "<i8"}.get(info.itemsize)
        have = tuple(int(v) for v in raw.view(dtype)) if dtype else None
        if have != pub.shape and (len(pub.shape) != 3 or have != pub.shape[1:]):
            raise SourceError(p.file, f"says the weight is {list(have or ())}, but its packed "
                              f"codes and scales make {list(pub.shape)}: only weights whose "
                              "input size is a multiple of 8 are read", p.tensor)


LABELS = ("F8_E4M3", "F8_E5M2", "MXFP4", "I4")  # source_dtype of a published weight


class PublishedFolder:
    """A local published checkpoint's logical tensors, whole (for `verify --source`)."""

    def __init__(self, folder, headers: dict[str, SafetensorsHeader], config: dict):
        self.folder = folder
        self.headers = headers
        self.pairing = pair(headers, config)

    def tensor(self, name: str, expert: int | None = None) -> np.ndarray | None:
        """A 2-D logical tensor, or one expert (in, out) of a stacked one; None if `name`
        is not a published weight."""
        import os

        pub = self.pairing.published.get(name)
        if pub is None:
            return None
        fds: dict[str, int] = {}

        def fd(file: str) -> int:
            if file not in fds:
                fds[file] = os.open(self.folder / file, os.O_RDONLY)
            return fds[file]

        try:
            reader = PublishedReader(fd, self.headers)
            if expert is not None:
                return reader.expert(pub, expert)
            return reader.rows(pub, 0, pub.shape[0])
        finally:
            for v in fds.values():
                os.close(v)
