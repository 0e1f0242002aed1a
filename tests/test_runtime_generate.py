"""`turboquant generate` end to end, in a subprocess, on a tiny TurboQuant repo."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_runtime_fixtures import make_checkpoint, write_repo


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "turboquant", "generate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("tq") / "tiny-moe"
    config, weights = make_checkpoint("qwen3_moe")
    write_repo(path, config, weights, bits=3)
    return path


def test_generate_streams_text_and_reports_speed(repo):
    r = _run("--model", repo, "--prompt", "def add(a, b):", "--max-tokens", 8)
    assert r.returncode == 0, r.stderr
    assert "prompt:" in r.stderr and "tokens/s" in r.stderr
    assert "generation: " in r.stderr and "peak memory:" in r.stderr
    assert r.stdout.endswith("\n")


def test_sampling_is_reproducible_with_a_seed_and_chat_template_applies(repo):
    args = ("--model", repo, "--prompt", "hello", "--max-tokens", 6, "--temp", 0.8,
            "--top-p", 0.9, "--seed", 3, "--chat")
    a, b = _run(*args), _run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    assert "no chat template" not in a.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path):
    r = _run("--model", tmp_path / "absent", "--prompt", "x")
    assert r.returncode == 1
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_bad_arguments_are_refused_before_loading(tmp_path):
    r = _run("--model", tmp_path, "--prompt", "x", "--max-tokens", 0)
    assert r.returncode == 2 and "--max-tokens" in r.stderr
    r = _run("--help")
    assert r.returncode == 0 and "--chat" in r.stdout


def test_kv_flags_compress_the_cache_and_bad_combinations_are_refused(repo):
    base = ("--model", repo, "--prompt", "def add(a, b):", "--max-tokens", 12)
    plain = _run(*base)
    # a window as large as the whole sequence: nothing is compressed, output unchanged
    wide = _run(*base, "--kv-bits-k", 4, "--kv-bits-v", 3, "--kv-window", 64, "--kv-sink", 2)
    assert plain.returncode == 0 and wide.returncode == 0, wide.stderr
    assert wide.stdout == plain.stdout
    # a tiny window forces compression: still runs end to end
    small = _run(*base, "--kv-bits-k", 4, "--kv-bits-v", 3, "--kv-window", 1, "--kv-sink", 1)
    assert small.returncode == 0, small.stderr
    assert "TurboQuant layers (fp16: " in small.stderr and "x less)" in small.stderr
    assert "decode attention: the pure-MLX reference" in small.stderr
    assert "KV cache:" not in plain.stderr
    bad = _run(*base, "--kv-bits-k", 16, "--kv-bits-v", 3)
    assert bad.returncode == 2 and "--kv-bits" in bad.stderr


def test_streamed_text_equals_the_whole_decode():
    """The printed text is the decode of all generated ids: a first token's leading space
    (indentation) survives, and split UTF-8 characters are held back until complete."""
    from turboquant.generate import _Text

    class Tok:
        pieces = {1: " ", 2: "  x", 3: b"\xc3", 4: b"\xa9"}

        def decode(self, ids):
            raw = b"".join(p if isinstance(p, bytes) else p.encode() for p in map(self.pieces.get, ids))
            return raw.decode("utf-8", errors="replace")

    t = _Text(Tok())
    out = [t.add(i) for i in (1, 2, 3, 4)]
    assert out == [" ", "  x", "", "é"]
