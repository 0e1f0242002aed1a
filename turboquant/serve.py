"""`turboquant serve`: an OpenAI-compatible HTTP API for a TurboQuant repo.

    turboquant serve --model out/llama-tq4 [--host 127.0.0.1] [--port 8080] [--api-key K]

Serves `/v1/models`, `/v1/chat/completions` and `/v1/completions` (streamed or whole) with
FastAPI on uvicorn; see docs/serve.md. Binds loopback unless told otherwise. MLX, mlx-lm
and the web stack are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

PROG = "turboquant serve"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a TurboQuant repo (or a plain Hugging Face / MLX model folder, or a "
        "Hub repo id) over an OpenAI-compatible HTTP API.",
    )
    p.add_argument("--model", required=True, help="model folder or Hub repo id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("TURBOQUANT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TURBOQUANT_API_KEY, "
                   "else no key)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the model folder's name, or the Hub "
                   "repo id)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + completion token limit (default: the config's "
                   "max_position_embeddings)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="completion length when a request gives no max_tokens (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for the worker before 503 (default 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation and 16-bit tensor dtype (as in `turboquant generate`)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    kv = p.add_argument_group("KV cache (TurboQuant-compressed; default: fp16)")
    kv.add_argument("--kv-bits-k", type=int, default=None, help="key bits: 2, 3, 4, 8 or 16")
    kv.add_argument("--kv-bits-v", type=int, default=None, help="value bits: 2, 3, 4, 8 or 16")
    kv.add_argument("--kv-sink", type=int, default=None, help="leading tokens kept in fp16")
    kv.add_argument("--kv-window", type=int, default=None, help="recent tokens kept in fp16")
    kv.add_argument("--kv-protect-layers", type=int, default=None,
                    help="first/last KV layers kept at higher precision")
    p.add_argument("--expert-budget", default=None,
                   help="memory for MoE experts held in RAM (expert streaming)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def served_model_id(model: str) -> str:
    """The model id clients send by default: a local folder's name (not its path, which
    tells clients about this machine's file system), or the Hub repo id as given."""
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model.rstrip("/")


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        return _fail("--port must be in 0..65535", 2)
    for name in ("max_context", "default_max_tokens", "max_body_bytes", "max_queue"):
        v = getattr(args, name)
        if v is not None and v < 1:
            return _fail(f"--{name.replace('_', '-')} must be at least 1", 2)
    if args.api_key == "":
        args.api_key = None

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    if not _loopback(args.host):
        logging.getLogger(PROG).warning(
            "binding %s: the API is reachable from other machines%s", args.host,
            "" if args.api_key else " and has no --api-key")

    import uvicorn

    from turboquant.runtime import RepoError
    from turboquant.runtime.server import (
        Engine,
        GenerationOptions,
        ServerConfig,
        _load_model,
        create_app,
        max_context_of,
    )
    from turboquant.runtime.server_engine import make_prompt_cache

    options = GenerationOptions(
        kv_bits_k=args.kv_bits_k, kv_bits_v=args.kv_bits_v, kv_sink=args.kv_sink,
        kv_window=args.kv_window, kv_protect_layers=args.kv_protect_layers,
        expert_budget=args.expert_budget,
    )
    from turboquant.runtime import ExpertBudgetError

    try:
        model, tokenizer, config = _load_model(args.model, dtype=args.dtype,
                                               revision=args.revision, options=options)
    except ExpertBudgetError as e:  # a budget below one token's experts, or unparsable
        return _fail(str(e), 2)
    except (RepoError, FileNotFoundError, ValueError) as e:
        return _fail(str(e), 1)
    try:
        make_prompt_cache(model, options)  # a bad KV flag fails now, not at the first request
    except ValueError as e:
        return _fail(str(e), 2)

    cfg = ServerConfig(
        model_id=args.served_model_name or served_model_id(args.model),
        max_context=max_context_of(config, args.max_context),
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
    )
    app = create_app(Engine(model, tokenizer, options=options, max_queue=args.max_queue), cfg)
    print(f"{PROG}: {cfg.model_id} at http://{args.host}:{args.port}/v1 "
          f"(context {cfg.max_context} tokens{', API key required' if cfg.api_key else ''})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
