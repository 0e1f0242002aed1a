"""The OpenAI wire format for `turboquant serve`: request checks, errors, response shapes.

Pure Python, no MLX and no web framework: a request body (already parsed JSON) becomes a
`CompletionRequest` or an `APIError` that names the offending parameter, and the response
helpers build the dicts the official `openai` client reads.

Parameters at their neutral value are accepted even when unsupported (`n: 1`,
`echo: false`, `logprobs: null`, ...); any other value of an unsupported parameter is a
400 naming it. Unknown fields are ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# OpenAI's documented limits.
MAX_STOP = 4
MAX_TEMPERATURE = 2.0
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error the client sees as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------- requests


@dataclass
class Sampling:
    """How one request generates: what the worker needs besides the prompt tokens."""

    max_tokens: int | None = None  # None: the server's default, capped by the context
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass
class CompletionRequest:
    kind: str  # "chat" | "completion"
    model: str
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    prompt: str | list[int] | None = None  # completion
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]


_MISSING = object()


def _number(body: dict, name: str, default, lo: float, hi: float, *, lo_open=False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_param(name, f"{name} must be a number, got {v!r}", "invalid_type")
    if v < lo or (lo_open and v == lo) or v > hi:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise bad_param(name, f"{name} must be in {lo_s}, {hi}], got {v!r}")
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_param(name, f"{name} must be an integer, got {v!r}", "invalid_type")
    if lo is not None and v < lo:
        raise bad_param(name, f"{name} must be at least {lo}, got {v}")
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise bad_param(name, f"{name} must be true or false, got {v!r}", "invalid_type")
    return v


def _unsupported(body: dict, neutral: dict[str, tuple]) -> None:
    """400 for an unsupported parameter set to anything but a neutral value."""
    for name, ok in neutral.items():
        if name in body and body[name] not in ok:
            raise bad_param(name, f"{name}={body[name]!r} is not supported by this server",
                            "unsupported_parameter")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad_param("stop", f"stop takes at most {MAX_STOP} sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise bad_param("stop", "stop sequences must not be empty")
    return tuple(dict.fromkeys(stops))


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_param("logit_bias", "logit_bias must be an object of token id -> bias",
                        "invalid_type")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad_param("logit_bias", f"logit_bias key {k!r} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise bad_param("logit_bias", f"logit_bias token {tok} is outside [0, {vocab_size})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad_param("logit_bias", f"logit_bias value for {k} must be in [-100, 100]")
        out[tok] = float(b)
    return out


def _common(body: dict, vocab_size: int, max_tokens_names: tuple[str, ...]) -> tuple:
    model = body.get("model", _MISSING)
    if model is _MISSING or model is None:
        raise bad_param("model", "model is required", "missing_required_parameter")
    if not isinstance(model, str):
        raise bad_param("model", f"model must be a string, got {model!r}", "invalid_type")
    max_tokens = None
    for name in max_tokens_names:  # the first one given wins (max_completion_tokens)
        max_tokens = _integer(body, name, lo=1)
        if max_tokens is not None:
            break
    n = _integer(body, "n", lo=1)
    if n not in (None, 1):
        raise bad_param("n", f"n={n} is not supported: this server returns one choice",
                        "unsupported_parameter")
    seed = _integer(body, "seed")
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        stop=_stop(body),
        logit_bias=_logit_bias(body, vocab_size),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
    )
    stream = _boolean(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad_param("stream_options", "stream_options is only allowed with stream=true")
        if not isinstance(opts, dict):
            raise bad_param("stream_options", "stream_options must be an object", "invalid_type")
        include_usage = _boolean(opts, "include_usage")
    return model, sampling, stream, include_usage


def _content(message: dict, i: int) -> str:
    c = message.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad_param(f"messages.[{i}].content",
                                "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param(f"messages.[{i}].content", "content must be a string or a list of parts",
                    "invalid_type")


def parse_chat(body: Any, vocab_size: int) -> CompletionRequest:
    """A `/v1/chat/completions` body -> CompletionRequest, or APIError."""
    body = _object(body)
    model, sampling, stream, include_usage = _common(
        body, vocab_size, ("max_completion_tokens", "max_tokens"))
    _unsupported(body, {"logprobs": (None, False), "top_logprobs": (None, 0),
                        "tools": (None, []), "tool_choice": (None, "none"),
                        "functions": (None, []), "function_call": (None, "none"),
                        "response_format": (None, {"type": "text"}), "audio": (None,),
                        "modalities": (None, ["text"])})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "messages must be a non-empty list",
                        "missing_required_parameter" if messages is None else "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_param(f"messages.[{i}]", "each message must be an object", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad_param(f"messages.[{i}].role",
                            f"role must be one of {', '.join(ROLES)}, got {role!r}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(m, i)})
    return CompletionRequest("chat", model, sampling, stream, include_usage, messages=out)


def parse_completion(body: Any, vocab_size: int) -> CompletionRequest:
    """A `/v1/completions` body -> CompletionRequest, or APIError."""
    body = _object(body)
    model, sampling, stream, include_usage = _common(body, vocab_size, ("max_tokens",))
    _unsupported(body, {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
                        "logprobs": (None, 0)})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param("prompt", "prompt must not be empty")
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise bad_param("prompt", f"token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_param("prompt", "batched prompts are not supported: send one prompt per "
                        "request (requests run concurrently)", "unsupported_parameter")
    else:
        raise bad_param("prompt", "prompt must be a non-empty string or list of token ids",
                        "missing_required_parameter" if prompt is None else "invalid_type")
    return CompletionRequest("completion", model, sampling, stream, include_usage, prompt=prompt)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


# ---------------------------------------------------------------------------- chat prompt


def fallback_chat_prompt(messages: list[dict]) -> str:
    """The documented template for tokenizers without one: role-prefixed lines.

        system: You are terse.
        user: Hi
        assistant:
    """
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"])


# ---------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: CompletionRequest, rid: str, created: int, text: str, finish: str,
             use: dict) -> dict:
    """A whole (non-streamed) completion."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model,
            "system_fingerprint": None, "choices": [choice], "usage": use}


def chunk(req: CompletionRequest, rid: str, created: int, text: str | None = None,
          finish: str | None = None, *, first: bool = False, use: dict | None = None) -> dict:
    """One streamed chunk: text, a finish, or (with `use`) the usage-only last chunk."""
    if use is not None:
        choices = []
    elif req.kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": req.model,
           "system_fingerprint": None, "choices": choices}
    if req.include_usage:
        out["usage"] = use  # null on every chunk but the last, as OpenAI does
    return out


def model_card(model_id: str, created: int | None = None) -> dict:
    return {"id": model_id, "object": "model", "created": created or int(time.time()),
            "owned_by": "turboquant"}
