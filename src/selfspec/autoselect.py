"""``method="auto"`` (``--method auto``): the fastest lossless method for this model on this machine.

Candidates are the methods that run without further downloads or training (:func:`candidates`):
``ar``, ``pld``, ``jacobi``, ``msn``, ``self-spec`` where a skip config exists, the fine-tuned
model's own method (``sdsat`` / ``space``), ``eagle2`` / ``hass`` where a head is installed or
shipped, and ``draft-model`` where the user names a draft.

They are measured greedily on the shipped calibration prompts, in the process that will decode
(same model, kernels and threads), by successive halving: every candidate decodes the first
half of the prompts (a pruning round, which also warms the process up), then ``ar`` and the
best two decode the second half, interleaved prompt by prompt, and the fastest there wins
(:func:`select`). A candidate whose token ids differ from ``ar``'s is disqualified.
The choice is cached per model, backend and machine under ``$SELFSPEC_HOME/profiles``, keyed by
the candidate list too (a new head or skip config means a new measurement); ``remeasure``
redoes it, and a corrupt cache is measured again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .core.cost import profile_key, profile_path, save_cache
from .models.loading import LoadedModel

CALIBRATION_PROMPTS = 4  # 2 code + 2 chat from the shipped calibration set
CALIBRATION_TOKENS = 32
FINALISTS = 2  # candidates (besides ar) that also decode the second half of the prompts


@dataclass(frozen=True)
class Candidate:
    """A method with the options it runs with (``options`` as ``selfspec.load`` keywords)."""

    method: str
    options: dict = field(default_factory=dict)


@dataclass
class Measurement:
    """Calibration of one candidate: generated tokens and wall seconds per prompt."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    identical: bool = True
    error: str = ""

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.seconds)
        return sum(self.tokens) / total if total > 0 else 0.0


@dataclass(frozen=True)
class Choice:
    """What ``auto`` resolved to, and the calibration table behind it (method -> tokens/s)."""

    method: str
    options: dict
    table: dict[str, float]
    cached: bool = False


def head_available(target: LoadedModel, method: str) -> bool:
    from .heads import find_head_dir

    return find_head_dir(target.name, method) is not None


def candidates(target: LoadedModel, draft_model: str | None = None) -> list[Candidate]:
    """The lossless methods that can run on ``target`` with what is installed (``ar`` first)."""
    from .drafters.skip_config import find
    from .errors import SelfspecError

    # msn before pld and jacobi: its cost profile covers the block sizes they need, so it is measured once
    out = [Candidate("ar"), Candidate("msn"), Candidate("pld"), Candidate("jacobi")]
    try:
        if find(target.name, target.model, "") is not None:
            out.append(Candidate("self-spec"))
    except SelfspecError:  # a config for another architecture: not a candidate
        pass
    meta_file = Path(target.path) / "selfspec_finetune.json" if target.path is not None else None
    if meta_file is not None and meta_file.is_file():
        try:
            method = json.loads(meta_file.read_text()).get("method")
        except (json.JSONDecodeError, OSError):
            method = None
        if method in ("sdsat", "space"):
            out.append(Candidate(method))
    for method in ("eagle2", "hass"):
        if head_available(target, method):
            out.append(Candidate(method))
    if draft_model:
        out.append(Candidate("draft-model", {"draft_model": draft_model}))
    return out


def calibration_prompts(n: int = CALIBRATION_PROMPTS) -> list[str]:
    """The first ``n`` shipped calibration prompts, alternating code and chat."""
    text = resources.files("selfspec").joinpath("data/calibration.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["prompt"])
    cats = sorted(by_cat)
    out: list[str] = []
    i = 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        for c in cats:
            if i < len(by_cat[c]) and len(out) < n:
                out.append(by_cat[c][i])
        i += 1
    return out


def select(table: dict[str, float], identical: dict[str, bool] | None = None) -> str:
    """The fastest candidate of a calibration table (method -> tokens/s) whose ids equal ``ar``'s.

    Ties go to the earlier entry (``ar`` first), so a method must be strictly faster to win.
    """
    identical = identical or {}
    best = None
    for method, speed in table.items():
        if not identical.get(method, True) or speed <= 0:
            continue
        if best is None or speed > table[best]:
            best = method
    return best or "ar"


def _artefacts(target: LoadedModel) -> list:
    """Size and modification time of every file the candidates' drafts are built from (shipped
    and user heads, skip configs, draft vocabulary rankings): a new head or config, installed or
    trained, invalidates the cached choice."""
    from .heads import default_head_dir, shipped_head_dir
    from .paths import model_key, selfspec_home

    key = model_key(target.name)
    data = Path(str(resources.files("selfspec"))) / "data"
    paths = [data / "skip_configs" / f"{key}.json", data / "draft_vocab" / f"{key}.json",
             selfspec_home() / "skip_configs" / f"{key}.json", selfspec_home() / "draft_vocab" / f"{key}.json"]
    for method in ("eagle2", "hass"):
        for d in (shipped_head_dir(target.name, method), default_head_dir(target.name, method)):
            if d is not None:
                paths += [d / "model.safetensors", d / "selfspec_head.json"]
    out = []
    for p in paths:
        try:
            st = p.stat()
            out.append([str(p), st.st_size, st.st_mtime_ns])
        except OSError:
            pass
    return out


def _cache_key(target: LoadedModel, cands: Sequence[Candidate]) -> str:
    sig = hashlib.sha256(json.dumps([[[c.method, c.options] for c in cands], _artefacts(target)],
                                    sort_keys=True).encode()).hexdigest()
    return profile_key(target.model, target.name, target.backend) + f"|method-auto|{sig[:12]}"


def _cache_path(target: LoadedModel, cands: Sequence[Candidate]) -> Path:
    return profile_path(_cache_key(target, cands))


def read_cache(path: Path, cands: Sequence[Candidate]) -> Choice | None:
    """The cached choice, or None when missing, corrupt or naming no current candidate."""
    try:
        d = json.loads(path.read_text())
        method, options, table = d["method"], d["options"], d["table"]
        if not isinstance(options, dict) or not isinstance(table, dict):
            return None
        if not any(c.method == method and c.options == options for c in cands):
            return None
        return Choice(method, options, {str(k): float(v) for k, v in table.items()}, cached=True)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def measure(make: Callable[[Candidate], object], cands: Sequence[Candidate], prompts: Sequence[str],
            max_new_tokens: int = CALIBRATION_TOKENS, finalists: int = FINALISTS,
            log: Callable[[str], None] | None = None) -> tuple[dict[str, float], dict[str, bool]]:
    """Calibrate ``cands`` (``ar`` first) greedily on ``prompts``; returns (tokens/s, identical to ar).

    ``make(candidate)`` builds a generator (``selfspec.load`` on the already loaded model). A
    candidate that fails to build or run is dropped with a note, never chosen.
    """
    from .errors import SelfspecError

    half = max(1, len(prompts) // 2)
    gens: dict[str, object] = {}
    results: dict[str, Measurement] = {}
    ref: dict[int, list[int]] = {}

    def run(c: Candidate, i: int, m: Measurement) -> None:
        t0 = time.perf_counter()
        r = gens[c.method].generate(prompts[i], max_new_tokens=max_new_tokens)
        m.seconds.append(time.perf_counter() - t0)
        m.tokens.append(r.new_tokens)
        if c.method == "ar":
            ref[i] = list(r.token_ids)
        elif i in ref and list(r.token_ids) != ref[i]:
            results[c.method].identical = False

    for c in cands:
        results[c.method] = Measurement()
        try:
            gens[c.method] = make(c)
            gens[c.method].generate(prompts[0], max_new_tokens=4)  # warm-up: one-off costs are not speed
            for i in range(half):
                run(c, i, results[c.method])
        except SelfspecError as e:
            results[c.method] = Measurement(error=str(e))
            continue
        if log:  # the round that picks the finalists; the choice is made on the other prompts
            log(f"{c.method} {results[c.method].tokens_per_s:.1f} tok/s on the first {half} prompt(s)")
    ok = [c for c in cands if not results[c.method].error and results[c.method].identical]
    ranked = sorted((c for c in ok if c.method != "ar"), key=lambda c: -results[c.method].tokens_per_s)
    final = [c for c in ok if c.method == "ar"] + ranked[:finalists]
    second = {c.method: Measurement() for c in final}
    for i in range(half, len(prompts)):  # finalists interleaved, so machine load hits all alike
        for c in final:
            run(c, i, second[c.method])
    table = {c.method: second[c.method].tokens_per_s for c in final}
    identical = {label: m.identical for label, m in results.items() if not m.error}
    for c in cands:
        m = results[c.method]
        if m.error:
            print(f"selfspec: auto: {c.method} left out ({m.error})", file=sys.stderr)
        elif not m.identical:
            print(f"selfspec: auto: {c.method} left out: its greedy ids differ from ar's; please report this",
                  file=sys.stderr)
    return table, identical


def choose(target: LoadedModel, make: Callable[[Candidate], object], draft_model: str | None = None,
           remeasure: bool = False, progress: bool = True) -> Choice:
    """The fastest lossless candidate for ``target`` here: cached, else measured (and cached)."""
    cands = candidates(target, draft_model)
    path = _cache_path(target, cands)
    if not remeasure:
        cached = read_cache(path, cands)
        if cached is not None:
            return cached
    prompts = calibration_prompts()
    names = ", ".join(c.method for c in cands)
    log = (lambda s: print(f"selfspec: auto: {s}", file=sys.stderr)) if progress else None
    if progress:
        print(f"selfspec: auto: measuring {names} on {len(prompts)} calibration prompts for {target.name} on "
              f"{target.backend} kernels (once; --remeasure redoes it) ...", file=sys.stderr)
    t0 = time.perf_counter()
    table, identical = measure(make, cands, prompts, log=log)
    method = select(table, identical)
    options = next(c.options for c in cands if c.method == method)
    if progress:
        ranked = sorted(table.items(), key=lambda kv: -kv[1])
        rest = len(prompts) - max(1, len(prompts) // 2)
        print(f"selfspec: auto: chose {method} (" + ", ".join(f"{k} {v:.1f}" for k, v in ranked)
              + f" tok/s on the other {rest} prompt(s), finalists interleaved; {time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    save_cache(_cache_key(target, cands), {"method": method, "options": options, "table": table,
                                           "candidates": [c.method for c in cands], "prompts": len(prompts),
                                           "max_new_tokens": CALIBRATION_TOKENS}, "auto choice")
    return Choice(method, options, table)
