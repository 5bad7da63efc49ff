"""Verify cost profile T(q): the cost of one target forward over q new tokens.

Every speedup is bounded by tau * T(1) / (T(q) + draft cost). On CPUs T(q) is far from flat and
has steps (``docs/DESIGN.md``), so drafters size their drafts from a profile measured on the
machine in use, cached per model, dtype, device and machine under ``$SELFSPEC_HOME/profiles``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import kv_cache

DEFAULT_QS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


@dataclass(frozen=True)
class CostProfile:
    """Median seconds per forward of q new tokens after a ``context``-token cache.

    Attributes:
        qs: the measured block sizes, increasing, starting at 1.
        seconds: median wall seconds for each q.
        context: cached tokens during the measurement.
        key: what was measured (model, dtype, device, machine).
    """

    qs: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int
    key: str

    @property
    def t1(self) -> float:
        return self.seconds[0]

    def ratio(self, q: int) -> float:
        """T(q) / T(1), linearly interpolated; extrapolated with the last slope beyond the range."""
        qs, ts = self.qs, self.seconds
        if q <= qs[0]:
            return 1.0
        for (qa, ta), (qb, tb) in zip(zip(qs, ts), zip(qs[1:], ts[1:])):
            if q <= qb:
                return (ta + (tb - ta) * (q - qa) / (qb - qa)) / ts[0]
        slope = (ts[-1] - ts[-2]) / (qs[-1] - qs[-2]) if len(qs) > 1 else 0.0
        return (ts[-1] + slope * (q - qs[-1])) / ts[0]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> CostProfile:
        return cls(tuple(d["qs"]), tuple(d["seconds"]), int(d["context"]), d["key"])


def machine_id() -> str:
    """CPU model, cores and torch version: profiles are only valid on the machine they came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def cpu_flags() -> str:
    """The SIMD features that decide which kernels are fast and exact here (e.g. ``avx2``,
    ``avx512f+avx512_vnni``), from ``/proc/cpuinfo``; empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
                return "+".join(f for f in wanted if f in have)
    except OSError:
        pass
    return ""


def profile_key(model: torch.nn.Module, model_name: str, backend: str = "stock") -> str:
    p = next(model.parameters())
    dev = str(p.device)
    if p.device.type == "cuda":
        dev = torch.cuda.get_device_name(p.device)
    cfg_hash = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    return f"{model_name}|{cfg_hash}|{p.dtype}|{dev}|{backend}|{machine_id()}"


@torch.inference_mode()
def measure(model: torch.nn.Module, key: str, qs: tuple[int, ...] = DEFAULT_QS, context: int = 256,
            reps: int = 3, progress: bool = False) -> CostProfile:
    """Measure T(q) with q values interleaved over ``reps`` rounds (medians)."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    cache = kv_cache.new_cache(model.config)
    prompt = torch.randint(0, vocab, (1, context), generator=g)
    model(input_ids=prompt.to(device), **kv_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    times: dict[int, list[float]] = {q: [] for q in qs}
    for r in range(reps + 1):  # round 0 warms up
        for q in qs:
            ids = torch.randint(0, vocab, (1, q), generator=g).to(device)
            pos = torch.arange(context, context + q, device=device)[None]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=pos, **kv_cache.cache_arg(model, cache), use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            kv_cache.truncate(cache, context)
            if r > 0:
                times[q].append(dt)
        if progress:
            print(f"selfspec: cost profile round {r}/{reps}", file=sys.stderr)
    return CostProfile(tuple(qs), tuple(statistics.median(times[q]) for q in qs), context, key)


def profile_path(key: str) -> Path:
    from ..models.bundled import selfspec_home

    name = hashlib.sha256(key.encode()).hexdigest()[:20]
    return selfspec_home() / "profiles" / f"{name}.json"


def load_or_measure(model: torch.nn.Module, model_name: str, backend: str = "stock",
                    remeasure: bool = False, extra_qs: tuple[int, ...] = ()) -> CostProfile:
    """The cached profile for this model and machine, measured (and cached) if missing.

    ``extra_qs``: larger block sizes a method needs priced by measurement rather than
    extrapolation (SPACE's masked forwards run 1 + k + (k + 1) k tokens); a cached profile
    without them is measured again with them."""
    key = profile_key(model, model_name, backend)
    path = profile_path(key)
    qs = tuple(sorted(set(DEFAULT_QS) | set(extra_qs)))
    if path.is_file() and not remeasure:
        try:
            prof = CostProfile.from_json(json.loads(path.read_text()))
            if prof.key == key and set(extra_qs) <= set(prof.qs):
                return prof
            qs = tuple(sorted(set(qs) | set(prof.qs)))
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    print(f"selfspec: measuring the verify cost profile of {model_name} on this machine (once) ...", file=sys.stderr)
    prof = measure(model, key, qs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(prof.to_json(), indent=1))
    tmp.replace(path)
    return prof
