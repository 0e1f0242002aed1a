"""`turboquant plan` from the command line: report, JSON, exit status, commands to run,
suggestions, and errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from checkpoints import write_llama_checkpoint, write_moe_checkpoint

from turboquant.plan import main, parse_kv_bits


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("cli") / "tiny-moe", layers=4,
                                hidden=128, intermediate=128, experts=8, vocab=512)


def _json(capsys, argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_resident_report(moe, capsys):
    assert main([str(moe), "--memory-gb", "16", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "verdict: RESIDENT" in out
    for label in ("weights", "routed experts", "KV cache", "workspace", "reserve", "total"):
        assert label in out
    assert f"turboquant convert {moe} tiny-moe-tq" in out
    assert 'turboquant generate --model tiny-moe-tq --prompt "..."' in out


def test_json_has_every_part(moe, capsys):
    code, d = _json(capsys, [str(moe), "--memory-gb", "16"])
    assert code == 0
    assert d["need"] == d["weights"] + d["kv_cache"] + d["workspace"] + d["reserve"]
    assert d["weights"] == d["experts"] + d["nonexpert"]
    assert d["workspace"] == max(d["phases"].values())
    assert d["max_context"]["resident"] >= 4096
    assert d["recipe"].startswith("qwen_moe: 4-bit, experts 3-bit")


def test_stream_verdict_gives_the_budget_flag(moe, capsys):
    code, d = _json(capsys, [str(moe), "--memory-gb", "16"])
    base = d["nonexpert"] + d["kv_cache"] + d["workspace"] + 1e9
    memory = (base + d["min_expert_budget"] + d["experts"] / 2) / 0.95 / 1e9
    code, d = _json(capsys, [str(moe), "--memory-gb", f"{memory:.6f}"])
    assert code == 0 and d["verdict"] == "STREAM"
    assert any("--expert-budget" in c for c in d["commands"])


def test_wont_fit_exits_1_and_suggests(moe, capsys):
    code, d = _json(capsys, [str(moe), "--memory-gb", "0.5"])
    assert code == 1 and d["verdict"] == "WON'T FIT"
    assert len(d["commands"]) == 1  # convert only: nothing to run
    assert main([str(moe), "--memory-gb", "0.5"]) == 1
    assert "verdict: WON'T FIT" in capsys.readouterr().out


def test_recipe_options_change_the_projection(moe, capsys):
    _, three = _json(capsys, [str(moe)])
    _, two = _json(capsys, [str(moe), "--expert-bits", "2", "--protect-layers", "0"])
    assert two["experts"] < three["experts"] and two["recipe"].endswith("experts 2-bit")
    assert "--expert-bits 2 --protect-layers 0" in two["commands"][0]


def test_compressed_kv(moe, capsys):
    _, fp = _json(capsys, [str(moe), "--context", "32768"])
    _, kv = _json(capsys, [str(moe), "--context", "32768", "--kv-bits", "4/3"])
    assert kv["kv_cache"] < fp["kv_cache"] / 2 and kv["kv_bits"] == [4, 3]
    assert any("--kv-bits-k 4 --kv-bits-v 3" in c for c in kv["commands"])


def test_a_converted_repo_and_a_recipe_refusal(tmp_path, capsys):
    src = write_llama_checkpoint(tmp_path / "m", extra_tensors=[("model.mystery.weight", (8, 64))])
    assert main([str(src)]) == 2
    assert "would refuse 1 tensor" in capsys.readouterr().out


def test_errors_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--kv-bits", "5/3"])
    assert e.value.code == 2
    assert main([str(tmp_path), "--context", "0"]) == 2


def test_kv_bits_parser():
    assert parse_kv_bits("4/3") == (4, 3) and parse_kv_bits("8") == (8, 8)


def test_cli_dispatch(moe):
    """Through `python -m turboquant` once the lead registers `plan` in cli.COMMANDS;
    the module's own entry point meanwhile."""
    r = subprocess.run([sys.executable, "-m", "turboquant.plan", str(moe), "--memory-gb", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "verdict: RESIDENT" in r.stdout
