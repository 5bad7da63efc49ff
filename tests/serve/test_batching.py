"""Continuous batching in the server: concurrent clients decode in shared packed forwards, each
request's text exactly its solo run's (int8 kernels: rows independent of the batch), a client that
goes away leaves the batch without disturbing the others, and /health and /metrics say how many
decode at once."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .conftest import client, http, metric, slow_steps, wait_idle

PROMPTS = ["w5 w6", "w7 w8 w9 w10 w11", "w12", "w13 w14 w15", "w16 w17", "w18 w19 w20 w21"]


def solo(g, prompt: str, n: int) -> str:
    return g.generate(prompt, max_new_tokens=n, ignore_eos=True, chat=False).text


def test_concurrent_requests_share_forwards_and_each_is_its_solo_run(batched):
    g, e = batched.generator, batched.engine
    lengths = [12, 30, 7, 21, 16, 25]
    want = [solo(g, p, n) for p, n in zip(PROMPTS, lengths)]
    c = client(batched)
    before = metric(batched, "batch_size_count")

    def ask(i: int):
        r = c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text, r.choices[0].model_extra["selfspec"]

    with slow_steps(e, 0.005), ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    assert [t for t, _ in got] == want  # 6 clients, up to 4 at once, 2 waiting then joining
    assert all(s["batch_invariant"] is True for _, s in got)
    assert max(e.batcher.sizes) > 1 and max(e.batcher.sizes) <= 4
    assert metric(batched, "batch_size_count") > before
    wait_idle(e)


def test_a_client_that_leaves_does_not_disturb_the_others(batched):
    g, e = batched.generator, batched.engine
    want = [solo(g, p, 24) for p in PROMPTS[:3]]
    c = client(batched)
    got: dict = {}

    def ask(i: int) -> None:
        r = c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True})
        got[i] = r.choices[0].text

    with slow_steps(e, 0.01):
        stream = c.completions.create(stream=True, model="tiny", prompt="w30 w31", max_tokens=400, temperature=0,
                                      extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 10  # until another request has joined the stream's batch (polled, not slept on)
        while (health := http().get(batched.url + "/health", timeout=10).json())["active_slots"] < 2:
            assert time.time() < deadline and any(t.is_alive() for t in threads), health
        assert health["status"] == "ok" and health["max_batch"] == 4 and 2 <= health["active_slots"] <= 4
        stream.close()  # gone mid-batch: it leaves at its next step
        for t in threads:
            t.join(30)
    assert [got[i] for i in range(3)] == want
    wait_idle(e)


@pytest.mark.load
def test_32_clients_with_cancellations_and_an_overlong_prompt(batched):
    """32 clients at once: some go away mid-stream, one sends a prompt longer than the context. The
    server keeps serving, every request that finishes is its own solo run (no request's tokens in
    another's stream), nothing is left behind, and the process's memory stays bounded."""
    import psutil

    g, e = batched.generator, batched.engine
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randint(4, 90)}" for _ in range(rng.randint(1, 12))) for _ in range(32)]
    lengths = [rng.randint(4, 40) for _ in range(32)]
    leave_after = {i: rng.randint(1, 3) for i in rng.sample(range(32), 8)}  # these clients go away mid-stream
    overlong = 5
    prompts[overlong] = " ".join(["w9"] * 600)  # the tiny model's context is 512
    want = {i: solo(g, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))
            if i not in leave_after and i != overlong}
    rss = psutil.Process().memory_info().rss
    c = client(batched)
    e.max_queue = 64
    got: dict = {}

    def one(i: int) -> None:
        try:
            stream = c.completions.create(stream=True, model="tiny", prompt=prompts[i], max_tokens=lengths[i],
                                          temperature=0, extra_body={"ignore_eos": True})
            pieces = []
            for k, ch in enumerate(stream):
                pieces.append(ch.choices[0].text if ch.choices else "")
                if i in leave_after and k + 1 >= leave_after[i]:
                    stream.close()
                    got[i] = "left"
                    return
            got[i] = "".join(pieces)
        except openai.BadRequestError as err:
            got[i] = f"400 {err.message}"

    try:
        with slow_steps(e, 0.002), ThreadPoolExecutor(32) as pool:
            list(pool.map(one, range(32)))
    finally:
        e.max_queue = 16
    assert got[overlong].startswith("400") and "context" in got[overlong]
    assert {i: got[i] for i in want} == want
    assert all(got[i] == "left" for i in leave_after)
    wait_idle(e, 15)
    assert e.queue_sizes() == (0, 0) and e.batcher.active == 0
    assert psutil.Process().memory_info().rss - rss < 300 * 2**20  # bounded: the caches of finished requests freed
    assert c.completions.create(model="tiny", prompt="w5", max_tokens=4, temperature=0).usage.completion_tokens >= 1


def test_a_request_whose_drafter_cannot_be_built_gets_500_and_the_batch_goes_on(batched, monkeypatch):
    g, e = batched.generator, batched.engine
    want = solo(g, PROMPTS[0], 10)
    e._slots.clear()  # the next request builds its drafter
    real = type(g).sibling
    calls = []

    def fails_once(self, target):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return real(self, target)

    monkeypatch.setattr(type(g), "sibling", fails_once)
    c = client(batched)
    try:
        c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0)
        raise AssertionError("expected a 500")
    except openai.InternalServerError as err:
        assert "could not start" in err.message
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    wait_idle(e)
    assert e.batcher.active == 0
