"""Progress bars driven by the ledgers: overall source bytes, and one bar per running shard.

Workers never talk to the bars: a thread in the main process reads each running job's
ledger twice a second (a ledger line is appended per finished unit), so the bars work the
same for in-process jobs, worker processes and Prefect tasks.
"""

from __future__ import annotations

import threading
from itertools import accumulate

from .ledger import WorkDir
from .plan import Job, Plan


class Progress:
    def __init__(self, plan: Plan, work: WorkDir, enabled: bool = True, workers: int = 1):
        self.plan, self.work, self.enabled = plan, work, enabled
        self.lock = threading.Lock()
        self.running: dict[str, tuple[Job, object]] = {}
        self.finished: dict[str, int] = {}
        self.slots = list(range(1, max(1, workers) + 1))
        self._prefix = {j.name: [0, *accumulate(u.read_bytes for u in j.units)] for j in plan.jobs}
        self._seen: dict[str, tuple[int, int]] = {}
        self.done: dict[str, int] = {}
        self._stop = threading.Event()
        self.total = None
        self.thread = None

    def _done_bytes(self, job: Job) -> int:
        """Source bytes of the job's units recorded in its ledger (reads only new lines)."""
        pos, lines = self._seen.get(job.name, (0, 0))
        try:
            with open(self.work.ledger(job), "rb") as f:
                f.seek(pos)
                new = f.read()
        except FileNotFoundError:
            new = b""
        if new:
            count = new.count(b"\n")
            pos += new.rfind(b"\n") + 1 if count else 0
            lines += count
            self._seen[job.name] = (pos, lines)
        return self._prefix[job.name][min(lines, len(job.units))]

    def start(self) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.done = {j.name: self._done_bytes(j) for j in self.plan.jobs}
        self.total = tqdm(total=self.plan.read_bytes, initial=sum(self.done.values()), unit="B", unit_scale=True,
                          unit_divisor=1024, desc="converting", position=0, dynamic_ncols=True,
                          smoothing=0.1)
        self.thread = threading.Thread(target=self._poll, name="tq-progress", daemon=True)
        self.thread.start()

    def job_started(self, job: Job) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        with self.lock:
            slot = self.slots.pop(0) if self.slots else len(self.running) + 1
            bar = tqdm(total=job.read_bytes, initial=self.done.get(job.name, 0), unit="B",
                       unit_scale=True, unit_divisor=1024, desc=f"{job.shard}", position=slot,
                       leave=False, dynamic_ncols=True)
            bar.slot = slot
            self.running[job.name] = (job, bar)

    def job_finished(self, job: Job) -> None:
        if not self.enabled:
            return
        with self.lock:
            entry = self.running.pop(job.name, None)
            if entry:
                _, bar = entry
                bar.n = job.read_bytes
                bar.close()
                self.slots.append(bar.slot)
                self.slots.sort()
            self.done[job.name] = job.read_bytes
        self.refresh()

    def refresh(self) -> None:
        if not self.enabled or self.total is None:
            return
        with self.lock:
            for job, bar in self.running.values():
                self.done[job.name] = bar.n = self._done_bytes(job)
                bar.refresh()
            self.total.n = sum(self.done.values())
            self.total.refresh()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join()
        if self.total is not None:
            self.refresh()
            with self.lock:
                for _, bar in self.running.values():
                    bar.close()
                self.running.clear()
            self.total.close()
            self.total = None

