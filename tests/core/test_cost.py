"""The verify-cost profile: interpolation, extrapolation, caching, and re-measuring a cached
profile when a method needs larger blocks measured (SPACE's masked forwards); repeats and the
isotonic fit, online correction from verify timings, and ``selfspec profile``."""

from __future__ import annotations

from dataclasses import replace

import pytest

import selfspec.core.cost as cost
from selfspec.core import store
from selfspec.core.cost import CostProfile, load_or_measure
from selfspec.core.online_cost import OnlineCost

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
    key = cost.profile_key(model, "tiny")
    first = load_or_measure(model, key)
    assert first.qs == cost.DEFAULT_QS and len(calls) == 1
    assert load_or_measure(model, key).qs == first.qs and len(calls) == 1  # cached
    wide = load_or_measure(model, key, extra_qs=(25, 36))
    assert len(calls) == 2 and {25, 36} <= set(wide.qs) and set(cost.DEFAULT_QS) <= set(wide.qs)
    assert load_or_measure(model, key, extra_qs=(36,)).qs == wide.qs and len(calls) == 2
    assert load_or_measure(model, key).qs == wide.qs and len(calls) == 2  # the wider profile serves all


# --- robust profiles: repeats, isotonic fit, noise-aware notes -------------------------------------------------


def test_isotonic_pools_adjacent_violators():
    assert cost.isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert cost.isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert cost.isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert cost.isotonic([1.0, 3.0, 1.0], [1.0, 1.0, 3.0]) == [1.0, 1.5, 1.5]
    fit = cost.isotonic([0.148, 0.10, 0.11, 0.121])  # the T(3) > T(16)
    assert all(a <= b for a, b in zip(fit, fit[1:]))


def test_violations_need_ten_percent_and_to_exceed_the_spread():
    qs = (1, 2, 3)
    assert cost.violations(qs, (1.0, 1.5, 1.4)) == []  # 7% below: noise
    assert cost.violations(qs, (1.0, 1.5, 1.2)) == [(2, 1.5, 3, 1.2)]
    assert cost.violations(qs, (1.0, 1.5, 1.2), (0.0, 0.4, 0.4)) == []  # repeats overlap
    assert cost.violations(qs, (1.0, 1.5, 1.2), (0.0, 0.1, 0.1)) == [(2, 1.5, 3, 1.2)]


def test_measure_runs_three_rounds_at_least_and_fits():
    p = cost.measure(tiny_model(), "k-measure", qs=(1, 2, 4), context=8, reps=1)
    assert p.reps == cost.MIN_ROUNDS and len(p.raw) == len(p.spread) == 3 and all(s >= 0 for s in p.spread)
    assert list(p.seconds) == cost.isotonic(p.raw)


def test_json_round_trip_and_legacy_profiles_are_fitted():
    p = CostProfile((1, 2, 3), (1.0, 2.0, 2.0), 16, "k", (1.0, 2.2, 1.8), (0.1, 0.1, 0.1), 5)
    assert CostProfile.from_json(p.to_json()) == p
    legacy = CostProfile.from_json({"qs": [1, 3, 16], "seconds": [0.1, 0.148, 0.121], "context": 256, "key": "k"})
    assert legacy.raw == (0.1, 0.148, 0.121) and legacy.seconds == (0.1, 0.1345, 0.1345) and legacy.reps == 0
    assert cost.stale_reason(legacy) is not None  # measured again on load
    assert cost.stale_reason(p) is None


def test_monotone_note_names_the_pair_and_no_warning_word():
    p = CostProfile((1, 3, 16), (0.1, 0.1345, 0.1345), 256, "k", (0.1, 0.148, 0.121), (0.002, 0.003, 0.002), 5)
    note = cost.monotone_note(p)
    assert note.startswith("selfspec: ") and "T(3) = 148.0 ms > T(16) = 121.0 ms" in note
    assert "\n" not in note and "warning" not in note.lower()
    noisy = CostProfile((1, 3, 16), (0.1, 0.1345, 0.1345), 256, "k", (0.1, 0.148, 0.121), (0.002, 0.05, 0.05), 5)
    assert cost.monotone_note(noisy) is None  # within the spread of the repeats


# --- online correction --------------------------------------------------------------------------------------------


def test_observe_keeps_an_average_per_q_and_ratio_reads_the_snapshot():
    p = CostProfile((1, 2, 4), (1.0, 2.0, 2.5), 16, "k-online")
    online = OnlineCost(p)
    for s in (1.4, 1.5, 9.0, 1.6, 1.5):  # median start: one cold outlier does not stay
        online.observe(2, s)
    online.observe(4, 3.0)  # once: too few to count
    online.observe(3, float("nan"))
    online.observe(0, 1.0)  # ignored
    assert online.estimates() == {2: 1.5}
    assert online.drift() == pytest.approx(0.25)  # |1.5 - 2.0| / 2.0
    for _ in range(20):
        online.observe(2, 1.0)
    ema = online.estimates()[2]
    assert 1.0 < ema < 1.5
    assert p.ratio(2) == 2.0 and p.seconds == (1.0, 2.0, 2.5)  # draft sizing never changes in-process
    c = online.corrected()
    assert c.qs == (1, 2, 4) and c.raw[1] == pytest.approx(ema) and c.source == "corrected"
    assert c.last_drift == pytest.approx(online.drift()) and dict(c.observations) == {2: 25}
    assert list(c.seconds) == cost.isotonic(c.raw)


def test_corrected_adds_unmeasured_qs_and_refits():
    online = OnlineCost(CostProfile((1, 2, 4), (1.0, 2.0, 2.5), 16, "k-add"))
    for _ in range(5):
        online.observe(3, 1.0)  # faster than T(2): pooled by the fit
    c = online.corrected()
    assert c.qs == (1, 2, 3, 4) and c.raw == (1.0, 2.0, 1.0, 2.5) and c.seconds == (1.0, 1.5, 1.5, 2.5)
    assert online.drift() == pytest.approx(1 - 1.0 / 2.25)


def test_estimates_belong_to_their_owner():
    """Two generators' estimates never mix: no process-wide state."""
    p = CostProfile((1, 2), (1.0, 2.0), 16, "k-own")
    a, b = OnlineCost(p), OnlineCost(p)
    for _ in range(5):
        a.observe(1, 2.0)
    assert a.drift() == pytest.approx(1.0) and b.drift() == 0.0 and b.estimates() == {}


def test_persist_writes_the_corrected_profile_and_never_raises(tmp_path):
    p = CostProfile((1, 2), (1.0, 2.0), 16, "k-persist", path=tmp_path / "p.json")
    online = OnlineCost(p)
    assert online.persist() is None and not (tmp_path / "p.json").exists()  # nothing observed
    for _ in range(6):
        online.observe(2, 3.0)
    assert online.persist() == tmp_path / "p.json"
    saved = store.read_at(tmp_path / "p.json", "k-persist", CostProfile)
    assert saved is not None
    assert saved.raw == (1.0, 3.0) and saved.last_drift == pytest.approx(0.5) and saved.source == "corrected"
    (tmp_path / "file").write_text("")
    assert online.persist(tmp_path / "file" / "p.json") is None  # unwritable: no exception
    nowhere = OnlineCost(CostProfile((1,), (1.0,), 16, "k-persist"))
    nowhere.observe(1, 1.0)
    assert nowhere.persist() is None  # no cache path: nowhere to write


def test_a_generator_writes_the_correction_back_after_requests(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    model = tiny_model()
    monkeypatch.setattr(cost, "measure", lambda m, key, qs=cost.DEFAULT_QS, *a, **kw: CostProfile(
        tuple(qs), tuple(float(q) for q in qs), 8, key, tuple(float(q) for q in qs), (0.0,) * len(qs), 3))
    key = cost.profile_key(model, "tiny-exit")
    prof = load_or_measure(model, key)
    assert prof.path is not None and prof.path.is_file()
    online = OnlineCost(prof)
    for _ in range(5):
        online.observe(2, 2.5)
    wider = load_or_measure(model, key, extra_qs=(36,))  # measured again, wider, meanwhile
    assert 36 in wider.qs
    assert online.persist() == prof.path
    again = load_or_measure(model, key)
    assert again.source == "corrected" and again.raw[1] == 2.5 and again.last_drift == pytest.approx(0.25)
    assert again.qs == wider.qs  # corrected on top of what the cache held when written


def test_drift_over_thirty_percent_is_measured_again_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    calls = []

    def fake(model, key, qs=cost.DEFAULT_QS, *a, **kw):
        calls.append(key)
        return CostProfile(tuple(qs), tuple(float(q) for q in qs), 8, key, tuple(float(q) for q in qs),
                           (0.0,) * len(qs), 3)

    monkeypatch.setattr(cost, "measure", fake)
    model = tiny_model()
    key = cost.profile_key(model, "tiny-drift")
    prof = load_or_measure(model, key)
    assert len(calls) == 1

    def drifted(p, d, **kw):
        store.write_at(cost.profile_path(p.key), p.key, cost.replace(p, last_drift=d, source="corrected", **kw))

    drifted(prof, 0.2)
    assert load_or_measure(model, key).last_drift == 0.2 and len(calls) == 1  # within 30%: kept
    drifted(prof, 0.45)
    fresh = load_or_measure(model, key)
    assert len(calls) == 2 and fresh.remeasured_for_drift and fresh.last_drift == 0.0
    # the same drift found right after that re-measurement is systematic: corrected values are kept
    drifted(fresh, 0.45, remeasured_for_drift=True)
    assert load_or_measure(model, key).last_drift == 0.45 and len(calls) == 2
    assert load_or_measure(model, key, remeasure=True) and len(calls) == 3


# --- selfspec profile ---------------------------------------------------------------------------------------------


def test_profile_command_says_cached_and_measures_up_to_max_q(tiny_dir, tmp_path, monkeypatch, capsys):
    from selfspec.cli import main

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    args = ["profile", "--model", str(tiny_dir), "--kernels", "stock", "--reps", "3"]

    def rows(out):
        return [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]

    assert main([*args, "--max-q", "6"]) == 0
    out = capsys.readouterr().out
    assert [int(r[0]) for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    assert "raw median ms" in out and "saved: " in out and "cached:" not in out
    assert main([*args, "--max-q", "5"]) == 0  # the cache reaches 5
    out = capsys.readouterr().out
    assert "cached: " in out and "use --remeasure to measure again" in out and "saved:" not in out
    assert [int(r[0]) for r in rows(out)] == [1, 2, 3, 4, 5]
    assert main([*args, "--max-q", "10"]) == 0  # stops short of 10: measured again, up to 10
    out = capsys.readouterr().out
    assert [int(r[0]) for r in rows(out)] == [1, 2, 3, 4, 5, 6, 8, 10] and "saved: " in out
    assert main([*args, "--max-q", "10", "--remeasure"]) == 0
    assert "saved: " in capsys.readouterr().out


class RecordingStep:
    """A :class:`~selfspec.core.cost.BlockStep` that records what :func:`~selfspec.core.cost.measure`
    runs through it (and computes nothing)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.capacity = 0
        self.given_back = False

    def capacity_for(self, tokens: int) -> int:
        return 4 * tokens

    def take_cache(self, capacity: int) -> str:
        self.capacity = capacity
        return "cache"

    def give_back(self, cache) -> None:
        self.given_back = cache == "cache"

    def prefill(self, cache, ids, want_hidden):
        self.calls.append(("prefill", ids.numel(), want_hidden))

    def forward(self, cache, ids, positions, block_mask, want_hidden, base=None):
        self.calls.append((ids.numel(), int(positions[0]), block_mask, want_hidden, base))


def test_measure_times_a_backends_step_instead_of_the_eager_forward():
    """The compiled backend's T(q) is its padded step's, not the eager forward's (which cost 2.4x
    its one-token step on SmolLM2): every block goes through the step, after the cached prefix, with
    the hidden states the method verifies with; the model's own forward never runs."""
    model = tiny_model()
    eager: list[int] = []
    model.register_forward_hook(lambda *a: eager.append(1))
    step = RecordingStep()
    prof = cost.measure(model, "k-step", qs=(1, 3), context=8, reps=1, step=step, hidden=True)
    rounds = cost.MIN_ROUNDS + 1  # and the warm-up round
    assert step.calls == [("prefill", 8, True)] + [(q, 8, None, True, 8) for _ in range(rounds) for q in (1, 3)]
    assert step.capacity == 4 * (8 + 3) and step.given_back and eager == []
    assert prof.qs == (1, 3) and prof.reps == cost.MIN_ROUNDS
    cost.measure(model, "k-eager", qs=(1, 3), context=8, reps=1)  # negative control: no step, the eager forward
    assert len(eager) == 1 + 2 * rounds


def test_profiles_timed_through_a_step_are_cached_under_their_own_key(tmp_path, monkeypatch):
    """A profile of the compiled backend cached before its step was timed (the eager forward's) is
    not read as the step's: the stepped key differs, and each key reads back its own profile."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    model = tiny_model()
    eager_key = cost.profile_key(model, "tiny", "compiled")
    stepped_key = cost.profile_key(model, "tiny", "compiled", stepped=True)
    assert stepped_key != eager_key and f"|compiled+{cost.STEP_TAG}|" in stepped_key
    eager = load_or_measure(model, eager_key)
    step = RecordingStep()
    monkeypatch.setattr(cost, "measure", lambda m, key, qs, **kw: replace(eager, key=key, qs=qs))
    stepped = load_or_measure(model, stepped_key, step=step)
    assert stepped.key == stepped_key
    assert load_or_measure(model, eager_key).key == eager.key


# --- busy machines and jumps -------------------------------------------------------------------------------------


class _Watch:
    """A load monitor's readings, injected: other processes' share of our CPUs over ``wall`` seconds."""

    def __init__(self, share: float, wall: float = 2.0) -> None:
        self.others_share, self.wall = share, wall

    def start(self) -> _Watch:
        return self

    def stop(self) -> _Watch:
        return self


def _fake_measures(monkeypatch, t1s: list[float], spread: float = 0.001) -> list[float]:
    """``cost.measure`` returning profiles whose T(1) are ``t1s`` in turn; returns the list of calls."""
    calls: list[float] = []

    def fake(model, key, qs=cost.DEFAULT_QS, *a, **kw):
        t1 = t1s[len(calls)]
        calls.append(t1)
        return CostProfile(tuple(qs), tuple(t1 * q for q in qs), 8, key, tuple(t1 * q for q in qs),
                           (spread,) * len(qs), 3)

    monkeypatch.setattr(cost, "measure", fake)
    return calls


def test_a_profile_measured_on_a_busy_machine_is_used_then_measured_again_when_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    calls = _fake_measures(monkeypatch, [0.2, 0.05])
    model = tiny_model()
    key = cost.profile_key(model, "tiny-busy")
    busy, measured = cost.cached_or_measure(model, key, cost.DEFAULT_QS, monitor=lambda: _Watch(0.8))
    assert measured and busy.busy and busy.t1 == 0.2 and calls == [0.2]
    assert cost.read_cached(key).busy  # stored as busy
    # still busy: the cached one is used, nothing measured
    again, measured = cost.cached_or_measure(model, key, cost.DEFAULT_QS, busy_now=lambda: True)
    assert not measured and again.t1 == 0.2 and calls == [0.2]
    # quiet now: measured again, and stored as quiet
    quiet, measured = cost.cached_or_measure(model, key, cost.DEFAULT_QS, busy_now=lambda: False,
                                             monitor=lambda: _Watch(0.0))
    assert measured and not quiet.busy and quiet.t1 == 0.05 and calls == [0.2, 0.05]
    assert not cost.read_cached(key).busy


def test_a_watch_too_short_to_read_marks_nothing_busy(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    _fake_measures(monkeypatch, [0.05])
    model = tiny_model()
    prof, _ = cost.cached_or_measure(model, cost.profile_key(model, "tiny-short"), cost.DEFAULT_QS,
                                     monitor=lambda: _Watch(0.9, wall=0.1))
    assert not prof.busy


def test_a_profile_that_jumps_from_its_history_is_measured_once_more(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    calls = _fake_measures(monkeypatch, [0.050, 0.052, 0.080, 0.051, 0.004, 0.006])
    model = tiny_model()
    key = cost.profile_key(model, "tiny-jump")
    quiet = lambda: _Watch(0.0)  # noqa: E731
    cost.cached_or_measure(model, key, cost.DEFAULT_QS, monitor=quiet)
    # within the spread and 10%: one measurement
    prof, _ = cost.cached_or_measure(model, key, cost.DEFAULT_QS, remeasure=True, monitor=quiet)
    assert calls == [0.050, 0.052] and prof.t1 == 0.052
    # 0.080 against 0.052: measured once more, and the second kept
    prof, _ = cost.cached_or_measure(model, key, cost.DEFAULT_QS, remeasure=True, monitor=quiet)
    assert calls == [0.050, 0.052, 0.080, 0.051] and prof.t1 == 0.051
    # steps shorter than the floor are timer noise: not judged
    cost.cached_or_measure(model, key, cost.DEFAULT_QS, remeasure=True, monitor=quiet)
    assert calls[-1] == 0.004
    prof, _ = cost.cached_or_measure(model, key, cost.DEFAULT_QS, remeasure=True, monitor=quiet)
    assert len(calls) == 6 and prof.t1 == 0.006


def test_busy_flag_round_trips_in_json():
    p = CostProfile((1, 2), (1.0, 2.0), 8, "k", busy=True)
    assert CostProfile.from_json(p.to_json()).busy and not CostProfile.from_json(replace(p, busy=False).to_json()).busy
