"""Measure `turboquant serve`: N concurrent streaming clients against the same N requests
one at a time, and both against mlx-lm generating the same tokens with no server.

    python -m turboquant.runtime.server_bench --model reference/models/pystd-dense \\
        --clients 4 --max-tokens 128

Starts the server in this process on a free loopback port, sends chat-free completion
requests with the official `openai` client (streamed, greedy, end-of-text masked so every
request makes exactly --max-tokens tokens), and prints tokens/s, time to first token and
per-request latency, with the ratios against the peers measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["import os\n", "def main(", "class Config:", "for i in range(",
           "with open(", "from typing import", "if __name__", "try:\n    "]


def _one(client, model: str, prompt: str, max_tokens: int, t0: float) -> dict:
    start = time.perf_counter()
    first, n, text = None, 0, ""
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        logit_bias={"0": -100}, stream_options={"include_usage": True})
    for c in stream:
        if c.choices and c.choices[0].text:
            first = first or time.perf_counter()
            text += c.choices[0].text
        if c.usage is not None:
            n = c.usage.completion_tokens
    end = time.perf_counter()
    return {"tokens": n, "ttft": (first or end) - start, "latency": end - start,
            "end": end - t0, "text": text}


def measure(url: str, model: str, clients: int, max_tokens: int, api_key: str = "x") -> dict:
    """Sequential vs concurrent runs of `clients` requests against a running server."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
    _one(client, model, prompts[0], 4, time.perf_counter())  # warm up

    t0 = time.perf_counter()
    seq = [_one(client, model, p, max_tokens, t0) for p in prompts]
    seq_wall = time.perf_counter() - t0

    barrier = threading.Barrier(clients)

    def run(p):
        barrier.wait()
        return _one(client, model, p, max_tokens, t0)

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        con = list(pool.map(run, prompts))
        con_wall = time.perf_counter() - t0

    def summary(rows, wall):
        return {"wall_s": wall, "tok_s": sum(r["tokens"] for r in rows) / wall,
                "ttft_mean_s": statistics.mean(r["ttft"] for r in rows),
                "ttft_max_s": max(r["ttft"] for r in rows),
                "latency_mean_s": statistics.mean(r["latency"] for r in rows),
                "latency_max_s": max(r["latency"] for r in rows)}

    return {"sequential": summary(seq, seq_wall), "concurrent": summary(con, con_wall),
            "same_text": [r["text"] for r in seq] == [r["text"] for r in con]}


def direct(model, tokenizer, clients: int, max_tokens: int) -> float:
    """Tokens/s of mlx-lm's stream_generate on the same requests, no server (the peer)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors({0: -100.0})
    for _ in stream_generate(model, tokenizer, PROMPTS[0], max_tokens=4):  # warm up
        pass
    n, t0 = 0, time.perf_counter()
    for i in range(clients):
        for r in stream_generate(model, tokenizer, PROMPTS[i % len(PROMPTS)],
                                 max_tokens=max_tokens, logits_processors=procs):
            pass
        n += r.generation_tokens
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m turboquant.runtime.server_bench")
    p.add_argument("--model", required=True, help="model folder or Hub repo id")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="rounds; medians are printed")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    args = p.parse_args(argv)

    from turboquant.runtime.server import (
        Engine, ServerConfig, _load_model, create_app, max_context_of, serve_in_thread)

    model, tokenizer, config = _load_model(args.model, dtype=args.dtype)
    engine = Engine(model, tokenizer)
    cfg = ServerConfig(model_id="bench", max_context=max_context_of(config))
    peers, rounds = [], []
    with serve_in_thread(create_app(engine, cfg)) as url:
        for _ in range(args.repeat):  # interleaved, so a busy machine hits all three alike
            # the worker is idle between rounds: the peer may use MLX on this thread
            peers.append(direct(model, tokenizer, args.clients, args.max_tokens))
            rounds.append(measure(url, "bench", args.clients, args.max_tokens))

    def med(name, key):
        return statistics.median(r[name][key] for r in rounds)

    peer = statistics.median(peers)
    print(f"model {args.model} ({args.dtype or 'stored dtype'}): {args.clients} requests x "
          f"{args.max_tokens} tokens, greedy; median of {args.repeat} interleaved rounds")
    print(f"{'':<26}{'tok/s':>9}{'wall s':>9}{'TTFT mean':>11}{'TTFT max':>10}"
          f"{'latency max':>13}")
    print(f"{'mlx-lm, no server':<26}{peer:>9.1f}")
    for name in ("sequential", "concurrent"):
        print(f"{'server, ' + name:<26}{med(name, 'tok_s'):>9.1f}{med(name, 'wall_s'):>9.2f}"
              f"{med(name, 'ttft_mean_s'):>11.3f}{med(name, 'ttft_max_s'):>10.3f}"
              f"{med(name, 'latency_max_s'):>13.2f}")
    seq, con = med("sequential", "tok_s"), med("concurrent", "tok_s")
    same = all(r["same_text"] for r in rounds)
    print(f"concurrent / sequential throughput: {con / seq:.2f}x; "
          f"server sequential / mlx-lm: {seq / peer:.2f}x; "
          f"same text concurrent and sequential: {same}")
    print("reproduce: python -m turboquant.runtime.server_bench --model "
          f"{args.model} --clients {args.clients} --max-tokens {args.max_tokens} "
          f"--repeat {args.repeat}" + (f" --dtype {args.dtype}" if args.dtype else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
