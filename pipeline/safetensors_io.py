"""Read safetensors files one tensor (or one slice) at a time, without loading a shard.

The header (8-byte little-endian length + JSON) is parsed here and checked against the
file size: every tensor's byte length must equal dtype size * shape, the tensors must
cover the data section exactly (no gap, no overlap, nothing past the end). Bytes are read
with positioned reads straight into NumPy buffers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from .errors import SourceError

# safetensors dtype tag -> (bytes per element, NumPy dtype used to hold the raw bytes)
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
FLOAT_DTYPES = ("BF16", "F16", "F32")  # what the codec accepts
MAX_HEADER = 100 * 1024 * 1024  # same bound as the safetensors library


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: absolute byte range [start, end) in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed, validated header of one file."""

    file: str  # name used in messages (the shard's file name)
    file_size: int
    data_start: int  # 8 + header length
    tensors: dict[str, TensorInfo]  # in data order
    metadata: dict = field(default_factory=dict)
    sha256: str = ""  # of the header bytes: identifies the file's layout

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


def header_length(first8: bytes, file: str, file_size: int) -> int:
    """The JSON header's length from the first 8 bytes, checked against the file size."""
    if file_size < 8 or len(first8) < 8:
        raise SourceError(file, f"file is truncated ({file_size} bytes): not a safetensors file")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER and n <= file_size - 8:
        raise SourceError(file, f"header length field says {n} bytes, more than the {MAX_HEADER} "
                                "a safetensors header may have: not a safetensors file")
    if n > file_size - 8:
        raise SourceError(
            file,
            f"header length field says {n} bytes, but only {max(file_size - 8, 0)} bytes "
            f"follow it (the file has {file_size} bytes): the file is truncated or not a "
            "safetensors file",
        )
    return n


def parse_header(raw: bytes, file: str, file_size: int) -> SafetensorsHeader:
    """Parse and validate a header (`raw` = the JSON bytes after the 8-byte length)."""
    data_start = 8 + len(raw)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(file, f"header is not valid JSON ({e}); the file is corrupted") from None
    if not isinstance(obj, dict):
        raise SourceError(file, "header is not a JSON object; the file is corrupted")
    metadata = obj.pop("__metadata__", None) or {}
    entries = []
    for name, info in obj.items():
        entries.append(_tensor_info(name, info, file, data_start))
    entries.sort(key=lambda t: (t.start, t.end))
    data_size = file_size - data_start
    pos = data_start
    for t in entries:
        if t.start != pos:
            what = "overlaps the previous tensor" if t.start < pos else "leaves a gap before it"
            raise SourceError(
                file, f"data offsets [{t.start - data_start}, {t.end - data_start}) {what}; "
                "the header is corrupted", t.name,
            )
        if t.end > file_size:
            raise SourceError(
                file,
                f"needs bytes up to {t.end - data_start} of the data section but the file has "
                f"only {data_size}: the file is truncated (re-download it)",
                t.name,
            )
        pos = t.end
    if pos != file_size:
        raise SourceError(
            file,
            f"file has {file_size - pos} bytes after the last tensor that the header does not "
            "describe: the header and the data disagree",
        )
    digest = hashlib.sha256(raw).hexdigest()
    return SafetensorsHeader(file, file_size, data_start, {t.name: t for t in entries},
                             dict(metadata), digest)


def _tensor_info(name: str, info, file: str, data_start: int) -> TensorInfo:
    if not isinstance(info, dict):
        raise SourceError(file, "header entry is not an object", name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise SourceError(file, f"unknown dtype {dtype!r} in the header", name)
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SourceError(file, f"bad shape {shape!r} in the header", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise SourceError(file, f"bad data_offsets {offsets!r} in the header", name)
    want = math.prod(shape) * DTYPE_SIZES[dtype]
    have = offsets[1] - offsets[0]
    if have != want:
        raise SourceError(
            file,
            f"header says {dtype} {tuple(shape)} ({want} bytes) but its data_offsets span "
            f"{have} bytes: the header lies about the tensor's size",
            name,
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_header(path: str | os.PathLike, file: str | None = None) -> SafetensorsHeader:
    """Read and validate the header of a local file."""
    file = file or os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SourceError(file, f"cannot open ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        n = header_length(os.pread(fd, 8, 0), file, size)
        raw = _pread_exact(fd, n, 8, file)
    finally:
        os.close(fd)
    return parse_header(raw, file, size)


def _pread_exact(fd: int, n: int, offset: int, file: str, tensor: str | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise SourceError(file, f"file ended at byte {offset + got} (wanted {offset + n}): "
                              "the file is truncated", tensor)
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def pread_into(fd: int, buf: np.ndarray, offset: int, file: str, tensor: str | None = None) -> None:
    """Fill `buf` (a contiguous array) with the bytes at `offset`; error if the file is short."""
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise SourceError(
                file, f"file ended at byte {offset + got} while reading {len(view)} bytes at "
                f"{offset}: the file is truncated (re-download it)", tensor,
            )
        got += n


def read_raw(fd: int, info: TensorInfo, start: int, count: int, file: str) -> np.ndarray:
    """Bytes of elements [start, start + count) of a tensor (flat, row-major), as uint8."""
    size = info.itemsize
    buf = np.empty(count * size, dtype=np.uint8)
    pread_into(fd, buf, info.start + start * size, file, info.name)
    return buf


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw little-endian bytes of BF16 / F16 / F32 values -> float32 (flat)."""
    if dtype == "BF16":
        bits = raw.view("<u2").astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32)
    if dtype == "F32":
        return raw.view("<f4")
    raise ValueError(f"cannot convert {dtype} to float32")


def read_float32(fd: int, info: TensorInfo, start: int, count: int, file: str) -> np.ndarray:
    """Elements [start, start + count) of a float tensor as float32 (flat)."""
    return to_float32(read_raw(fd, info, start, count, file), info.dtype)


def check_finite(x: np.ndarray, file: str, tensor: str, first_index: int = 0) -> None:
    """Error naming the tensor and the first bad element if `x` holds NaN or Inf."""
    ok = np.isfinite(x)
    if not ok.all():
        bad = int(np.argmin(ok.reshape(-1)))
        raise SourceError(
            file,
            f"holds non-finite values (first at flat index {first_index + bad}); "
            "the file is corrupted or the checkpoint is broken",
            tensor,
        )
