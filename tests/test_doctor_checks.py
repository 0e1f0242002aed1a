"""`turboquant doctor`: a good converted repo passes; each kind of damage fails the check
that names it, with exit status 2 (warnings only: 1); the folder is never written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from checkpoints import write_llama_checkpoint

from turboquant.doctor import main
from turboquant.manifests.schema import read_manifest, write_manifest
from turboquant.pipeline.convert import ConvertOptions, convert
from turboquant.runtime.doctor import CHECKS, Check, exit_code

FIT = ["--memory-gb", "16"]  # M002 independent of this machine's free memory


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    src = write_llama_checkpoint(root / "src", layers=3, hidden=64, intermediate=128,
                                 shards=2)
    out = root / "repo"
    convert(ConvertOptions(str(src), str(out), in_process=True, progress=False,
                           check_disk=False, min_job_bytes=0))
    assert len(list(out.glob("model-*.safetensors"))) == 2
    return out


@pytest.fixture
def repo(good, tmp_path):
    dst = tmp_path / "repo"
    shutil.copytree(good, dst)
    return dst


def run(capsys, path, *extra) -> tuple[int, dict[str, tuple[str, str]]]:
    code = main([str(path), *FIT, *extra])
    checks = {}
    for line in capsys.readouterr().out.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3 and parts[1] in CHECKS:
            checks[parts[1]] = (parts[0], parts[3] if len(parts) > 3 else "")
    return code, checks


def _status(checks) -> dict[str, str]:
    return {k: v[0] for k, v in checks.items()}


def _snapshot(folder) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            digest = None
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, folder)] = (st.st_size, st.st_mtime_ns, digest)
    return out


def test_a_good_repo_passes_everything(good, capsys):
    before = _snapshot(good)
    code, checks = run(capsys, good)
    assert code == 0
    assert set(checks) == set(CHECKS)
    assert all(s == "PASS" for s in _status(checks).values()), checks
    assert "RESIDENT" in checks["M002"][1]
    assert _snapshot(good) == before  # read-only: nothing written, nothing touched


def test_quick_skips_the_checksums(good, capsys):
    code, checks = run(capsys, good, "--quick")
    assert code == 0 and checks["D006"] == ("SKIP", "--quick")


def _a_row(repo, name_part="mlp.down_proj"):
    rows = read_manifest(repo).to_pylist()
    return next(r for r in rows if name_part in r["name"] and r["codec"] != "raw")


def test_a_corrupt_byte_fails_the_checksums(repo, capsys):
    row = _a_row(repo)
    with open(repo / row["shard"], "r+b") as f:
        f.seek((row["byte_start"] + row["byte_end"]) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    code, checks = run(capsys, repo)
    assert code == 2
    assert checks["D006"][0] == "FAIL" and row["name"] in checks["D006"][1]
    assert {k for k, s in _status(checks).items() if s != "PASS"} == {"D006"}
    assert run(capsys, repo, "--quick")[0] == 0  # only the checksums can see it


def test_a_deleted_shard_fails_the_index_check(repo, capsys):
    shard = sorted(repo.glob("model-*.safetensors"))[1]
    shard.unlink()
    code, checks = run(capsys, repo)
    assert code == 2
    assert checks["D003"][0] == "FAIL" and f"shard {shard.name} is missing" in checks["D003"][1]
    assert checks["M002"][0] == "SKIP"


def test_an_edited_index_fails_the_index_check(repo, capsys):
    p = repo / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    moved = next(t for t, s in wm.items() if s == shards[0])
    wm[moved] = shards[1]
    p.write_text(json.dumps(index))
    code, checks = run(capsys, repo)
    assert code == 2 and checks["D003"][0] == "FAIL"
    assert f"index maps {moved} to {shards[1]}, it is in {shards[0]}" in checks["D003"][1]
    assert checks["D005"][0] == "FAIL"  # the manifest disagrees with the index too

    del wm[moved]
    p.write_text(json.dumps(index))
    code, checks = run(capsys, repo)
    assert code == 2 and "not in the index" in checks["D003"][1]


def test_a_truncated_shard_fails_the_size_check(repo, capsys):
    shard = sorted(repo.glob("model-*.safetensors"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    code, checks = run(capsys, repo)
    assert code == 2 and checks["D004"][0] == "FAIL"
    assert f"{shard.name}: {size - 100} bytes, its header says {size}" in checks["D004"][1]
    assert "truncated" in checks["D004"][1]


def test_a_wrong_manifest_row_fails_the_manifest_check(repo, capsys):
    rows = read_manifest(repo).to_pylist()
    rows[3]["byte_end"] += 2
    write_manifest(rows, repo / "manifest.parquet")
    code, checks = run(capsys, repo)
    assert code == 2 and checks["D005"][0] == "FAIL"
    assert rows[3]["name"] in checks["D005"][1] and "byte range" in checks["D005"][1]


def test_tokenizer_files(repo, capsys):
    (repo / "tokenizer_config.json").unlink()
    code, checks = run(capsys, repo)
    assert code == 1 and checks["D007"][0] == "WARN"
    for f in repo.glob("tokenizer*"):
        f.unlink()
    code, checks = run(capsys, repo)
    assert code == 2 and checks["D007"][0] == "FAIL"


def test_an_unfinished_conversion_warns(repo, capsys):
    (repo / ".turboquant" / "complete").unlink()
    code, checks = run(capsys, repo)
    assert code == 1 and checks["D009"][0] == "WARN" and "resume" in checks["D009"][1]


def test_config_problems(repo, capsys):
    p = repo / "config.json"
    cfg = json.loads(p.read_text())
    cfg["quantization_config"]["format_version"] = 99
    p.write_text(json.dumps(cfg))
    code, checks = run(capsys, repo)
    assert code == 2 and checks["D002"][0] == "FAIL" and "upgrade turboquant" in checks["D002"][1]

    cfg["model_type"] = "no_such_architecture"
    p.write_text(json.dumps(cfg))
    assert run(capsys, repo)[1]["D008"][0] == "FAIL"

    p.write_text("{not json")
    code, checks = run(capsys, repo)
    assert code == 2 and checks["D001"][0] == "FAIL"
    assert checks["D002"][0] == "SKIP" and checks["D008"][0] == "SKIP"


def test_a_source_checkpoint_is_not_a_repo(good, capsys):
    code, checks = run(capsys, good.parent / "src", "--quick")
    assert code == 2
    assert checks["D002"][0] == "FAIL" and "not a TurboQuant repo" in checks["D002"][1]
    assert checks["D005"][0] == "FAIL"


def test_memory_that_does_not_fit(good, capsys):
    code = main([str(good), "--memory-gb", "0.5", "--quick"])
    out = capsys.readouterr().out
    assert code == 2 and "FAIL  M002 memory-fit" in out and "WON'T FIT" in out


def test_json_and_missing_folder(good, tmp_path, capsys):
    assert main([str(good), *FIT, "--json", "--quick"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["exit_code"] == 0
    assert [c["id"] for c in d["checks"]] == list(CHECKS)
    assert main([str(tmp_path / "nope"), *FIT]) == 2
    assert "FAIL  D001" in capsys.readouterr().out


def test_exit_codes():
    assert exit_code([Check("D001", "PASS", ""), Check("D006", "SKIP", "")]) == 0
    assert exit_code([Check("D001", "PASS", ""), Check("D009", "WARN", "")]) == 1
    assert exit_code([Check("D009", "WARN", ""), Check("D003", "FAIL", "")]) == 2
