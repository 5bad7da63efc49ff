"""A tiny random-init Llama with a chat template, served on a free loopback port in this process
(uvicorn in a thread), and the official ``openai`` client against it."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfspec.serve.concurrency import InProcessServer

from ..conftest import save_tiny

KEY = "test-key-123"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}w10 {% endif %}{{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}w1{% endif %}")
METHOD = ("pld", {"k": 4, "auto_k": False})  # fixed drafts: no cost profile to measure
METHOD_FLAGS = ["--method", "pld", "--k", "4", "--fixed-k"]


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory) -> Path:
    """The tiny Llama of tests/conftest.py, its word-level tokenizer given a chat template."""
    from transformers import AutoTokenizer

    path = save_tiny(tmp_path_factory.mktemp("tiny-chat"), "llama", 0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


class Running(InProcessServer):
    """A uvicorn server in a thread (the bench's :class:`InProcessServer`): ``url``, its ``engine``, ``stop()``."""


class Process:
    """``selfspec serve`` in a subprocess, its key from ``$SELFSPEC_API_KEY``, on a free port."""

    KEY = "env-key"

    def __init__(self, model_dir: Path, log: Path) -> None:
        env = {**os.environ, "SELFSPEC_API_KEY": self.KEY, "SELFSPEC_KERNELS": "stock", "OMP_NUM_THREADS": "1"}
        self.log_path = log
        self.log = open(log, "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "selfspec.cli", "serve", "--model", str(model_dir),
                                      *METHOD_FLAGS, "--port", "0", "--threads", "1", "--log-level", "warning"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url: str | None = None

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 90) -> str:
        """The server's URL once /health says 200."""
        import httpx

        deadline = time.time() + timeout
        while True:
            assert self.proc.poll() is None and time.time() < deadline, self.output()
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.output())
            if m:
                try:
                    if http().get(m.group(1) + "/health", timeout=5).status_code == 200:
                        self.url = m.group(1)
                        return self.url
                except httpx.TransportError:  # a loaded machine: try again until the deadline
                    pass
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


PROCESS_TEST = "test_serve_process_generate_equality_and_sigterm_drain"


@pytest.fixture(scope="session")
def serve_process(chat_dir, tmp_path_factory):
    p = Process(chat_dir, tmp_path_factory.mktemp("serve-process") / "serve.log")
    yield p
    p.close()


@pytest.fixture(scope="session")
def served(chat_dir, request):
    """The tiny model with pld, served with API key ``KEY``."""
    import selfspec

    if any(item.name == PROCESS_TEST for item in request.session.items):
        request.getfixturevalue("serve_process")  # start it now: it starts up while the tests here run
    from selfspec.serve.app import AppOptions
    from selfspec.serve.engine import Engine

    g = selfspec.load(str(chat_dir), METHOD[0], **METHOD[1])
    engine = Engine(max_queue=16, request_timeout=30.0, max_batch=1)  # one at a time: the queue's tests
    engine.attach(g)
    run = Running(engine, AppOptions(model_id="tiny", aliases=(str(chat_dir),), api_key=KEY, default_max_tokens=32))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def batched(chat_dir):
    """The tiny model with pld on the int8 kernels (rows independent of the batch), served with
    continuous batching of up to 4 requests."""
    import selfspec
    from selfspec.serve.app import AppOptions
    from selfspec.serve.engine import Engine

    g = selfspec.load(str(chat_dir), METHOD[0], kernels="int8", self_test=False, **METHOD[1])
    engine = Engine(max_queue=16, request_timeout=30.0, max_batch=4)
    engine.attach(g)
    run = Running(engine, AppOptions(model_id="tiny", aliases=(str(chat_dir),), api_key=KEY, default_max_tokens=32))
    run.generator = g
    yield run
    run.stop()


@pytest.fixture
def server(served):
    """The served model, with the engine's settings restored after the test and nothing left in
    its queue."""
    e = served.engine
    saved = (e.max_queue, e.request_timeout, e.step_hook)
    yield served
    e.max_queue, e.request_timeout, e.step_hook = saved
    wait_idle(e)


def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while engine.queue_sizes() != (0, 0):
        assert time.time() < deadline, f"the engine is still busy: {engine.queue_sizes()}"
        time.sleep(0.01)


_clients: dict = {}


def http():
    """One shared httpx client (a new one per request costs tens of ms: its SSL context)."""
    import httpx

    if "http" not in _clients:
        _clients["http"] = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=100,
                                                                        max_keepalive_connections=100))
    return _clients["http"]


def client(server, key: str = KEY):
    """The official openai client for ``server`` (cached per server and key)."""
    import openai

    if (server.url, key) not in _clients:
        _clients[server.url, key] = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                                                  timeout=30)
    return _clients[server.url, key]


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.01):
    """Each decode step takes at least ``seconds`` (so that a request is still decoding when a
    test looks)."""
    engine.step_hook = lambda: time.sleep(seconds)
    try:
        yield
    finally:
        engine.step_hook = None


def metric(server, name: str, **labels) -> float:
    """A counter or gauge from ``GET /metrics`` (0 when absent)."""
    text = http().get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    want = "selfspec:" + name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels
                                 else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0
