"""Where a default request's time goes on the compiled backend, and what bounds the int8 draft step
(issue 34: the default at 1.5x llama.cpp F32).

Three measurements, each printed and written to ``--out`` (JSON):

1. **Request breakdown** (``breakdown``): the default configuration (``auto``, whatever it chose
   here) on the first ``--prompts`` built-in prompts x 64 tokens, ``--rounds`` rounds after a warm-up
   round; wall time inside the compiled steps' ``forward``, split by the drafter's own one-token
   step, the verify steps by padded block size, and the prompt's 64-token blocks.
2. **Int8 product variants** (``products``): the draft step's products (SmolLM2's 121 linear layers
   and its LM head, random int8 weights) compiled as the library writes them (the few-row layout
   of ``kernels/gemv.py``: int8 converted to fp32 as it is read, one accumulator per block of 16
   outputs) against a variant that packs four weights in each int32 lane and unpacks them with
   shifts and masks (unsigned, offset by 128, corrected by ``128 * sum(x)`` after the sum), for the
   LM head alone and for every product of a step, 1 and 2 threads. Also the rate of a plain sum
   over 1 GiB of fp32 (the memory's speed on these threads).
3. **Draft rows** (``rows``): the compiled int8 draft step (self-spec's, loaded or compiled) and the
   fp32 verify step for blocks of 1-4 rows after a 150-token prefix: what a second draft row
   (a guessed token drafted beside the known one) would cost.

    python experiments/draft_step_limits.py [--prompts 6] [--rounds 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from selfspec.core.machine import cpu_flags
from selfspec.kernels import gemv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
"""SmolLM2-135M's products of one step: fused q/k/v, o, fused gate/up and down per layer, the LM head."""


def breakdown(prompts: int, rounds: int) -> dict:
    """Seconds per kind of compiled step over ``rounds`` rounds of the default configuration."""
    import selfspec
    from selfspec.bench.datasets import builtin
    from selfspec.models import compiled_step as cs

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    g = selfspec.load()
    draft_step = getattr(getattr(g.controller, "drafter", None), "draft_step", None)
    real = cs.StaticStep.forward

    def timed(self, cache, ids, *args, **kwargs):
        t = time.perf_counter()
        out = real(self, cache, ids, *args, **kwargs)
        p = cs.bucket(ids.numel())
        kind = "draft" if self is draft_step else ("prompt" if p == cs.PREFILL_BLOCK else "verify")
        key = f"{kind} {p}-row"
        spent[key] += time.perf_counter() - t
        calls[key] += 1
        return out

    cs.StaticStep.forward = timed
    texts = [p.text for p in builtin()][:prompts]
    try:
        for text in texts:  # warm-up round, not counted
            g.generate(text, max_new_tokens=64)
        spent.clear()
        calls.clear()
        t0, tokens = time.perf_counter(), 0
        for _ in range(rounds):
            for text in texts:
                tokens += g.generate(text, max_new_tokens=64).new_tokens
        wall = time.perf_counter() - t0
    finally:
        cs.StaticStep.forward = real
    parts = {k: {"seconds": round(v, 4), "calls": calls[k], "ms_per_call": round(1e3 * v / calls[k], 3),
                 "share": round(v / wall, 3)} for k, v in sorted(spent.items())}
    return {"method": g.method, "tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "parts": parts, "outside_steps_share": round(1 - sum(spent.values()) / wall, 3)}


def pack4(q: torch.Tensor) -> torch.Tensor:
    """``q[N, K]`` int8 as ``[N / B, K / 4, B]`` int32: lane ``i`` of block ``j`` at group ``g`` holds
    ``q[j * B + i, 4g .. 4g + 3] + 128`` as four unsigned bytes (little-endian)."""
    n, k = q.shape
    u8 = (q.to(torch.int16) + 128).to(torch.uint8)
    wb = gemv.blocked(u8)
    return wb.view(n // gemv.BLOCK, k // 4, 4, gemv.BLOCK).permute(0, 1, 3, 2).contiguous().view(torch.int32).reshape(
        n // gemv.BLOCK, k // 4, gemv.BLOCK)


def product4(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x[M, K] @ (Q * scale).T`` over :func:`pack4` weights: bytes unpacked by shift and mask,
    converted to fp32, summed, the 128 offset taken out once per row."""
    nb, groups, b = w.shape
    rows = []
    for m in range(x.shape[0]):
        x4 = x[m].reshape(groups, 4)
        acc = None
        for u in range(4):
            byte = ((w >> (8 * u)) & 255).to(x.dtype) * x4[:, u].reshape(1, groups, 1)
            acc = byte if acc is None else acc + byte
        rows.append(acc.sum(1).reshape(1, nb * b) - 128.0 * x[m].sum())
    return (rows[0] if len(rows) == 1 else torch.cat(rows)) * scale


def _median_ms(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def products(rounds: int) -> dict:
    """Milliseconds of the library's int8 few-row product and of the packed variant."""
    import torch._inductor.config as inductor

    inductor.realize_reads_threshold = 1  # as the library's step (models/aot_step.py)
    torch.manual_seed(0)
    qs = [torch.randint(-127, 128, s, dtype=torch.int8) for s in SHAPES]
    weights = [(gemv.blocked(q), pack4(q), torch.rand(q.shape[0])) for q in qs]
    x = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
    sets = {"lm_head": weights[-1:], "all products": weights}
    out: dict = {}
    threads = torch.get_num_threads()
    for name, ws in sets.items():
        mb = sum(w.numel() for w, _, _ in ws) / 1e6
        library = torch.compile(lambda xs, ws=ws: [gemv.gemv(xs[w.shape[1]], w, None, s) for w, _, s in ws])
        packed = torch.compile(lambda xs, ws=ws: [product4(xs[w.shape[1]], p, s) for w, p, s in ws])
        err = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(library(x), packed(x)))
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            ms = {"library": [], "packed": []}
            for _ in range(rounds):
                ms["library"].append(_median_ms(lambda f=library: f(x)))
                ms["packed"].append(_median_ms(lambda f=packed: f(x)))
            out[f"{name}, {t} thread(s)"] = {k: {"ms": round(min(v), 3), "GB_s": round(mb / min(v), 1)}
                                             for k, v in ms.items()} | {"max_rel_diff": err}
        torch.set_num_threads(threads)
    big = torch.ones(256 * 1024 * 1024)
    out["fp32 sum over 1 GiB"] = {"GB_s": round(big.numel() * 4 / _median_ms(big.sum, 7) / 1e6, 1)}
    return out


def rows(rounds: int, context: int = 150) -> dict:
    """Milliseconds of the int8 draft step and the verify step for blocks of 1-4 rows."""
    import selfspec
    from selfspec.models.compiled_step import MIN_CAPACITY

    g = selfspec.load(method="self-spec", kernels="compiled", draft_kernels="int8")
    drafter = g.controller.drafter
    draft, step = drafter.draft_step, g.target.step
    if draft is None:
        return {"skipped": "no compiled int8 draft step here"}
    draft.warm_up(MIN_CAPACITY, (1, 2, 4), False)  # the 2- and 4-row draft steps compile once
    step.warm_up(MIN_CAPACITY, (1, 2, 4), False)
    cache = step.take_cache(MIN_CAPACITY)
    ms: dict[str, list[float]] = collections.defaultdict(list)
    with torch.inference_mode():
        step.prefill(cache, torch.arange(1, context + 1), False)
        for _ in range(rounds):
            for q in (1, 2, 3, 4):
                ids, pos = torch.arange(1, q + 1), torch.arange(context, context + q)
                ms[f"draft {q}"].append(_median_ms(lambda i=ids, p=pos: draft.forward(cache, i, p, None, False,
                                                                                      base=context), 10))
                ms[f"verify {q}"].append(_median_ms(lambda i=ids, p=pos: step.forward(cache, i, p, None, False,
                                                                                     base=context), 10))
    step.give_back(cache)
    return {k: round(statistics.median(v), 3) for k, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="breakdown,products,rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict = {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    for part in args.parts.split(","):
        if part == "breakdown":
            result[part] = breakdown(args.prompts, args.rounds)
        elif part == "products":
            result[part] = products(args.rounds)
        elif part == "rows":
            result[part] = rows(args.rounds + 3)
        print(json.dumps({part: result.get(part)}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
