"""The verify-cost profile: interpolation, extrapolation, caching, and re-measuring a cached
profile when a method needs larger blocks measured (SPACE's masked forwards)."""

from __future__ import annotations

import selfspec.core.cost as cost
from selfspec.core.cost import CostProfile, load_or_measure

from ..conftest import tiny_model


def test_ratio_interpolates_and_extrapolates():
    p = CostProfile((1, 2, 4), (1.0, 2.0, 2.5), 16, "k")
    assert p.ratio(1) == 1.0 and p.ratio(3) == 2.25 and p.ratio(6) == 3.0


def test_cache_and_extra_block_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    calls = []
    real = cost.measure

    def counting(model, key, qs=cost.DEFAULT_QS, *a, **kw):
        calls.append(tuple(qs))
        return real(model, key, qs, context=8, reps=1)

    monkeypatch.setattr(cost, "measure", counting)
    model = tiny_model()
    first = load_or_measure(model, "tiny")
    assert first.qs == cost.DEFAULT_QS and len(calls) == 1
    assert load_or_measure(model, "tiny").qs == first.qs and len(calls) == 1  # cached
    wide = load_or_measure(model, "tiny", extra_qs=(25, 36))
    assert len(calls) == 2 and {25, 36} <= set(wide.qs) and set(cost.DEFAULT_QS) <= set(wide.qs)
    assert load_or_measure(model, "tiny", extra_qs=(36,)).qs == wide.qs and len(calls) == 2
    assert load_or_measure(model, "tiny").qs == wide.qs and len(calls) == 2  # the wider profile serves all
