"""Issue 57 item 3: the ``compiled`` backend's two CPU routes, side by side, on SmolLM2.

- ``saved``: :mod:`selfspec.models.aot_step` (``torch.compile(...).aot_compile`` steps saved to disk and
  loaded without tracing; private torch internals: guards off, module references bound again, Inductor's
  ISA probe skipped).
- ``public``: ``SELFSPEC_COMPILE_ROUTE=public``: ``torch.compile`` with its own on-disk caches (Inductor's
  FX graph cache under ``$SELFSPEC_HOME/compile``): every process traces the model again, then finds the
  generated code in the cache.

One process per measurement (one JSON line each): the load, the first request (which loads or compiles
the steps ``ar`` runs for its prompt: the one-token step and the prompt's blocks), then 4 built-in chat
prompts x 64 tokens greedy, twice: tok/s of the first pass (which meets the other prompts' block sizes
for the first time in the process) and of the second. Run the two routes alternating, cold once each,
then warm::

    for rep in cold 1 2 3; do for r in saved public; do python experiments/compile_routes.py --route $r; done; done

``--route export`` tries ``torch.export`` + AOTInductor packages (``aoti_compile_and_package`` /
``aoti_load_package``) on the same one-token step and reports where it stops.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time


def decode(route: str) -> dict:
    if route == "public":
        os.environ["SELFSPEC_COMPILE_ROUTE"] = "public"
    import selfspec
    from selfspec.bench.datasets import load_dataset
    from selfspec.decoding.text import encode_prompt

    t0 = time.perf_counter()
    g = selfspec.load("smollm2-135m-instruct", method="ar", kernels="compiled", measure=False)
    load_s = time.perf_counter() - t0
    vocab = g.target.model.config.vocab_size
    ids = [encode_prompt(g.tokenizer, p.text, True, vocab) for p in load_dataset("builtin", limit=5)]
    t0 = time.perf_counter()
    g.generate(ids[0], max_new_tokens=8)
    first_s = time.perf_counter() - t0
    passes = []
    for _ in range(2):  # the first pass meets each prompt's blocks for the first time in the process
        tok, sec, out = 0, 0.0, []
        for x in ids[1:]:
            r = g.generate(x, max_new_tokens=64)
            tok, sec = tok + r.new_tokens, sec + r.wall_s
            out.append(r.token_ids)
        passes.append((round(tok / sec, 2), hashlib.sha256(json.dumps(out).encode()).hexdigest()[:12]))
    return {"route": route, "resolved": g.target.backend, "load_s": round(load_s, 2),
            "first_request_s": round(first_s, 2), "tok_s_first_pass": passes[0][0], "tok_s_second_pass": passes[1][0],
            "ids": sorted({h for _, h in passes})}


def export_case() -> dict:
    """torch.export of the stock model's one-token step on a static cache, then AOTInductor."""
    import tempfile

    import torch

    import selfspec
    from selfspec.core import kv_cache
    from selfspec.models.compiled_step import padded_mask, window_arg

    g = selfspec.load("smollm2-135m-instruct", method="ar", kernels="onednn", measure=False)
    model = g.target.base.model
    cache = kv_cache.new_cache(model.config, 512)
    ids = torch.tensor([[1]])
    model(input_ids=ids, position_ids=torch.tensor([[0]]), **kv_cache.cache_arg(model, cache), use_cache=True)
    mask = padded_mask(1, None, 1, 1, 512, model.config._attn_implementation, model.dtype, torch.device("cpu"))
    kwargs = dict(input_ids=ids, position_ids=torch.tensor([[1]]), attention_mask=mask,
                  **kv_cache.cache_arg(model, cache), use_cache=True, **window_arg(model, 2))
    out: dict = {"route": "export"}
    t0 = time.perf_counter()
    try:
        ep = torch.export.export(model, (), kwargs, strict=False)
        out["export_s"] = round(time.perf_counter() - t0, 2)
    except Exception as e:  # noqa: BLE001 - the finding is where it stops
        out["export_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return out
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        try:
            path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/step.pt2")
            out["aoti_compile_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            fn = torch._inductor.aoti_load_package(path)
            out["aoti_load_s"] = round(time.perf_counter() - t0, 2)
            with torch.inference_mode():
                fn(**kwargs)
                t0 = time.perf_counter()
                for _ in range(20):
                    fn(**kwargs)
                out["aoti_step_ms"] = round(50 * (time.perf_counter() - t0), 2)
        except Exception as e:  # noqa: BLE001
            out["aoti_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--route", choices=("saved", "public", "export"), required=True)
    a = ap.parse_args()
    print(json.dumps(export_case() if a.route == "export" else decode(a.route)), flush=True)


if __name__ == "__main__":
    main()
