"""What the host builds for one decode step, per decoder layer, on the CUDA path.

Decode on MLX's CUDA backend is bound by the host: each token's graph is built in Python
and every operation in it is encoded (a launch ~5 us with graphs off). This counts, per
decoder layer of one steady decode step, the MLX operations by name, the custom-kernel
calls among them, and the microseconds of graph building, for mlx-lm's affine 4-bit and
TurboQuant 3-bit as `benchmarks/decode.py` builds them (the dense Llama-3-8B shape, or
`--moe` the Qwen3-30B-A3B shape).

It runs on the CPU: `mx.fast.cuda_kernel` is replaced by a stand-in that returns outputs
of the right shapes, and the kernel dispatch is told it is on CUDA, so TurboQuant layers
build exactly the graph they build on the GPU machine (fused blocks, grouped linears,
the gathered experts' pair arrays); MLX's rope, rms_norm and attention are one stand-in
node each, as on the GPU (on the CPU they fall back to several ops). Per-layer figures
are the difference between a model of `--layers` + 2 and one of `--layers` decoder
layers, divided by 2 (embedding, final norm and lm_head cancel out). Building times are
this machine's; the op counts are exact.

Reproduce:  .venv/bin/python tools/host_ops.py [--moe]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # kv.py, decode.py

from kv import call_events, graph_ops  # noqa: E402  (benchmarks/kv.py)

_ZEROS: dict = {}


def _stand_in(inputs, shapes, dtypes) -> list[mx.array]:
    """Outputs of the given shapes that depend on `inputs`: one `Depends` node over zeros
    built once, as a single GPU kernel is one node."""
    outs = []
    for shape, dtype in zip(shapes, dtypes):
        key = (tuple(shape), dtype)
        if key not in _ZEROS:
            _ZEROS[key] = mx.zeros(key[0], dtype)
            mx.eval(_ZEROS[key])
        outs.append(_ZEROS[key])
    return mx.depends(outs, [x for x in inputs if isinstance(x, mx.array)])


class _StandInKernel:
    """`mx.fast.cuda_kernel`'s object off the GPU."""

    calls = 0

    def __init__(self, name: str, **_):
        self.name = name

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_):
        _StandInKernel.calls += 1
        return _stand_in(inputs, output_shapes, output_dtypes)


def _on_fake_cuda(patch=setattr) -> None:
    """Make TurboQuant's CUDA path run here with stand-in kernels, and MLX's fused ops one
    node each as on the GPU (on the CPU rope, rms_norm and attention fall back to several
    ops). Before anything binds a decode call: bound calls are kept per device type, not
    per `dispatch.backend()`. `patch(obj, name, value)`: setattr, or a test's
    `monkeypatch.setattr`, which undoes it all afterwards."""
    from turboquant.kernels import cuda_attend, cuda_gemv, cuda_linear, cuda_rotate, dispatch

    patch(mx.fast, "cuda_kernel", lambda **kw: _StandInKernel(**kw))
    for module in (cuda_attend, cuda_gemv, cuda_linear, cuda_rotate):
        # the kernel builders' caches of their own while faked: no real kernel is reused
        # here, no stand-in outlives the fake
        patch(module, "_kernel", functools.lru_cache(maxsize=None)(module._kernel.__wrapped__))
    patch(dispatch, "backend", lambda: "cuda")
    patch(mx.fast, "rope", lambda x, *a, **k: _stand_in([x], [x.shape], [x.dtype])[0])
    patch(mx.fast, "rms_norm", lambda x, w, eps: _stand_in([x, w], [x.shape], [x.dtype])[0])
    patch(mx.fast, "scaled_dot_product_attention", lambda q, k, v, **kw: _stand_in(
        [q, k, v], [(*q.shape[:-1], v.shape[-1])], [q.dtype])[0])


def step_cost(variant: str, layers: int, moe: bool, steps: int) -> dict:
    """Median graph-building seconds of a decode step, its ops by name and kernel calls,
    with the runtime switches the variant's suffixes name (`decode.variant_switches`)."""
    import decode

    with decode.variant_switches(variant):
        return _step_cost(decode, variant, layers, moe, steps)


def _step_cost(decode, variant: str, layers: int, moe: bool, steps: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    # a small vocabulary: embedding and lm_head cancel out of the per-layer figures
    (decode.QWEN3_30B_A3B if moe else decode.LLAMA3_8B).update(num_hidden_layers=layers,
                                                               vocab_size=1024)
    model = decode.build(variant, moe=moe)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 9))]), cache=cache))  # a short prompt first
    token = mx.array([[3]])
    times, ops, calls = [], {}, 0
    for i in range(steps):
        before = _StandInKernel.calls
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        times.append(time.perf_counter() - t0)
        if i == steps - 1:
            ops, calls = graph_ops([logits]), _StandInKernel.calls - before
        mx.eval(logits)
    events = _call_events(functools.partial(model, token, cache=cache))
    del model, cache
    return dict(seconds=statistics.median(times), ops=ops, calls=calls, **events)


def _call_events(step) -> dict:
    """`kv.call_events` of a step, the stand-ins' own calls excluded."""
    return call_events(step, skip=(__file__,))


def per_layer(variant: str, layers: int, moe: bool, steps: int) -> dict:
    small = step_cost(variant, layers, moe, steps)
    big = step_cost(variant, layers + 2, moe, steps)
    names = set(small["ops"]) | set(big["ops"])
    ops = {n: (big["ops"].get(n, 0) - small["ops"].get(n, 0)) / 2 for n in names}
    return dict(us=(big["seconds"] - small["seconds"]) / 2 * 1e6,
                ops={n: v for n, v in ops.items() if v}, calls=(big["calls"] - small["calls"]) / 2,
                py_calls=(big["py_calls"] - small["py_calls"]) / 2,
                c_calls=(big["c_calls"] - small["c_calls"]) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe", action="store_true", help="the Qwen3-30B-A3B shape")
    ap.add_argument("--variants", default="affine4,tq3")
    ap.add_argument("--layers", type=int, default=2, help="the smaller model's decoder layers")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per model")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    _on_fake_cuda()
    shape = "Qwen3-30B-A3B" if args.moe else "Llama-3-8B"
    print(f"host side of one decode step per decoder layer, {shape} shape, CUDA path with "
          f"stand-in kernels on the CPU ({args.steps} steps, median)")
    rows = {v: per_layer(v, args.layers, args.moe, args.steps) for v in args.variants.split(",")}
    print(f"{'variant':<10} {'build us':>9} {'py calls':>9} {'C calls':>8} {'ops':>6} "
          f"{'kernel calls':>13}  ops by name")
    for v, r in rows.items():
        names = ", ".join(f"{n} {c:g}" for n, c in sorted(r["ops"].items(), key=lambda kv: -kv[1]))
        print(f"{v:<10} {r['us']:9.1f} {r['py_calls']:9g} {r['c_calls']:8g} "
              f"{sum(r['ops'].values()):6g} {r['calls']:13g}  {names}")
    print("(py calls, C calls: Python functions and builtins called while building one step's "
          "graph, per layer, the stand-ins' own excluded; exact, unlike the times)")
    flag = " --moe" if args.moe else ""
    print(f"reproduce: .venv/bin/python tools/host_ops.py{flag} --variants {args.variants}")


if __name__ == "__main__":
    main()
