"""Verify cost profile T(q): the cost of one target forward over q new tokens.

Every speedup is bounded by tau * T(1) / (T(q) + draft cost). On CPUs T(q) is far from flat and
has steps (``docs/DESIGN.md``), so drafters size their drafts from a profile measured on the
machine in use, cached per model, dtype, device and machine under ``$SELFSPEC_HOME/profiles``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from . import kv_cache, store
from .attention import decode_attention
from .machine import MIN_STAT_WALL_S, LoadMonitor, machine_busy, share_busy
from .store import Kind
from .timing import interleaved

log = logging.getLogger("selfspec.cost")

DEFAULT_QS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
PROFILE_QS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)  # ``selfspec profile``, capped at --max-q
MIN_ROUNDS = 3  # measured rounds at least (after one warm-up round); medians of these
NOISE_RATIO = 0.10  # a later q this much below an earlier q's median (and beyond the spread) is noted
MIN_OBSERVATIONS = 5  # verify timings of a q before its online average counts
DRIFT_REMEASURE = 0.30  # re-measure on load when the last session's online drift exceeded this
JUMP_FLOOR_S = 0.005  # steps shorter than this are not checked for jumps (tiny models: timer noise)


def isotonic(values: list[float] | tuple[float, ...], weights: list[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in (weighted) least squares:
    pool-adjacent-violators. A run that decreases is replaced by its (weighted) mean."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [m for m, _, c in blocks for _ in range(int(c))]


def violations(qs: tuple[int, ...], medians: tuple[float, ...],
               spread: tuple[float, ...] | None = None) -> list[tuple[int, float, int, float]]:
    """Pairs (qa, T(qa), qb, T(qb)) with qa < qb where T(qb) is more than ``NOISE_RATIO`` below
    T(qa) and, when the repeats' ``spread`` (max - min per q) is known, the gap is also larger
    than half their spreads together (the two ranges of repeats do not overlap): a slowdown the
    noise of the repeats cannot explain. Worst (largest relative drop) first."""
    out = []
    for i in range(len(qs)):
        for j in range(i + 1, len(qs)):
            a, b = medians[i], medians[j]
            if b < (1 - NOISE_RATIO) * a and (spread is None or a - b > (spread[i] + spread[j]) / 2):
                out.append((qs[i], a, qs[j], b))
    return sorted(out, key=lambda v: v[3] / v[1])


@dataclass(frozen=True)
class CostProfile:
    """Median seconds per forward of q new tokens after a ``context``-token cache.

    Attributes:
        qs: the measured block sizes, increasing, starting at 1.
        seconds: T(q) fitted non-decreasing (isotonic) to ``raw``; what :meth:`ratio` reads.
        context: cached tokens during the measurement.
        key: what was measured (model, dtype, device, machine).
        raw: the medians of the repeats per q before the fit (online averages where corrected).
        spread: max - min of the repeats per q (0 for a q corrected online).
        reps: measured rounds (0: a profile cached before repeats were recorded).
        last_drift: the online correction's drift (``core.online_cost``) when this profile was
            written back (0 for a fresh measurement); ``drift`` in the JSON.
        source: ``measured``, or ``corrected`` (cached T(q) with online averages put in).
        remeasured_for_drift: measured again because the cached profile had drifted (then a
            drift found again is kept, not measured a third time).
        observations: (q, verify timings averaged) of a corrected profile.
        busy: measured while other processes kept our CPUs busy: used, but measured again on the
            next load that finds the machine quiet.
        path: where a correction of it is written back (not serialised; None: nowhere).

    ``ratio`` reads only this snapshot: the online estimates of an ``OnlineCost``
    (``core.online_cost``) never change draft lengths within a process; they take effect through
    its ``persist`` on the next load.
    """

    KIND: ClassVar[Kind] = Kind.COST_PROFILE
    qs: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int
    key: str
    raw: tuple[float, ...] | None = None
    spread: tuple[float, ...] | None = None
    reps: int = 0
    last_drift: float = 0.0
    source: str = "measured"
    remeasured_for_drift: bool = False
    observations: tuple[tuple[int, int], ...] = ()
    busy: bool = False
    path: Path | None = field(default=None, compare=False, repr=False)

    @property
    def t1(self) -> float:
        return self.seconds[0]

    def at(self, q: int) -> float:
        """Interpolated T(q) in seconds (see :meth:`ratio`)."""
        return self.t1 * self.ratio(q)

    def shared(self, q: int, width: int = 1) -> float:
        """T(width * q) / T(width): the cost of a packed forward in which each of ``width``
        requests verifies ``q`` rows, in units of a plain step of that batch (one row each).
        A draft sized on it maximises the batch's tokens per second as though every request in
        it drafted alike: drafts grow where more rows cost little (the step already reads the
        weights) and shrink toward plain batched decoding where rows cost compute. ``width``
        1: :meth:`ratio`."""
        return self.ratio(width * q) / self.ratio(width) if width > 1 else self.ratio(q)

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
        d = {"qs": list(self.qs), "seconds": list(self.seconds), "context": self.context, "key": self.key,
             "raw": list(self.raw) if self.raw is not None else None,
             "spread": list(self.spread) if self.spread is not None else None, "reps": self.reps,
             "drift": self.last_drift, "source": self.source}
        if self.remeasured_for_drift:
            d["remeasured_for_drift"] = True
        if self.observations:
            d["observations"] = {str(q): n for q, n in self.observations}
        if self.busy:
            d["busy"] = True
        return d

    @classmethod
    def from_json(cls, d: dict) -> CostProfile:
        """From :meth:`to_json`; a profile cached before fits were recorded keeps its medians as
        ``raw`` and is fitted non-decreasing here."""
        qs = tuple(int(q) for q in d["qs"])
        raw = tuple(float(t) for t in (d.get("raw") or d["seconds"]))
        spread = tuple(float(t) for t in d["spread"]) if d.get("spread") else None
        if len(raw) != len(qs) or (spread is not None and len(spread) != len(qs)) or not qs:
            raise ValueError("a cost profile needs one time per block size")
        return cls(qs, tuple(isotonic(raw)), int(d["context"]), d["key"], raw, spread, int(d.get("reps", 0)),
                   float(d.get("drift", 0.0)), str(d.get("source", "measured")),
                   bool(d.get("remeasured_for_drift", False)),
                   tuple((int(q), int(n)) for q, n in (d.get("observations") or {}).items()),
                   bool(d.get("busy", False)))


class BlockStep(Protocol):
    """A backend's own step over blocks of new tokens, timed by :func:`measure` instead of the
    eager forward where the backend has one (the ``compiled`` backend's padded static-shape step,
    :class:`~selfspec.models.compiled_step.StaticStep`, whose T(q) is a staircase over its padded
    sizes and whose one-token step costs well under the eager forward's)."""

    def capacity_for(self, tokens: int) -> int: ...

    def take_cache(self, capacity: int) -> Any: ...

    def give_back(self, cache: Any) -> None: ...

    def prefill(self, cache: Any, ids: torch.Tensor, want_hidden: bool) -> Any: ...

    def forward(self, cache: Any, ids: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None,
                want_hidden: bool, base: int | None = None) -> Any: ...


STEP_TAG = "step"
"""Appended to the backend in the key of a profile timed through a :class:`BlockStep` (profiles of
the ``compiled`` backend cached before its step was timed were of the eager forward)."""


def profile_key(model: torch.nn.Module, model_name: str, backend: str = "stock", stepped: bool = False) -> str:
    """The store key of a profile (:func:`~selfspec.core.store.key`): model, config, dtype, device,
    backend (``+step`` when timed through the backend's step) and machine."""
    return store.key(Kind.COST_PROFILE, model, model_name, f"{backend}+{STEP_TAG}" if stepped else backend)


@torch.inference_mode()
def measure(model: torch.nn.Module, key: str, qs: tuple[int, ...] = DEFAULT_QS, context: int = 256,
            reps: int = 3, progress: bool = False, step: BlockStep | None = None,
            hidden: bool = False) -> CostProfile:
    """Measure T(q) with q values interleaved over ``reps`` rounds (at least ``MIN_ROUNDS``,
    after a warm-up round): medians per q as ``raw``, fitted non-decreasing as ``seconds``.

    ``step``: time the backend's own step (on its static cache, with hidden states when
    ``hidden``, as the method's verify runs it: the shapes it compiles or loads are those decoding
    uses) instead of the eager forward on a growing cache."""
    reps = max(reps, MIN_ROUNDS)
    device = next(model.parameters()).device
    config: Any = model.config  # a HF model's
    vocab: int = config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g)
    if step is not None:
        cache = step.take_cache(step.capacity_for(context + max(qs)))
        step.prefill(cache, prompt[0], hidden)
    else:
        cache = kv_cache.new_cache(model.config)
        model(input_ids=prompt.to(device), **kv_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    blocks = {q: (torch.randint(0, vocab, (q,), generator=g), torch.arange(context, context + q)) for q in qs}

    def case(q: int) -> Callable[[], object]:
        ids, pos = blocks[q]
        if step is not None:
            return lambda: step.forward(cache, ids, pos, None, hidden, base=context)

        def eager() -> None:
            with decode_attention(device):
                model(input_ids=ids.to(device)[None], position_ids=pos.to(device)[None],
                      **kv_cache.cache_arg(model, cache), use_cache=True)
        return eager

    def back(q: int) -> None:  # the step writes its block at ``base``: nothing to undo
        if step is None:
            kv_cache.truncate(cache, context)

    times = interleaved({q: case(q) for q in qs}, reps, warmup=1, device=device, reset=back,  # the warm-up round
                        on_round=(lambda r: log.info(f"cost profile round {r}/{reps}")) if progress else None)
    if step is not None:
        step.give_back(cache)
    raw = tuple(statistics.median(times[q]) for q in qs)
    spread = tuple(max(times[q]) - min(times[q]) for q in qs)
    return CostProfile(tuple(qs), tuple(isotonic(raw)), context, key, raw, spread, reps)


def profile_path(key: str) -> Path:
    """Where the profile of ``key`` is read (:func:`~selfspec.core.store.path`)."""
    return store.path(key)


def load_or_measure(model: torch.nn.Module, key: str, what: str = "the model", remeasure: bool = False,
                    extra_qs: tuple[int, ...] = (), step: BlockStep | None = None,
                    hidden: bool = False) -> CostProfile:
    """The cached profile of ``key`` for this model and machine, measured (and cached) if missing;
    ``what`` names the model in the log. ``key``: :func:`profile_key`; a loaded model's is
    ``LoadedModel.cost_key`` (``stepped``, plus the step's code version, where ``step`` is given).

    ``extra_qs``: larger block sizes a method needs priced by measurement rather than
    extrapolation (SPACE's masked forwards run 1 + k + (k + 1) k tokens); a cached profile
    without them is measured again with them. ``step`` and ``hidden``: the backend's own step
    and whether the method verifies with hidden states (see :func:`measure`)."""
    prof, _ = cached_or_measure(model, key, tuple(sorted(set(DEFAULT_QS) | set(extra_qs))), remeasure=remeasure,
                                what=what, step=step, hidden=hidden)
    return prof


def read_cached(key: str) -> CostProfile | None:
    """The stored profile of ``key``; None when missing, unreadable, corrupt or of another key."""
    prof = store.read(key, CostProfile)
    return prof if prof is not None and prof.key == key else None


def stale_reason(prof: CostProfile, busy_now: Callable[[], bool] | None = None) -> str | None:
    """Why a cached profile must be measured again, or None: it was measured on a busy machine
    and this one is quiet now (``busy_now``, asked only then), the verify times of its last
    session drifted more than ``DRIFT_REMEASURE`` from it (once: a drift that persists right
    after re-measuring is kept), or it was cached before repeats were recorded and is not
    monotonic beyond ``NOISE_RATIO``. ``busy_now`` defaults to :func:`~.machine.machine_busy`."""
    if prof.busy and not (busy_now or machine_busy)():
        return "the cached cost profile was measured while other processes kept the machine busy; it is quiet now"
    if prof.last_drift > DRIFT_REMEASURE and not prof.remeasured_for_drift:
        return (f"the verify times measured while decoding differed by up to {prof.last_drift:.0%} from the "
                "cached cost profile")
    if prof.reps == 0 and violations(prof.qs, prof.raw or prof.seconds):
        qa, ta, qb, tb = violations(prof.qs, prof.raw or prof.seconds)[0]
        return (f"the cached cost profile is not monotonic (T({qa}) = {1e3 * ta:.1f} ms > "
                f"T({qb}) = {1e3 * tb:.1f} ms) and was cached before fits were recorded")
    return None


def monotone_note(prof: CostProfile) -> str | None:
    """One line when the measured medians decrease beyond the noise of their repeats (see
    :func:`violations`), else None. The profile is fitted non-decreasing either way."""
    if prof.raw is None:
        return None
    found = violations(prof.qs, prof.raw, prof.spread)
    if not found:
        return None
    qa, ta, qb, tb = found[0]
    return (f"selfspec: the measured verify cost is not monotonic: T({qa}) = {1e3 * ta:.1f} ms > T({qb}) = "
            f"{1e3 * tb:.1f} ms beyond the spread of {prof.reps} repeats; drafts are sized from a non-decreasing "
            "fit. A busy machine or a kernel that is slower for fewer rows; measure again on an idle machine "
            "with `selfspec profile --remeasure`")


def jumped(new: CostProfile, old: CostProfile) -> bool:
    """Whether ``new``'s T(1) moved from ``old``'s by more than the spread of their repeats (and
    :data:`NOISE_RATIO`): a step that got much faster or slower than its own history, which a
    one-off disturbance explains more often than a changed machine. Steps under
    :data:`JUMP_FLOOR_S` are not judged."""
    a, b = (new.raw or new.seconds)[0], (old.raw or old.seconds)[0]
    if min(a, b) < JUMP_FLOOR_S:
        return False
    spread = max((new.spread or (0.0,))[0], (old.spread or (0.0,))[0])
    return abs(a - b) > spread + NOISE_RATIO * min(a, b)


def cached_or_measure(model: torch.nn.Module, key: str, qs: tuple[int, ...], remeasure: bool = False,
                      max_q: int = 0, reps: int = MIN_ROUNDS, progress: bool = False,
                      what: str = "the model", step: BlockStep | None = None, hidden: bool = False,
                      monitor: Callable[[], LoadMonitor] | None = None,
                      busy_now: Callable[[], bool] | None = None) -> tuple[CostProfile, bool]:
    """The cached profile of ``key`` if it has every q of ``qs`` (or, with ``max_q``, reaches
    ``max_q``) and is not stale (:func:`stale_reason`); else measured over ``qs`` and the cached
    qs, cached, and noted when not monotonic. Returns (profile, measured).

    A measurement during which other processes took more than a quarter of our CPUs (``monitor``,
    default :class:`~.machine.LoadMonitor`; judged only where it lasted long enough to read their
    share) is cached as ``busy``: it is used, and measured again on the next load that finds the machine quiet
    (``busy_now``). One whose T(1) jumped from the cached profile's beyond their spread
    (:func:`jumped`) is measured once more before use, and the second one is kept."""
    cached = read_cached(key)
    history = cached if cached is not None and not cached.busy else None
    prof = None if remeasure else cached
    again = announced = False
    if prof is not None:
        covers = max(prof.qs) >= max_q if max_q else set(qs) <= set(prof.qs)
        reason = stale_reason(prof, busy_now)
        if covers and reason is None:
            return replace(prof, path=store.write_path(key)), False
        if reason is not None:
            again = prof.last_drift > DRIFT_REMEASURE
            log.info(f"{reason}; measuring it again ...")
            announced = True
        qs = tuple(sorted(set(qs) | set(prof.qs)))
    if not announced:
        log.info(f"measuring the verify cost profile of {what} on this machine (once) ...")
    if again:  # the cached one drifted from what decoding measured: it is no history to compare with
        history = None

    def timed() -> CostProfile:
        mon = (monitor or LoadMonitor)().start()
        new = measure(model, key, qs, reps=reps, progress=progress, step=step, hidden=hidden)
        mon.stop()
        busy = mon.wall >= MIN_STAT_WALL_S and share_busy(mon.others_share)
        return replace(new, remeasured_for_drift=again, busy=busy)

    prof = timed()
    if prof.busy:
        log.info("other processes kept the machine busy while the cost profile was measured: it is used for "
                 "now and measured again on a quiet start")
    elif history is not None and jumped(prof, history):
        log.info(f"the measured T(1) = {1e3 * prof.t1:.1f} ms moved from the cached {1e3 * history.t1:.1f} ms beyond "
                 "the spread of their repeats: measuring once more before use ...")
        prof = timed()
    note = monotone_note(prof)
    if note:
        log.info(note.removeprefix("selfspec: "))
    saved = store.write(key, prof, "cost profile")
    return replace(prof, path=saved or store.write_path(key)), True
