"""The driving half of a batch of requests (``generate_batch``, ``stream_batch``): each request's
decode loop in a thread of its own, joined to a :class:`~selfspec.models.batch.Batcher`, and every
packed forward in the calling thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from ..errors import SelfspecError
from .batch import Batcher

Work = Callable[[Callable[[str], None] | None], object]
"""One request: called with ``emit`` (None: not streaming), it decodes and returns its result,
calling ``emit(piece)`` for each text piece while streaming."""


def request_thread() -> None:
    """Set up the calling thread as one request's thread of a batch: one torch CPU thread.

    A request's thread runs only small host-side ops (drafts, acceptance, argmax); its forwards run
    in the driving thread. With torch's default, each request thread that runs a parallel op gets
    an OpenMP pool of its own, and once a process holds more pool threads than cores libgomp
    throttles every pool's spin-wait, the driving thread's included, whose parallel regions then
    start by waking their threads from sleep (docs/serving.md, "One process, one thread pool"): on a
    2-core EPYC (SmolLM2, oneDNN, 8 requests x 128 tokens), ``pld`` ran at 46-53 tok/s with the
    default pools and 67-75 with one thread per request thread; ``self-spec`` at 4 requests 26.2 and
    36.8, and 9.2 and 13.0 for one request. The setting is the calling thread's own (the driving
    thread keeps its pool). The ops a request thread runs give the same results on any number of
    threads (:func:`~selfspec.core.acceptance` normalises with a serial scan), so its tokens stay
    those of its solo run."""
    torch.set_num_threads(1)


def run_batch(batcher: Batcher, works: Sequence[Work], results: list, streaming: bool) -> Iterator[tuple[int, str]]:
    """Run ``works`` as one continuous batch: ``results[i]`` gets work i's result; while
    ``streaming``, yields ``(i, piece)`` as pieces come (the packed forwards then run between
    yields, in the consumer's thread). Interrupted (Ctrl-C, the iterator closed) or a thread that
    did not start: the batch stops, every started thread is joined, and the interruption is
    raised; a work's own error is raised after every thread is joined."""
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        request_thread()
        try:
            results[i] = works[i]((lambda piece: pieces.put((i, piece))) if streaming else None)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(e)
        finally:
            batcher.leave()

    threads = [threading.Thread(target=run, args=(i,), name=f"selfspec-batch-{i}", daemon=True)
               for i in range(len(works))]
    started = []
    for _ in threads:
        batcher.join()  # all of them before any forward: the first packed forward waits for every request
    try:
        for t in threads:
            t.start()
            started.append(t)
        if not streaming:
            batcher.drive()  # every packed forward in this thread, until the last request leaves
        while streaming:
            batcher.step(wait=0.05)
            while not pieces.empty():
                yield pieces.get()
            if batcher.active == 0:
                break
    except BaseException as e:
        batcher.abort(e)
        for _ in threads[len(started):]:
            batcher.leave()
        for t in started:
            t.join()
        raise
    for t in threads:
        t.join()
    while not pieces.empty():
        yield pieces.get()
    if errors:
        raise errors[0]


def is_batch(prompt) -> bool:
    """Whether ``prompt`` is several prompts: a list of texts, of token-id lists or of conversations
    (a list of ids, or of ``{"role", "content"}`` messages, is one prompt)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, str) or (isinstance(p, (list, tuple)) and not isinstance(p, str)) for p in prompt))


def per_request(n: int, gen_kwargs: dict) -> list[dict]:
    """Each of ``n`` prompts' keyword arguments (``max_new_tokens`` and ``seed`` may be one per prompt)."""
    each = {k: v for k, v in gen_kwargs.items() if k in ("max_new_tokens", "seed") and isinstance(v, (list, tuple))}
    for k, v in each.items():
        if len(v) != n:
            raise SelfspecError(f"{k} has {len(v)} values for {n} prompts; give one, or one per prompt")
    return [{**gen_kwargs, **{k: v[i] for k, v in each.items()}} for i in range(n)]
