"""``selfspec serve``'s flags and the pieces it is built of: binding, the exposure warning, /health
while loading, streams of whole characters."""

from __future__ import annotations

import json
import time

import pytest

from selfspec.cli import main

from .conftest import Running, http


def test_flag_errors_are_one_line_exit_2(capsys, chat_dir):
    for argv, what in [(["--port", "70000"], "--port"), (["--max-tokens", "0"], "--max-tokens"),
                       (["--request-timeout", "0"], "--request-timeout"), (["--host", "no.such.host.invalid"], "host"),
                       (["--k", "3"], "--k")]:
        capsys.readouterr()
        assert main(["serve", "--model", str(chat_dir), "--method", "ar", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("selfspec: error:") and what in err and "\n" not in err


def test_port_in_use_is_a_one_line_error():
    from selfspec.errors import SelfspecError
    from selfspec.serve.server import bind

    sock = bind("127.0.0.1", 0)
    sock.listen()
    try:
        with pytest.raises(SelfspecError, match="cannot listen on 127.0.0.1"):
            bind("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_exposure_warning_without_a_key():
    from selfspec.serve.command import exposure_warning, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.com")
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    w = exposure_warning("0.0.0.0", None)
    assert "warning" in w and "--api-key" in w and "SELFSPEC_API_KEY" in w


def test_health_is_503_while_loading(chat_dir):
    """Before the model is attached: /health 503, completions 503 with an error body; then 200."""
    import selfspec
    from selfspec.serve.app import AppOptions
    from selfspec.serve.engine import Engine

    engine = Engine()
    run = Running(engine, AppOptions(model_id="tiny"))
    try:
        r = http().get(run.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = http().post(run.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and "Retry-After" in r.headers
        engine.attach(selfspec.load(str(chat_dir), "ar", self_test=False))
        assert http().get(run.url + "/health").status_code == 200
        r = http().post(run.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["selfspec"]["method"] == "ar"
        assert r.json()["choices"][0]["selfspec"]["tau"] == 1.0
        engine.drain()  # SIGTERM: /health says so, new requests get 503
        assert http().get(run.url + "/health").status_code == 503
        assert http().post(run.url + "/v1/completions", json={"prompt": "w5"}).json()["error"]["code"] == \
            "shutting_down"
    finally:
        run.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_ctrl_c_answers_the_request_in_flight_503_json(chat_dir, capsys, stream):
    """The first Ctrl-C lets the request that is decoding finish; a second one used to cancel its
    task, which uvicorn answered with a plain-text 500 and an ASGI traceback. Now the request gets
    the API's JSON error, 503 shutting_down, and the server exits soon after."""
    import signal
    import threading
    import time

    import uvicorn

    import selfspec
    from selfspec.serve.app import AppOptions
    from selfspec.serve.engine import Engine
    from selfspec.serve.server import FORCE_EXIT_AFTER_S, _Server

    engine = Engine()
    engine.attach(selfspec.load(str(chat_dir), "ar", self_test=False))
    engine.step_hook = lambda: time.sleep(0.02)
    run = Running(engine, AppOptions(model_id="tiny"))
    timers: list = []  # the force-exit timer, fired by the test (no sleep)

    class FakeTimer:
        def __init__(self, seconds: float, fn) -> None:
            self.seconds, self.fn, self.daemon = seconds, fn, False
            timers.append(self)

        def start(self) -> None:
            pass

    server = _Server(uvicorn.Config(run.server.config.app), engine, timer=FakeTimer)  # its signal handling
    try:
        result: dict = {}
        started = threading.Event()  # the stream's first event was read (its 200 was sent)
        body = {"prompt": "w5 w6", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": stream}

        def post() -> None:
            if not stream:
                result["r"] = http().post(run.url + "/v1/completions", json=body, timeout=30)
                return
            with http().stream("POST", run.url + "/v1/completions", json=body, timeout=30) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                result["r"], result["lines"] = r, lines
            started.set()

        t = threading.Thread(target=post)
        t.start()
        deadline = time.time() + 10
        while engine.queue_sizes() != (0, 1) or (stream and not started.is_set()):
            assert time.time() < deadline
            time.sleep(0.01)
        server.handle_exit(signal.SIGINT, None)
        assert engine.queue_sizes() == (0, 1) and not server.force_exit  # the first: it decodes on
        server.handle_exit(signal.SIGINT, None)
        t.join(10)
        r = result["r"]
        if stream:  # the stream had started (200): its last event is the error, then [DONE]
            events = [line[6:] for line in result["lines"] if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert [t.seconds for t in timers] == [FORCE_EXIT_AFTER_S] and not server.force_exit
        timers[0].fn()  # the timer fires
        assert server.force_exit and "SIGINT again" in capsys.readouterr().err
    finally:
        run.stop()


def test_streams_never_split_a_multibyte_character():
    """The worker's stream path on a byte-level tokenizer, one byte per decode step: every piece
    is whole characters and the pieces join to the text."""
    import asyncio

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from selfspec.decoding.state import StepStats
    from selfspec.serve.engine import Engine, Job
    from selfspec.serve.protocol import Request

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = {_byte_of(c): c for c in alphabet}
    tok = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    text = "héllo wörld, 日本語 🙂!"
    ids = list(text.encode())
    assert tokenizer.decode(ids) == text

    class State:
        def __init__(self):
            self.stats, self.generated, self.finish_reason = StepStats(), [], None

        @property
        def done(self):
            return self.finish_reason is not None

    class FakeGenerator:
        method, lossless, kernels, last_method = "scripted", True, "stock", "scripted"

        def __init__(self):
            self.tokenizer = tokenizer
            self.saved = 0

        def save_cost_correction(self):  # the engine writes the timings back when it stops
            self.saved += 1

        def steps(self, prompt, chat, **kw):
            state = State()
            for i, t in enumerate(ids):
                state.generated.append(t)
                state.stats.record(0, 0, 1)
                if i == len(ids) - 1:
                    state.finish_reason = "eos"
                yield state, [t]

    async def run() -> list:
        engine = Engine()
        engine.generator = FakeGenerator()
        job = Job(Request(chat=False, prompt=[1], stream=True), [1], 100, time.perf_counter())
        engine.submit(job)
        events = []
        while not events or events[-1][0] not in ("done", "error"):
            events.append(await asyncio.wait_for(job.events.get(), 10))
        engine.stop(5)
        assert engine.generator.saved == 1  # stopping writes the cost correction, once
        return events

    events = asyncio.run(run())
    pieces = [e[1] for e in events if e[0] == "delta"]
    assert events[-1][0] == "done" and events[-1][1].finish_reason == "stop"
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert len(pieces) == len(text)  # one piece per character, none per byte


def _byte_of(c: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(cs, bs))[ord(c)]


@pytest.mark.parametrize("flags, batching", [([], True), (["--max-batch", "4"], True), (["--max-batch", "1"], False)])
def test_the_server_asks_auto_for_a_configuration_that_batches(monkeypatch, chat_dir, flags, batching):
    """``auto`` in a server chooses among configurations whose requests share a batch, unless the
    server decodes one request at a time (``--max-batch 1``)."""
    import selfspec.api
    import selfspec.serve.command

    asked: list[bool] = []
    monkeypatch.setattr(selfspec.api, "load", lambda **kw: asked.append(kw["batching"]))
    monkeypatch.setattr(selfspec.serve.command, "run_serve", lambda args, load: (load(), 0)[1])
    assert main(["serve", "--model", str(chat_dir), *flags]) == 0
    assert asked == [batching]
