"""tools/ncu_summary.py: GPU time a decode token, per kernel, from ncu's summary CSV."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import ncu_summary  # noqa: E402  (a profiling tool)

CSV = '''==PROF== Connected to process 1 (/usr/bin/python3)
one decode token at 1024 context (ms):
"Process ID","Kernel Name","Grid Size","Invocations","Metric Name","Minimum","Maximum","Average"
"1","custom_kernel_tq_kv_partial_x(const float *, float *)","(8, 8, 1)","16","gpu__time_duration.sum","90,592.00","94,016.00","92,000.00"
"1","void mlx::rope_single<__nv_bfloat16, 0, 1>(const T1 *)","(1, 1, 1)","32","gpu__time_duration.sum","3,648.00","4,320.00","4,000.00"
rc=0
'''


def test_per_token_time_by_kernel(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(CSV)
    table = ncu_summary.per_token(ncu_summary.rows(str(path)), tokens=4)
    assert [(round(us, 3), name, n) for us, name, _, n, _ in table] == [
        (368.0, "custom_kernel_tq_kv_partial_x", 16),  # 16 x 92 us over 4 tokens
        (32.0, "void mlx::rope_single<__nv_bfloat16, 0, 1>", 32),
    ]
    assert table[0][2] == "(8, 8, 1)" and table[0][4] == 92.0
