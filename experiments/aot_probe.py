"""Can the compiled one-token step be saved and loaded without Dynamo tracing (issue 34, warm
start)? ``torch.compile(...).aot_compile`` (experimental in torch 2.13) on the bundled SmolLM2's
static-cache step: compile once and save (``--save``), then in a fresh process load it and time
the first call (``--load``). Prints seconds and whether the logits equal eager's.

    python experiments/aot_probe.py --save /tmp/step.aot && python experiments/aot_probe.py --load /tmp/step.aot
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time

import torch


def external(model) -> dict:
    """The functions the saved step refers to but cannot pickle (``transformers`` wraps
    ``forward`` in decorators): passed by name on save and load."""
    out, f, i = {}, type(model).forward, 0
    while f is not None:
        out[f"forward{i}"] = f
        f, i = getattr(f, "__wrapped__", None), i + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from selfspec.core import kv_cache
    from selfspec.models.compiled_step import padded_mask
    from selfspec.models.loading import load_model

    t_import = time.perf_counter() - t0
    t = load_model(args.model, kernels="compiled")
    model = t.model
    t_load = time.perf_counter() - t0 - t_import
    cache = kv_cache.new_cache(model.config, 512)
    with torch.inference_mode():
        t.step.prefill(cache, torch.tensor([1, 2, 3, 4]), False)
    kv_cache.set_length(cache, 4)
    mask = padded_mask(4, None, 1, 1, 512, model.config._attn_implementation, model.dtype, torch.device("cpu"))
    kwargs = dict(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[4]]), attention_mask=mask,
                  **kv_cache.cache_arg(model, cache), use_cache=True)
    with torch.inference_mode():
        ref = model(**kwargs).logits
        kv_cache.set_length(cache, 4)
        t1 = time.perf_counter()
        if args.save:
            fn = torch.compile(model.forward, dynamic=False, fullgraph=True,
                               options={"guard_filter_fn": lambda entries: [False for _ in entries]}
                               ).aot_compile(((), kwargs))
            fn.save_compiled_function(args.save, external_data=external(model))
            what = "aot_compile + save"
        else:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            with open(args.load, "rb") as f:
                data = f.read()
            env = dict(type(model).forward.__globals__)
            for _ in range(20):  # module references are saved under names holding the saver's id()
                try:
                    fn = AOTCompiledFunction.deserialize(data, f_globals=env, external_closure_data=external(model))
                    break
                except RuntimeError as e:
                    names = re.findall(r"'(___module_\w+?)_\d+_c0'", str(e))
                    full = re.findall(r"'(___module_\w+?_\d+_c0)'", str(e))
                    if not names:
                        raise
                    for short, name in zip(names, full):
                        env[name] = importlib.import_module(short.removeprefix("___module_").replace("_", "."))
            what = "load"
        t_fn = time.perf_counter() - t1
        kv_cache.set_length(cache, 4)
        t2 = time.perf_counter()
        out = fn(model, **kwargs).logits
        t_call = time.perf_counter() - t2
    print(f"import {t_import:.1f} s, load model {t_load:.1f} s, {what} {t_fn:.1f} s, first call {t_call:.2f} s, "
          f"max |logits - eager| {float((out - ref).abs().max()):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
