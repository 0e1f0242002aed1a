"""`turboquant plan`'s projection against MLX's measured peak memory, for the two reference
models converted by the pipeline and run by the runtime (a fresh process each, so the
peak is the run's own): within 15%. benchmarks/plan.py runs the same at more contexts.

The projection compared is weights + KV cache + workspace (what `mx.get_peak_memory()`
counts); the reserve is head-room for what MLX does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.pipeline.fit import GB, Machine, project
from turboquant.pipeline.fit_weights import inventory
from turboquant.pipeline.sources import LocalSource

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "reference" / "models"
HELDOUT = ROOT / "reference" / "heldout.txt"
TOLERANCE = 0.15

# Load a repo, prefill `context - new` tokens of held-out text, generate `new` tokens (the
# way `turboquant generate` does, through mlx-lm's stream_generate) and report MLX's peak.
_MEASURE = r"""
import json, sys
import mlx.core as mx
from mlx_lm import stream_generate
from turboquant.runtime import load

path, context, new, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mx.reset_peak_memory()
model, tokenizer = load(path)
mx.eval(model.parameters())
weights = mx.get_active_memory()
ids = tokenizer.encode(open(text).read())
ids = (ids * (context // max(len(ids), 1) + 1))[: context - new]
made = 0
for r in stream_generate(model, tokenizer, ids, max_tokens=new):
    made = r.generation_tokens
print(json.dumps({"peak": mx.get_peak_memory(), "weights": weights, "prompt": len(ids),
                  "generated": made}))
"""


def convert_reference(name: str, out: Path) -> Path:
    convert(ConvertOptions(str(REFERENCE / name), str(out), in_process=True, progress=False,
                           check_disk=False))
    return out


def measure_peak(repo: Path, context: int, new: int = 4) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(repo), str(context), str(new),
                        str(HELDOUT)], capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"measuring {repo} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def projected_peak(repo: Path, context: int) -> tuple[int, int]:
    """(weights + KV + workspace, weights) as `turboquant plan` projects them here."""
    p = project(inventory(LocalSource(repo)), context, Machine("cpu", 24 * GB, "test"))
    return p.peak, p.weights


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pystd-dense", "pystd-moe"])
def test_projection_matches_measured_peak(name, tmp_path):
    repo = convert_reference(name, tmp_path / name)
    context = 512
    measured = measure_peak(repo, context)
    peak, weights = projected_peak(repo, context)
    print(f"{name} at {context} tokens: projected {peak / 1e6:.2f} MB, measured "
          f"{measured['peak'] / 1e6:.2f} MB ({peak / measured['peak'] - 1:+.1%})")
    assert abs(weights - measured["weights"]) <= 0.02 * measured["weights"]
    assert abs(peak - measured["peak"]) <= TOLERANCE * measured["peak"]
    # the source checkpoint projects the same (the recipe the conversion used)
    assert projected_peak(REFERENCE / name, context) == (peak, weights)
