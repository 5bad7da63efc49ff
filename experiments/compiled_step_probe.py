"""What one verify forward costs on the ``compiled`` backend's static-shape step (issue 34).

Times a verify step of each of ``--blocks`` sizes q of the bundled SmolLM2 (fp32, stock linear
layers) after a ``--context`` token prefix, several ways, interleaved over ``--rounds`` rounds,
medians: eager on the growing cache (what every eager backend runs), and the padded static-shape
step eager and compiled, on each static capacity given. The model is loaded on the ``compiled``
backend (its attention shares KV heads over the static cache), once per kind of linear layers in
``--linears`` (``backend``: as the backend loads them; ``separate``: one oneDNN product per layer,
no sibling groups; ``stock``: PyTorch's), all in one process and interleaved, so the kinds
compare on the same machine state (the VM's speed drifts by 20% between processes). Compiles
are cached in ``$SELFSPEC_HOME/compile``.

    python experiments/compiled_step_probe.py --capacities 1024,512 --threads 2,1 --blocks 1,8
    python experiments/compiled_step_probe.py --linears backend,separate --blocks 1,8 --rounds 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--capacities", default="512")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--blocks", default="1", help="comma-separated verify block sizes (T(q) for each q)")
    ap.add_argument("--linears", default="backend",
                    help="comma-separated kinds of linear layers: backend (as the compiled backend loads them), "
                         "separate (oneDNN, one product per layer), stock")
    args = ap.parse_args(argv)
    from selfspec.core import kv_cache
    from selfspec.core.machine import cpu_flags
    from selfspec.kernels.onednn import OneDNNLinear
    from selfspec.kernels.swap import restore_linears, swap_linears
    from selfspec.models.adapter import forward_block
    from selfspec.models.compiled_step import StaticStep
    from selfspec.models.loading import load_model

    kinds = args.linears.split(",")
    if not set(kinds) <= {"backend", "separate", "stock"}:
        ap.error(f"--linears takes backend, separate, stock; not {args.linears}")
    ctx = args.context
    fns = {}
    with torch.inference_mode():
        for kind in kinds:
            model = load_model(args.model, kernels="compiled").model
            if kind == "stock":
                restore_linears(model)  # the static-cache attention stays
            elif kind == "separate":
                swap_linears(model, OneDNNLinear)
            tag = "" if len(kinds) == 1 else f"{kind} layers, "
            prefix = torch.randint(100, model.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0))
            dyn = kv_cache.new_cache(model.config)
            forward_block(model, dyn, prefix, torch.arange(ctx), None)
            steps = {}
            for cap in (int(c) for c in args.capacities.split(",")):
                for compiled in (False, True):
                    step, cache = StaticStep(model, compile=compiled), kv_cache.new_cache(model.config, capacity=cap)
                    step.prefill(cache, prefix, False)
                    steps[(cap, compiled)] = (step, cache)
            for q in (int(b) for b in args.blocks.split(",")):
                ids, pos = torch.full((q,), 5), torch.arange(ctx, ctx + q)

                def eager(model=model, dyn=dyn, ids=ids, pos=pos) -> None:
                    forward_block(model, dyn, ids, pos, None)
                    kv_cache.truncate(dyn, ctx)

                fns[f"{tag}q={q}, eager, growing cache"] = eager
                for (cap, compiled), (step, cache) in steps.items():
                    def run(step=step, cache=cache, ids=ids, pos=pos) -> None:
                        step.forward(cache, ids, pos, None, False)
                        kv_cache.truncate(cache, ctx)

                    run()  # compiles (or loads the compiled graph)
                    fns[f"{tag}q={q}, static {cap}, {'compiled' if compiled else 'eager'}"] = run
        out = {"command": " ".join(sys.argv), "cpu_flags": cpu_flags(), "context": ctx, "linears": args.linears,
               "ms": {}}
        for th in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(th)
            samples: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    samples[k].append(time.perf_counter() - t0)
            out["ms"][f"threads={th}"] = {k: round(sorted(v)[len(v) // 2] * 1000, 1) for k, v in samples.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
