"""`turboquant serve` live on loopback: the official `openai` client, concurrency,
disconnects and every kind of bad request.

One server for the module: a tiny random Llama (mlx-lm's own class) with the reference
tokenizer, served by uvicorn on a background thread at a free 127.0.0.1 port.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

TOKENIZER = Path(__file__).resolve().parents[1] / "reference" / "tokenizer"
MODEL = "tiny-llama"
CONTEXT = 4096
NO_EOS = {"0": -100}  # keep the random model from ending early where length matters


def write_tiny_llama(out: Path, seed: int = 0, **overrides) -> Path:
    """A plain HF/MLX folder: random Llama weights, config.json, the reference tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = dict(model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, vocab_size=8192, rope_theta=10000.0,
                  max_position_embeddings=CONTEXT, tie_word_embeddings=False, **overrides)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from turboquant.runtime.server import (
        Engine, ServerConfig, _load_model, create_app, max_context_of, serve_in_thread)

    path = write_tiny_llama(tmp_path_factory.mktemp("serve") / MODEL)
    model, tokenizer, config = _load_model(path)
    engine = Engine(model, tokenizer)
    cfg = ServerConfig(model_id=MODEL, max_context=max_context_of(config),
                       max_body_bytes=64 * 1024)
    with serve_in_thread(create_app(engine, cfg)) as url:
        yield url, engine


@pytest.fixture
def url(server):
    return server[0]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats").json()


def _chat_stream(client, **kw) -> tuple[str, str, dict | None]:
    text, finish, usage = "", None, None
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
        if c.usage is not None:
            usage = c.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                "total_tokens"})
    return text, finish, usage


def _completion_stream(client, **kw) -> tuple[str, str]:
    text, finish = "", None
    for c in client.completions.create(stream=True, **kw):
        text += c.choices[0].text
        finish = c.choices[0].finish_reason or finish
    return text, finish


# ---------------------------------------------------------------------------- the API


def test_models_are_listed_and_retrieved(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "turboquant"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_chat_whole_and_streamed_give_the_same_text_and_usage(client):
    kw = dict(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "def add(a, b):"}],
              max_tokens=12, temperature=0.9, top_p=0.95, seed=7, logit_bias=NO_EOS)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    text, finish, usage = _chat_stream(client, stream_options={"include_usage": True}, **kw)
    assert text == choice.message.content and finish == "length"
    assert usage == whole.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                    "total_tokens"})


def test_completions_whole_and_streamed_with_text_or_token_prompts(client):
    kw = dict(model=MODEL, max_tokens=10, temperature=0, logit_bias=NO_EOS)
    whole = client.completions.create(prompt="import os\n", **kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens > 0
    assert _completion_stream(client, prompt="import os\n", **kw) == (
        whole.choices[0].text, "length")
    ids = client.completions.create(prompt=[5, 6, 7], **kw)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 10


def test_seed_reproduces_and_different_seeds_differ(client):
    kw = dict(model=MODEL, prompt="class Foo:", max_tokens=16, temperature=1.0,
              logit_bias=NO_EOS)
    a = client.completions.create(seed=1, **kw).choices[0].text
    b = client.completions.create(seed=1, **kw).choices[0].text
    c = client.completions.create(seed=2, **kw).choices[0].text
    assert a == b and a != c


def test_stop_sequences_are_trimmed_streamed_and_not(client):
    kw = dict(model=MODEL, prompt="for i in range(10):", temperature=0, logit_bias=NO_EOS)
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a 3-character stop from the middle
    cut = full[: full.find(stop)]
    r = client.completions.create(max_tokens=24, stop=[stop, "\x00never"], **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert r.usage.completion_tokens < 24
    assert _completion_stream(client, max_tokens=24, stop=stop, **kw) == (cut, "stop")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "for i in range(10):"}],
        max_tokens=24, temperature=0, logit_bias=NO_EOS, stop=stop)
    assert chat.choices[0].message.content == cut and chat.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- concurrency


def test_concurrent_streams_give_the_same_text_as_one_at_a_time(client, url):
    jobs = [dict(model=MODEL, messages=[{"role": "user", "content": f"def f{i}(x):"}],
                 max_tokens=48, temperature=0.9, seed=100 + i, logit_bias=NO_EOS)
            for i in range(4)]
    alone = [_chat_stream(client, **kw)[0] for kw in jobs]
    assert len(set(alone)) == 4

    start = threading.Barrier(len(jobs))

    def run(kw):
        start.wait()
        return _chat_stream(client, **kw)[0]

    before = _stats(url)["requests"]["submitted"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together == alone
    recent = [r for r in _stats(url)["recent"] if r["id"] > before]
    assert len(recent) == 4
    # they really were in flight together: some arrived before the previous one finished
    assert any(b["submitted"] < a["finished"] for a, b in zip(recent, recent[1:]))


# ---------------------------------------------------------------------------- disconnects


def _wait_for(url: str, pred, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in _stats(url)["recent"]:
            if pred(r):
                return r
        time.sleep(0.05)
    raise AssertionError(f"no matching request in /stats: {_stats(url)['recent'][-3:]}")


def test_a_streaming_client_that_disconnects_stops_its_generation(client, url):
    last = _stats(url)["requests"]["submitted"]
    body = dict(model=MODEL, prompt="x = ", max_tokens=4000, temperature=0, stream=True,
                logit_bias=NO_EOS)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got  # some tokens arrived; now hang up
    rec = _wait_for(url, lambda r: r["id"] > last)
    assert rec["finish_reason"] == "cancelled"
    assert 0 < rec["completion_tokens"] < 4000
    # and the worker is free for the next request
    r = client.completions.create(model=MODEL, prompt="y = ", max_tokens=5, temperature=0,
                                  logit_bias=NO_EOS)
    assert r.usage.completion_tokens == 5


def test_a_whole_request_whose_client_gives_up_is_cancelled(url):
    last = _stats(url)["requests"]["submitted"]
    body = dict(model=MODEL, prompt="x = ", max_tokens=4000, temperature=0, logit_bias=NO_EOS)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    rec = _wait_for(url, lambda r: r["id"] > last)
    assert rec["finish_reason"] == "cancelled" and rec["completion_tokens"] < 4000


# ---------------------------------------------------------------------------- bad requests


def _post(url: str, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def test_bad_json_is_400(url):
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": "tiny-llama", ',
                   headers={"Content-Type": "application/json"})
    assert _error(r, 400)["type"] == "invalid_request_error"
    assert _error(_post(url, "/v1/completions", [1, 2]), 400)["type"] == "invalid_request_error"


def test_unknown_model_is_404(url, client):
    err = _error(_post(url, "/v1/chat/completions", {**CHAT, "model": "gpt-4"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_over_long_prompt_is_400_context_length_exceeded(url, client):
    err = _error(_post(url, "/v1/completions", {**COMPLETION, "max_tokens": CONTEXT}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    long = "def f(): pass\n" * 2000  # far more than CONTEXT tokens, no max_tokens
    err = _error(_post(url, "/v1/chat/completions",
                       {"model": MODEL, "messages": [{"role": "user", "content": long}]}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("path, change, param", [
    ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"seed": "1"}, "seed"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"stop": 3}, "stop"),
    ("/v1/chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages.[0].role"),
    ("/v1/chat/completions", {"model": 3}, "model"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"max_tokens": -3}, "max_tokens"),
])
def test_bad_parameters_are_400_naming_the_parameter(url, path, change, param):
    base = CHAT if path.startswith("/v1/chat") else COMPLETION
    err = _error(_post(url, path, {**base, **change}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_bad_parameters_raise_bad_request_in_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_request_body_size_is_limited(url):
    big = {**COMPLETION, "prompt": "x" * (65 * 1024)}
    err = _error(_post(url, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), timeout=10)
    assert _error(r, 413)["code"] == "request_too_large"


def test_unknown_routes_and_methods_are_openai_style(url):
    assert _error(httpx.get(url + "/v1/nothing"), 404)["type"] == "invalid_request_error"
    _error(httpx.get(url + "/v1/completions"), 405)


def test_server_is_healthy_after_the_bad_requests(client):
    r = client.chat.completions.create(**{**CHAT, "max_tokens": 3, "logit_bias": NO_EOS})
    assert r.usage.completion_tokens == 3
