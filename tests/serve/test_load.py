"""One request decodes at a time (``max_batch`` 1; batching: ``test_batching.py``): the queue's bound
(429 + Retry-After), cancellation by the client, the time limit, /health and /metrics while decoding,
metrics, and a bounded load test."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import KEY, client, http, metric, slow_steps, wait_idle

AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_health_and_metrics_answer_while_a_request_decodes(server):
    e = server.engine
    with slow_steps(e, 0.02):
        c = client(server)
        stream = c.completions.create(stream=True, **{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        assert e.queue_sizes() == (0, 1)
        before = metric(server, "generation_tokens_total")
        assert http().get(server.url + "/health", timeout=10).status_code == 200
        text = http().get(server.url + "/metrics", headers=AUTH, timeout=10).text
        # answered while the request decodes, not after it: a bound on decode steps, not on seconds
        assert metric(server, "generation_tokens_total") - before < 200 and e.queue_sizes() == (0, 1)
        assert "selfspec:num_requests_running 1" in text
        stream.close()
    wait_idle(e)


def test_client_disconnect_cancels_at_the_next_step(server):
    """A stream closed after its first chunks, and a non-streamed request whose client times out:
    both stop decoding at once, count as 499, and the next request is served."""
    e = server.engine
    gone = metric(server, "requests_total", status="499")
    tokens = metric(server, "generation_tokens_total")
    with slow_steps(e, 0.01):
        c = client(server)
        stream = c.completions.create(stream=True, model="tiny", prompt="w5 w6", max_tokens=400, temperature=0,
                                      extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it), next(it)
        stream.close()
        wait_for(lambda: e.queue_sizes() == (0, 0), 5)
        with pytest.raises(httpx.ReadTimeout):
            http().post(server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=0.3)
        wait_for(lambda: e.queue_sizes() == (0, 0), 5)
    wait_for(lambda: metric(server, "requests_total", status="499") == gone + 2, 5)
    assert metric(server, "generation_tokens_total") - tokens < 400  # neither ran to its 400 tokens
    assert metric(server, "num_requests_waiting") == 0 and metric(server, "num_requests_running") == 0
    r = client(server).completions.create(model="tiny", prompt="w5 w6", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_queue_overflow_is_429_with_retry_after(server):
    e = server.engine
    e.max_queue = 1
    with slow_steps(e, 0.01):
        c = client(server)
        running = c.completions.create(stream=True, model="tiny", prompt="w5", max_tokens=400, temperature=0,
                                       extra_body={"ignore_eos": True})
        next(iter(running))
        waiting: dict = {}
        t = threading.Thread(target=lambda: waiting.update(r=http().post(
            server.url + "/v1/completions", json={**LONG, "max_tokens": 2}, headers=AUTH, timeout=30)))
        t.start()
        wait_for(lambda: e.queue_sizes() == (1, 1), 5)
        r = http().post(server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "busy: 1 request is waiting for the decoder" in r.json()["error"]["message"]  # not "1 requests are"
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=2)
        running.close()
        t.join(10)
    assert waiting["r"].status_code == 200  # the queued one is served once the first is gone


def test_time_limit_ends_with_length(server):
    e = server.engine
    e.request_timeout = 0.3
    with slow_steps(e, 0.01):
        r = client(server).completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                              extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and 0 < r.usage.completion_tokens < 400
        chunks = list(client(server).completions.create(stream=True, **{k: v for k, v in LONG.items()
                                                                         if k != "ignore_eos"},
                                                        extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"


def test_metrics_rise_and_parse_as_prometheus_text(server):
    names = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total", "prompt_tokens_total", "generation_tokens_total")
    before = {n: metric(server, n) for n in names}
    ok = metric(server, "requests_total", status="200")
    c = client(server)
    prompt = "w5 w6 w7 w8 " * 8
    for _ in range(2):
        c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    after = {n: metric(server, n) for n in names}
    assert all(after[n] > before[n] for n in names), (before, after)
    assert metric(server, "requests_total", status="200") == ok + 2
    text = http().get(server.url + "/metrics", headers=AUTH).text
    sample = re.compile(r'^selfspec:[a-z0-9_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP selfspec:") or line.startswith("# TYPE selfspec:") or sample.match(line), line
    assert 'selfspec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    per_pos = sum(float(m) for m in re.findall(r'per_pos_total\{position="\d+"\} (\S+)', text))
    assert per_pos == metric(server, "spec_decode_num_accepted_tokens_total")
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert f'selfspec:{h}_bucket{{le="+Inf"}}' in text and metric(server, h + "_count") > 0
    assert "# TYPE selfspec:num_requests_waiting gauge" in text


def test_24_concurrent_requests_each_end_200_or_429_then_a_fresh_one_is_served(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 8,
            "temperature": 0}

    def one(_):
        return http().post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).status_code

    with slow_steps(server.engine, 0.002), ThreadPoolExecutor(24) as pool:
        codes = list(pool.map(one, range(24)))
    assert set(codes) <= {200, 429} and 200 in codes, codes
    r = client(server).chat.completions.create(**body)
    assert r.choices[0].message.content is not None


def test_50_clients_with_short_timeouts_then_a_fresh_request_succeeds(server):
    """50 concurrent clients that give up after 0.5 s (a few are served, many queue and leave,
    the rest get 429): afterwards nothing is left behind and a fresh request is served."""
    body = {**LONG, "max_tokens": 60}
    outcomes: list[str] = []

    def one(_):
        try:
            return str(http().post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5).status_code)
        except httpx.TimeoutException:
            return "timeout"

    with slow_steps(server.engine, 0.005), ThreadPoolExecutor(50) as pool:
        outcomes = list(pool.map(one, range(50)))
    assert set(outcomes) <= {"200", "429", "timeout"}, outcomes
    wait_idle(server.engine, 15)
    assert server.engine.queue_sizes() == (0, 0)  # nothing left behind
    r = client(server).completions.create(model="tiny", prompt="w5 w6", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens >= 1
