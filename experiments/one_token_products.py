"""How fast a decode step's matrix products read their weights, by kernel (kernels/gemv.py).

One compiled graph runs 60 fp32 products of SmolLM2's MLP shapes (576 -> 1536 -> 576, 212 MB of
weights, more than any cache) on a block of M rows, with a cheap pointwise op between products
as a decode step has; the median of 9 timed calls after a warm-up, per kernel and M:

- ``onednn``: oneDNN's prepacked product (the compiled backend's kernel for blocks of 2+ rows);
- ``blocked``: ``(W_blocked * x).sum(K)`` on the ``[N / 8, K, 8]`` layout, Inductor's own loop
  (the compiled backend's one-token product);
- ``stock``: ``F.linear`` (MKL);
- ``sum``: a plain sum over a 1 GiB tensor (the memory's speed, for scale).

    python experiments/one_token_products.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from selfspec.kernels import gemv
from selfspec.kernels.onednn import onednn_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ws = [torch.randn(1536, 576) if i % 2 == 0 else torch.randn(576, 1536) for i in range(60)]
    nbytes = sum(w.numel() * 4 for w in ws)
    weights = {"onednn": [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws],
               "blocked": [gemv.blocked(w) for w in ws], "stock": ws}

    def step(kind: str):
        def fwd(x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
            for w, ref in zip(params, ws):
                if kind == "onednn":
                    x = onednn_linear(x, w, None, ref.shape[0])
                elif kind == "blocked" and x.shape[0] == 1:
                    x = gemv.gemv(x, w)
                elif kind == "blocked":  # the same reduction for M rows: reads the weights once per row
                    nb, k, b = w.shape
                    x = (w.reshape(1, nb, k, b) * x.reshape(-1, 1, k, 1)).sum(2).reshape(-1, nb * b)
                else:
                    x = torch.nn.functional.linear(x, w)
                x = x * 0.03
            return x
        return torch.compile(fwd, dynamic=False)

    big = torch.randn(256 * 1024 * 1024)
    big.sum()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        t.append(time.perf_counter() - t0)
    print(f"sum over 1 GiB: {2**30 / sorted(t)[2] / 1e9:.1f} GB/s ({args.threads} threads)")
    with torch.inference_mode():
        for kind in ("stock", "onednn", "blocked"):
            torch._dynamo.reset()  # one function, compiled afresh per kind (else Dynamo's recompile limit)
            fn = step(kind)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, 576)
                fn(x, weights[kind])
                t = []
                for _ in range(9):
                    t0 = time.perf_counter()
                    fn(x, weights[kind])
                    t.append(time.perf_counter() - t0)
                s = sorted(t)[4]
                print(f"{kind:8s} M={m:<3d} {s * 1e3:7.2f} ms  {nbytes / s / 1e9:5.1f} GB/s of weights", flush=True)


if __name__ == "__main__":
    main()
