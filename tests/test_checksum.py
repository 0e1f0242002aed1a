"""pipeline/checksum.py: the fast CRC-32 gives zlib's values (the ledgers' `source_crc32`
must not depend on which is installed)."""

import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.pipeline.checksum import crc32


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), start=st.integers(0, 2**32 - 1),
       cut=st.integers(0, 5000))
def test_crc32_matches_zlib_and_continues(data, start, cut):
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, start) == zlib.crc32(data, start)
    cut = min(cut, len(data))
    assert crc32(data[cut:], crc32(data[:cut])) == zlib.crc32(data)


def test_crc32_reads_arrays_and_memoryviews():
    rows = np.random.default_rng(3).integers(0, 2**16, (300, 1000), dtype=np.uint16)
    assert crc32(rows) == zlib.crc32(rows.tobytes())
    assert crc32(memoryview(rows).cast("B")) == zlib.crc32(rows.tobytes())


def test_the_fast_crc_is_installed():
    """zlib-ng is a dependency: the pipeline's CRC is not the standard library's."""
    assert crc32.__module__.startswith("zlib_ng")
