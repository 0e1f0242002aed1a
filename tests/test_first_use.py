"""What a new user meets first, done right: the documented Python API snippet, a dry-run
publish offline, no Prefect analytics notice, `turboquant demo` from a non-editable install,
tokenizers that never run repo code, `generate` on plain folders, `doctor` on Hub ids, the
served model id, and messages that read right."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import re
import select
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.pipeline.convert import ConvertOptions, convert

ROOT = Path(__file__).resolve().parents[1]
DENSE = ROOT / "reference" / "models" / "pystd-dense"
MOE = ROOT / "reference" / "models" / "pystd-moe"
NOTICE = "Prefect collects anonymous usage data"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK",)}
    return {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


def _closed_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _turboquant(*args, cwd=ROOT, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turboquant", *args], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                         p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("first-use")
    src = write_llama_checkpoint(base / "src", layers=2, hidden=64, intermediate=128, vocab=320)
    out = base / "tiny-llama-tq"
    convert(ConvertOptions(str(src), str(out), in_process=True, min_job_bytes=0, progress=False))
    return out


# ------------------------------------------------------------------ the Python API snippet


def _snippet() -> str:
    text = (ROOT / "docs" / "convert.md").read_text()
    block = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return block


def test_python_api_snippet_runs_as_a_script(tmp_path):
    code = _snippet().replace('"./model"', repr(str(DENSE))).replace(
        '"out/m"', repr(str(tmp_path / "out")))
    (tmp_path / "convert_it.py").write_text(code)
    r = subprocess.run([sys.executable, "convert_it.py"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "converted 74 tensors" in r.stdout


def test_snippet_without_main_guard_explains_the_dead_worker(tmp_path):
    lines = _snippet().splitlines()
    body = [ln for ln in lines if not ln.startswith("if __name__")]
    code = textwrap.dedent("\n".join(ln[4:] if ln.startswith("    ") else ln for ln in body))
    code = code.replace('"./model"', repr(str(DENSE))).replace(
        '"out/m"', repr(str(tmp_path / "out")))
    (tmp_path / "unguarded.py").write_text(code)
    r = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "a worker process died" in last
    assert ("If unguarded.py calls convert() at its top level: worker processes are spawned "
            "and import the script again, so put the call under `if __name__ == "
            "\"__main__\":` (or pass in_process=True)") in last


# ------------------------------------------------------------------ publish --dry-run offline


@pytest.mark.parametrize("prefect", [False, True])
def test_publish_dry_run_offline_writes_nothing_and_says_so(converted, tmp_path, prefect):
    out = tmp_path / converted.name
    shutil.copytree(converted, out)
    (out / ".turboquant" / "publish-hashes.json").unlink(missing_ok=True)
    before = _snapshot(out)
    endpoint = _closed_endpoint()
    args = ["publish", str(out), "--org", "me", "--dry-run"] + ([] if prefect else
                                                                 ["--no-prefect"])
    r = _turboquant(*args, env=_env(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"),
                                    PREFECT_HOME=str(tmp_path / "prefect")))
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"failed: could not reach the Hugging Face Hub at {endpoint} (") in r.stdout
    assert "nothing was written" in r.stdout and "would upload" not in r.stdout
    assert r.stdout.rstrip().endswith("0 of 1 repos ok, 0 B to upload")
    assert _snapshot(out) == before


# ------------------------------------------------------------------ Prefect's analytics notice


def _on_a_terminal(args: list[str], env: dict, timeout: float = 120) -> str:
    """Run with stdout and stderr on a pseudo-terminal (Prefect shows its notice only there)."""
    main, child = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "turboquant", *args], cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    out = b""
    while True:
        ready, _, _ = select.select([main], [], [], timeout)
        if not ready:
            p.kill()
            break
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    p.wait(timeout=30)
    os.close(main)
    return out.decode(errors="replace")


def test_no_prefect_analytics_notice_on_a_terminal(converted, tmp_path):
    from prefect._internal.analytics.ci_detection import is_ci_environment

    args = ["publish", str(converted), "--org", "me", "--dry-run"]

    def env(name, **extra):  # a fresh Prefect home: the notice shows once per home
        return _env(HF_ENDPOINT=_closed_endpoint(), HF_HOME=str(tmp_path / "hf"),
                    PREFECT_HOME=str(tmp_path / name), **extra)

    text = _on_a_terminal(args, env("quiet"))
    assert "could not reach the Hugging Face Hub" in text  # it ran, on the terminal
    assert NOTICE not in text
    if not is_ci_environment():  # the control: a user who asks for it gets it
        assert NOTICE in _on_a_terminal(args, env("loud", DO_NOT_TRACK="0"))


# ------------------------------------------------------------------ demo, not editable


@pytest.mark.slow
def test_demo_after_a_non_editable_install(tmp_path):
    target = tmp_path / "site"
    build_existed = (ROOT / "build").exists()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                        str(target), str(ROOT)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    if not build_existed:
        shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' leftovers
    if r.returncode:
        pytest.skip(f"cannot build a wheel here (no package index?): {r.stderr[-300:]}")
    assert (target / "turboquant" / "bundled" / "pystd-dense" / "config.json").is_file()
    work = tmp_path / "work"
    work.mkdir()
    r = _turboquant("demo", "--max-tokens", "4", cwd=work,
                    env=_env(PYTHONPATH=str(target), PREFECT_HOME=str(tmp_path / "prefect")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"== generate from {work / 'turboquant-demo' / 'pystd-dense-tq3'}" in r.stdout
    assert (work / "turboquant-demo" / "pystd-dense-tq3" / "manifest.parquet").is_file()
    assert not (target / "out").exists() and not (target / "turboquant-demo").exists()


# ------------------------------------------------------------------ tokenizers run no repo code


def _with_auto_map(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    (dst / "tokenization_evil.py").write_text(
        "open(__file__ + '.ran', 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    return dst


@pytest.mark.parametrize("kind", ["plain", "turboquant"])
def test_a_tokenizer_with_auto_map_is_refused_in_one_line(converted, tmp_path, kind):
    model = _with_auto_map(DENSE if kind == "plain" else converted, tmp_path / "m")
    r = _turboquant("generate", "--model", str(model), "--prompt", "x", "--max-tokens", "1")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (f"turboquant generate: {model}: tokenizer_config.json has auto_map "
            '["tokenization_evil.EvilTokenizer", null]: its tokenizer is Python code shipped '
            "in the repo, which turboquant never runs") in r.stderr
    assert not (model / "tokenization_evil.py.ran").exists()


def test_doctor_flags_a_tokenizer_with_auto_map(converted, tmp_path, capsys):
    from turboquant.doctor import main as doctor_main

    model = _with_auto_map(converted, tmp_path / "m")
    assert doctor_main([str(model), "--quick"]) == 2
    line = next(x for x in capsys.readouterr().out.splitlines() if " D007 " in x)
    assert line.startswith("FAIL  D007 tokenizer")
    assert "auto_map" in line and "never runs" in line


def test_tokenizers_load_with_trust_remote_code_false(converted, monkeypatch):
    import transformers

    from turboquant.runtime import load
    from turboquant.runtime.server_engine import load_plain

    seen = []
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kw):  # records the call, then does the real thing
        seen.append(kw.get("trust_remote_code", "unset"))
        return real(cls, *args, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
    load(converted)
    load_plain(DENSE)
    assert seen == [False, False]


# ------------------------------------------------------------------ generate, doctor, serve


def test_generate_takes_a_plain_hf_folder_as_serve_does():
    r = _turboquant("generate", "--model", str(DENSE), "--prompt", "def f(", "--max-tokens",
                    "3")
    assert r.returncode == 0, r.stderr
    assert "generation: 3 tokens" in r.stderr


def test_doctor_takes_a_hub_repo_id(hub_server, converted, capsys):
    from turboquant.doctor import main as doctor_main

    api = hub_server.api()
    api.create_repo("test-user/tiny-llama-tq")
    api.upload_folder(repo_id="test-user/tiny-llama-tq", folder_path=str(converted),
                      ignore_patterns=[".turboquant/**"])
    code = doctor_main(["test-user/tiny-llama-tq", "--quick", "--memory-gb", "64"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS  D001" in out and "PASS  D005" in out


def test_served_model_id_is_the_folder_name_not_its_path(tmp_path):
    from turboquant.serve import served_model_id

    (tmp_path / "out" / "llama-tq4").mkdir(parents=True)
    assert served_model_id(str(tmp_path / "out" / "llama-tq4") + "/") == "llama-tq4"
    assert served_model_id("org/llama-tq4") == "org/llama-tq4"  # a Hub id, not a folder here


# ------------------------------------------------------------------ messages that read right


def test_header_length_message_says_what_does_not_fit(tmp_path):
    from turboquant.pipeline.errors import SourceError
    from turboquant.pipeline.safetensors_io import read_header

    f = tmp_path / "model.safetensors"
    f.write_bytes((1000).to_bytes(8, "little") + b"{" + b" " * 99)
    with pytest.raises(SourceError) as e:
        read_header(f)
    assert str(e.value) == ("model.safetensors: header length field says 1000 bytes, but only "
                            "100 bytes follow it (the file has 108 bytes): the file is "
                            "truncated or not a safetensors file")


def test_expert_budget_minimum_adds_up(tmp_path):
    out = tmp_path / "moe-tq"
    convert(ConvertOptions(str(MOE), str(out), in_process=True, min_job_bytes=0, progress=False,
                           bits=3))
    r = _turboquant("generate", "--model", str(out), "--prompt", "x", "--max-tokens", "1",
                    "--expert-budget", "1KB")
    assert r.returncode == 2
    m = re.search(r"\(((?:\d+ x [\d.]+ KB(?: \+ )?)+)\), so the minimum is ([\d.]+) KB", r.stderr)
    assert m, r.stderr
    parts = re.findall(r"(\d+) x ([\d.]+) KB", m.group(1))
    assert sum(int(k) * float(s) for k, s in parts) == pytest.approx(float(m.group(2)), abs=0.02)


@pytest.mark.parametrize("value, message", [
    ("5", "argument --bits: must be 2, 3, 4 or ternary, got '5'"),
    ("raw", "argument --bits: must be 2, 3, 4 or ternary; raw (16-bit) is for --expert-bits, "
            "--down-proj-bits, --embeddings-bits and --lm-head-bits"),
])
def test_bits_errors_list_what_bits_takes(value, message, capsys, tmp_path):
    from turboquant.convert import main as convert_main

    with pytest.raises(SystemExit):
        convert_main([str(DENSE), str(tmp_path / "out"), "--bits", value])
    assert not (tmp_path / "out").exists()
    assert message in capsys.readouterr().err


def test_plan_context_defaults_to_the_model_maximum(capsys):
    from turboquant.plan import main as plan_main

    assert plan_main([str(DENSE), "--memory-gb", "64"]) == 0
    out = capsys.readouterr().out
    assert "context 2,048 tokens (the model's maximum)" in out
    assert plan_main([str(DENSE), "--memory-gb", "64", "--context", "8192"]) == 0
    assert "context 8,192 tokens (more than the model's maximum, 2,048)" in capsys.readouterr().out


def test_docs_describe_expert_streaming_in_serve_as_it_is():
    serve = (ROOT / "docs" / "serve.md").read_text()
    big = (ROOT / "docs" / "bigger-than-memory.md").read_text()
    for text in (serve, big):
        assert "streaming is coming" not in text and "no expert streaming yet" not in text
    assert "`--expert-budget GB\\|PERCENT`" in serve
    assert "turboquant serve --model Qwen3-235B-A22B-tq --expert-budget 12.7GB" in big
