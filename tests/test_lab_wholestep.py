"""benchmarks/lab_wholestep.py (session 20's negative lab, kept as a starting point): on the
CPU, with the pure-MLX kernels, the whole single-token step compiled as one function gives
mlx-lm's step's logits exactly (on CUDA it did not: see the script's docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode  # noqa: E402  (the benchmark scripts)
import lab_wholestep  # noqa: E402


def test_the_whole_compiled_step_keeps_mlx_lms_logits_on_the_cpu(monkeypatch):
    monkeypatch.setattr(decode, "LLAMA3_8B", dict(
        decode.LLAMA3_8B, num_hidden_layers=2, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        with decode.reference_kernel("linear_group", True), \
                decode.reference_kernel("matvec", True):
            model = decode.build("tq3")
            got = lab_wholestep.compare(model, mx.array(list(range(1, 17))), tokens=6)
    finally:
        mx.set_default_device(device)
    assert got["same"] == got["tokens"] == 6
    assert got["diff"] <= 1e-5 * got["scale"] and got["scale"] > 0
