"""The decode worker: continuous batching off the event loop, behind a bounded queue.

Up to ``max_batch`` requests decode at once, each in a thread of its own running the one decode
loop with a drafter of its own (:meth:`~selfspec.generator.SpeculativeGenerator.sibling`); the
worker thread admits queued requests between forwards and runs every packed forward of their verify
and prompt blocks (:class:`~selfspec.models.batch.Batcher`), so a request joins the batch at the
next step and leaves it when it ends. On the compiled backend (static-shape steps) or with
``max_batch`` 1, the worker decodes one request at a time. The event loop only validates, queues and
relays. Each request's cancel flag and deadline are checked after every one of its decode steps: a
client that went away leaves the batch at its next step, and a request past the time limit ends
there with ``finish_reason`` ``length``. Events go back to the request's handler on its event loop:
``("started",)``, ``("delta", text)`` (streams), ``("done", Outcome)`` or ``("error", ApiError)``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from ..decoding.text import IncrementalDetokenizer, StopTextFilter, encode_prompt, text_before_stop
from ..errors import SelfspecError
from .metrics import Metrics
from .protocol import Outcome
from .requests import ApiError, Request

if TYPE_CHECKING:
    from ..generator import SpeculativeGenerator
    from ..models.batch import Batcher

log = logging.getLogger("selfspec.serve")


class Job:
    """One queued request: its prompt ids, where its events go, and its cancel flag.

    ``state``: ``waiting`` (queued), ``running``, ``dropped`` (cancelled or drained while
    queued: the worker skips it) or ``done``; changed under the engine's lock.
    """

    def __init__(self, req: Request, ids: list[int], max_new_tokens: int, arrived: float,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.req = req
        self.ids = ids
        self.max_new_tokens = max_new_tokens
        self.arrived = arrived
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.state = "waiting"

    def push(self, *event) -> None:
        """Hand an event to the request's handler (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def default_max_batch(generator, share: float = 0.25, cap: int = 16) -> int:
    """How many requests decode at once by default: as many as ``share`` of the memory available now
    holds KV caches of the model's whole context (``2 x layers x kv heads x head dim x context x
    dtype size`` each), at most ``cap``, at least 1."""
    import psutil

    cfg = generator.target.model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_request = (2 * cfg.num_hidden_layers * heads * head_dim * generator.target.context_length
                   * generator.target.model.dtype.itemsize)
    return max(1, min(cap, int(share * psutil.virtual_memory().available // max(per_request, 1))))


class Engine:
    """The generator, its queue and its worker thread.

    Attributes:
        max_queue: requests that may wait (besides those decoding); beyond it, 429.
        request_timeout: seconds a request may decode; it then ends with ``length``.
        max_batch: requests that decode at once (None: :func:`default_max_batch` when the model
            is attached).
        step_hook: called after every decode step (tests slow decoding down with it).
        batcher: the continuous batch (None: requests decode one at a time).
    """

    def __init__(self, metrics: Metrics | None = None, max_queue: int = 16, request_timeout: float = 300.0,
                 max_batch: int | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.max_batch = max_batch
        self.batcher: Batcher | None = None
        self.batch_invariant: bool | None = None
        self.step_hook: Callable[[], None] | None = None
        self.generator: SpeculativeGenerator | None = None
        self.draining = False
        self._encoder = None  # a copy of the tokenizer, for the event loop's threads (encoding is not thread-safe)
        self._encode_lock = threading.Lock()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: set[Job] = set()
        self._slots: list = []  # sibling generators of finished requests, for the next ones
        self._mean_s = 1.0  # moving mean of request seconds, for Retry-After
        self._thread = threading.Thread(target=self._work, name="selfspec-decode", daemon=True)
        self._thread.start()

    # -- the model ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.generator is not None

    def attach(self, generator) -> None:
        """Start serving ``generator`` (a :class:`~selfspec.generator.SpeculativeGenerator`)."""
        tok = generator.tokenizer
        try:
            self._encoder = copy.deepcopy(tok) if tok is not None else None
        except Exception:  # an uncopyable tokenizer: share it, one encoding at a time  # noqa: BLE001
            self._encoder = tok
        if self.max_batch is None:
            self.max_batch = default_max_batch(generator)
        if self.max_batch > 1 and generator.batchable():
            from ..models.batch import Batcher, row_invariant

            self.batcher = Batcher(generator.target, self.max_batch)
            self.batcher.on_forward = lambda n: self.metrics.observe("batch_size", n)
            self.batch_invariant = row_invariant(generator.kernels)
            log.info("continuous batching: up to %d requests at once on %s kernels (%s)", self.max_batch,
                     generator.kernels, "each identical to its solo run" if self.batch_invariant
                     else "the kernels' rows may depend on the batch: a request's tokens may differ from its solo "
                          "run where two tokens' logits nearly tie")
        self.generator = generator
        self.metrics.set("model_ready", 1)

    @property
    def context_length(self) -> int:
        assert self.generator is not None  # asked for once a model is attached (ready)
        return self.generator.target.context_length

    def encode(self, req: Request) -> list[int]:
        """The prompt's token ids (chat: through the chat template), as ``selfspec generate``
        encodes them. Blocking: run it in a thread."""
        g = self.generator
        if self._encoder is None:
            raise ApiError(400, "this model has no tokenizer, which the server needs for text", code="no_tokenizer")
        if req.chat and not getattr(self._encoder, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages",
                           "no_chat_template")
        param = "messages" if req.chat else "prompt"
        with self._encode_lock:
            try:
                return encode_prompt(self._encoder, req.prompt, req.chat, g.target.model.config.vocab_size)
            except SelfspecError as e:  # e.g. a token id outside the vocabulary, an empty prompt
                raise ApiError(400, str(e), param, "invalid_prompt") from None
            except Exception as e:  # noqa: BLE001 - the chat template refused the messages (a jinja error)
                raise ApiError(400, f"the model's chat template refused the messages: {e}", param) from None

    # -- the queue ---------------------------------------------------------------------------
    def queue_sizes(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._lock:
            return self._waiting, len(self._running)

    def _gauges(self) -> None:  # under self._lock
        self.metrics.set("num_requests_waiting", self._waiting)
        self.metrics.set("num_requests_running", len(self._running))

    def submit(self, job: Job) -> None:
        """Queue ``job``, or refuse it: 503 while draining, 429 (with Retry-After) when full."""
        with self._lock:
            if self.draining:
                raise ApiError(503, "the server is shutting down; retry later", code="shutting_down")
            if self._waiting >= self.max_queue:
                retry = math.ceil(min(60.0, max(1.0, self._mean_s * (self._waiting + 1))))
                waiting = f"{self._waiting} request{' is' if self._waiting == 1 else 's are'} waiting"
                raise ApiError(429, f"the server is busy: {waiting} for the decoder (queue size {self.max_queue}); "
                                    f"retry after {retry} s", code="rate_limit_exceeded",
                               type="rate_limit_error", headers={"Retry-After": str(retry)})
            self._waiting += 1
            self._gauges()
            self._queue.put(job)
        if self.batcher is not None:
            self.batcher.wake()  # admitted at the next step

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if queued, else stop it at the next decode step."""
        job.cancelled.set()
        with self._lock:
            if job.state == "waiting":
                job.state = "dropped"
                self._waiting -= 1
                self._gauges()

    def drain(self) -> None:
        """Refuse new requests and answer the queued ones 503; the one decoding finishes."""
        dropped = []
        with self._lock:
            self.draining = True
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                if job.state == "waiting":
                    job.state = "dropped"
                    self._waiting -= 1
                    dropped.append(job)
            self._gauges()
        for job in dropped:
            job.push("error", ApiError(503, "the server is shutting down; retry later", code="shutting_down"))

    def abort(self) -> None:
        """Shut down now (a second Ctrl-C): :meth:`drain`, and answer the request that is decoding
        503 ``shutting_down`` at once (its decoding stops at the next step), so its client gets
        the JSON error the API promises rather than a cut connection or a plain-text 500."""
        self.drain()
        with self._lock:
            running = list(self._running)
        for job in running:
            job.cancelled.set()
            job.push("error", ApiError(503, "the server is shutting down now (interrupted twice); the request was not "
                                            "finished: retry it", code="shutting_down"))

    def stop(self, timeout: float | None = None) -> None:
        """End the worker after the requests it is decoding."""
        self.drain()
        self._queue.put(None)
        self._thread.join(timeout)
        if self.generator is not None and not self._thread.is_alive():
            self.generator.save_cost_correction()  # what the served requests' timings measured

    # -- the worker --------------------------------------------------------------------------
    def _work(self) -> None:
        """Admit queued requests (into the batch, up to ``max_batch``; else one at a time, here) and
        run the batch's packed forwards, until stopped and nothing decodes."""
        stopping = False
        while True:
            b = self.batcher
            busy = b is not None and b.active > 0
            if not stopping and (b is None or not busy or b.active < b.max_batch):
                job: Job | Literal[False] | None
                try:
                    job = self._queue.get(block=not busy)  # wait for work only when nothing decodes
                except queue.Empty:
                    job = False
                if job is None:
                    stopping = True
                elif job is not False:
                    if self._claim(job):
                        if self.batcher is None:
                            self._serve(job, self.generator)
                        else:
                            self._start(job)
                    continue  # admit the others that wait before the next forward
            if stopping and not busy:
                return
            if busy and b is not None:
                b.step(wait=0.05)

    def _claim(self, job: Job) -> bool:
        """Mark ``job`` running; False where it was cancelled or drained while it waited."""
        with self._lock:
            if job.state != "waiting":
                return False
            job.state = "running"
            self._waiting -= 1
            self._running.add(job)
            self._gauges()
            return True

    def _start(self, job: Job) -> None:
        """Decode ``job`` in the batch: a thread of its own, with a drafter of its own. Where that
        cannot start (the drafter's build failed, no thread), the job is answered with the error
        and the batch goes on without it."""
        from ..models.batch_run import request_thread

        b = self.batcher
        assert b is not None  # _work starts jobs here only with a batcher
        joined = False
        try:
            with self._lock:
                g = self._slots.pop() if self._slots else None
            if g is None:
                assert self.generator is not None  # attached with the batcher
                g = self.generator.sibling(b.slot())
            b.join()
            joined = True

            def run() -> None:
                request_thread()  # its small ops on one torch thread: the forwards' pool keeps the cores
                try:
                    self._serve(job, g)
                finally:
                    b.leave()
                    with self._lock:
                        self._slots.append(g)

            threading.Thread(target=run, name=f"selfspec-request-{job.req.id}", daemon=True).start()
        except Exception as e:  # noqa: BLE001 - logged; the client gets a clean 500, the others go on
            if joined:
                b.leave()
            log.exception("starting request %s failed", job.req.id)
            job.push("error", ApiError(500, f"the request could not start ({type(e).__name__}); see the server log",
                                       code="internal_error"))
            self._finish(job)

    def _serve(self, job: Job, g) -> None:
        """Decode ``job`` with generator ``g`` and answer it (the result or a clean error)."""
        t0 = time.perf_counter()
        try:
            self._decode(job, g)
        except ApiError as e:
            job.push("error", e)
        except SelfspecError as e:
            job.push("error", ApiError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - logged; the client gets a clean 500
            log.exception("decoding request %s failed", job.req.id)
            job.push("error", ApiError(500, f"decoding failed ({type(e).__name__}); see the server log",
                                       code="internal_error"))
        finally:
            self._finish(job, time.perf_counter() - t0)

    def _finish(self, job: Job, seconds: float | None = None) -> None:
        """``job`` ended (answered): no longer running; ``seconds`` it decoded feed Retry-After."""
        with self._lock:
            job.state = "done"
            self._running.discard(job)
            if seconds is not None:
                self._mean_s = 0.8 * self._mean_s + 0.2 * seconds
            self._gauges()

    def _decode(self, job: Job, g) -> None:
        m, req = self.metrics, job.req
        job.push("started")
        deadline = time.perf_counter() + self.request_timeout
        detok = IncrementalDetokenizer(g.tokenizer) if req.stream else None
        text = StopTextFilter(req.stop)
        m.inc("prompt_tokens", len(job.ids))
        # the public decode loop (SpeculativeGenerator.steps), with the live state for the per-step metrics
        steps = g.steps(job.ids, False, **req.gen_kwargs(job.max_new_tokens))
        accepted: list[int]
        state, first, accepted, timed_out = None, None, [], False
        try:
            for state, new in steps:
                if self.step_hook is not None:
                    self.step_hook()
                st = state.stats
                now = [a - (accepted[i] if i < len(accepted) else 0) for i, a in enumerate(st.accepted_by_depth)]
                accepted = list(st.accepted_by_depth)
                m.record_step(st.drafted_per_step[-1] if st.drafted_per_step else 0, now, len(new))
                t = time.perf_counter()
                if new and first is None:
                    first = t
                    m.observe("time_to_first_token_seconds", t - job.arrived)
                if detok is not None:
                    piece = text.push(detok.push(new))
                    if state.done:
                        piece += text.flush(stopped=state.finish_reason == "stop")
                    if piece:
                        job.push("delta", piece)
                if job.cancelled.is_set():
                    return  # the client is gone: nothing to answer
                if not state.done and t > deadline:
                    timed_out = True
                    log.warning("request %s reached the time limit (%.0f s): ending it with finish_reason length",
                                req.id, self.request_timeout)
                    if detok is not None:
                        piece = text.flush(stopped=False)
                        if piece:
                            job.push("delta", piece)
                    break
        finally:
            steps.close()
        if state is None:
            raise ApiError(500, "decoding produced nothing", code="internal_error")
        gen = state.generated
        finish = "length" if timed_out or state.finish_reason == "length" else "stop"
        full = ""
        if detok is None and g.tokenizer is not None:  # as GenerationResult.text
            full = g.tokenizer.decode(gen, skip_special_tokens=True)
            if state.finish_reason == "stop":
                full = text_before_stop(full, req.stop)
        end = time.perf_counter()
        if first is not None and len(gen) > 1:
            m.observe("time_per_output_token_seconds", (end - first) / (len(gen) - 1))
        m.observe("e2e_request_latency_seconds", end - job.arrived)
        m.inc("request_success", finished_reason=finish)
        job.push("done", Outcome(text=full, finish_reason=finish, prompt_tokens=len(job.ids),
                                 completion_tokens=len(gen), steps=state.stats.steps, method=g.last_method or g.method,
                                 lossless=g.lossless, batch_invariant=self.batch_invariant))
