"""The matrix products of SmolLM2's 30 layers and LM head alone, one oneDNN call per layer against
one per group of siblings that read the same input (q/k/v, gate/up), and PyTorch's stock kernels
likewise (issue 34: ``SharedProductLinear``). Random weights of SmolLM2-135M's shapes (538 MB,
so caches are cold as in a real step); the LM head is oneDNN's in every variant. ``--mkl`` adds
MKL's packed GEMM (``torch.ops.mkl._mkl_linear``, weights packed for one row), one call per group,
as a candidate for the compiled step's layers. Medians of ``--rounds`` interleaved rounds, ms, at
1 and 8 rows.

    python experiments/shared_products_sim.py --threads 2 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

H, KV, INTER, VOCAB, LAYERS = 576, 192, 1536, 49152, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--mkl", action="store_true", help="also MKL's packed GEMM, one call per group")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pack = torch.ops.mkldnn._reorder_linear_weight

    def onednn(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    layers = []
    for _ in range(LAYERS):
        w = {"q": torch.randn(H, H), "k": torch.randn(KV, H), "v": torch.randn(KV, H), "o": torch.randn(H, H),
             "g": torch.randn(INTER, H), "u": torch.randn(INTER, H), "d": torch.randn(H, INTER)}
        w["qkv"], w["gu"] = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["g"], w["u"]])
        packed = {k: pack(v) for k, v in w.items()}
        if args.mkl:
            mkl_pack = torch.ops.mkl._mkl_reorder_linear_weight
            packed.update({f"mkl-{k}": mkl_pack(w[k], 1) for k in ("qkv", "o", "gu", "d")})
        layers.append((w, packed))
    head = pack(torch.randn(VOCAB, H))

    def run(q: int, kind: str) -> None:
        xh, xi = torch.randn(q, H), torch.randn(q, INTER)
        for w, p in layers:
            if kind == "onednn, one call per layer":
                for n in "qkvogu":
                    onednn(xh, p[n])
                onednn(xi, p["d"])
            elif kind == "onednn, one call per group":
                onednn(xh, p["qkv"]), onednn(xh, p["o"]), onednn(xh, p["gu"]), onednn(xi, p["d"])
            elif kind == "mkl packed, one call per group":
                for n, x in (("qkv", xh), ("o", xh), ("gu", xh), ("d", xi)):
                    torch.ops.mkl._mkl_linear(x, p[f"mkl-{n}"], w[n], None, 1)
            elif kind == "stock, one call per layer":
                for n in "qkvogu":
                    F.linear(xh, w[n])
                F.linear(xi, w["d"])
            else:
                F.linear(xh, w["qkv"]), F.linear(xh, w["o"]), F.linear(xh, w["gu"]), F.linear(xi, w["d"])
        onednn(xh, head)

    kinds = ["onednn, one call per layer", "onednn, one call per group", "stock, one call per layer",
             "stock, one call per group"] + (["mkl packed, one call per group"] if args.mkl else [])
    out = {}
    with torch.inference_mode():
        for q in (1, 8):
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.rounds):
                for k in kinds:
                    t0 = time.perf_counter()
                    run(q, k)
                    samples[k].append(time.perf_counter() - t0)
            out[f"q={q}"] = {k: round(statistics.median(v) * 1e3, 2) for k, v in samples.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
