"""What the ``compact`` kernels' products cost against oneDNN's fp32 ones, by rows in the block (issue 62).

Times the 210 linear products of one SmolLM2-135M step (30 layers of q/k/v/o/gate/up/down; LM head
and attention left out) for 1, 2, 4, 8, 16 and 64 rows: a decode step, verify blocks and batches, and a
prompt's chunk. Both backends' layers are the runners' own (``LoadedModel.runner``), interleaved in one
process, median of 7 passes each.

    python experiments/compact_rows.py
"""

from __future__ import annotations

import statistics
import time

import torch

from selfspec.models import bundled
from selfspec.models.loading import load_model


def main() -> None:
    torch.set_num_threads(2)
    base = load_model(str(bundled.pull("smollm2-135m-instruct")), "cpu", "float32", False, kernels="stock")
    layers = {k: [m for n, m in base.runner(k).model.named_modules() if n.endswith("proj")]
              for k in ("compact", "onednn")}
    print("rows  compact ms  onednn ms  onednn/compact")
    for rows in (1, 2, 4, 8, 16, 64):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        ms = {}
        for name in layers:
            for layer in layers[name]:  # warm
                layer(xs[layer.in_features])
        runs: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(7):
            for name, ls in layers.items():
                t = time.perf_counter()
                for layer in ls:
                    layer(xs[layer.in_features])
                runs[name].append((time.perf_counter() - t) * 1e3)
        ms = {name: statistics.median(r) for name, r in runs.items()}
        print(f"{rows:4d}  {ms['compact']:10.1f}  {ms['onednn']:9.1f}  {ms['onednn'] / ms['compact']:14.2f}")


if __name__ == "__main__":
    main()
