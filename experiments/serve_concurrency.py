"""Issue 58: the server under concurrent clients (continuous batching), through the official OpenAI client.

Serves SmolLM2-135M fp32 in this process (the engine and app of ``selfspec serve`` on a free loopback
port; method and kernels as given, default the product's ``auto``), then for each concurrency C sends
the same N built-in-style chat prompts (greedy, ``max_tokens`` T, EOS ignored) from C client threads,
each taking the next prompt when its last one ends. Reports per C: aggregate tok/s, p50/p95 time to
first token and per output token (streamed), and how many requests' ids equal their solo run
(``generate`` of the same generator, one at a time). One JSON line per concurrency, then a plot.

    python experiments/serve_concurrency.py --concurrency 1,2,4,8 --prompts 16 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))] if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="auto")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--out", default="serve-concurrency")
    a = ap.parse_args()

    import openai

    import selfspec
    from selfspec.bench.datasets import load_dataset
    from selfspec.serve.app import AppOptions
    from selfspec.serve.engine import Engine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' in-process server
    from tests.serve.conftest import Running

    g = selfspec.load("smollm2-135m-instruct", method=a.method, kernels=a.kernels)
    engine = Engine(max_queue=64, request_timeout=600.0, max_batch=a.max_batch)
    engine.attach(g)
    run = Running(engine, AppOptions(model_id="m", aliases=(), api_key=None, default_max_tokens=a.tokens))
    texts = [p.text for p in load_dataset("builtin", limit=a.prompts)]
    while len(texts) < a.prompts:
        texts += texts[: a.prompts - len(texts)]
    solo = [g.generate(t, max_new_tokens=a.tokens, ignore_eos=True).token_ids for t in texts]
    tok = g.tokenizer
    client = openai.OpenAI(base_url=run.url + "/v1", api_key="none", max_retries=0, timeout=600)
    def level(c: int) -> dict:
        queue = list(range(len(texts)))
        lock = threading.Lock()
        ttft, tpot, same, ntok = [], [], [0], [0]

        def worker() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                t0 = time.perf_counter()
                first, pieces = None, []
                for ch in client.chat.completions.create(model="m", messages=[{"role": "user", "content": texts[i]}],
                                                         max_tokens=a.tokens, temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True}):
                    if ch.choices and ch.choices[0].delta.content:
                        if first is None:
                            first = time.perf_counter()
                        pieces.append(ch.choices[0].delta.content)
                end = time.perf_counter()
                with lock:
                    ttft.append(first - t0)
                    tpot.append((end - first) / max(1, a.tokens - 1))
                    ntok[0] += a.tokens
                    same[0] += "".join(pieces) == tok.decode(solo[i], skip_special_tokens=True)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return {"concurrency": c, "method": g.method, "kernels": g.kernels, "max_batch": engine.max_batch,
                "tok_s": round(ntok[0] / wall, 2), "ttft_p50_s": round(pct(ttft, 0.5), 3),
                "ttft_p95_s": round(pct(ttft, 0.95), 3), "tpot_p50_ms": round(1e3 * pct(tpot, 0.5), 1),
                "tpot_p95_ms": round(1e3 * pct(tpot, 0.95), 1), "identical_to_solo": f"{same[0]}/{len(texts)}",
                "mean_batch": round(statistics.mean(engine.batcher.sizes[-200:]), 2) if engine.batcher else 1}

    rows = []
    for c in [int(x) for x in a.concurrency.split(",")]:
        rows.append(level(c))
        print(json.dumps(rows[-1]), flush=True)
    run.stop()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    cs = [r["concurrency"] for r in rows]
    ax1.plot(cs, [r["tok_s"] for r in rows], "o-")
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("aggregate tokens/s")
    ax2.plot(cs, [r["tpot_p50_ms"] for r in rows], "o-", label="p50")
    ax2.plot(cs, [r["tpot_p95_ms"] for r in rows], "s--", label="p95")
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel("ms per output token")
    ax2.legend()
    fig.suptitle(f"selfspec serve, SmolLM2-135M fp32, {rows[0]['method']} ({rows[0]['kernels']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "throughput_latency.png", dpi=110)


if __name__ == "__main__":
    main()
