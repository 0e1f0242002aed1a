"""`turboquant generate`: stream text from a TurboQuant repo (or a plain HF / mlx-lm folder).

    turboquant generate --model ./out --prompt "Once upon a time" --max-tokens 64

Tokens go to stdout as they are generated; prompt and generation speed and peak memory
go to stderr at the end, and with the --kv-* flags the compressed cache's size against an
fp16 cache of the same tokens and which attention path decoding used. MLX and mlx-lm are
imported only when the command runs.

`--expert-budget 25%` (or `6GB`) streams a Mixture-of-Experts model's experts from disk
through a cache of that size (docs/expert-streaming.md) and adds its hit rate, bytes read
and read throughput to the stderr summary.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="turboquant generate",
        description="Generate text from a TurboQuant repo, or a plain Hugging Face / mlx-lm "
        "model folder (a local folder or a Hub repo id).",
    )
    p.add_argument("--model", required=True, help="model folder (TurboQuant, or plain HF / "
                   "mlx-lm) or Hub repo id")
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None,
        help="activation and 16-bit tensor dtype (default: stored; float32 for MoE on CPU)",
    )
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    from turboquant.runtime.kvcache import add_kv_arguments

    add_kv_arguments(p)
    e = p.add_argument_group("expert streaming (Mixture-of-Experts bigger than memory)")
    e.add_argument(
        "--expert-budget", default=None, metavar="GB|PERCENT",
        help="stream experts from disk through a cache of this size: GB (a bare number, or "
        "with a unit: 500MB, 1.5GiB) or a percentage of all experts (25%%)",
    )
    e.add_argument("--expert-pin", default=None, metavar="FILE",
                   help="JSON [[layer, expert], ...] to keep resident (with --expert-budget)")
    e.add_argument("--expert-prefetch", action="store_true",
                   help="read the next layer's likely experts ahead (with --expert-budget)")
    e.add_argument("--expert-threads", type=int, default=4, metavar="N",
                   help="parallel expert reads (default 4)")
    return p


def _prompt_tokens(tokenizer, prompt: str, chat: bool, system: str | None) -> list[int]:
    if chat:
        if not getattr(tokenizer, "has_chat_template", False):
            print("turboquant generate: the tokenizer has no chat template; using the raw prompt",
                  file=sys.stderr)
        else:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


class _Text:
    """Printable text of the generated tokens so far, decoded as a whole.

    Decoding the whole sequence (rather than token by token) keeps a leading space of the
    first token, which mlx-lm's streaming detokenizer drops (it matters for indentation).
    An incomplete UTF-8 character is held back until its next token arrives.
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        new, self.shown = full[self.shown:], len(full)
        return new


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        print("turboquant generate: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    if not 0.0 < args.top_p <= 1.0:
        print("turboquant generate: --top-p must be in (0, 1]", file=sys.stderr)
        return 2
    if args.expert_budget is None and (args.expert_pin or args.expert_prefetch):
        print("turboquant generate: --expert-pin and --expert-prefetch need --expert-budget",
              file=sys.stderr)
        return 2
    if args.expert_threads < 1:
        print("turboquant generate: --expert-threads must be at least 1", file=sys.stderr)
        return 2

    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from turboquant.runtime import ExpertBudgetError, RepoError, expert_stats, load, resolve
    from turboquant.runtime.server_engine import is_turboquant, load_plain

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.seed is not None:
        mx.random.seed(args.seed)
    try:
        local = resolve(args.model, revision=args.revision)
        if not is_turboquant(local):  # a plain HF / mlx-lm folder, as `serve` takes
            if args.expert_budget is not None:
                print("turboquant generate: --expert-budget needs a TurboQuant repo (convert "
                      "the model first)", file=sys.stderr)
                return 2
            model, tokenizer = load_plain(local, args.dtype)
        else:
            model, tokenizer = load(
                local, dtype=args.dtype, expert_budget=args.expert_budget,
                expert_pin=args.expert_pin, expert_prefetch=args.expert_prefetch,
                expert_threads=args.expert_threads,
            )
    except ExpertBudgetError as e:
        print(f"turboquant generate: {e}", file=sys.stderr)
        return 2
    except (RepoError, FileNotFoundError) as e:
        print(f"turboquant generate: {e}", file=sys.stderr)
        return 1

    from turboquant.runtime.kvcache import kv_cache_from_args

    try:
        cache = kv_cache_from_args(model, args.kv_bits_k, args.kv_bits_v, args.kv_sink,
                                   args.kv_window, args.kv_protect_layers)
    except ValueError as e:
        print(f"turboquant generate: {e}", file=sys.stderr)
        return 2
    tokens = _prompt_tokens(tokenizer, prompt, args.chat, args.system)
    sampler = make_sampler(args.temp, args.top_p if args.top_p < 1.0 else 0.0)
    extra = {} if cache is None else {"prompt_cache": cache}
    last, text = None, _Text(tokenizer)
    try:
        for response in stream_generate(
            model, tokenizer, tokens, max_tokens=args.max_tokens, sampler=sampler, **extra
        ):
            print(text.add(response.token), end="", flush=True)
            last = response
    except RepoError as e:  # an expert read that failed mid-generation
        print(f"\nturboquant generate: {e}", file=sys.stderr)
        return 1
    print()
    if last is not None:
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s\n"
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s\n"
            f"peak memory: {last.peak_memory:.3f} GB",
            file=sys.stderr,
        )
    stats = expert_stats(model)
    if stats is not None:
        print(stats.summary(), file=sys.stderr)
    if cache is not None:
        from turboquant.runtime.kvcache import kv_summary

        print(kv_summary(cache), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
