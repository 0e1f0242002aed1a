"""The generation side of `turboquant serve`: one worker thread, a FIFO queue, and stats.

MLX is not safe for concurrent evaluation, so every request runs on one worker thread, one
at a time, in arrival order. A request is a `Job`: its prompt tokens and `Sampling`, a
cancel flag, and an asyncio queue on the server's event loop that receives its events
(`Text`, then `Finished` or `Failed`) as they are produced.

Determinism: the worker seeds MLX's generator at the start of every request (from the
request's `seed`, else a fresh random one), and nothing else draws from it while the
request runs. So a seeded request gives the same text alone or among concurrent ones.

Cancellation: `Job.cancel()` sets a flag the worker checks between tokens; a job cancelled
while still queued is skipped. The server cancels when a client disconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from .server_api import Sampling

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096  # when neither --max-context nor the config says
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


# ---------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class GenerationOptions:
    """The KV-cache and expert-streaming options of `turboquant generate`, per server."""

    kv_bits_k: int | None = None
    kv_bits_v: int | None = None
    kv_sink: int | None = None
    kv_window: int | None = None
    kv_protect_layers: int | None = None
    expert_budget: str | None = None

    @property
    def kv(self) -> bool:
        return self.kv_bits_k is not None or self.kv_bits_v is not None


def make_prompt_cache(model, options: GenerationOptions):
    """A fresh KV cache for one request: None (mlx-lm's fp16 cache) or a TurboQuant one."""
    if not options.kv:
        return None
    from turboquant.runtime.kvcache import kv_cache_from_args

    return kv_cache_from_args(
        model, bits_k=options.kv_bits_k, bits_v=options.kv_bits_v, sink=options.kv_sink,
        window=options.kv_window, protect_layers=options.kv_protect_layers,
    )


def is_turboquant(path: Path) -> bool:
    """A TurboQuant repo has a manifest, or says so in config.json's quantization_config."""
    from turboquant.manifests.schema import MANIFEST_FILE, QUANT_METHOD

    if (path / MANIFEST_FILE).is_file():
        return True
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD


def _load_model(path, *, dtype: str | None = None, revision: str | None = None,
                options: GenerationOptions = GenerationOptions()):
    """(model, tokenizer, config) for a TurboQuant repo or a plain HF/MLX folder.

    A Hub repo id is fetched through the runtime (`turboquant.runtime.resolve`). A TurboQuant
    repo loads with `turboquant.runtime.load`; anything else with `mlx_lm.load`.
    """
    from turboquant.runtime import resolve

    local = resolve(path, revision=revision)
    if options.expert_budget is not None and not is_turboquant(local):
        raise ValueError("--expert-budget needs a TurboQuant repo (convert the model first)")
    if is_turboquant(local):
        from turboquant.runtime import load

        model, tokenizer = load(local, dtype=dtype, expert_budget=options.expert_budget)
    else:
        model, tokenizer = load_plain(local, dtype)
    config = json.loads((local / "config.json").read_text())
    return model, tokenizer, config


def load_plain(local: Path, dtype: str | None = None):
    """(model, tokenizer) of a plain Hugging Face / mlx-lm folder, through `mlx_lm.load`
    (no code from the folder runs: see repo.TOKENIZER_OPTIONS)."""
    import mlx.core as mx
    from mlx_lm import load

    from turboquant.runtime.repo import TOKENIZER_OPTIONS, check_tokenizer_code

    check_tokenizer_code(local)
    model, tokenizer = load(str(local), tokenizer_config=dict(TOKENIZER_OPTIONS))
    if dtype is None and _cpu_moe(model):
        dtype = "float32"  # MLX's CPU gather_mm supports nothing else, as in the runtime
        log.info("%s: Mixture-of-Experts on the CPU runs in float32", local)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer


def _cpu_moe(model) -> bool:
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    return mx.default_device().type == mx.cpu and any(
        isinstance(m, SwitchLinear) for _, m in model.named_modules())


def max_context_of(config: dict, flag: int | None = None) -> int:
    """--max-context, else the config's position limit, else DEFAULT_CONTEXT."""
    if flag is not None:
        return flag
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            v = source.get(key)
            if isinstance(v, int) and v > 0:
                return v
    log.warning("the config states no context length; using %d (set --max-context)",
                DEFAULT_CONTEXT)
    return DEFAULT_CONTEXT


# ---------------------------------------------------------------------------- stop strings


class StopText:
    """Cuts streamed text at the first stop sequence, holding back a possible partial one.

    `feed(segment)` returns (text safe to emit, stopped). Text that might be the start of
    a stop sequence is held until the next segment decides it; `flush()` returns it at
    the end. The first stop is the first to be complete (the occurrence that ends first;
    of two that end together, the longer), so the output does not depend on how the text
    was split into segments: it is the full text up to that occurrence.
    """

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, segment: str) -> tuple[str, bool]:
        text = self._held + segment
        if not self.stops:
            return text, False
        hits = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)[1]], True
        keep = 0
        for k in range(min(len(text), max(map(len, self.stops)) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                keep = k
                break
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


# ---------------------------------------------------------------------------- jobs


@dataclass
class Text:
    text: str


@dataclass
class Finished:
    reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str


class QueueFull(Exception):
    pass


_ids = itertools.count(1)


class Job:
    """One request on its way through the worker; its events arrive on the caller's loop."""

    def __init__(self, prompt: list[int], sampling: Sampling, loop: asyncio.AbstractEventLoop,
                 tag: str = ""):
        self.id = next(_ids)
        self.tag = tag
        self.prompt = prompt
        self.sampling = sampling
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event) -> None:
        """From the worker thread: hand an event to the request's loop."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def events(self) -> list:
        """The next events: waits for one, then takes whatever else is already there."""
        out = [await self._events.get()]
        while not self._events.empty():
            out.append(self._events.get_nowait())
        return out


# ---------------------------------------------------------------------------- engine


class Engine:
    """Runs jobs one at a time, first in first out, on a single worker thread."""

    def __init__(self, model, tokenizer, *, options: GenerationOptions = GenerationOptions(),
                 max_queue: int = 64, history: int = 64):
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._counts = dict(submitted=0, completed=0, cancelled=0, failed=0,
                            prompt_tokens=0, generated_tokens=0)
        self._recent: deque = deque(maxlen=history)
        self._t0 = time.perf_counter()

    def _clock(self, t: float) -> float:
        """Seconds since the engine was made: the times in `stats()["recent"]`."""
        return round(t - self._t0, 4)

    # lifecycle

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="turboquant-generate",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running job and every queued one, and stop the worker."""
        with self._lock:
            if self._current is not None:
                self._current.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit(Failed("the server is shutting down"))
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._queue.qsize() >= self.max_queue:
                raise QueueFull(f"{self._queue.qsize()} requests are already waiting")
            self._counts["submitted"] += 1
        self._queue.put(job)

    def stats(self) -> dict:
        with self._lock:
            return {
                "queue_depth": self._queue.qsize(),
                "busy": self._current is not None,
                "requests": {k: self._counts[k] for k in
                             ("submitted", "completed", "cancelled", "failed")},
                "tokens": {"prompt": self._counts["prompt_tokens"],
                           "generated": self._counts["generated_tokens"]},
                "options": asdict(self.options),
                "recent": list(self._recent),
            }

    # worker

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            started = time.perf_counter()
            record = {"id": job.id, "tag": job.tag, "prompt_tokens": len(job.prompt),
                      "completion_tokens": 0, "max_tokens": job.sampling.max_tokens,
                      "submitted": self._clock(job.submitted), "started": self._clock(started),
                      "queued_s": round(started - job.submitted, 4)}
            if job.cancelled.is_set():
                self._finish(record, "cancelled", started)
                continue
            with self._lock:
                self._current = job
            try:
                outcome = self._generate(job, record)
            except Exception as e:  # one bad request must not stop the worker
                log.exception("request %d failed", job.id)
                job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                outcome = "error"
            with self._lock:
                self._current = None
            self._finish(record, outcome, started)

    def _finish(self, record: dict, outcome: str, started: float) -> None:
        record["finish_reason"] = outcome
        now = time.perf_counter()
        record["finished"] = self._clock(now)
        record["generate_s"] = round(now - started, 4)
        key = {"cancelled": "cancelled", "error": "failed"}.get(outcome, "completed")
        with self._lock:
            self._counts[key] += 1
            self._counts["prompt_tokens"] += record["prompt_tokens"]
            self._counts["generated_tokens"] += record["completion_tokens"]
            self._recent.append(record)

    def _generate(self, job: Job, record: dict) -> str:
        """Run one job to its end; returns "stop", "length" or "cancelled"."""
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        s = job.sampling
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        mx.random.seed(seed % (1 << 64))  # before anything of this request samples
        sampler = make_sampler(s.temperature, s.top_p if s.top_p < 1.0 else 0.0)
        processors = make_logits_processors(
            s.logit_bias or None,
            presence_penalty=s.presence_penalty or None,
            frequency_penalty=s.frequency_penalty or None,
        )
        stop = StopText(s.stop)
        reason = "length"
        for r in stream_generate(
            self.model, self.tokenizer, job.prompt,
            max_tokens=s.max_tokens or 256, sampler=sampler, logits_processors=processors or None,
            prompt_cache=make_prompt_cache(self.model, self.options),
        ):
            record["completion_tokens"] = r.generation_tokens
            if job.cancelled.is_set():
                return "cancelled"
            text, hit = stop.feed(r.text)
            if text:
                job.emit(Text(text))
            if hit:
                reason = "stop"
                break
            if r.finish_reason is not None:
                reason = r.finish_reason
        else:
            tail = stop.flush()
            if tail:
                job.emit(Text(tail))
        job.emit(Finished(reason, len(job.prompt), record["completion_tokens"]))
        return reason
