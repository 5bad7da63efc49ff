"""End-to-end check of ``selfspec serve`` on a real model with the official ``openai`` client.

Starts ``selfspec serve --model M`` on a free loopback port (default method ``auto``), then checks
what a user relies on, and prints one line per check and a JSON summary:

- chat and completions, streamed and not; greedy text equals ``selfspec generate`` (same model,
  same method that the server resolved, same prompt);
- no key / a wrong key: 401; each bad-input class: a 400-class OpenAI error;
- 24 concurrent requests each end in 200 or 429, and a fresh request is served right after;
- ``/metrics``: the draft and accepted-token counters rise.

    python scripts/serve_check.py --model smollm2-135m-instruct [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

KEY = "sk-serve-check"
PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France? Answer briefly."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    """Sum of every sample of ``selfspec:<name>`` in Prometheus text."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^selfspec:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    exe = str(Path(sys.executable).with_name("selfspec"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([exe, "serve", "--model", a.model, "--method", a.method, "--port", str(port),
                            "--api-key", KEY, "--max-queue", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    results: dict[str, object] = {}
    ok = True

    def check(name: str, cond: bool, detail: object = "") -> None:
        nonlocal ok
        ok &= bool(cond)
        results[name] = {"ok": bool(cond), "detail": detail}
        print(f"{'PASS' if cond else 'FAIL'} {name} {detail}", flush=True)

    try:
        ready = ""
        t0 = time.time()
        while time.time() - t0 < 600:
            line = srv.stdout.readline()
            if not line:
                break
            print("server:", line.rstrip(), flush=True)
            if "ready:" in line:
                ready = line
                break
        check("ready", bool(ready), f"{time.time() - t0:.0f} s")
        m = re.search(r"with (\S+) \(", ready)
        served = m.group(1) if m else a.method
        method = served.split("→")[-1]
        threading.Thread(target=lambda: [None for _ in srv.stdout], daemon=True).start()
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        h = {"Authorization": f"Bearer {KEY}"}
        before = httpx.get(url + "/metrics", headers=h).text
        for i, p in enumerate(PROMPTS):
            gen = subprocess.run([exe, "generate", "--model", a.model, "--method", method, "--max-new-tokens",
                                  str(a.max_tokens), "--json", p], capture_output=True, text=True, check=True)
            want = json.loads(gen.stdout)["text"]
            r = c.chat.completions.create(model=a.model, messages=[{"role": "user", "content": p}],
                                          max_tokens=a.max_tokens, temperature=0)
            s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=a.model, messages=[{"role": "user", "content": p}], max_tokens=a.max_tokens, temperature=0,
                stream=True))
            ext = r.model_extra.get("choices", [{}])[0] if r.model_extra else {}
            sel = r.choices[0].model_extra.get("selfspec", ext.get("selfspec"))
            check(f"chat {i} equals generate (not streamed)", r.choices[0].message.content == want,
                  {"selfspec": sel, "usage": r.usage.model_dump()})
            check(f"chat {i} equals generate (streamed)", s == want)
        p = "def fibonacci(n):"
        gen = subprocess.run([exe, "generate", "--model", a.model, "--method", method, "--max-new-tokens",
                              str(a.max_tokens), "--no-chat", "--json", p], capture_output=True, text=True, check=True)
        want = json.loads(gen.stdout)["text"]
        r = c.completions.create(model=a.model, prompt=p, max_tokens=a.max_tokens, temperature=0)
        s = "".join(ch.choices[0].text for ch in c.completions.create(model=a.model, prompt=p,
                                                                      max_tokens=a.max_tokens, temperature=0,
                                                                      stream=True))
        check("completion equals generate --no-chat (not streamed)", r.choices[0].text == want)
        check("completion equals generate --no-chat (streamed)", s == want)
        for name, key in [("no key", None), ("wrong key", "sk-wrong")]:
            hdr = {"Authorization": f"Bearer {key}"} if key else {}
            st = httpx.post(url + "/v1/chat/completions", headers=hdr, json={"model": a.model, "messages": [
                {"role": "user", "content": "hi"}]}).status_code
            check(f"{name}: 401", st == 401, st)
        msgs = [{"role": "user", "content": "hi"}]
        bad = {
            "wrong type": {"model": a.model, "messages": msgs, "max_tokens": "ten"},
            "max_tokens < 1": {"model": a.model, "messages": msgs, "max_tokens": 0},
            "max_tokens beyond context": {"model": a.model, "messages": msgs, "max_tokens": 10**9},
            "temperature < 0": {"model": a.model, "messages": msgs, "temperature": -1},
            "top_p outside (0, 1]": {"model": a.model, "messages": msgs, "top_p": 1.5},
            "empty messages": {"model": a.model, "messages": []},
            "unknown role": {"model": a.model, "messages": [{"role": "wizard", "content": "hi"}]},
            "n > 1": {"model": a.model, "messages": msgs, "n": 2},
            "unknown model": {"model": "gpt-9", "messages": msgs},
        }
        for name, body in bad.items():
            resp = httpx.post(url + "/v1/chat/completions", headers=h, json=body)
            is_json = resp.headers.get("content-type", "").startswith("application/json")
            err = resp.json().get("error", {}) if is_json else {}
            check(f"bad input, {name}: 4xx with an OpenAI error", 400 <= resp.status_code < 500 and "message" in err,
                  resp.status_code)
        nan = b'{"model": "m", "messages": [], "temperature": NaN}'
        for name, raw in [("malformed JSON", b'{"model": '), ("NaN", nan)]:
            resp = httpx.post(url + "/v1/chat/completions", headers={**h, "content-type": "application/json"},
                              content=raw)
            check(f"bad input, {name}: 4xx", 400 <= resp.status_code < 500, resp.status_code)
        resp = httpx.post(url + "/v1/completions", headers=h, json={"model": a.model, "prompt": "x" * (2 << 20)})
        check("bad input, oversized body: 4xx", 400 <= resp.status_code < 500, resp.status_code)

        def one(i: int) -> int:
            try:
                return httpx.post(url + "/v1/completions", headers=h, timeout=600, json={
                    "model": a.model, "prompt": f"Count to {i}:", "max_tokens": 16, "temperature": 0}).status_code
            except httpx.HTTPError as e:
                return -1 if not isinstance(e, httpx.TimeoutException) else -2
        with ThreadPoolExecutor(24) as ex:
            codes = list(ex.map(one, range(24)))
        check("24 concurrent: each 200 or 429", set(codes) <= {200, 429},
              {str(k): codes.count(k) for k in sorted(set(codes))})
        check("fresh request served after the burst", one(99) == 200)
        after = httpx.get(url + "/metrics", headers=h).text
        rise = {n: (metric(before, n), metric(after, n)) for n in (
            "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "generation_tokens_total")}
        check("metrics: draft and accepted counters rise" if method != "ar" else "metrics: tokens rise",
              all(b > a_ for k, (a_, b) in rise.items() if method != "ar" or k == "generation_tokens_total"), rise)
        results["served"] = served
    finally:
        srv.terminate()
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
    summary = {"model": a.model, "method": a.method, "all_ok": ok, "checks": results}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({"all_ok": ok, "served": results.get("served")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
