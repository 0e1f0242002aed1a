"""`turboquant plan` on the header-exact layouts of the big published releases (sparse
files: the headers are real, the data is zeros that take no disk): DeepSeek-V3.x (FP8 with
128x128 block scales), Kimi K2 (the same, 384 experts, about 1T parameters) and gpt-oss-120b
(MXFP4 experts). Parameters are counted once per weight (scales are not parameters), source
bytes as stored (FP8: one byte a weight)."""

from __future__ import annotations

import json
import math

import pytest
from published_checkpoints import TAG_SIZE, layout, write_layout

from turboquant.plan import main

# (layout, recipe, parameters as the release states them (within 0.5%), most the coded
# weights may take of the published bytes: FP8 is 8 bits a weight, MXFP4 4.25)
RELEASES = [("DeepSeek-V3.1", None, 685e9, 0.5), ("Kimi-K2", "deepseek_v2", 1.03e12, 0.5),
            ("gpt-oss-120b", None, 116.8e9, 1.0)]


def expected(release: str) -> tuple[int, int]:
    """(parameters, bytes) straight from the layout: an MXFP4 byte holds two weights."""
    params = nbytes = 0
    for name, dtype, shape in layout(release):
        n = math.prod(shape)
        nbytes += n * TAG_SIZE[dtype]
        if name.endswith(("_scale_inv", "_scales")):
            continue
        params += 2 * n if name.endswith("_blocks") else n
    return params, nbytes


@pytest.mark.parametrize("name,recipe,stated,ratio", RELEASES, ids=[r[0] for r in RELEASES])
def test_plan_of_a_published_release(tmp_path, capsys, name, recipe, stated, ratio):
    src = write_layout(tmp_path / name, name)
    args = [str(src), "--json", "--memory-gb", "2048"] + (["--recipe", recipe] if recipe else [])
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["problems"] == []
    params, nbytes = expected(name)
    assert d["source"] == {"parameters": params, "bytes": nbytes}
    assert abs(params - stated) < 0.005 * stated
    assert d["verdict"] == "RESIDENT"
    assert 0.2 * nbytes < d["weights"] < ratio * nbytes  # coded at 3-4 bits
