"""Every runtime switch the code reads (a `TURBOQUANT_*` environment variable in kernels/,
runtime/ or stages/) is in a user guide's table: docs/run.md's "Runtime switches", or
docs/kv-cache.md's for the KV kernels."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _switches_read() -> set[str]:
    names = set()
    for folder in ("kernels", "runtime", "stages"):
        for path in (ROOT / folder).glob("*.py"):
            names |= set(re.findall(r'environ(?:\.get\(|\[)\s*"(TURBOQUANT_[A-Z0-9_]+)"',
                                    path.read_text()))
    return names


def _table_rows(guide: str) -> set[str]:
    text = (ROOT / "docs" / guide).read_text()
    return set(re.findall(r"^\| `(TURBOQUANT_[A-Z0-9_*]+)`", text, flags=re.M))


def test_every_runtime_switch_is_in_a_guides_table():
    read = _switches_read()
    assert "TURBOQUANT_CUDA_GATHER_MM" in read and len(read) > 10  # the scan finds them
    documented = _table_rows("run.md") | _table_rows("kv-cache.md")
    missing = sorted(n for n in read if n not in documented)
    assert not missing, f"switches read by the code but in no guide's table: {missing}"
