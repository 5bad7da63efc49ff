"""Can a decode step read SmolLM2's weights as the Q4_1 blocks they came from, and compute in fp32 (issue 62)?

SmolLM2-135M is bundled from a Q4_1 GGUF: every weight of a linear layer is ``fl32(d * q + m)``, a
4-bit code ``q`` and the two fp16 constants ``d``, ``m`` of its 32-weight block, and our fp32 copy
reads 4 bytes for each. This script

1. **proves** which of the model's linear weights are Q4_1 blocks, from the fp32 tensors alone: per
   block, ``m`` is its smallest value (code 0), ``d`` the fp16 that maps every value back to a code,
   and the block is kept only where ``fl32(d * q + m)`` gives every fp32 weight back bit for bit;
2. times one decode step's linear products (30 layers of q/k/v/o/gate/up/down and the LM head, one
   token), as the ``compiled`` backend writes them (a reduction Inductor fuses, ``kernels/gemv.py``),
   on four weight stores: fp32 blocked (today's compiled step, 4 bytes a weight), one byte a code,
   two codes a byte (nibbles), and eight codes an int32 word (0.5 bytes a weight, plus ``d`` and ``m``
   per block). Each store's product
   decompresses the codes in registers and multiplies in fp32;
3. checks each store's product on one-hot inputs, which read back every weight it decompresses:
   they must equal the fp32 weights bit for bit.

The products differ from the fp32 step's in summation order (a packed step is lossless with respect
to itself, like every backend; its identity with ``generate`` is what the issue measures), so the
script states their largest difference too.

    python experiments/packed_q4_gemv.py --out docs/results/packed-q4-gemv-avx2-1130

Timings: median of ``--repeats`` runs of ``--steps`` steps each, the stores interleaved in one process.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from selfspec.kernels.compact import q8_0_blocks
from selfspec.kernels.gemv import BLOCK, blocked, gemv

GROUP = 32  # weights per Q4_1 block


def q4_1_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The Q4_1 codes of ``w[N, K]`` if every 32-weight block along ``K`` is ``fl32(d * q + m)`` for
    fp16 ``d``, ``m`` and codes ``q`` in 0..15, proven bit for bit; else None.

    Returns:
        ``q[N, K]`` uint8, ``d[N, K / 32]`` and ``m[N, K / 32]`` fp32 (fp16 values).
    """
    n, k = w.shape
    if k % GROUP:
        return None
    g = w.reshape(n, k // GROUP, GROUP)
    m = g.amin(-1)
    if not torch.equal(m.half().float(), m):
        return None
    span = (g.amax(-1) - m) / 15
    for nudge in (0, -1, 1, -2, 2):  # d is an fp16 near span; try its neighbours
        d = span.half()
        if nudge:
            d = torch.nextafter(d, torch.full_like(d, float("inf") if nudge > 0 else float("-inf")))
            if abs(nudge) == 2:
                d = torch.nextafter(d, torch.full_like(d, float("inf") if nudge > 0 else float("-inf")))
        d = d.float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((g - m[..., None]) / safe[..., None]).clamp(0, 15)
        back = (q * d[..., None] + m[..., None]).float()
        ok = (back == g).all(-1)
        if bool(ok.all()):
            return q.to(torch.uint8).reshape(n, k), d, m
    return None


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, nibbles: bool) -> tuple[torch.Tensor, ...]:
    """Codes ``q[N, K]`` laid out for the fused reduction: ``[N / B, K / 32, 32, B]`` uint8 (or, with
    ``nibbles``, ``[N / B, K / 32, 16, B]``: element ``i`` of a block in the low nibble, ``i + 16`` in
    the high one, as GGUF packs them), and ``d``, ``m`` as ``[N / B, K / 32, 1, B]`` fp32."""
    n, k = q.shape
    b = BLOCK
    qb = q.reshape(n // b, b, k // GROUP, GROUP).permute(0, 2, 3, 1)  # [N/B, K/32, 32, B]
    if nibbles:
        qb = qb[:, :, :16] | (qb[:, :, 16:] << 4)
    scales = [t.reshape(n // b, b, k // GROUP).permute(0, 2, 1)[:, :, None, :].contiguous() for t in (d, m)]
    return (qb.contiguous(), *scales)


def q4_gemv(x: torch.Tensor, qb: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x[1, K] @ W.T -> [1, N]`` with ``W = d * q + m`` read from :func:`pack`'s layout."""
    nb, kb, inner, b = qb.shape
    if inner == GROUP:  # one code a byte
        w = qb.float() * d + m
        return (w * x.reshape(1, kb, GROUP, 1)).sum((1, 2)).reshape(1, nb * b)
    xs = x.reshape(1, kb, 2, 16, 1)
    lo = (qb & 15).float() * d + m
    hi = (qb >> 4).float() * d + m
    return (lo * xs[:, :, 0] + hi * xs[:, :, 1]).sum((1, 2)).reshape(1, nb * b)


def pack_words(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes ``q[N, K]`` as int32 words of eight codes along ``K`` (code ``j`` in bits ``4j..4j+3``),
    laid out ``[N / B, K / 32, 4, B]``, and ``d``, ``m`` as ``[N / B, K / 32, 1, B]``: whole vectors of
    int32 to load, where a byte store loads a fraction of a byte vector."""
    n, k = q.shape
    b = BLOCK
    q64 = q.to(torch.int64).reshape(n, k // 8, 8)
    word = sum(q64[..., j] << (4 * j) for j in range(8))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    wb = word.reshape(n // b, b, k // GROUP, 4).permute(0, 2, 3, 1).contiguous()
    scales = [t.reshape(n // b, b, k // GROUP).permute(0, 2, 1)[:, :, None, :].contiguous() for t in (d, m)]
    return (wb, *scales)


def words_gemv(x: torch.Tensor, wb: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x[1, K] @ W.T -> [1, N]`` with ``W = d * q + m`` read from :func:`pack_words`' layout."""
    nb, kb, four, b = wb.shape
    xs = x.reshape(kb, four, 8)
    acc = None
    for j in range(8):
        t = (((wb >> (4 * j)) & 15).float() * d + m) * xs[None, :, :, j:j + 1]
        acc = t if acc is None else acc + t
    return acc.sum((1, 2)).reshape(1, nb * b)


def layer(x: torch.Tensor, ws: list, product) -> torch.Tensor:
    """One layer's seven one-token products (q, k, v, o on ``x``; gate, up; down on their SiLU
    product): ``x[1, H] -> [1, H]`` (attention left out: the products are the weights' bytes)."""
    q, k, v, o, gate, up, down = ws
    a = product(x, *q) + product(x, *o)
    a = a + torch.cat([product(x, *k), product(x, *v)], 1).sum() * 0
    h = torch.nn.functional.silu(product(x, *gate)) * product(x, *up)
    return a + product(h, *down)


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = set(re.findall(r"\b(avx2|avx512\w*|amx\w*|avx_vnni)\b", text))
    return sorted(found)


def run_args(doc: str) -> argparse.Namespace:
    """The options of this experiment and of ``packed_q4_kernel.py`` (torch's threads set from them)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def write_run(script: str, args: argparse.Namespace, result: dict, **meta: object) -> None:
    """``result.json`` and ``meta.json`` (the command, commit, date, CPU flags, torch, threads,
    model and ``meta``) in ``args.out``, where given."""
    if not args.out:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = f"python experiments/{script} " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    (args.out / "meta.json").write_text(json.dumps({
        "command": command, "commit": commit, "date": time.strftime("%Y-%m-%d"), "cpu_flags": cpu_flags(),
        "torch": torch.__version__, "threads": args.threads, "model": args.model, **meta}, indent=1))


def main() -> None:
    args = run_args(__doc__)
    from selfspec.models import bundled
    from selfspec.models.loading import load_model

    model = load_model(str(bundled.pull(args.model))).model  # the HF model of the runner
    proven, total, stores = 0, 0, {"fp32": [], "q8 (a code a byte)": [], "q4 (nibbles)": [],
                                         "q4 (int32 words)": []}
    for blk in model.model.layers:
        mods = [blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj, blk.self_attn.o_proj,
                blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj]
        fp32, q8, q4, q4w = [], [], [], []
        for mod in mods:
            w = mod.weight.detach().float()
            total += 1
            blocks = q4_1_blocks(w)
            if blocks is None:
                raise SystemExit(f"{mod} is not Q4_1 blocks: this script times models whose layers all are")
            proven += 1
            fp32.append((blocked(w),))
            q8.append(pack(*blocks, nibbles=False))
            q4.append(pack(*blocks, nibbles=True))
            q4w.append(pack_words(*blocks))
        stores["fp32"].append(fp32)
        stores["q8 (a code a byte)"].append(q8)
        stores["q4 (nibbles)"].append(q4)
        stores["q4 (int32 words)"].append(q4w)
    products = {"fp32": gemv, "q8 (a code a byte)": q4_gemv, "q4 (nibbles)": q4_gemv, "q4 (int32 words)": words_gemv}
    head = model.lm_head.weight.detach().float()
    head_blocks = q4_1_blocks(head)
    head_kind = "Q4_1" if head_blocks else "Q8_0" if q8_0_blocks(head) is not None else "neither Q4_1 nor Q8_0"
    print(f"{proven}/{total} layer weights proven Q4_1; LM head (tied embedding): proven {head_kind}")

    # exactness: one-hot inputs read back every decompressed weight
    exact = {}
    for name in products:
        ws = stores[name][0][0]
        w = model.model.layers[0].self_attn.q_proj.weight.detach().float()
        eye = torch.eye(w.shape[1])
        back = torch.cat([products[name](eye[i:i + 1], *ws) for i in range(w.shape[1])], 0).t()
        exact[name] = bool(torch.equal(back, w))
    print("decompressed weights equal the fp32 weights bit for bit:", exact)

    fns = {name: torch.compile(lambda x, ws, p=products[name]: layer(x, ws, p), dynamic=False) for name in products}
    x = torch.randn(1, head.shape[1])
    outs, t_compile = {}, {}
    for name, fn in fns.items():
        t = time.perf_counter()
        outs[name] = fn(x, stores[name][0])
        t_compile[name] = time.perf_counter() - t
    ref = outs["fp32"]
    diff = {n: float((o - ref).abs().max()) for n, o in outs.items()}

    def step(name: str) -> None:
        h = x
        for ws in stores[name]:
            h = fns[name](h, ws) * 0.01 + x
    runs: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(2):
        for n in fns:
            step(n)
    for _ in range(args.repeats):
        for n in fns:
            t = time.perf_counter()
            for _ in range(args.steps):
                step(n)
            runs[n].append((time.perf_counter() - t) / args.steps * 1e3)
    med = {n: statistics.median(r) for n, r in runs.items()}
    bytes_per = {"fp32": 4.0, "q8 (a code a byte)": 1 + 8 / GROUP, "q4 (nibbles)": 0.5 + 8 / GROUP,
                 "q4 (int32 words)": 0.5 + 8 / GROUP}
    n_weights = sum(m.weight.numel() for blk in model.model.layers for m in blk.modules()
                    if isinstance(m, torch.nn.Linear))
    rows = {n: {"ms_per_step": round(med[n], 3), "vs_fp32": round(med["fp32"] / med[n], 3),
                "bytes_per_weight": bytes_per[n], "GB_per_s": round(n_weights * bytes_per[n] / med[n] / 1e6, 2),
                "compile_s": round(t_compile[n], 1), "max_abs_diff_vs_fp32_step": diff[n],
                "weights_exact": exact[n], "runs_ms": [round(r, 3) for r in runs[n]]} for n in fns}
    for n, r in rows.items():
        print(f"{n:20s} {r['ms_per_step']:8.3f} ms/step  {r['vs_fp32']:.2f}x fp32  {r['GB_per_s']:6.1f} GB/s  "
              f"compile {r['compile_s']} s  diff {r['max_abs_diff_vs_fp32_step']:.2e}  exact {r['weights_exact']}")
    write_run("packed_q4_gemv.py", args, {"layer_weights_proven_q4_1": f"{proven}/{total}", "lm_head": head_kind,
                                          "stores": rows}, platform=platform.platform())

if __name__ == "__main__":
    main()
