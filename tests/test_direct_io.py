"""DirectAppender: the bytes in the file are the bytes written, whatever the start
position, the sizes of the writes, the flushes between them and whether the filesystem
took O_DIRECT (the buffered fallback writes the same)."""

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from turboquant.pipeline import direct_io
from turboquant.pipeline.direct_io import BLOCK, DirectAppender


@pytest.fixture(params=["direct", "buffered"])
def mode(request, monkeypatch):
    monkeypatch.setenv(direct_io.DIRECT_ENV, "1" if request.param == "direct" else "0")
    monkeypatch.setattr(direct_io, "STAGING", 4 * BLOCK)  # several buffers a test
    return request.param


writes = st.lists(st.tuples(st.integers(0, 6 * BLOCK), st.booleans()), max_size=12)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 3 * BLOCK), plan=writes)
def test_bytes_equal_what_was_written(tmp_path_factory, mode, start, plan):
    path = tmp_path_factory.mktemp("d") / "shard"
    head = os.urandom(start)
    path.write_bytes(head)
    want = bytearray(head)
    out = DirectAppender(path, start)
    for size, flush in plan:
        data = os.urandom(size)
        out.write(data)
        want += data
        if flush:
            out.sync()
            assert path.read_bytes() == want  # flushed: the file is exactly the bytes so far
    out.close()
    assert path.read_bytes() == want
    assert out.pos == len(want)


def test_direct_is_used_where_the_filesystem_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv(direct_io.DIRECT_ENV, "1")
    path = tmp_path / "shard"
    path.write_bytes(b"x" * 10)
    out = DirectAppender(path, 10)
    out.write(b"y" * (3 * direct_io.STAGING + 5))
    out.close()
    assert path.read_bytes() == b"x" * 10 + b"y" * (3 * direct_io.STAGING + 5)
    if hasattr(os, "O_DIRECT"):  # where the filesystem opens it, it is used
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
        except OSError:
            return
        assert out.direct


def test_a_failed_write_is_raised_to_the_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_io, "STAGING", 4 * BLOCK)
    path = tmp_path / "shard"
    path.write_bytes(b"")
    out = DirectAppender(path, 0)
    os.close(out.fd)  # the device write fails (EBADF) on the writer's thread
    with pytest.raises(OSError):
        out.write(b"z" * (4 * BLOCK * 3))  # fills buffers until one's failure is seen
        out.flush()
    out.fd = -1
