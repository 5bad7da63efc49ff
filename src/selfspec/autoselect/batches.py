"""What a server's ``auto`` times: batches, not one stream (issue 58).

A server serves requests that arrive together in one continuous batch, and what wins one stream
need not win a batch. On a 2-core EPYC (AVX2, SmolLM2, ``compact``; 2026-12-07) the one-stream
calibration chose ``self-spec``, draft as verify (26.0 tok/s against ``ar``'s 24.7), which served 4
and 8 clients at 20.6 and 16.8 tok/s: each request's draft forwards run in its own thread, one
after the other, and the packed forward waits for every one of them (2 s between forwards at 8
requests). ``pld``'s drafts cost the batch's rows where they were rarely accepted (34 rows a forward
at 8 requests: 34.9 tok/s against ``ar``'s 44.2). So a server's ``auto`` decodes each calibration
prompt in a batch of :data:`BATCH_WIDTH` (:class:`BatchDecoder`) and chooses by the batch's
aggregate tokens per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

BATCH_WIDTH = 4
"""Requests in each batch a server's ``auto`` times (the concurrency its choice is made for)."""


class BatchGenerator(Protocol):
    """What :class:`BatchDecoder` drives: ``selfspec.load``'s generator, or a fake in tests."""

    def generate_batch(self, prompts: Sequence[Any], max_batch: int | None = None, **gen_kwargs: Any) -> list: ...


@dataclass(frozen=True)
class BatchDecoded:
    """A timed batch: the ids of the prompt asked for, and the new tokens of every request."""

    token_ids: list[int]
    new_tokens: int


class BatchDecoder:
    """A :class:`~selfspec.autoselect.calibration.Decoder` whose ``generate(prompt, n)`` decodes
    ``prompt`` together with the ``width - 1`` calibration prompts after it (cyclically) as one
    continuous batch (``generate_batch``). It returns the asked prompt's ids (on a row-invariant
    backend, those of its solo run: the reference check still holds) and the batch's new tokens,
    so the calibration's tokens per second are the batch's aggregate."""

    def __init__(self, generator: BatchGenerator, prompts: Sequence[str], width: int = BATCH_WIDTH) -> None:
        self.generator = generator
        self.prompts = list(prompts)
        self.width = width

    def group(self, prompt: str) -> list[str]:
        """``prompt`` and the ``width - 1`` calibration prompts after it (``prompt`` alone when it is
        none of them, e.g. a warm-up)."""
        if prompt not in self.prompts:
            return [prompt]
        i, n = self.prompts.index(prompt), len(self.prompts)
        return [self.prompts[(i + j) % n] for j in range(min(self.width, n))]

    def generate(self, prompt: str, max_new_tokens: int) -> BatchDecoded:
        out = self.generator.generate_batch(self.group(prompt), max_new_tokens=max_new_tokens)
        return BatchDecoded(list(out[0].token_ids), sum(r.new_tokens for r in out))
