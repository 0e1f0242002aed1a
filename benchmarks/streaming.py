"""Expert streaming: tokens/s, hit rate and peak RSS at 10/25/50/100% expert budgets, next
to the fully loaded (resident) model in the same run.

Two models:

- a synthetic Qwen3-MoE whose experts total `--expert-gb` (default 8 GB) at 4 bits,
  written straight in the TurboQuant format by this script (random codes, random fp16-range
  scales, random bf16 attention and routers kept raw): converting a ~30 GB bf16 source on
  two CPU cores would take hours, and speed does not depend on the code values. The
  routers are random, so routing is close to uniform: the worst case for a cache.
- the reference MoE (reference/models/pystd-moe, trained on Python source) converted by
  the pipeline at 4 bits: real routing, tiny experts (3.3 MB in all).

Every configuration runs in its own subprocess (so peak RSS is its own): load, greedy
generation of `--tokens` tokens from a short prompt, decode tokens/s (after the first
token) and CPU seconds per token, the cache's hit rate, bytes read and read throughput
over the decode, and peak RSS (VmHWM). Configurations run `--repeat` times, interleaved,
and the fastest run of each counts (the machine is shared). Each streamed run's tokens
are checked against the resident run's. The page cache is warmed first (the files are
read once); `--cold` adds a 25% run after dropping this model's pages from the page cache
(posix_fadvise DONTNEED on its shards only).

    python benchmarks/streaming.py --cold      # ~8 minutes here (+30 s to write the repo)
    python benchmarks/streaming.py --expert-gb 2 --tokens 8 --repeat 1
    python benchmarks/streaming.py --skip-synthetic      # the reference MoE only

Targets (docs/expert-streaming.md): at 25% budget on a warm page cache >= 50% of the
resident model's decode speed; peak RSS <= budget + non-expert weights + 1 GB.
Times count only on the machine they were measured on; the ratios are the claim.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

RESULTS = ROOT / "benchmarks" / "results" / "streaming.txt"
REFERENCE = ROOT / "reference" / "models" / "pystd-moe"
SHARD_BYTES = 2 * 10**9
GROUP = 64


# ---------------------------------------------------------------------------- the synthetic repo


def synthetic_config(layers: int, experts: int, hidden: int, inter: int, vocab: int) -> dict:
    heads = hidden // 128
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4), "head_dim": 128, "vocab_size": vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "num_experts": experts, "num_experts_per_tok": 2,
        "moe_intermediate_size": inter, "intermediate_size": inter * 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "torch_dtype": "bfloat16",
    }


class _Writer:
    """Safetensors shards written tensor by tensor, with manifest rows and checksums."""

    def __init__(self, out: Path, seed: int = 0):
        self.out = out
        self.rng = np.random.default_rng(seed)
        self.pool = np.frombuffer(self.rng.bytes(64 << 20), dtype=np.uint8)
        self.pos = 0

    def random_bytes(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            take = min(left, len(self.pool) - self.pos)
            chunks.append(self.pool[self.pos : self.pos + take])
            self.pos = (self.pos + take + 4099) % (len(self.pool) - 4096)  # drift: no two alike
            left -= take
        return b"".join(c.tobytes() for c in chunks)

    def raw(self, shape, std=0.02, mean=0.0) -> tuple[str, bytes]:
        from checkpoints import float32_to_bf16_bits

        x = self.rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * std + mean
        return "BF16", float32_to_bf16_bits(x).tobytes()

    def scales(self, n: int, in_features: int) -> bytes:
        s = self.rng.uniform(0.6, 1.4, n).astype(np.float32) / np.sqrt(in_features * 1.6)
        return s.astype(np.float16).tobytes()


def write_synthetic(out: Path, *, layers: int, experts: int, hidden: int, inter: int,
                    vocab: int = 512) -> None:
    """A TurboQuant repo (docs/FORMAT.md) with 4-bit random experts, written directly."""
    from checkpoints import write_tokenizer

    from turboquant.kernels.reference import words_per_row
    from turboquant.manifests.schema import write_manifest
    from turboquant.stages import rotation_key, tensor_seed

    out.mkdir(parents=True, exist_ok=True)
    cfg = synthetic_config(layers, experts, hidden, inter, vocab)
    w = _Writer(out)
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    # every row: (name, shape, [(stored name, dtype, shape, bytes-maker)], codec)
    def raw(name, shape, std=0.02, mean=0.0):
        return (name, shape, [(name, "BF16", shape, lambda: w.raw(shape, std, mean)[1])], "raw")

    def quant(name, out_f, in_f):
        base = name[: -len(".weight")]
        words, groups = words_per_row(in_f, 4), in_f // GROUP
        return (name, (out_f, in_f), [
            (f"{base}.tq_codes", "U32", (out_f, words), lambda: w.random_bytes(out_f * words * 4)),
            (f"{base}.tq_scales", "F16", (out_f, groups), lambda: w.scales(out_f * groups, in_f)),
        ], "turboquant")

    rows = [raw("model.embed_tokens.weight", (vocab, hidden), std=1.0)]
    for i in range(layers):
        p = f"model.layers.{i}"
        rows += [
            raw(f"{p}.input_layernorm.weight", (hidden,), 0.05, 1.0),
            raw(f"{p}.self_attn.q_proj.weight", (heads * hd, hidden), hidden**-0.5),
            raw(f"{p}.self_attn.k_proj.weight", (kv * hd, hidden), hidden**-0.5),
            raw(f"{p}.self_attn.v_proj.weight", (kv * hd, hidden), hidden**-0.5),
            raw(f"{p}.self_attn.o_proj.weight", (hidden, heads * hd), (heads * hd) ** -0.5),
            raw(f"{p}.self_attn.q_norm.weight", (hd,), 0.05, 1.0),
            raw(f"{p}.self_attn.k_norm.weight", (hd,), 0.05, 1.0),
            raw(f"{p}.post_attention_layernorm.weight", (hidden,), 0.05, 1.0),
            raw(f"{p}.mlp.gate.weight", (experts, hidden), hidden**-0.5),
        ]
        for e in range(experts):
            q = f"{p}.mlp.experts.{e}"
            rows += [quant(f"{q}.down_proj.weight", hidden, inter),
                     quant(f"{q}.gate_proj.weight", inter, hidden),
                     quant(f"{q}.up_proj.weight", inter, hidden)]
    rows += [raw("model.norm.weight", (hidden,), 0.05, 1.0),
             raw("lm_head.weight", (vocab, hidden), hidden**-0.5)]

    size = {"BF16": 2, "F16": 2, "U32": 4}
    shards, current, used = [], [], 0
    for r in rows:
        nbytes = sum(int(np.prod(s)) * size[d] for _, d, s, _ in r[2])
        if current and used + nbytes > SHARD_BYTES:
            shards.append(current)
            current, used = [], 0
        current.append(r)
        used += nbytes
    shards.append(current)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    manifest, weight_map, total = [], {}, 0
    for shard, shard_rows in zip(names, shards):
        header, offset = {}, 0
        for _, _, stored, _ in shard_rows:
            for t, d, s, _ in stored:
                n = int(np.prod(s)) * size[d]
                header[t] = {"dtype": d, "shape": list(s), "data_offsets": [offset, offset + n]}
                offset += n
        head = json.dumps({"__metadata__": {"format": "turboquant"}, **header},
                          separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        start = 8 + len(head)
        with open(out / shard, "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            for name, shape, stored, codec in shard_rows:
                digest, first = hashlib.sha256(), header[stored[0][0]]["data_offsets"][0]
                for t, _, _, make in stored:
                    data = make()
                    f.write(data)
                    digest.update(data)
                    weight_map[t] = shard
                last = header[stored[-1][0]]["data_offsets"][1]
                total += last - first
                manifest.append(_row(name, shape, codec, shard, start + first, start + last,
                                     digest.hexdigest(), rotation_key, tensor_seed))
    write_manifest(manifest, out / "manifest.parquet")
    (out / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": total, "format": "turboquant", "format_version": 1},
        "weight_map": dict(sorted(weight_map.items())),
    }, indent=1))
    cfg["quantization_config"] = {
        "quant_method": "turboquant", "format_version": 1, "recipe": "synthetic-benchmark",
        "recipe_hash": "0" * 64, "model_seed": 0, "bits": 4, "group_size": GROUP,
        "overrides": {},
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out, vocab)


def _row(name, shape, codec, shard, start, end, checksum, rotation_key, tensor_seed) -> dict:
    import re

    layer = re.search(r"\.layers\.(\d+)\.", name)
    expert = re.search(r"\.experts\.(\d+)\.", name)
    quant = codec != "raw"
    n = int(np.prod(shape))
    return {
        "name": name, "source_name": name, "source_shard": "synthetic", "shape": list(shape),
        "source_dtype": "BF16", "codec": codec, "bits": 4 if quant else None,
        "group_size": GROUP if quant else None,
        "seed": tensor_seed(0, rotation_key(name)) if quant else None,
        "padded_in": shape[1] if quant else None, "shard": shard, "byte_start": start,
        "byte_end": end, "checksum": checksum, "rel_mse": None,
        "bits_per_weight": 8.0 * (end - start) / n,
        "layer": int(layer.group(1)) if layer else None,
        "expert": int(expert.group(1)) if expert else None,
    }


def synthetic_repo(work: Path, expert_gb: float, layers: int, hidden: int, inter: int) -> Path:
    blob = 3 * hidden * inter * 4 // 8 + 3 * hidden * inter // GROUP * 2
    experts = max(8, round(expert_gb * 1e9 / (layers * blob)))
    path = work / f"synthetic-{layers}x{experts}-h{hidden}-i{inter}"
    if not (path / "config.json").is_file():
        t = time.perf_counter()
        print(f"writing {path.name}: {layers} layers x {experts} experts of "
              f"{blob / 1e6:.2f} MB ({layers * experts * blob / 1e9:.2f} GB of experts)",
              flush=True)
        write_synthetic(path, layers=layers, experts=experts, hidden=hidden, inter=inter)
        print(f"  written in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def reference_repo(work: Path) -> Path:
    path = work / "pystd-moe-tq4"
    if not (path / "config.json").is_file():
        from turboquant.pipeline.convert import ConvertOptions, convert

        convert(ConvertOptions(source=str(REFERENCE), output=str(path), in_process=True,
                               progress=False, check_disk=False, bits=4, expert_bits=4))
    return path


def page_cache(path: Path, drop: bool = False) -> float:
    """Read every shard once (warm), or drop its pages (cold); seconds taken."""
    t = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 16 << 20):
                    pass
        finally:
            os.close(fd)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------- one run


def peak_rss() -> int:
    """This process's peak RSS in bytes. Linux: VmHWM, which starts afresh at exec
    (ru_maxrss keeps the parent's peak across fork and exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if platform.system() == "Darwin" else rss * 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (MLX's and the readers')."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(args) -> int:
    """One configuration: load, generate, report JSON on the last stdout line."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step

    from turboquant.runtime import expert_cache, expert_stats, load

    budget = args.budget if args.budget != "resident" else None
    t0 = time.perf_counter()
    model, tokenizer = load(args.model, expert_budget=budget,
                            expert_prefetch=args.prefetch)
    load_s = time.perf_counter() - t0
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = mx.array(tokenizer.encode(args.prompt)[: args.prompt_tokens])
    tokens, t_first, cpu_first = [], None, None
    t_start = time.perf_counter()
    for tok, _ in generate_step(prompt, model, max_tokens=args.tokens,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        if t_first is None:
            t_first, cpu_first = time.perf_counter(), cpu_seconds()
            if expert_cache(model) is not None:
                expert_cache(model).reset_stats()  # decode-phase stats
    t_end, cpu_end = time.perf_counter(), cpu_seconds()
    stats = expert_stats(model)
    rss = peak_rss()
    print(json.dumps({
        "load_s": load_s, "prefill_s": t_first - t_start, "prompt_tokens": int(prompt.size),
        "decode_tps": (len(tokens) - 1) / (t_end - t_first), "tokens": tokens,
        "cpu_per_token": (cpu_end - cpu_first) / max(1, len(tokens) - 1),
        "weights_bytes": weights, "peak_rss": rss, "mlx_peak": mx.get_peak_memory(),
        "stats": stats.as_dict() if stats else None,
    }))
    return 0


def run_config(model: Path, budget: str, args, prefetch=False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--budget", budget,
           "--tokens", str(args.tokens), "--prompt", args.prompt,
           "--prompt-tokens", str(args.prompt_tokens)]
    if prefetch:
        cmd.append("--prefetch")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{budget} on {model.name} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the table


UNIT = ["GB", 1e9]  # set per table: MB for the small reference model


def gb(n: float) -> str:
    return f"{n / UNIT[1]:.3f}" if n < UNIT[1] else f"{n / UNIT[1]:.2f}"


def measure(name: str, model: Path, args, out: list[str]) -> dict:
    def say(line=""):
        print(line, flush=True)
        out.append(line)

    warm = page_cache(model)
    say(f"## {name}: {model.name} (page cache warmed: read in {warm:.1f} s)")
    configs = [("resident", "resident", False)]
    configs += [(b, b, False) for b in args.budgets]
    if args.prefetch_row:
        configs.append(("25%", "25% +prefetch", True))
    results = {}
    for rep in range(args.repeat):  # interleaved, so load drifts hit every config alike
        for budget, label, prefetch in configs:
            r = run_config(model, budget, args, prefetch)
            print(f"  {label} (run {rep + 1}): {r['decode_tps']:.2f} tok/s, "
                  f"load {r['load_s']:.1f} s", flush=True)
            if label in results and results[label]["tokens"] != r["tokens"]:
                raise RuntimeError(f"{label}: two runs generated different tokens")
            if label not in results or r["decode_tps"] > results[label]["decode_tps"]:
                results[label] = r
    if args.cold:
        page_cache(model, drop=True)
        results["25% cold"] = run_config(model, "25%", args)
        page_cache(model)
    res = results["resident"]
    first = next(r for r in results.values() if r["stats"])
    experts = first["stats"]["expert_bytes"]
    non_expert = first["weights_bytes"]
    UNIT[:] = ["GB", 1e9] if experts >= 1e9 else ["MB", 1e6]
    u = UNIT[0]
    say(f"experts {gb(experts)} {u}, non-expert weights {gb(non_expert)} {u} as loaded, "
        f"prompt {res['prompt_tokens']} tokens, {args.tokens} generated (greedy)")
    say("")
    say(f"| config | budget {u} | decode tok/s | vs resident | CPU s/token | vs resident | "
        f"hit rate | read {u} | read GB/s | peak RSS {u} | RSS bound {u} | same tokens |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, r in results.items():
        s = r["stats"]
        ratio = r["decode_tps"] / res["decode_tps"]
        cpu = r["cpu_per_token"] / res["cpu_per_token"]
        same = "yes" if r["tokens"] == res["tokens"] else "NO"
        head = (f"| {label} | {gb(s['budget_bytes']) if s else '(all ' + gb(experts) + ')'} | "
                f"{r['decode_tps']:.2f} | {ratio:.2f} | {r['cpu_per_token']:.3f} | {cpu:.2f} | ")
        if s is None:
            say(head + f"- | - | - | {gb(r['peak_rss'])} | - | - |")
            continue
        bound = s["budget_bytes"] + non_expert + 1e9
        flag = "" if r["peak_rss"] <= bound else " (over)"
        say(head + f"{s['hit_rate']:.1%} | {gb(s['bytes_read'])} | "
            f"{s['read_throughput'] / 1e9:.2f} | {gb(r['peak_rss'])}{flag} | {gb(bound)} | "
            f"{same} |")
    say("")
    q = results.get("25%")
    if q:
        ratio = q["decode_tps"] / res["decode_tps"]
        cpu = res["cpu_per_token"] / q["cpu_per_token"]
        say(f"target, 25% budget, warm page cache: {ratio:.0%} of resident decode speed, "
            f"{cpu:.0%} by CPU time per token (target >= 50%): "
            f"{'met' if min(ratio, cpu) >= 0.5 else 'NOT met'}")
    over = [k for k, r in results.items() if r["stats"] and
            r["peak_rss"] > r["stats"]["budget_bytes"] + non_expert + 1e9]
    say(f"target, peak RSS <= budget + non-expert weights + 1 GB: "
        f"{'met at every budget' if not over else 'NOT met at ' + ', '.join(over)}")
    say("")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "turboquant-bench"),
                    help="where the repos go, kept between runs "
                    "(default: $TMPDIR/turboquant-bench)")
    ap.add_argument("--expert-gb", type=float, default=8.0, help="synthetic experts, GB")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="per-expert intermediate size")
    ap.add_argument("--budgets", default="10%,25%,50%,100%")
    ap.add_argument("--tokens", type=int, default=24, help="tokens to generate per run")
    ap.add_argument("--ref-tokens", type=int, default=64, help="tokens on the reference MoE")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (best counts)")
    ap.add_argument("--no-prefetch-row", dest="prefetch_row", action="store_false")
    ap.add_argument("--cold", action="store_true",
                    help="add a 25%% run with this model's pages dropped from the page cache")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    # child mode
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    ap.add_argument("--prefetch", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    import mlx.core as mx

    cmd = "python benchmarks/streaming.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = [
        "# Expert streaming benchmark",
        "",
        f"reproduce: {cmd.strip()}",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"MLX {mx.__version__} on {mx.default_device()}",
        "decode tok/s: tokens after the first / their wall time (best of --repeat runs); CPU "
        "s/token: user + system time of the run's process over the decode, a steadier "
        "measure on a shared machine; hit rate, read GB and read "
        "GB/s over the decode; peak RSS: VmHWM of the run's own process; RSS bound: "
        "budget + non-expert weights + 1 GB; same tokens: greedy tokens equal the resident run's",
        "",
    ]
    for line in out:
        print(line)
    t = time.perf_counter()
    if not args.skip_synthetic:
        model = synthetic_repo(work, args.expert_gb, args.layers, args.hidden, args.inter)
        prompt = args.prompt or "The quick brown fox jumps over the lazy dog"
        a = argparse.Namespace(**{**vars(args), "prompt": prompt})
        measure("synthetic MoE, random routing", model, a, out)
    if not args.skip_reference and REFERENCE.is_dir():
        model = reference_repo(work)
        text = (ROOT / "reference" / "heldout.txt").read_text()[:400]
        a = argparse.Namespace(**{**vars(args), "prompt": text, "tokens": args.ref_tokens,
                                  "prompt_tokens": 32})
        measure("reference MoE (pystd-moe, 4-bit), real routing", model, a, out)
    out.append(f"total benchmark time {time.perf_counter() - t:.0f} s")
    print(out[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
