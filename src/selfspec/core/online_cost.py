"""The online correction of a verify-cost profile: the verify forwards timed while decoding,
averaged per block size, and the corrected profile they imply (written back for the next load).

Owned by one generator (``SpeculativeGenerator.online_cost``); nothing here is process-wide.
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import replace
from pathlib import Path

from . import store
from .cost import MIN_OBSERVATIONS, CostProfile, isotonic

EMA_ALPHA = 0.1  # weight of a new verify timing in the online average


class OnlineCost:
    """Exponential moving average, per q, of the verify forwards timed while decoding, and the
    correction of one cached :class:`CostProfile` they imply.

    Owned by one generator (no process-wide state): the decode loop feeds it the verify timings it
    already measures, and the generator writes the corrected profile back at explicit points
    (``save_cost_correction``, which the CLI calls when a command ends). The profile's ``ratio``
    never changes in-process; a correction takes effect from the next load. The first
    ``MIN_OBSERVATIONS`` timings of a q start its average at their median, so a cold first
    forward does not linger in it.

    Args:
        profile: the profile the timings correct.
        alpha: weight of a new timing in the average.
    """

    def __init__(self, profile: CostProfile, alpha: float = EMA_ALPHA) -> None:
        self.profile = profile
        self.alpha = alpha
        self.count: dict[int, int] = {}
        self.ema: dict[int, float] = {}
        self._first: dict[int, list[float]] = {}
        self._lock = threading.Lock()

    def observe(self, q: int, seconds: float) -> None:
        """Record one verify forward of ``q`` new tokens that took ``seconds`` (wall, synchronised).
        Cheap; never raises; ignores non-finite or non-positive timings and q < 1."""
        q, seconds = int(q), float(seconds)
        if q < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        with self._lock:
            n = self.count.get(q, 0) + 1
            self.count[q] = n
            if n <= MIN_OBSERVATIONS:
                first = self._first.setdefault(q, [])
                first.append(seconds)
                self.ema[q] = statistics.median(first)
                if n == MIN_OBSERVATIONS:
                    del self._first[q]
            else:
                self.ema[q] += self.alpha * (seconds - self.ema[q])

    def estimates(self, min_count: int = MIN_OBSERVATIONS) -> dict[int, float]:
        """q -> averaged seconds, for the qs observed at least ``min_count`` times."""
        with self._lock:
            return {q: self.ema[q] for q in sorted(self.ema) if self.count[q] >= min_count}

    def drift(self, profile: CostProfile | None = None) -> float:
        """The largest relative difference |EMA - T(q)| / T(q) of ``profile`` (default: the one
        corrected) over the qs observed at least ``MIN_OBSERVATIONS`` times (0 when none)."""
        p = profile or self.profile
        return max((abs(v - p.at(q)) / p.at(q) for q, v in self.estimates().items()), default=0.0)

    def corrected(self, base: CostProfile | None = None) -> CostProfile:
        """``base`` (default: the profile corrected) with the online averages (qs observed at least
        ``MIN_OBSERVATIONS`` times) in place of its raw points, or added as points, then fitted
        non-decreasing again."""
        p = base or self.profile
        est = self.estimates()
        points = dict(zip(p.qs, p.raw if p.raw is not None else p.seconds))
        spreads = dict(zip(p.qs, p.spread or (0.0,) * len(p.qs)))
        for q, v in est.items():
            points[q], spreads[q] = v, 0.0
        qs = tuple(sorted(points))
        raw = tuple(points[q] for q in qs)
        return replace(p, qs=qs, seconds=tuple(isotonic(raw)), raw=raw, spread=tuple(spreads[q] for q in qs),
                       last_drift=self.drift(p), source="corrected",
                       remeasured_for_drift=p.source == "measured" and p.remeasured_for_drift,
                       observations=tuple((q, self.count[q]) for q in est))

    def persist(self, path: Path | None = None) -> Path | None:
        """Write :meth:`corrected` to ``path`` (default: where the profile was loaded for, its
        ``path``), with the drift, when some q has enough timings. The base is the profile cached
        there now when it has the same key (it may have been measured again, wider, since this one
        was loaded), else the one corrected. Best effort: returns where it wrote, or None; never
        raises (a cache that cannot be written is no error)."""
        try:
            path = path or self.profile.path
            if path is None or not self.estimates():
                return None
            key = self.profile.key
            disk = store.read_at(path, key, CostProfile)
            base = disk if disk is not None and disk.key == key else self.profile
            store.write_at(path, key, self.corrected(base))
            return path
        except Exception:  # noqa: BLE001 -- best effort by contract
            return None
