"""Where a one-token step's time goes on the ``compact`` kernels, against ``onednn`` (issue 62).

Times one eager one-token step of SmolLM2-135M after a 128-token context (median of 40) on each
backend's runner, then profiles 10 compact steps by operator (``torch.profiler``): the products,
the Q8_0 LM head, attention and the eager model's small operations.

    python experiments/compact_step.py
"""

from __future__ import annotations

import time

import torch

from selfspec.core import kv_cache
from selfspec.models import bundled
from selfspec.models.loading import load_model


def step(model, cache) -> None:
    model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[128]]), **kv_cache.cache_arg(model, cache),
          use_cache=True)
    kv_cache.truncate(cache, 128)


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    base = load_model(str(bundled.pull("smollm2-135m-instruct")), "cpu", "float32", False, kernels="stock")
    for kernels in ("compact", "onednn"):
        model = base.runner(kernels).model
        cache = kv_cache.new_cache(model.config)
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)),
              **kv_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1)
        times = []
        for _ in range(40):
            t = time.perf_counter()
            step(model, cache)
            times.append(time.perf_counter() - t)
        print(f"{kernels}: one-token step, median of 40: {sorted(times)[20] * 1e3:.1f} ms")
        if kernels == "compact":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    step(model, cache)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
