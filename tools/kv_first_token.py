"""Why the first decode token is slow with the TurboQuant KV cache: its pieces, timed apart.

On the H200 the first decode token of an 8-layer bf16 8B-shaped Llama after a 1024-token
prefill took 13.2 s with the K4/V3 cache on a fresh machine (6.7 s in a second process)
against 0.44 s (0.11 s) with the fp16 cache. This script runs that first decode step one
layer at a time and one piece at a time, with mx.eval + mx.synchronize after each piece,
so each piece's one-time costs (JIT compiles of MLX's own kernels and of ours, codebooks,
rotations) land on that piece:

    projections + rope | flush (compress what left the window) | cache update | parts() |
    cuda_kv.prepare | tq_kv_partial | tq_kv_merge | rest of the layer (o_proj, MLP)

The fp16 cache runs first (the pieces both share, e.g. the linears, compile there), then
K4V3; each gets a table in ms: the first layer, the other layers summed, and all layers.
Layers differ: the first and last two KV layers are protected at 8 bits (other kernel
template values), and each layer has its own rotation seed.

Off CUDA (here, CPU) the CUDA pieces are skipped with a note and the attention is the
pure-MLX reference, timed as one piece. Run it twice in one call on the GPU machine to
see what MLX's on-disk kernel cache saves a second process:

    python tools/kv_first_token.py; python tools/kv_first_token.py
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

SHAPE = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
             vocab_size=128256, rope_theta=500000.0)


def timed(rows: dict, layer: int, piece: str, fn):
    """fn() evaluated and synchronized; its seconds added to rows[piece][layer]."""
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    rows.setdefault(piece, {})[layer] = rows.get(piece, {}).get(layer, 0.0) + time.perf_counter() - t0
    return out


def _arrays(parts) -> list:
    pk = parts.packed
    xs = [parts.sink_k, parts.sink_v, parts.tail_k, parts.tail_v]
    xs += [] if pk is None else [pk.k_codes, pk.k_norms, pk.v_codes, pk.v_norms]
    return [x for x in xs if x is not None]


def attention(rows: dict, i: int, attn, x, cache, on_cuda: bool):
    """One layer's attention, piece by piece -> (B, 1, hidden)."""
    from turboquant.kernels import cuda_kv, cuda_kv_plan
    from turboquant.kernels.kv_reference import tq_attention

    b, n, _ = x.shape

    def qkv():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=cache.offset), attn.rope(k, offset=cache.offset), v

    q, k, v = timed(rows, i, "projections + rope", qkv)
    if not hasattr(cache, "parts"):  # mlx-lm's fp16 cache
        keys, values = timed(rows, i, "cache update", lambda: cache.update_and_fetch(k, v))
        out = timed(rows, i, "sdpa", lambda: mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=attn.scale))
    else:
        timed(rows, i, "flush (compress)", lambda: (cache._flush(), _arrays(cache.parts()))[1])
        timed(rows, i, "cache update", lambda: _arrays(cache.update_and_fetch(k, v)[0]))
        parts = cache.parts()
        timed(rows, i, "parts()", lambda: _arrays(cache.parts()))
        launch = None

        def prepare():
            launch = cuda_kv.prepare(q, parts, attn.scale)
            mx.eval(launch.layout.consts, launch.layout.unrot)
            return launch

        if on_cuda:
            try:
                launch = timed(rows, i, "cuda_kv.prepare", prepare)
            except NotImplementedError as e:
                print(f"  layer {i}: kernel declined ({e}): reference")
        if launch is None:
            out = timed(rows, i, "reference attention", lambda: tq_attention(q, parts, attn.scale))
        else:
            lay = launch.layout
            ml, acc = timed(rows, i, "tq_kv_partial", lambda: cuda_kv._kernel("tq_kv_partial")(
                inputs=launch.inputs, template=lay.partial_template, grid=lay.partial_grid,
                threadgroup=(cuda_kv_plan.NT, 1, 1), output_shapes=lay.partial_shapes,
                output_dtypes=[mx.float32, mx.float32]))
            out = timed(rows, i, "tq_kv_merge", lambda: cuda_kv._kernel("tq_kv_merge")(
                inputs=[ml, acc, lay.unrot], template=lay.merge_template, grid=lay.merge_grid,
                threadgroup=(cuda_kv_plan.NT, 1, 1), output_shapes=[lay.out_shape],
                output_dtypes=[lay.out_dtype])[0])
    return timed(rows, i, "rest of the layer", lambda: attn.o_proj(
        out.transpose(0, 2, 1, 3).reshape(b, n, -1)))


def first_token(model, cache, prompt, on_cuda: bool) -> tuple[dict, float]:
    """Prefill `prompt`, then the first decode step piece by piece:
    ({piece: {layer: seconds}}, the step's wall seconds)."""
    mx.eval(model(prompt, cache=cache))
    mx.synchronize()
    t0 = time.perf_counter()
    rows: dict = {}
    x = timed(rows, 0, "embedding", lambda: model.model.embed_tokens(mx.array([[1]])))
    for i, (layer, c) in enumerate(zip(model.model.layers, cache)):
        h = x + attention(rows, i, layer.self_attn, layer.input_layernorm(x), c, on_cuda)
        x = timed(rows, i, "rest of the layer",
                  lambda: h + layer.mlp(layer.post_attention_layernorm(h)))
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear
    timed(rows, 0, "norm + lm_head", lambda: head(model.model.norm(x)))
    return rows, time.perf_counter() - t0


def report(name: str, rows: dict, wall: float, per_layer: bool = False):
    """Pieces in ms: layer 0, the other layers together, all; with `per_layer` a column
    for every layer instead (is a cost paid once, or by every layer?)."""
    print(f"\n{name}: first decode token, pieces in ms (eval + synchronize after each)")
    layers = sorted({k for per in rows.values() for k in per})
    heads = [f"layer {k}" for k in layers] if per_layer else ["layer 0", "layers 1.."]
    print(f"{'piece':<22} " + " ".join(f"{h:>9}" for h in heads) + f" {'all':>9}")
    total = 0.0
    for piece, per in rows.items():
        if per_layer:
            cells = [per.get(k, 0.0) for k in layers]
        else:
            cells = [per.get(0, 0.0), sum(v for k, v in per.items() if k > 0)]
        total += sum(cells)
        print(f"{piece:<22} " + " ".join(f"{c * 1e3:9.1f}" for c in cells)
              + f" {sum(cells) * 1e3:9.1f}")
    print(f"{'sum of pieces':<22} " + " ".join(f"{'':>9}" for _ in heads)
          + f" {total * 1e3:9.1f}   (wall {wall * 1e3:.1f})")


def main(argv=None):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from turboquant.kernels import dispatch
    from turboquant.runtime.kvcache import make_turboquant_cache

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="prefill tokens")
    ap.add_argument("--caches", nargs="+", default=["fp16", "K4V3"], choices=["fp16", "K4V3"])
    ap.add_argument("--hidden", type=int, default=None, help="smaller model (smoke test)")
    ap.add_argument("--per-layer", action="store_true", help="a column for every layer")
    args = ap.parse_args(argv)
    shape = dict(SHAPE, num_hidden_layers=args.layers)
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                     num_attention_heads=args.hidden // 128, num_key_value_heads=2,
                     vocab_size=1024)
    on_cuda = dispatch.backend() == "cuda"
    print(f"mlx {mx.__version__}, {mx.default_device()}, backend {dispatch.backend()}; "
          f"bf16 Llama {shape['hidden_size']} wide, {args.layers} layers, {args.context}-token prefill")
    if not on_cuda:
        print("note: not on CUDA: the kernel pieces (cuda_kv.prepare, tq_kv_partial, "
              "tq_kv_merge) are skipped, the attention is the pure-MLX reference")
    model = llama.Model(llama.ModelArgs.from_dict(shape))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, shape["vocab_size"], (1, args.context))
    for name in args.caches:
        cache = (make_prompt_cache(model) if name == "fp16"
                 else make_turboquant_cache(model, bits_k=4, bits_v=3))
        report(name, *first_token(model, cache, prompt, on_cuda), per_layer=args.per_layer)
        del cache
        mx.clear_cache()
    print("\nreproduce: python tools/kv_first_token.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
