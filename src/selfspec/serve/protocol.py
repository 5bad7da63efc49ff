"""The OpenAI wire format: request validation with OpenAI-style errors, and response bodies.

Every bad request becomes an :class:`ApiError` naming the field at fault (``param``); the app
turns it into ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. Nothing
here needs the ``serve`` extra.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field

MAX_STOPS = 16  # stop strings per request
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SAMPLING_MODES = ("coupled", "rejection")  # as selfspec.config (the ``sampling`` extension field)
GREEDY_BELOW = 1e-5  # temperatures below it decode greedily, as in vLLM (1 / 1e-300 overflows the logits)


class ApiError(Exception):
    """An error answered as OpenAI does: ``status`` and ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object (NaN and Infinity, which JSON does not have, refused)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise bad("the request body nests too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, NaN / Infinity
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    try:  # "\ud800" escapes decode to lone surrogates, which no text (nor the response) can hold
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad("the request body has a string with invalid Unicode (a lone surrogate escape)",
                  code="invalid_json") from None
    return body


def _type_error(param: str, want: str, value) -> ApiError:
    return ApiError(400, f"'{param}' must be {want}, got {json.dumps(value)[:80]}", param, "invalid_type")


def _int(body: dict, key: str, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and math.isfinite(v):
            return int(v)  # 64.0: what some clients send for an integer
        raise _type_error(key, "an integer", v)
    return v


def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(key, "a number", v)
    v = float(v)
    if not math.isfinite(v):
        raise bad(f"'{key}' must be a finite number, got {v}", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(key, "true or false", v)
    return v


@dataclass(frozen=True)
class Request:
    """One validated completion request.

    Attributes:
        chat: ``/v1/chat/completions`` (messages through the chat template) or ``/v1/completions``.
        prompt: the messages (chat) or the prompt text or token ids (completions).
        model: the model the client named, or None (the served one).
        max_tokens: None: the server's default, capped by the context.
        top_k: 0 = off (``-1``, vLLM's "off", is taken as 0).
    """

    chat: bool
    prompt: object
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    sampling: str = "coupled"
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def gen_kwargs(self, max_new_tokens: int) -> dict:
        """Keywords of :meth:`selfspec.api.SpeculativeGenerator.generate` (less prompt and chat)."""
        return dict(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                    sampling=self.sampling)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required: a list of {\"role\", \"content\"} objects", "messages", "missing_required")
    if not isinstance(msgs, list):
        raise _type_error("messages", "a list of {\"role\", \"content\"} objects", msgs)
    if not msgs:
        raise bad("'messages' is empty; pass at least one message", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object with 'role' and 'content'", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role)
        if role not in ROLES:
            raise bad(f"{where}.role {role!r} is not supported; use one of {', '.join(ROLES)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}] must be a {{\"type\": \"text\", \"text\": ...}} part (this "
                              "server takes text only)", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _type_error(f"{where}.content", "a string or a list of text parts", content)
        out.append({"role": ROLES[role], "content": content})
    return out


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required: a string (or a list of token ids)", "prompt", "missing_required")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p.strip():
            raise bad("'prompt' is empty; pass some text", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(i, (str, list)) for i in p):
        raise bad("one prompt per request: send a string, not a list of prompts", "prompt")
    if isinstance(p, list) and not p:
        raise bad("'prompt' is empty; pass some text", "prompt")
    raise _type_error("prompt", "a string or a list of token ids", p)


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    stops = [s] if isinstance(s, str) else s
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise _type_error("stop", "a string or a list of strings", s)
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' has {len(stops)} strings; {MAX_STOPS} at most", "stop")
    if any(x == "" for x in stops):
        raise bad("'stop' strings must not be empty", "stop")
    return tuple(stops)


UNSUPPORTED = {  # field: (is it set to something this server does not do?, what to say)
    "logprobs": (lambda v: v not in (None, False, 0), "log-probabilities are not supported"),
    "top_logprobs": (lambda v: v not in (None, 0), "log-probabilities are not supported"),
    "echo": (lambda v: v not in (None, False), "echo is not supported"),
    "best_of": (lambda v: v not in (None, 1), "best_of must be 1"),
    "suffix": (lambda v: v not in (None, ""), "suffix (insertion) is not supported"),
    "tools": (lambda v: v not in (None, []), "tools are not supported"),
    "functions": (lambda v: v not in (None, []), "functions are not supported"),
    "tool_choice": (lambda v: v not in (None, "none"), "tools are not supported"),
    "function_call": (lambda v: v not in (None, "none"), "functions are not supported"),
    "logit_bias": (lambda v: v not in (None, {}), "logit_bias is not supported"),
    "presence_penalty": (lambda v: v not in (None, 0, 0.0), "presence_penalty is not supported (it would change "
                                                             "the model's distribution)"),
    "frequency_penalty": (lambda v: v not in (None, 0, 0.0), "frequency_penalty is not supported (it would change "
                                                               "the model's distribution)"),
    "response_format": (lambda v: v not in (None,) and not (isinstance(v, dict) and v.get("type") == "text"),
                        "only the text response_format is supported"),
}


def parse_request(body: dict, chat: bool) -> Request:
    """Validate an OpenAI completion request body (already a JSON object)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    for key, (unsupported, why) in UNSUPPORTED.items():
        if key in body and unsupported(body[key]):
            raise ApiError(400, f"'{key}': {why} by selfspec serve", key, "unsupported_parameter")
    n = _int(body, "n", 1)
    if n != 1:
        raise bad(f"'n' must be 1 (one choice per request), got {n}", "n")
    prompt = _messages(body) if chat else _prompt(body)
    max_tokens = _int(body, "max_tokens", None)
    mct = _int(body, "max_completion_tokens", None)
    key = "max_completion_tokens" if mct is not None else "max_tokens"
    max_tokens = mct if mct is not None else max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"'{key}' must be at least 1, got {max_tokens}", key)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad(f"'temperature' must be >= 0 (0 = greedy), got {temperature}", "temperature")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", 0)
    if top_k == -1:
        top_k = 0
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0 (0 or -1 = off), got {top_k}", "top_k")
    seed = _int(body, "seed", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise bad(f"'seed' must be in [0, 2^63), got {seed}", "seed")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _type_error("stream_options", "an object", opts)
    include_usage = _bool(opts or {}, "include_usage", False)
    if opts is not None and not stream:
        raise bad("'stream_options' is only allowed with stream: true", "stream_options")
    sampling = body.get("sampling", "coupled")
    if sampling not in SAMPLING_MODES:
        raise bad(f"'sampling' must be one of {', '.join(SAMPLING_MODES)}, got {json.dumps(sampling)[:40]}",
                  "sampling")
    return Request(chat=chat, prompt=prompt, model=model, max_tokens=max_tokens, temperature=temperature,
                   top_p=top_p, top_k=top_k, seed=seed, stop=_stop(body), stream=stream, include_usage=include_usage,
                   ignore_eos=_bool(body, "ignore_eos", False), sampling=sampling)


@dataclass(frozen=True)
class Outcome:
    """How a request ended, for the response body.

    Attributes:
        text: the whole text (non-streamed requests; streams sent it in pieces).
        finish_reason: ``stop`` (end of sequence or a stop string) or ``length`` (max_tokens, or
            the server's time limit).
        steps: target forwards that produced tokens (prefill included); tau = tokens / steps.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    steps: int
    method: str
    lossless: bool

    def selfspec(self) -> dict:
        tau = self.completion_tokens / self.steps if self.steps else 0.0
        return {"method": self.method, "tau": round(tau, 4), "steps": self.steps, "lossless": self.lossless}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _object(req: Request, chunk: bool) -> str:
    if req.chat:
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def _id(req: Request) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{req.id}"


def response(req: Request, model: str, out: Outcome) -> dict:
    """The body of a non-streamed response."""
    choice: dict = {"index": 0}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": out.text}
    else:
        choice["text"] = out.text
    choice.update(finish_reason=out.finish_reason, logprobs=None, selfspec=out.selfspec())
    return {"id": _id(req), "object": _object(req, False), "created": req.created, "model": model,
            "system_fingerprint": None, "choices": [choice], "usage": out.usage()}


def chunk(req: Request, model: str, text: str | None = None, out: Outcome | None = None, first: bool = False,
          usage_only: Outcome | None = None) -> dict:
    """One streamed chunk: a text piece, the first (chat: the role), the last (``out``: finish
    reason and the ``selfspec`` object) or, with ``include_usage``, the usage after it."""
    body: dict = {"id": _id(req), "object": _object(req, True), "created": req.created, "model": model,
                  "system_fingerprint": None}
    if usage_only is not None:
        body["choices"] = []
        body["usage"] = usage_only.usage()
        return body
    choice: dict = {"index": 0}
    if req.chat:
        choice["delta"] = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    choice.update(finish_reason=out.finish_reason if out else None, logprobs=None)
    if out is not None:
        choice["selfspec"] = out.selfspec()
    body["choices"] = [choice]
    if req.include_usage:
        body["usage"] = None
    return body


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: JSON`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
