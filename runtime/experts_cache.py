"""The byte-budgeted expert cache behind expert streaming (`runtime.experts`).

Experts live in preallocated slot pools, one per expert layout (the shapes of an expert's
codes and scales; nearly every model has one): for each projection, a codes array
`(slots + 1, out, words)` and a scales array `(slots + 1, out, groups)`, allocated once by
MLX. A miss reads the expert's byte range from its shard with one positioned read
(`os.preadv`) that scatters it straight into the slot's codes and scales: the only copy is
the kernel's, from the page cache into MLX-owned memory (the arrays share memory with
NumPy on the CPU and on Apple silicon). The last slot of every pool stays zero: it is the
"other experts" slot when a step needs more experts than the pool holds at once.

Eviction is least-recently-used over the unpinned slots, never touching the experts the
current layer uses. Reads run on a small thread pool; all bookkeeping stays on the calling
thread. The caller must evaluate everything it computed from a slot before that slot can
be refilled (StreamedExperts evaluates each layer's output before returning).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .repo import RepoError

log = logging.getLogger(__name__)

MERGE_GAP = 1 << 20  # tensors of one expert this close on disk are read together
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 10**9, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
          "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10,
          "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


class ExpertBudgetError(ValueError):
    """An expert budget that cannot work for this model (too small, or unreadable)."""


class ExpertReadError(RepoError):
    """An expert's bytes could not be read as the manifest describes them."""


def parse_budget(value, total_bytes: int) -> int:
    """Bytes from an int (bytes), "2GB", "1.5GiB", "500MB", a bare number (GB) or "25%"
    (of `total_bytes`, all streamed experts)."""
    if isinstance(value, bool):
        raise ExpertBudgetError(f"expert budget must be bytes, 'NGB' or 'N%', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ExpertBudgetError(f"expert budget must be positive, got {value!r}")
        return int(value)
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise ExpertBudgetError(f"expert budget {text!r}: a percentage must be in (0, 100]")
        return int(total_bytes * pct / 100)
    m = _SIZE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ExpertBudgetError(
            f"expert budget {text!r}: use bytes, a size like 2GB / 500MB / 1.5GiB "
            "(a bare number is GB), or a percentage of the experts like 25%"
        )
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ExpertBudgetError(f"expert budget must be positive, got {text!r}")
    return n


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Part:
    """One stored tensor of an expert: `array` is (projection, "codes" | "scales")."""

    array: tuple[str, str]
    start: int  # absolute byte offsets in the shard
    end: int


@dataclass(frozen=True)
class Segment:
    """A byte range of one shard read with one positioned read."""

    shard: str
    start: int
    end: int
    parts: tuple[Part, ...]  # sorted by start, inside [start, end)


@dataclass(frozen=True)
class Blob:
    """Where one expert of one layer lies on disk: normally one segment."""

    layer: int
    expert: int
    segments: tuple[Segment, ...]

    @property
    def disk_bytes(self) -> int:
        return sum(s.end - s.start for s in self.segments)


def segments_of(parts: list[tuple[str, Part]]) -> tuple[Segment, ...]:
    """(shard, part) pairs -> segments: parts of one shard closer than MERGE_GAP merge."""
    out: list[Segment] = []
    for shard, p in sorted(parts, key=lambda sp: (sp[0], sp[1].start)):
        last = out[-1] if out else None
        if last and last.shard == shard and p.start >= last.end and p.start - last.end <= MERGE_GAP:
            out[-1] = Segment(shard, last.start, p.end, last.parts + (p,))
        else:
            out.append(Segment(shard, p.start, p.end, (p,)))
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """The arrays one expert fills: ((projection, kind), shape, dtype name), sorted."""

    arrays: tuple[tuple[tuple[str, str], tuple[int, ...], str], ...]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.arrays)


@dataclass
class Group:
    """One streamed expert layer (a SwitchGLU): its experts in stack order."""

    name: str  # module path, for messages
    layout: Layout
    blobs: list[Blob]  # index = position in the layer's expert stack
    top_k: int


# ---------------------------------------------------------------------------- stats


@dataclass
class ExpertStats:
    budget_bytes: int
    expert_bytes: int  # all streamed experts, as cached
    slots: int
    resident_bytes: int  # experts in the cache now
    peak_resident_bytes: int
    pinned: int
    hits: int
    misses: int
    prefetched: int
    prefetch_hits: int
    reads: int
    bytes_read: int
    read_seconds: float  # wall time while reads were in flight (batches)
    stall_seconds: float  # time the forward pass waited for reads

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def read_throughput(self) -> float:
        return self.bytes_read / self.read_seconds if self.read_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "read_throughput": self.read_throughput}

    def summary(self) -> str:
        share = self.budget_bytes / self.expert_bytes if self.expert_bytes else 0.0
        line = (
            f"experts: budget {fmt_bytes(self.budget_bytes)} ({share:.0%} of "
            f"{fmt_bytes(self.expert_bytes)}), hit rate {self.hit_rate:.1%} "
            f"({self.hits} hits, {self.misses} misses), read {fmt_bytes(self.bytes_read)} in "
            f"{self.read_seconds:.2f} s ({fmt_bytes(self.read_throughput)}/s), "
            f"peak cached {fmt_bytes(self.peak_resident_bytes)}"
        )
        if self.prefetched:
            line += f", prefetched {self.prefetched} ({self.prefetch_hits} used)"
        return line


# ---------------------------------------------------------------------------- reads


def _preadv_full(fd: int, bufs: list, offset: int) -> int:
    """Read into bufs (writable buffers) from offset until they are full or EOF."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    got = 0
    if not hasattr(os, "preadv"):  # fall back: one pread, then one copy per buffer
        want = sum(len(v) for v in views)
        data = os.pread(fd, want, offset)
        pos = 0
        for v in views:
            n = min(len(v), len(data) - pos)
            v[:n] = data[pos : pos + n]
            pos += n
        return len(data)
    while views:
        n = os.preadv(fd, views, offset + got)
        if n <= 0:
            break
        got += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return got


class _Batch:
    """Reads submitted together; read_seconds counts from submission to the last one."""

    def __init__(self, n: int):
        self.start = time.perf_counter()
        self.left = n


@dataclass
class _Pool:
    layout: Layout
    slots: int
    arrays: dict = field(default_factory=dict)  # (proj, kind) -> mx.array (slots + 1, ...)
    views: dict = field(default_factory=dict)  # (proj, kind) -> np.ndarray sharing memory
    free: list = field(default_factory=list)
    lru: OrderedDict = field(default_factory=OrderedDict)  # key -> slot, oldest first
    pinned: dict = field(default_factory=dict)  # key -> slot
    pending: dict = field(default_factory=dict)  # key -> Future of a prefetch
    prefetched: set = field(default_factory=set)  # prefetched keys not used yet
    in_use: set = field(default_factory=set)
    slot_expert: np.ndarray | None = None  # slot -> expert index (bias rows); dummy -> 0

    @property
    def dummy(self) -> int:
        return self.slots

    @property
    def occupied(self) -> int:
        return len(self.lru) + len(self.pinned)


def _allocate(layout: Layout, slots: int) -> tuple[dict, dict]:
    arrays, views = {}, {}
    for key, shape, dtype in layout.arrays:
        a = mx.zeros((slots + 1, *shape), dtype=getattr(mx, dtype))
        mx.eval(a)
        v = np.array(a, copy=False)
        if not (v.flags.writeable and v.flags.c_contiguous and v.dtype == np.dtype(dtype)):
            raise ExpertBudgetError(
                "expert streaming needs MLX arrays that share memory with NumPy (the CPU "
                f"and Apple silicon do); this device ({mx.default_device()}) gives a copy"
            )
        v[0].reshape(-1)[:1] = 1  # do writes through the view reach the MLX array?
        shared = mx.sum(a[0]).item() != 0
        v[0].reshape(-1)[:1] = 0
        if not shared:
            raise ExpertBudgetError(
                f"expert streaming: NumPy views of MLX arrays are copies on "
                f"{mx.default_device()}; streaming needs shared memory"
            )
        arrays[key], views[key] = a, v
    return arrays, views


# ---------------------------------------------------------------------------- the cache


class ExpertCache:
    """LRU cache of experts in preallocated slot pools, `budget` bytes in all."""

    def __init__(self, root: Path, groups: list[Group], budget: int, *, threads: int = 4):
        self.root = Path(root)
        self.groups = groups
        self.expert_bytes = sum(g.layout.nbytes * len(g.blobs) for g in groups)
        self.budget = min(int(budget), self.expert_bytes)  # more than everything is everything
        self._pools: dict[Layout, _Pool] = {}
        for layout, slots in allocate_slots(groups, self.budget).items():
            pool = _Pool(layout, slots)
            pool.arrays, pool.views = _allocate(layout, slots)
            pool.free = list(range(slots - 1, -1, -1))
            pool.slot_expert = np.zeros(slots + 1, dtype=np.int32)
            self._pools[layout] = pool
        shards = sorted({s.shard for g in groups for b in g.blobs for s in b.segments})
        self._fds = {s: os.open(self.root / s, os.O_RDONLY) for s in shards}
        self._executor = ThreadPoolExecutor(max(1, threads), thread_name_prefix="tq-experts")
        self.threads = max(1, threads)
        self.uses: dict[tuple[int, int], int] = {}  # (layer, expert) -> requests
        # hits, misses, prefetch counts, stalls and peak: the calling thread; reads,
        # bytes and read time: the reader threads, under _lock
        self._s = dict(hits=0, misses=0, prefetched=0, prefetch_hits=0, reads=0, bytes_read=0,
                       read_seconds=0.0, stall_seconds=0.0, peak=0)
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ queries

    def pool_of(self, gid: int) -> _Pool:
        return self._pools[self.groups[gid].layout]

    @property
    def resident_bytes(self) -> int:
        return sum(p.occupied * p.layout.nbytes for p in self._pools.values())

    @property
    def slots(self) -> int:
        return sum(p.slots for p in self._pools.values())

    def cached(self, gid: int) -> list[int]:
        pool = self.pool_of(gid)
        return sorted(e for (g, e) in (*pool.lru, *pool.pinned) if g == gid)

    def stats(self) -> ExpertStats:
        """A snapshot; safe to call from any thread."""
        with self._lock:
            s = dict(self._s)
        return ExpertStats(
            budget_bytes=self.budget, expert_bytes=self.expert_bytes, slots=self.slots,
            resident_bytes=self.resident_bytes, peak_resident_bytes=s["peak"],
            pinned=sum(len(p.pinned) for p in self._pools.values()), hits=s["hits"],
            misses=s["misses"], prefetched=s["prefetched"], prefetch_hits=s["prefetch_hits"],
            reads=s["reads"], bytes_read=s["bytes_read"], read_seconds=s["read_seconds"],
            stall_seconds=s["stall_seconds"],
        )

    def reset_stats(self) -> None:
        with self._lock:
            for k in self._s:
                self._s[k] = 0 if k != "peak" else self.resident_bytes
        self.uses.clear()

    def hot(self, n: int | None = None) -> list[list[int]]:
        """The most requested experts as [layer, expert] pairs (a pin file's contents)."""
        order = sorted(self.uses.items(), key=lambda kv: (-kv[1], kv[0]))
        return [list(k) for k, _ in order[:n]]

    # ------------------------------------------------------------------ planning

    def plan(self, gid: int, experts: list[int]) -> list[list[int]]:
        """Split the experts one step needs into chunks that fit the pool at once.

        One chunk whenever they fit; otherwise cached experts go first, so they are used
        before anything evicts them.
        """
        pool = self.pool_of(gid)
        cap = pool.slots - len(pool.pinned)
        pinned = [e for e in experts if (gid, e) in pool.pinned]
        rest = [e for e in experts if (gid, e) not in pool.pinned]
        if len(rest) <= cap:
            return [sorted(experts)]
        cached = [e for e in rest if (gid, e) in pool.lru]
        cold = [e for e in rest if (gid, e) not in pool.lru]
        ordered = cached + cold
        chunks = [ordered[i : i + cap] for i in range(0, len(ordered), cap)]
        chunks[0] = chunks[0] + pinned
        return [sorted(c) for c in chunks]

    # ------------------------------------------------------------------ acquire / release

    def acquire(self, gid: int, experts: list[int]) -> list[int]:
        """Slots holding `experts` of layer `gid`, reading the missing ones; they stay
        resident until `release`."""
        self._check_open()
        pool = self.pool_of(gid)
        group = self.groups[gid]
        keys = [(gid, e) for e in experts]
        protect = set(keys) | pool.in_use
        unpinned = [k for k in keys if k not in pool.pinned]
        if len(unpinned) > pool.slots - len(pool.pinned):
            raise ExpertBudgetError(
                f"{group.name}: {len(unpinned)} experts at once, the budget holds "
                f"{pool.slots - len(pool.pinned)} (plan() splits a step into chunks)"
            )
        slots, misses, waited = [], [], []
        for key in keys:
            b = group.blobs[key[1]]
            self.uses[(b.layer, b.expert)] = self.uses.get((b.layer, b.expert), 0) + 1
            if key in pool.pinned:
                slots.append(pool.pinned[key])
                self._s["hits"] += 1
            elif key in pool.lru:
                pool.lru.move_to_end(key)
                slots.append(pool.lru[key])
                if key in pool.pending:
                    waited.append(key)
                self._s["hits"] += 1
                if key in pool.prefetched:
                    pool.prefetched.discard(key)
                    self._s["prefetch_hits"] += 1
            else:
                slot = self._take_slot(pool, protect)
                pool.lru[key] = slot
                pool.slot_expert[slot] = key[1]
                slots.append(slot)
                misses.append((key, slot))
                self._s["misses"] += 1
        t0 = time.perf_counter()
        failed = []
        for key in waited:
            if not self._resolve(pool, key):
                failed.append(key)
        for key in failed:  # a prefetch that failed: read again, raising its error
            misses.append((key, pool.lru[key]))
        if misses:
            self._read_now(pool, group, misses)
        if misses or waited:
            self._s["stall_seconds"] += time.perf_counter() - t0
        pool.in_use = protect
        self._s["peak"] = max(self._s["peak"], self.resident_bytes)
        return slots

    def release(self, gid: int) -> None:
        self.pool_of(gid).in_use = set()

    def _take_slot(self, pool: _Pool, protect: set) -> int:
        if pool.free:
            return pool.free.pop()
        for key in pool.lru:
            if key not in protect:
                return self._evict(pool, key)
        raise ExpertBudgetError("expert cache: every slot is in use (budget too small)")

    def _evict(self, pool: _Pool, key) -> int:
        if key in pool.pending:
            self._resolve(pool, key)
        pool.prefetched.discard(key)
        return pool.lru.pop(key)

    def _read_now(self, pool: _Pool, group: Group, misses: list) -> None:
        batch = _Batch(len(misses))
        futures = [
            (key, slot, self._executor.submit(self._read, pool, group.blobs[key[1]], slot, batch))
            for key, slot in misses
        ]
        error = None
        for key, slot, f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - every read finishes before raising
                error = error or e
                pool.lru.pop(key, None)
                pool.free.append(slot)
        if error is not None:
            raise error

    def _resolve(self, pool: _Pool, key) -> bool:
        """Wait for a pending prefetch of key; False (and the slot kept) if it failed."""
        future = pool.pending.pop(key)
        try:
            future.result()
            return True
        except Exception as e:  # noqa: BLE001 - the demand read reports it
            log.debug("prefetch of %s failed: %s", key, e)
            return False

    def _read(self, pool: _Pool, blob: Blob, slot: int, batch: _Batch) -> int:
        total = 0
        try:
            for seg in blob.segments:
                bufs, pos = [], seg.start
                for p in seg.parts:
                    if p.start > pos:
                        bufs.append(bytearray(p.start - pos))
                    bufs.append(pool.views[p.array][slot].reshape(-1).view(np.uint8))
                    pos = p.end
                want = seg.end - seg.start
                try:
                    got = _preadv_full(self._fds[seg.shard], bufs, seg.start)
                except OSError as e:
                    raise ExpertReadError(
                        f"{self.root / seg.shard}: reading expert {blob.expert} of layer "
                        f"{blob.layer} (bytes {seg.start}..{seg.end}) failed: {e}"
                    ) from e
                if got < want:
                    size = os.fstat(self._fds[seg.shard]).st_size
                    raise ExpertReadError(
                        f"{self.root / seg.shard}: expert {blob.expert} of layer {blob.layer} "
                        f"is bytes {seg.start}..{seg.end} per the manifest, but the file "
                        f"ends at {size}: it was truncated or replaced after loading; "
                        "download it again"
                    )
                total += got
            return total
        finally:
            with self._lock:
                self._s["reads"] += 1
                self._s["bytes_read"] += total
                batch.left -= 1
                if batch.left == 0:
                    self._s["read_seconds"] += time.perf_counter() - batch.start

    # ------------------------------------------------------------------ prefetch and pins

    def prefetch(self, gid: int, experts: list[int]) -> int:
        """Start reading experts of layer gid that are not cached; returns how many.

        Uses free slots or evicts the least recently used, never one in use now; returns
        without waiting (the next acquire waits for what it needs).
        """
        if self._closed:
            return 0
        pool = self.pool_of(gid)
        group = self.groups[gid]
        todo = []
        protect = set(pool.in_use)
        for e in experts:
            key = (gid, e)
            if key in pool.lru or key in pool.pinned:
                continue
            taken = protect | {k for k, _ in todo}
            if not pool.free and all(k in taken for k in pool.lru):
                break  # only experts in use (or just prefetched) are left to evict
            slot = self._take_slot(pool, taken)
            pool.lru[key] = slot
            pool.slot_expert[slot] = e
            todo.append((key, slot))
        if todo:
            batch = _Batch(len(todo))
            for key, slot in todo:
                f = self._executor.submit(self._read, pool, group.blobs[key[1]], slot, batch)
                pool.pending[key] = f
                pool.prefetched.add(key)
            self._s["prefetched"] += len(todo)
            self._s["peak"] = max(self._s["peak"], self.resident_bytes)
        return len(todo)

    def pin(self, pairs: list[tuple[int, int]]) -> None:
        """Load these (layer, expert) pairs now and never evict them."""
        where = {(b.layer, b.expert): (gid, i) for gid, g in enumerate(self.groups)
                 for i, b in enumerate(g.blobs)}
        for layer, expert in pairs:
            if (layer, expert) not in where:
                raise ExpertBudgetError(
                    f"pinned expert {expert} of layer {layer}: the model has no such streamed "
                    "expert"
                )
        by_pool: dict[Layout, list] = {}
        for pair in dict.fromkeys(tuple(p) for p in pairs):
            gid, i = where[pair]
            by_pool.setdefault(self.groups[gid].layout, []).append((gid, i))
        for layout, keys in by_pool.items():
            pool = self._pools[layout]
            top_k = max(g.top_k for g in self.groups if g.layout == layout)
            if len(pool.pinned) + len(keys) + top_k > pool.slots:
                need = (len(pool.pinned) + len(keys) + top_k) * layout.nbytes
                raise ExpertBudgetError(
                    f"pinning {len(keys)} experts leaves less than one token's {top_k} experts "
                    f"per layer in the budget: it needs at least {fmt_bytes(need)} "
                    f"({len(pool.pinned) + len(keys)} pinned + {top_k})"
                )
            for gid in sorted({g for g, _ in keys}):
                mine = [i for g, i in keys if g == gid]
                slots = self.acquire(gid, mine)
                self.release(gid)
                for i, slot in zip(mine, slots):
                    pool.lru.pop((gid, i), None)
                    pool.pinned[(gid, i)] = slot
        self.reset_stats()

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the expert cache was closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def minimum_budget(groups: list[Group]) -> int:
    """Bytes for one token's experts of the widest layer, per layout."""
    need: dict[Layout, int] = {}
    for g in groups:
        need[g.layout] = max(need.get(g.layout, 0), g.top_k)
    return sum(k * layout.nbytes for layout, k in need.items())


def allocate_slots(groups: list[Group], budget: int) -> dict[Layout, int]:
    """Slots per layout: each gets one token's experts, the rest in proportion to its bytes."""
    count: dict[Layout, int] = {}
    top_k: dict[Layout, int] = {}
    for g in groups:
        count[g.layout] = count.get(g.layout, 0) + len(g.blobs)
        top_k[g.layout] = max(top_k.get(g.layout, 0), g.top_k)
    minimum = minimum_budget(groups)
    total = sum(layout.nbytes * n for layout, n in count.items())
    if budget < minimum:
        per = ", ".join(f"{top_k[lay]} x {fmt_bytes(lay.nbytes)}" for lay in count)
        raise ExpertBudgetError(
            f"expert budget {fmt_bytes(budget)} is too small: one token needs {per} per layer, "
            f"so the minimum is {fmt_bytes(minimum)} ({minimum} bytes, "
            f"{100 * minimum / total:.1f}% of the {fmt_bytes(total)} of experts)"
        )
    slots = {lay: min(top_k[lay], count[lay]) for lay in count}
    spare = budget - sum(slots[lay] * lay.nbytes for lay in count)
    for lay in sorted(count, key=lambda lay: -lay.nbytes * count[lay]):
        share = spare * lay.nbytes * count[lay] / total
        extra = min(count[lay] - slots[lay], int(share // lay.nbytes))
        slots[lay] += extra
    spare = budget - sum(slots[lay] * lay.nbytes for lay in count)
    for lay in count:  # what rounding left over
        extra = min(count[lay] - slots[lay], spare // lay.nbytes)
        slots[lay] += extra
        spare -= extra * lay.nbytes
    return slots


def read_pins(value) -> list[tuple[int, int]]:
    """(layer, expert) pairs from a JSON file path, a JSON string, or a list of pairs.

    The file holds `[[layer, expert], ...]` or `{"experts": [[layer, expert], ...]}`.
    """
    if value is None:
        return []
    data = value
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ExpertBudgetError(f"pin file {path}: {e.strerror or e}") from e
        except json.JSONDecodeError as e:
            raise ExpertBudgetError(f"pin file {path}: not valid JSON ({e})") from e
    if isinstance(data, dict):
        data = data.get("experts", [])
    try:
        pairs = [(int(p[0]), int(p[1])) for p in data]
        if any(len(p) != 2 for p in data):
            raise ValueError
    except (TypeError, ValueError, IndexError, KeyError):
        raise ExpertBudgetError(
            f"pins must be [[layer, expert], ...] (or {{\"experts\": [...]}}), got {str(data)[:80]}"
        ) from None
    return pairs
