"""Appending a shard's bytes without the page cache's copy.

On Linux a buffered write copies every byte into the page cache, and that kernel copy is
what the output costs: ~1.2 ns a byte of system CPU on the 2-core machine the benchmarks
run on (2.5 GB in 3.0 CPU s), a sixth of a conversion job's CPU. Written with O_DIRECT
the device reads the bytes from this process's buffer: 0.14 CPU s for the same 2.5 GB
(`benchmarks/results/convert-cpu-2026-12.txt`).

O_DIRECT wants the file offset, the length and the buffer's address aligned to the
device's block. `DirectAppender` keeps an aligned staging buffer that starts at the block
holding the append position (the block's earlier bytes read back first), writes whole
buffers as they fill, on a thread of its own (a direct write returns when the device has
the bytes: the job's thread goes on filling the next buffer meanwhile), and on `flush`
writes the last, partial block padded to a whole one and truncates the file to its true
length. Where O_DIRECT is missing (macOS, Windows) or
the filesystem refuses it (tmpfs, some network filesystems), it writes buffered: the same
bytes either way. TURBOQUANT_DIRECT_IO=0 turns it off.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

BLOCK = 4096  # a multiple of every device block size O_DIRECT asks for (512 or 4096)
STAGING = 4 << 20  # bytes a write: a whole number of blocks
BUFFERS = 3  # staging buffers a file: one filling, up to two being written
DIRECT_ENV = "TURBOQUANT_DIRECT_IO"


def direct_enabled() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get(DIRECT_ENV, "1") != "0"


class DirectAppender:
    """Writes bytes at `pos` and after, into `path` (which exists and holds at least
    `pos` bytes). Not thread-safe; one appender a file."""

    def __init__(self, path: os.PathLike, pos: int):
        self.path = path
        self.direct = False
        self.fd = -1
        if direct_enabled():
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
                self.direct = True
            except OSError:  # the filesystem does not take O_DIRECT
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, os.O_WRONLY)
        self.free = [mmap.mmap(-1, STAGING) for _ in range(BUFFERS)]  # page-aligned
        self.buf = self.free.pop()
        self.writing: deque[tuple[Future, mmap.mmap]] = deque()
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shard-write")
        self.base = pos - pos % BLOCK  # file offset of buf[0]
        self.fill = pos - self.base
        if self.fill:
            with open(path, "rb") as f:
                f.seek(self.base)
                head = f.read(self.fill)
            if len(head) != self.fill:
                raise OSError(f"{path}: shorter than {pos} bytes")
            self.buf[:self.fill] = head

    @property
    def pos(self) -> int:
        return self.base + self.fill

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), STAGING - self.fill)
            self.buf[self.fill:self.fill + take] = view[:take]
            self.fill += take
            view = view[take:]
            if self.fill == STAGING:
                done = self.writer.submit(self._put, self.buf, STAGING, self.base)
                self.writing.append((done, self.buf))
                self.base += STAGING
                self.fill = 0
                if not self.free:
                    self._wait(1)
                self.buf = self.free.pop()

    def _wait(self, keep: int) -> None:
        """Until at most `keep` buffers are being written (their errors raised here)."""
        while len(self.writing) > keep:
            done, buf = self.writing.popleft()
            self.free.append(buf)
            done.result()

    def flush(self) -> None:
        """Every byte written so far is in the file (not yet durable: `sync`)."""
        self._wait(0)
        if self.fill == 0:
            return
        whole = self.fill - self.fill % BLOCK
        padded = whole if whole == self.fill else whole + BLOCK
        self._put(self.buf, padded, self.base)
        if padded != self.fill:
            os.ftruncate(self.fd, self.pos)  # the pad past the true end
        if whole:  # keep the partial block at the front: the next bytes complete it
            rest = self.fill - whole
            self.buf[:rest] = self.buf[whole:self.fill]
            self.base += whole
            self.fill = rest

    def sync(self) -> None:
        self.flush()
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                self.flush()
            finally:
                self.abandon()

    def abandon(self) -> None:
        """Close without writing what is staged (after a failure)."""
        if self.fd >= 0:
            for done, _ in self.writing:
                done.exception()  # wait; the error was or will be reported elsewhere
            self.writer.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1

    def _put(self, buf: mmap.mmap, length: int, base: int) -> None:
        view = memoryview(buf)[:length]
        try:
            done = os.pwrite(self.fd, view, base)
        except OSError as e:
            if not self.direct or e.errno != 22:  # EINVAL: O_DIRECT refused at write time
                raise
            self._buffered()
            done = os.pwrite(self.fd, view, base)
        while done < length:  # a short write (a full disk raises instead)
            done += os.pwrite(self.fd, view[done:], base + done)

    def _buffered(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY)
        self.direct = False
