"""``auto``'s choice: cached per model, machine, candidate list and draft artefacts
(:func:`cache_key`), else calibrated (:mod:`.calibration`) and cached; a choice measured while the
machine was busy is measured again on a quiet start."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import ClassVar

from ..core import store
from ..core.machine import LoadMonitor, machine_busy, others_busy, share_busy
from ..errors import SelfspecError
from ..models.loading import Runner
from .calibration import (
    CACHE_FORMAT,
    CALIBRATION_PROMPTS,
    CALIBRATION_TOKENS,
    PRUNE_TOKENS,
    ROUNDS,
    Candidate,
    Choice,
    Decoder,
    calibration_prompts,
    select,
)
from .calibration import measure as calibrate

log = logging.getLogger("selfspec.auto")


def _artefacts(target: Runner, cands: Sequence[Candidate]) -> list:
    """Size and modification time of every file the candidates' drafts are built from (shipped
    and user heads, skip configs, draft vocabulary rankings): a new head or config, installed or
    trained, invalidates the cached choice."""
    from ..heads import default_head_dir, shipped_head_dir
    from ..paths import model_key, selfspec_home

    key = model_key(target.name)
    data = Path(str(resources.files("selfspec"))) / "data"
    paths = [data / "skip_configs" / f"{key}.json", data / "draft_vocab" / f"{key}.json",
             selfspec_home() / "skip_configs" / f"{key}.json", selfspec_home() / "draft_vocab" / f"{key}.json"]
    for method in dict.fromkeys(c.method for c in cands):  # head directories exist for head methods only
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


@dataclass(frozen=True)
class AutoRecord:
    """``auto``'s stored choice: the chosen label, the finalists' and the pruned candidates' tokens/s,
    whether the machine was busy, and how it was measured (load, candidates, prompts, tokens)."""

    KIND: ClassVar[store.Kind] = store.Kind.AUTO_CHOICE
    choice: str
    table: dict[str, float]
    pruned: dict[str, float]
    busy: bool
    load: dict = field(default_factory=dict)
    candidates: list[str] = field(default_factory=list)
    prompts: int = 0
    max_new_tokens: int = 0

    def to_json(self) -> dict:
        return {"format": CACHE_FORMAT, "choice": self.choice, "table": self.table, "pruned": self.pruned,
                "busy": self.busy, "load": self.load, "candidates": self.candidates, "prompts": self.prompts,
                "max_new_tokens": self.max_new_tokens}

    @classmethod
    def from_json(cls, d: dict) -> AutoRecord:
        if not isinstance(d["busy"], bool) or not isinstance(d["choice"], str):
            raise TypeError("an auto choice names a label and whether the machine was busy")
        return cls(d["choice"], {str(k): float(v) for k, v in d["table"].items()},
                   {str(k): float(v) for k, v in d["pruned"].items()}, d["busy"], dict(d.get("load") or {}),
                   [str(c) for c in d.get("candidates") or []], int(d.get("prompts", 0)),
                   int(d.get("max_new_tokens", 0)))


def cache_key(target: Runner, cands: Sequence[Candidate], width: int = 1) -> str:
    """The store key (:func:`~selfspec.core.store.key`) of the choice among ``cands``: model, dtype,
    device, machine (CPU, threads, torch), candidate list, draft artefacts, where a candidate
    runs on the compiled backend the version of its steps' code
    (:func:`~selfspec.models.aot_step.code_version`), and the batch width timed (a server's choice,
    :mod:`.batches`, is not one stream's)."""
    from ..models.aot_step import code_version

    step_code = code_version() if any(c.kernels == "compiled" for c in cands) else None
    sig = hashlib.sha256(json.dumps([[[c.method, c.options, c.kernels, c.precision] for c in cands],
                                     _artefacts(target, cands), CALIBRATION_PROMPTS, CALIBRATION_TOKENS, PRUNE_TOKENS,
                                     list(ROUNDS), step_code, *([width] if width > 1 else [])],
                                    sort_keys=True).encode()).hexdigest()
    return store.key(store.Kind.AUTO_CHOICE, target.model, target.name, "auto", CACHE_FORMAT, sig[:12])


def cache_path(target: Runner, cands: Sequence[Candidate], width: int = 1) -> Path:
    return store.path(cache_key(target, cands, width))


def read_cache(key: str, cands: Sequence[Candidate]) -> Choice | None:
    """The stored choice of ``key``, or None when missing, corrupt or naming no current candidate."""
    by_label = {c.label: c for c in cands}
    rec = store.read(key, AutoRecord)
    if rec is None or rec.choice not in by_label:
        return None
    return Choice(by_label[rec.choice], rec.table, rec.pruned, cached=True, busy=rec.busy)


def _nothing_ran(errors: dict[str, str]) -> str:
    """The one line for a calibration where no candidate ran: where every failure had the same
    reason (a draft model with another tokenizer fails alike on every kernels backend), that reason
    itself, since it is the user's to fix; else each candidate's."""
    reasons = list(dict.fromkeys(errors.values()))
    if len(reasons) == 1:
        return reasons[0]
    if reasons:
        return "auto: no candidate configuration ran here (" + "; ".join(f"{k}: {v}" for k, v in errors.items()) + ")"
    return "auto: no candidate configuration gave the reference's ids here (see the notes above)"


def choose(target: Runner, make: Callable[[Candidate], Decoder], cands: Sequence[Candidate],
           reference: str | None = None, remeasure: bool = False, prompts: Sequence[str] | None = None,
           clock: Callable[[], float] = time.perf_counter, monitor: Callable[[], LoadMonitor] = LoadMonitor,
           busy_now: Callable[[], bool] = machine_busy, measure: bool = True, width: int = 1) -> Choice:
    """The fastest candidate for ``target`` here: cached, else measured (and cached).

    Args:
        make: builds a candidate's generator on ``target`` (see :func:`.calibration.measure`).
        cands: the configurations to choose from (:func:`candidates`, or one method on several
            kernels); a single one is returned without measuring.
        reference: the method every other candidate's ids must equal on the same kernels (None
            where the method is fixed and only kernels are chosen).
        remeasure: measure even if a choice is cached.
        prompts: calibration prompts (default :func:`calibration_prompts`).
        clock, monitor, busy_now: the timer, the load monitor of the calibration, and whether
            the machine is busy now (a cached choice measured while busy is redone when quiet).
        measure: off: the cached choice (busy or not), else the first candidate (the reference,
            ``ar``, where there is one), with a note; nothing is timed or written.
        width: the requests of each timed batch where ``make``'s decoders decode batches (a
            server's, :class:`~.batches.BatchDecoder`); part of the cache key and of the notes.
    """
    if not cands:
        raise SelfspecError("auto has no candidate configuration to choose from")
    if len(cands) == 1:
        return Choice(cands[0])
    key = cache_key(target, cands, width)
    if not measure:
        cached = read_cache(key, cands)
        if cached is not None:
            return cached
        first = next((c for c in cands if c.method == reference), cands[0])
        log.info("auto: nothing measured (measure off) and no cached choice for %s: %s", target.name, first.label)
        return Choice(first)
    if not remeasure:
        cached = read_cache(key, cands)
        if cached is not None and not (cached.busy and not busy_now()):
            return cached
        if cached is not None:
            log.info("auto: the cached choice was measured while the machine was busy; it is quiet now: measuring "
                     "again")
    prompts = list(prompts) if prompts is not None else calibration_prompts()
    kernels = ", ".join(dict.fromkeys(c.kernels for c in cands))
    log.info("auto: measuring %d configurations (%s on %s kernels) on %d calibration prompts%s for %s (once; "
             "--remeasure redoes it) ...", len(cands), ", ".join(dict.fromkeys(c.method for c in cands)), kernels,
             len(prompts), f", each in a batch of {width} requests (a server's)" if width > 1 else "", target.name)
    t0 = clock()
    mon = monitor().start()

    def busy_so_far() -> bool:
        return share_busy(mon.others_so_far())

    cal = calibrate(make, cands, prompts, reference, clock=clock, busy=busy_so_far)
    mon.stop()
    table = cal.finalists()
    label = select(table, cal.identical)
    if cal.untimed:  # a busy machine spent the budget: plain decoding, the fastest reference timed
        plain = {lab: s for lab, s in table.items() if next(c for c in cands if c.label == lab).method == reference}
        label = select(plain, cal.identical) or label
        log.info("auto: the machine is busy: kept plain decoding (%s) rather than choose on %d short runs; a quiet "
                 "start measures every configuration again", label, len(table))
    if label is None:
        raise SelfspecError(_nothing_ran(cal.errors))
    choice = Choice(next(c for c in cands if c.label == label), table, cal.pruned(),
                    busy=others_busy(mon) or bool(cal.untimed))
    ranked = sorted(table.items(), key=lambda kv: -kv[1])
    log.info("auto: chose %s (%s tok/s; %.0f s%s)", label, ", ".join(f"{k} {v:.1f}" for k, v in ranked),
             clock() - t0, "; the machine was busy: measured again on a quiet start" if choice.busy else "")
    store.write(key, AutoRecord(label, table, choice.pruned, choice.busy, mon.summary(), [c.label for c in cands],
                                len(prompts), CALIBRATION_TOKENS), "auto choice")
    return choice
