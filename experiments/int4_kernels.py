"""Are torch's CPU int4 weight-only kernels fast enough for an int4 self-draft (issue 21)?

Times one decode-step product (``x[1, K] @ W[N, K].T``) for the linear shapes of SmolLM2-135M and
Qwen2.5-Coder-1.5B with fp32 weights (``F.linear``), bf16 weights, and the two int4 paths in
torch: ``_weight_int4pack_mm_for_cpu`` (group-wise asymmetric, packed by
``_convert_weight_to_int4pack_for_cpu``) and ``_dyn_quant_matmul_4bit`` (KleidiAI layout; falls
back to a reference kernel off Arm). Median of 5 runs of ``--reps`` calls, one thread.

    python experiments/int4_kernels.py --out docs/results/int4-kernels/kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch

SHAPES = {  # (N out, K in)
    "smollm2 q/o_proj": (576, 576), "smollm2 gate/up_proj": (1536, 576), "smollm2 down_proj": (576, 1536),
    "smollm2 lm_head": (49152, 576), "qwen1.5b gate/up_proj": (8960, 1536), "qwen1.5b down_proj": (1536, 8960),
}


def median_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t) / reps * 1e6)
    return sorted(runs)[2]


def int4_weight(w: torch.Tensor, group: int):
    """Group-wise asymmetric 4-bit codes of ``w[N, K]`` packed for ``_weight_int4pack_mm_for_cpu``,
    with its ``[K / group, N, 2]`` scales-and-zeros (value = (code - 8) * scale + zero)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    codes = torch.clamp(torch.round((g - lo) / scale), 0, 15).to(torch.int32).reshape(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    zero = lo + 8 * scale
    sz = torch.stack([scale.reshape(n, -1).t(), zero.reshape(n, -1).t()], -1).contiguous()
    return packed, sz


def measure(name: str, n: int, k: int, group: int, reps: int) -> dict:
    """One shape's row: microseconds per product on each path, and int4's relative error."""
    w, x = torch.randn(n, k) * 0.02, torch.randn(1, k)
    ref = x @ w.t()
    packed, sz = int4_weight(w, group)
    y4 = torch._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    wb, xb = w.bfloat16(), x.bfloat16()
    row = {"shape": name, "N": n, "K": k,
           "fp32_us": median_us(lambda: torch.nn.functional.linear(x, w), reps),
           "bf16_us": median_us(lambda: torch.nn.functional.linear(xb, wb), reps),
           "int4pack_us": median_us(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, group, sz), reps),
           "int4pack_rel_err": float((y4 - ref).norm() / ref.norm())}
    try:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        pw = torch.ops.aten._dyn_quant_pack_4bit_weight((codes[:, 1::2] << 4 | codes[:, ::2]).contiguous(),
                                                       torch.rand(n, k // group), None, group, k, n)
        row["dyn_quant_4bit_us"] = median_us(lambda: torch.ops.aten._dyn_quant_matmul_4bit(x, pw, group, k, n), reps)
    except (RuntimeError, NotImplementedError) as e:
        row["dyn_quant_4bit_us"] = None
        row["dyn_quant_4bit_error"] = str(e).splitlines()[0]
    print(f"{name:24s} fp32 {row['fp32_us']:9.1f} us  bf16 {row['bf16_us']:9.1f}  int4pack "
          f"{row['int4pack_us']:9.1f}  dyn4 {row['dyn_quant_4bit_us'] or float('nan'):9.1f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--group", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    info = Path("/proc/cpuinfo")
    flags = sorted(set(re.findall(r"\bavx\w*", info.read_text()))) if info.exists() else []
    rows = [measure(name, n, k, a.group, a.reps) for name, (n, k) in SHAPES.items()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                                 "cpu_flags": flags, "threads": 1, "group": a.group, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
