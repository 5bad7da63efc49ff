"""``selfspec bench --concurrency 1,2,4,8``: the server under concurrent clients (issue 58).

The model is served by ``selfspec serve`` in a process of its own, as users run it (continuous
batching, its default ``--max-batch``), on a free loopback port. For each concurrency C, C client
threads of the official ``openai`` client in this process stream the same chat prompts (greedy,
``max_tokens`` new tokens each, EOS ignored), each thread taking the next prompt when its last one
ends. Per C: aggregate tokens/s (tokens over the level's wall time), p50/p95 time to first token
and per output token, the server's mean batch size (its ``/metrics``), and how many requests' text
equals their **solo run** (``generate`` of the same configuration loaded here, one request at a
time; every solo run is also checked against ``transformers`` ``generate(do_sample=False)`` once).

Peers in the same run, on the same prompts and weights (fp32):

* ``transformers``: ``generate`` with a left-padded batch of C prompts at a time (stock kernels);
  its rows are compared with the solo ids (padding changes their shapes and masks).
* ``vllm``: vLLM's CPU build through its own OpenAI server, in its own venv (``--vllm-python`` or
  ``$SELFSPEC_VLLM_PYTHON``: it pins another transformers), driven by the same client code. A peer
  that fails to start or crashes is reported as failed, never as a figure.

Writes ``concurrency.jsonl`` (one row per contender and level), ``concurrency.md`` and
``concurrency.png`` (throughput and p95 time per token against concurrency) in ``--out``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..errors import SelfspecError
from .load_peers import SelfspecServer, VllmServer, no_eos, transformers_batches

if TYPE_CHECKING:
    from ..generator import SpeculativeGenerator

log = logging.getLogger(__name__)

LOAD_PEERS = ("transformers", "vllm")
"""Peers of the concurrency benchmark."""
VLLM_PYTHON_ENV = "SELFSPEC_VLLM_PYTHON"


@dataclass(frozen=True)
class ConcurrencyOptions:
    """One concurrency benchmark.

    Attributes:
        levels: the concurrencies, e.g. (1, 2, 4, 8).
        prompts: chat prompts (texts), each sent once per level.
        max_new_tokens: tokens generated per request (EOS ignored).
        peers: among :data:`LOAD_PEERS`.
        vllm_python: the Python of vLLM's venv (None: ``$SELFSPEC_VLLM_PYTHON``).
        max_batch: the server's ``--max-batch`` (None: its default, from free memory).
        out: the output directory.
        serve_args: ``selfspec serve``'s arguments for the model, method and kernels measured.
    """

    levels: tuple[int, ...]
    prompts: tuple[str, ...]
    max_new_tokens: int = 128
    peers: tuple[str, ...] = ()
    vllm_python: str | None = None
    max_batch: int | None = None
    out: Path = Path("bench-out")
    serve_args: tuple[str, ...] = ()


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8); a one-line error for anything else."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise SelfspecError(f"--concurrency takes comma-separated client counts >= 1 (e.g. 1,2,4,8), not {text!r}")
    return levels


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; nan when empty)."""
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))] if v else float("nan")


def drive(base_url: str, model: str, prompts: Sequence[str], clients: int, max_new_tokens: int,
          clock: Callable[[], float] = time.perf_counter) -> dict:
    """Stream every prompt once through the OpenAI client from ``clients`` threads, each taking
    the next prompt when its last one ends. Returns tok/s, TTFT and TPOT percentiles and each
    prompt's text (by index); a request that fails is counted in ``failed``."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600)
    queue = list(range(len(prompts)))
    lock = threading.Lock()
    ttft: list[float] = []
    tpot: list[float] = []
    texts: dict[int, str] = {}
    tokens = [0]
    failed: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            t0 = clock()
            first, pieces = None, []
            try:
                for ch in client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": prompts[i]}], max_tokens=max_new_tokens,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    if ch.choices and ch.choices[0].delta.content:
                        if first is None:
                            first = clock()
                        pieces.append(ch.choices[0].delta.content)
            except Exception as e:  # noqa: BLE001 - reported as a failed request, never as a figure
                with lock:
                    failed.append(f"{type(e).__name__}: {e}"[:200])
                continue
            end = clock()
            with lock:
                first = end if first is None else first
                ttft.append(first - t0)
                tpot.append((end - first) / max(1, max_new_tokens - 1))
                tokens[0] += max_new_tokens
                texts[i] = "".join(pieces)

    t0 = clock()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = clock() - t0
    return {"concurrency": clients, "tok_s": round(tokens[0] / wall, 2) if wall > 0 else 0.0,
            "ttft_p50_s": round(percentile(ttft, 0.5), 3), "ttft_p95_s": round(percentile(ttft, 0.95), 3),
            "tpot_p50_ms": round(1e3 * percentile(tpot, 0.5), 1), "tpot_p95_ms": round(1e3 * percentile(tpot, 0.95), 1),
            "failed": failed, "texts": texts}


class InProcessServer:
    """The app of ``selfspec serve`` over ``engine`` in a uvicorn thread on a free loopback port."""

    def __init__(self, engine, options) -> None:
        import uvicorn

        from .app import create_app
        from .server import bind

        self.engine = engine
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = create_app(engine, options)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise SelfspecError("the benchmark's server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.stop(timeout=10)
        self.sock.close()


def run_concurrency(opts: ConcurrencyOptions, load: Callable[[], SpeculativeGenerator],
                    model_dir: str | None = None) -> int:
    """The benchmark (see the module docstring); ``load()`` returns the served generator and
    ``model_dir`` is its weights' directory (what the vLLM peer loads). Prints the report; 0."""
    import torch

    from ..decoding.text import encode_prompt

    vllm_python = opts.vllm_python or os.environ.get(VLLM_PYTHON_ENV)
    if "vllm" in opts.peers and not vllm_python:
        raise SelfspecError("--peers vllm needs the Python of vLLM's own venv: --vllm-python PATH or "
                            f"${VLLM_PYTHON_ENV} (docs/serving.md says how to install it)")
    opts.out.mkdir(parents=True, exist_ok=True)
    write_meta(opts)
    g = load()
    config: Any = g.target.model.config  # a transformers config (nn.Module's attributes type as Tensor | Module)
    vocab = config.vocab_size
    ids = [encode_prompt(g.tokenizer, t, True, vocab) for t in opts.prompts]
    log.info("solo runs of %d prompts", len(ids))
    solo = [g.generate(x, max_new_tokens=opts.max_new_tokens, ignore_eos=True).token_ids for x in ids]
    model = g.target.base.model
    generate = cast("Callable[..., torch.Tensor]", model.generate)  # transformers' generate: the ids tensor
    with torch.inference_mode():
        # an explicit mask: without one, generate infers it from the pad id, which masks a chat prompt's
        # turn-end tokens where the pad id is the end-of-turn id (SmolLM2) and EOS is no longer it
        dev = next(model.parameters()).device
        ref = [generate(input_ids=torch.tensor([x], device=dev),
                        attention_mask=torch.ones(1, len(x), dtype=torch.long, device=dev),
                        generation_config=no_eos(model, opts.max_new_tokens))[0, len(x):].tolist() for x in ids]
    solo_vs_generate = sum(a == b for a, b in zip(solo, ref))
    solo_text = [g.tokenizer.decode(s, skip_special_tokens=True) for s in solo]
    rows: list[dict] = []
    path = opts.out / "concurrency.jsonl"

    def record(row: dict) -> None:
        rows.append(row)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    path.write_text("")
    _serve_levels(opts, solo_text, record)
    if "transformers" in opts.peers:
        transformers_batches(g, ids[:1], 1, 2)  # warm-up
        for c in opts.levels:
            tok_s, out = transformers_batches(g, ids, c, opts.max_new_tokens)
            record({"contender": "transformers generate, padded batch (stock fp32)", "concurrency": c,
                    "tok_s": round(tok_s, 2), "identical_to_solo": sum(a == b for a, b in zip(out, solo)),
                    "requests": len(solo), "failed": []})
    if "vllm" in opts.peers:
        assert vllm_python is not None  # refused above without one
        _vllm_levels(opts, vllm_python, model_dir, solo_text, record)
    report = render(rows, solo_vs_generate, len(solo), opts)
    (opts.out / "concurrency.md").write_text(report)
    plot(rows, opts.out / "concurrency.png")
    print(report)
    return 0


def batch_totals(metrics_text: str) -> tuple[float, float]:
    """``(sum, count)`` of the server's batch-size histogram in its ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "selfspec:batch_size_sum":
                total = sample.value
            elif sample.name == "selfspec:batch_size_count":
                count = sample.value
    return total, count


def _identity(texts: dict[int, str], solo_text: list[str]) -> dict:
    """A level's identity columns: how many of the prompts' texts (by index) equal their solo run."""
    return {"identical_to_solo": sum(texts.get(i) == t for i, t in enumerate(solo_text)), "requests": len(solo_text)}


def _serve_levels(opts: ConcurrencyOptions, solo_text: list[str], record: Callable[[dict], None]) -> None:
    """``selfspec serve`` (a process of its own, as users run it) at each concurrency; its mean batch
    size per level from its ``/metrics``; a server that fails is recorded as such."""
    args = (*opts.serve_args, *(("--max-batch", str(opts.max_batch)) if opts.max_batch else ()))
    server = SelfspecServer(args, opts.out / "selfspec-serve.log")
    try:
        server.start()
        card = json.loads(server.get("/v1/models"))["data"][0].get("selfspec", {})
        method, kernels = card.get("method", "?"), card.get("kernels", "?")
        name = f"selfspec {method}" + ("" if "@" in method else f"@{kernels}")
        drive(server.url + "/v1", "m", opts.prompts[:1], 1, 2)  # warm-up: the first request's one-off costs
        for c in opts.levels:
            s0, n0 = batch_totals(server.get("/metrics"))
            r = drive(server.url + "/v1", "m", opts.prompts, c, opts.max_new_tokens)
            s1, n1 = batch_totals(server.get("/metrics"))
            record({"contender": name, **r, "mean_batch": round((s1 - s0) / (n1 - n0), 2) if n1 > n0 else 1.0,
                    **_identity(r.pop("texts"), solo_text)})
    except SelfspecError as e:
        record({"contender": "selfspec serve", "concurrency": None, "tok_s": None, "failed": [str(e)]})
    finally:
        server.stop()


def write_meta(opts: ConcurrencyOptions) -> None:
    """``meta.json`` in ``--out``: how the run was made (command, date, commit, CPU flags, versions),
    as every result directory has."""
    import datetime
    import sys

    from ..bench.runner import environment

    env = environment()
    meta = {"command": ["selfspec", *sys.argv[1:]], "date": datetime.date.today().isoformat(), "commit": env["git"],
            "cpu_flags": env["cpu_flags"], "levels": list(opts.levels), "peers": list(opts.peers),
            "prompts": len(opts.prompts), "max_new_tokens": opts.max_new_tokens, "environment": env}
    (opts.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def _vllm_levels(opts: ConcurrencyOptions, vllm_python: str, model_dir: str | None, solo_text: list[str],
                 record: Callable[[dict], None]) -> None:
    """vLLM's CPU build through its own server at each concurrency; a failure is recorded as such."""
    vllm = VllmServer(vllm_python, model_dir or "", opts.out / "vllm.log")
    try:
        vllm.start()
        name = f"vLLM CPU {vllm.version()} (fp32, its own server)"
        for c in opts.levels:
            r = drive(vllm.url + "/v1", "m", opts.prompts, c, opts.max_new_tokens)
            record({"contender": name, **r, **_identity(r.pop("texts"), solo_text)})
    except SelfspecError as e:
        record({"contender": "vLLM CPU", "concurrency": None, "tok_s": None, "failed": [str(e)]})
    finally:
        vllm.stop()


def render(rows: list[dict], solo_vs_generate: int, n: int, opts: ConcurrencyOptions) -> str:
    """The markdown report: one table row per contender and level, then the identity lines."""
    from ..core.machine import cpu_flags

    lines = [f"# selfspec bench --concurrency {','.join(map(str, opts.levels))}", "",
             f"{n} chat prompts x {opts.max_new_tokens} tokens, greedy, EOS ignored; CPU flags: {cpu_flags()}.",
             f"Solo runs identical to `transformers` `generate(do_sample=False)`: {solo_vs_generate}/{n}.", "",
             "| contender | clients | tok/s | x 1 client | p50 TTFT s | p95 TTFT s | p50 TPOT ms | p95 TPOT ms "
             "| mean batch | text = solo |", "|---|---|---|---|---|---|---|---|---|---|"]
    first: dict[str, float] = {}
    for r in rows:
        if r.get("tok_s") is None:
            continue
        first.setdefault(r["contender"], r["tok_s"])
        scale = r["tok_s"] / first[r["contender"]] if first[r["contender"]] else float("nan")
        lines.append(f"| {r['contender']} | {r['concurrency']} | {r['tok_s']:.1f} | {scale:.2f}x | "
                     f"{r.get('ttft_p50_s', '-')} | {r.get('ttft_p95_s', '-')} | {r.get('tpot_p50_ms', '-')} | "
                     f"{r.get('tpot_p95_ms', '-')} | {r.get('mean_batch', '-')} | "
                     f"{r.get('identical_to_solo', '-')}/{r.get('requests', '-')} |")
    failed = [r for r in rows if r.get("failed")]
    if failed:
        lines += ["", "Failures (no figures: a crash is never a measurement):", ""]
        lines += [f"- {r['contender']} (clients {r.get('concurrency')}): {'; '.join(r['failed'][:3])}" for r in failed]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Throughput and p95 time per output token against concurrency, one line per contender."""
    try:
        import matplotlib
    except ImportError:
        log.warning("no plot: matplotlib is not installed (pip install 'selfspec[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = dict.fromkeys(r["contender"] for r in rows if r.get("tok_s") is not None)
    for i, name in enumerate(names):
        rs = [r for r in rows if r["contender"] == name and r.get("tok_s") is not None]
        cs = [r["concurrency"] for r in rs]
        color = f"C{i}"  # one colour per contender in both panels
        ax1.plot(cs, [r["tok_s"] for r in rs], "o-", color=color, label=name)
        if all("tpot_p95_ms" in r for r in rs):
            ax2.plot(cs, [r["tpot_p95_ms"] for r in rs], "s-", color=color, label=name)
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("aggregate tokens/s")
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel("p95 ms per output token (streamed)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
