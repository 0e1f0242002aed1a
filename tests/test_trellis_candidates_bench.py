"""benchmarks/trellis_candidates.py (`codec.py --trellis-candidates`): the candidate
codebooks, the SASS loop it counts, and a tiny table end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trellis_candidates as bench  # noqa: E402  (the benchmark script)

from turboquant.stages import trellis  # noqa: E402
from turboquant.stages.trellis import TrellisCode  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   IMAD R4, R5, R6, R7 ;
        /*0040*/                   FFMA R8, R9, R10, R8 ;
        /*0050*/                   IDP.4A.U8.U8 R4, R4, R5, R6 ;
        /*0060*/              @!P1 BRA 0x30 ;
        /*0070*/              @!P2 BRA 0x30 ;
        /*0080*/                   EXIT ;
"""


def test_the_hot_loop_is_the_longest_innermost_one():
    insns = bench.parse_sass(SASS)
    assert [a for a, _ in insns] == list(range(0, 0x90, 0x10))
    loop = bench.hot_loop(insns)  # not 0x10-0x20 (shorter), not 0x30-0x70 (holds 0x30-0x60)
    assert [bench.opcode(t) for t in loop] == ["IMAD", "FFMA", "IDP.4A.U8.U8", "BRA"]
    assert bench.hot_loop(bench.parse_sass("        /*0000*/  EXIT ;\n")) == []


@pytest.mark.parametrize("values", [1, 2])
def test_the_candidate_codebooks(values):
    code = TrellisCode(12, 3, values)
    assert np.array_equal(bench.book("v1", code), trellis.codebook(code))
    for name in ("mad", "tri"):
        b = bench.book(name, code)
        assert b.shape == (4096, values) and not np.array_equal(b, trellis.codebook(code))
        assert abs(b.mean()) < 0.05 and 0.9 < b.std() < 1.1, name
    s = np.arange(4096, dtype=np.uint32)
    h = s * np.uint32(trellis.MUL[0]) + np.uint32(trellis.ADD[0])  # mad: no shift-xor
    total = sum(((h >> np.uint32(8 * i)) & 0xFF).astype(np.int64) for i in range(4))
    want = (total - 510) / trellis.BYTESUM_STD
    assert np.allclose(bench.book("mad", code)[:, 0], want, atol=1e-6)
    with pytest.raises(ValueError, match="unknown codebook"):
        bench.book("lattice", code)


def test_a_tiny_table(capsys):
    assert bench.main(["--states", "8", "--books", "v1,mad", "--cols", "512", "--rows", "2",
                       "--gemv", "64x256", "--repeats", "1", "--no-sass"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  8 ")]
    # k = 2, 3, 4 with V = 1, 2 (k = 4, V = 2 leaves no state bit at L = 8: skipped)
    assert len(rows) == 2 * 5 and {r[3] for r in rows} == {"v1", "mad"}
    assert all(float(r[6]) > 0 for r in rows)  # rel. MSE
    assert all(r[14] != "-" for r in rows if r[3] == "v1")  # the GEMV's ratio to scalar
    assert "reproduce: " in out


@pytest.mark.skipif(bench.sass_tools() is None, reason="nvcc, cuobjdump or nvdisasm missing")
def test_sass_counts_of_the_gemvs():
    """The counts the table prints: v1's trellis GEMV and the mad candidate (no shift-xor:
    two instructions a weight fewer) against the scalar kernel."""
    tools = bench.sass_tools()
    code = TrellisCode(12, 3, 1)
    v1, ops = bench.loop_count(*bench.trellis_source(code, "v1")[:1], tools,
                               bench.trellis_source(code, "v1")[1])
    mad, _ = bench.loop_count(*bench.trellis_source(code, "mad")[:1], tools,
                              bench.trellis_source(code, "mad")[1])
    scalar, _ = bench.loop_count(*bench.scalar_source(3)[:1], tools, bench.scalar_source(3)[1])
    assert ops["IDP.4A.U8.U8"] == 32 * 4  # one dp4a a weight, 4 rows of 32
    assert 6 < v1 < 12 and 1.5 < v1 - mad < 2.5 and scalar < v1 / 2
