"""``selfspec serve`` as a process (started early by the ``served`` fixture, so that it starts up
while the in-process tests run; this file runs late): the key from ``$SELFSPEC_API_KEY``, greedy
text equal to ``selfspec generate``, SIGTERM draining the request in flight."""

from __future__ import annotations

import json
import signal
import threading
import time

from selfspec.cli import main

from .conftest import METHOD_FLAGS, http

PROMPT = "w5 w6 w7 w5 w6 w7 w5 w6"


def test_serve_process_generate_equality_and_sigterm_drain(serve_process, chat_dir, capsys):
    url = serve_process.wait_ready()
    auth = {"Authorization": f"Bearer {serve_process.KEY}"}  # the key from $SELFSPEC_API_KEY
    assert http().get(url + "/v1/models", timeout=5).status_code == 401
    body = {"model": str(chat_dir), "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20,
            "temperature": 0}
    served = http().post(url + "/v1/chat/completions", json=body, headers=auth, timeout=30).json()
    capsys.readouterr()
    assert main(["generate", "--model", str(chat_dir), *METHOD_FLAGS, "--json", "--max-new-tokens", "20", PROMPT]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert served["choices"][0]["message"]["content"] == ref["text"]
    assert served["usage"]["completion_tokens"] == ref["new_tokens"]

    result: dict = {}
    long = {"model": str(chat_dir), "prompt": "w5 w6", "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.update(
        r=http().post(url + "/v1/completions", json=long, headers=auth, timeout=60)))
    t.start()
    deadline = time.time() + 30
    while "selfspec:num_requests_running 1" not in http().get(url + "/metrics", headers=auth, timeout=5).text:
        assert time.time() < deadline and t.is_alive()
        time.sleep(0.02)
    serve_process.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert serve_process.proc.wait(30) == 0
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 450 and r.json()["choices"][0]["finish_reason"] == "length"
    out = serve_process.output()
    assert "SIGTERM: finishing the request in flight" in out and "selfspec serve: stopped" in out
    assert "Traceback" not in out
