"""OpenAI request bodies: parsing, validation with pydantic models, and OpenAI-style errors.

Request bodies are validated by pydantic models (:class:`CompletionBody`, :class:`Message`);
every bad request becomes an :class:`ApiError` naming the field at fault (``param``); the app
turns it into ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status. What a
valid request becomes is :class:`Request`.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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
        """Keywords of :meth:`selfspec.generator.SpeculativeGenerator.generate` (less prompt and chat)."""
        return dict(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                    sampling=self.sampling)


def _type_error(param: str | None, want: str, value) -> PydanticCustomError:
    return PydanticCustomError("invalid_type", "'{param}' must be {want}, got {got}",
                               {"param": param, "want": want, "got": json.dumps(value)[:80]})


def _invalid(message: str, code: str = "invalid_value") -> PydanticCustomError:
    return PydanticCustomError(code, "{message}", {"message": message})


def _int(v, info: ValidationInfo) -> int | None:
    """An integer (64.0, what some clients send for one, too); never a bool or a string."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        return int(v)
    raise _type_error(info.field_name, "an integer", v)


def _number(v, info: ValidationInfo) -> float | None:
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(info.field_name, "a number", v)
    if not math.isfinite(v):
        raise _invalid(f"'{info.field_name}' must be a finite number, got {v}")
    return float(v)


def _bool(v, info: ValidationInfo) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise _type_error(info.field_name, "true or false", v)


def _str(v, info: ValidationInfo) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise _type_error(info.field_name, "a string", v)


Int = Annotated[int | None, BeforeValidator(_int)]
Number = Annotated[float | None, BeforeValidator(_number)]
Bool = Annotated[bool | None, BeforeValidator(_bool)]
Str = Annotated[str | None, BeforeValidator(_str)]


class StreamOptions(BaseModel):
    """``stream_options`` (``include_usage``: a last chunk with the usage)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: Bool = None


class Message(BaseModel):
    """One chat message: a role this server knows (mapped: ``developer`` is ``system``) and text
    content (a string, or text parts joined)."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: str

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v):
        if not isinstance(v, str):
            raise _type_error("role", "a string", v)
        if v not in ROLES:
            raise _invalid(f"role {v!r} is not supported; use one of {', '.join(ROLES)}")
        return ROLES[v]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):  # content parts: only text ones
            for j, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _invalid(f"content[{j}] must be a {{\"type\": \"text\", \"text\": ...}} part (this "
                                   "server takes text only)")
            return "".join(part["text"] for part in v)
        if not isinstance(v, str):
            raise _type_error("content", "a string or a list of text parts", v)
        return v


def _unsupported(body: dict) -> None:
    for key, (unsupported, why) in UNSUPPORTED.items():
        if key in body and unsupported(body[key]):
            raise PydanticCustomError("unsupported_parameter", "'{key}': {why} by selfspec serve",
                                      {"key": key, "why": why})


LIMITS = {  # field: (is the value allowed?, what it must be)
    "n": (lambda v: v == 1, "1 (one choice per request)"),
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "max_completion_tokens": (lambda v: v >= 1, "at least 1"),
    "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= -1, ">= 0 (0 or -1 = off)"),
    "seed": (lambda v: 0 <= v < 2**63, "in [0, 2^63)"),
}


class CompletionBody(BaseModel):
    """The body of ``/v1/chat/completions`` (``messages``) or ``/v1/completions`` (``prompt``), as
    OpenAI defines it, with the fields this server does not do refused by name (``UNSUPPORTED``)
    and unknown ones (``user``, ``metadata``, ...) ignored. ``sampling`` is selfspec's extension."""

    model_config = ConfigDict(extra="ignore")
    model: Str = None
    messages: object = None  # checked by _messages (chat only), message by message
    prompt: object = None
    n: Int = None
    max_tokens: Int = None
    max_completion_tokens: Int = None
    temperature: Number = None
    top_p: Number = None
    top_k: Int = None
    seed: Int = None
    stop: object = None
    stream: Bool = None
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = None
    sampling: object = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body):
        _unsupported(body)
        if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
            raise _type_error("stream_options", "an object", body["stream_options"])
        return body

    @field_validator(*LIMITS)
    @classmethod
    def _in_range(cls, v, info: ValidationInfo):
        assert info.field_name is not None  # a field validator: pydantic names the field
        allowed, want = LIMITS[info.field_name]
        if v is not None and not allowed(v):
            raise _invalid(f"'{info.field_name}' must be {want}, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, s):
        if s is None:
            return ()
        stops = [s] if isinstance(s, str) else s
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise _type_error("stop", "a string or a list of strings", s)
        if len(stops) > MAX_STOPS:
            raise _invalid(f"'stop' has {len(stops)} strings; {MAX_STOPS} at most")
        if any(x == "" for x in stops):
            raise _invalid("'stop' strings must not be empty")
        return tuple(stops)

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling(cls, v):
        if v is not None and v not in SAMPLING_MODES:
            raise _invalid(f"'sampling' must be one of {', '.join(SAMPLING_MODES)}, got {json.dumps(v)[:40]}")
        return v


def _messages(msgs: object) -> list[dict]:
    """The chat messages, each validated as a :class:`Message`, as ``{"role", "content"}`` dicts."""
    if msgs is None:
        raise bad("'messages' is required: a list of {\"role\", \"content\"} objects", "messages", "missing_required")
    if not isinstance(msgs, list):
        raise ApiError(400, f"'messages' must be a list of {{\"role\", \"content\"}} objects, got "
                            f"{json.dumps(msgs)[:80]}", "messages", "invalid_type")
    if not msgs:
        raise bad("'messages' is empty; pass at least one message", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"'messages[{i}]' must be an object with 'role' and 'content', got "
                                f"{json.dumps(m)[:80]}", f"messages[{i}]", "invalid_type")
        try:
            msg = Message.model_validate(m)
        except ValidationError as e:
            raise _api_error(e, f"messages[{i}]") from None
        out.append({"role": msg.role, "content": msg.content})
    return out


def _prompt(p: object) -> str | list[int]:
    """The completion prompt: text, or token ids (a batch of one is taken; more are refused)."""
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
    raise ApiError(400, f"'prompt' must be a string or a list of token ids, got {json.dumps(p)[:80]}", "prompt",
                   "invalid_type")


def _api_error(e: ValidationError, prefix: str = "") -> ApiError:
    """The first error of a pydantic validation as an OpenAI one: ``param`` from its location
    (``messages[0].role``; a whole-body check names its field in the error's context), ``code``
    from our error types (``invalid_type``, ``invalid_value``, ``unsupported_parameter``;
    pydantic's own become ``invalid_value``). ``prefix`` locates a nested model (``messages[0]``)."""
    err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    field = ".".join(str(x) for x in err["loc"])
    param = ".".join(x for x in (prefix, field) if x) or ctx.get("key") or ctx.get("param")
    code = err["type"] if err["type"] in ("invalid_type", "invalid_value", "unsupported_parameter") else "invalid_value"
    message = err["msg"]
    if err["type"] == "missing":
        code, message = "missing_required", f"'{param}' is required"
    last = str(err["loc"][-1]) if err["loc"] else ""
    if message.startswith("'") and last and param != last:  # "'role' must be" -> "'messages[0].role' must be"
        message = message.replace(f"'{last}'", f"'{param}'", 1)
    elif prefix and not message.startswith("'"):  # "role 'x' is not ..." -> "messages[0].role 'x' is not ..."
        message = f"{prefix}.{message}"
    return ApiError(400, message, param, code)


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
    """Validate an OpenAI completion request body (already a JSON object) against
    :class:`CompletionBody`; the first problem becomes an :class:`ApiError` naming its field."""
    try:
        b = CompletionBody.model_validate(body)
    except ValidationError as e:
        raise _api_error(e) from None
    prompt = _messages(b.messages) if chat else _prompt(b.prompt)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    temperature = 1.0 if b.temperature is None else b.temperature
    if b.stream_options is not None and not b.stream:
        raise bad("'stream_options' is only allowed with stream: true", "stream_options")
    # stop and sampling as _stop and _sampling left them: a tuple of strings; a mode or None
    return Request(chat=chat, prompt=prompt, model=b.model, max_tokens=max_tokens,
                   temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                   top_p=1.0 if b.top_p is None else b.top_p, top_k=max(b.top_k or 0, 0), seed=b.seed,
                   stop=cast("tuple[str, ...]", b.stop or ()), stream=bool(b.stream),
                   include_usage=bool(b.stream_options and b.stream_options.include_usage),
                   ignore_eos=bool(b.ignore_eos),
                   sampling=cast(str, b.sampling or "coupled"))
