"""`turboquant serve` as a command: a TurboQuant repo served from a subprocess with an API
key and the compressed KV cache, and the command's refusals before it binds."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "sk-test-loopback"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tq_repo):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "turboquant", "serve", "--model", str(tq_repo), "--port",
         str(port), "--api-key", KEY, "--served-model-name", "tiny-tq", "--max-context", "256",
         "--kv-bits-k", "4", "--kv-bits-v", "3", "--kv-sink", "2", "--kv-window", "8",
         "--kv-protect-layers", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"turboquant serve exited {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("turboquant serve did not start within 60 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_api_key_is_required(served):
    r = httpx.get(served + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served + "/stats", headers={"Authorization": "Bearer nope"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served + "/v1", api_key="wrong", max_retries=0).models.list()


def test_turboquant_repo_serves_chat_and_completions_with_the_kv_cache(served):
    client = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny-tq"]
    r = client.chat.completions.create(model="tiny-tq", messages=[{"role": "user",
                                       "content": "hello"}], max_tokens=90, temperature=0,
                                       logit_bias={"1": -100})
    # 90 tokens: more than the 8-token window plus a 64-token block, so codes are used
    assert r.usage.completion_tokens == 90
    text = ""
    for c in client.completions.create(model="tiny-tq", prompt="def f(x):", max_tokens=24,
                                       temperature=0, logit_bias={"1": -100}, stream=True):
        text += c.choices[0].text
    assert text
    stats = httpx.get(served + "/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stats["options"]["kv_bits_k"] == 4 and stats["options"]["kv_window"] == 8
    assert stats["requests"]["completed"] == 2 and stats["max_context"] == 256


def test_the_command_refuses_bad_setups_before_binding(tmp_path, tq_repo, capsys):
    from turboquant.serve import main

    assert main(["--model", str(tmp_path / "absent")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["--model", str(tq_repo), "--kv-bits-k", "16", "--kv-bits-v", "3"]) == 2
    assert "--kv-bits-k" in capsys.readouterr().err
    assert main(["--model", str(tq_repo), "--max-body-bytes", "0"]) == 2
    # a dense repo has no experts to stream: a budget is refused before binding
    assert main(["--model", str(tq_repo), "--expert-budget", "4GB"]) == 2
    assert "no quantized expert layers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--api-key" in capsys.readouterr().out
