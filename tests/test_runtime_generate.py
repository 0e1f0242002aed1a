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
