"""The OpenAI wire format of responses: bodies, streamed chunks and server-sent events (requests
and their errors: :mod:`selfspec.serve.requests`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .requests import Request


@dataclass(frozen=True)
class Outcome:
    """How a request ended, for the response body.

    Attributes:
        text: the whole text (non-streamed requests; streams sent it in pieces).
        finish_reason: ``stop`` (end of sequence or a stop string) or ``length`` (max_tokens, or
            the server's time limit).
        steps: target forwards that produced tokens (prefill included); tau = tokens / steps.
        batch_invariant: decoded in a continuous batch: whether its tokens equal its solo run's
            (None: decoded alone).
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    steps: int
    method: str
    lossless: bool
    batch_invariant: bool | None = None

    def selfspec(self) -> dict:
        """The response's ``selfspec`` object; ``batch_invariant`` where the request was decoded in a
        batch: whether its tokens are exactly those of its solo run (False: the backend's rows may
        depend on the batch, so they may differ where two tokens' logits nearly tie)."""
        tau = self.completion_tokens / self.steps if self.steps else 0.0
        out = {"method": self.method, "tau": round(tau, 4), "steps": self.steps, "lossless": self.lossless}
        if self.batch_invariant is not None:
            out["batch_invariant"] = self.batch_invariant
        return out

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
