"""``auto``: the joint choice of (method, kernels, draft precision) by decode tokens/s.

Selection and successive halving are driven by fake generators on an injected clock (no sleeps,
nothing that depends on this machine's speed); the cache (corrupt, busy), the candidate list from
the registry, and what ``selfspec.load`` fixes when the user names kernels or a method, on tiny
random-init models."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import selfspec
from selfspec import autoselect
from selfspec.autoselect import Candidate, Choice, calibration
from selfspec.drafters.spec import ALWAYS, AutoCandidacy, AutoContext, MethodSpec
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model
from selfspec.registry import METHODS

from .conftest import COMPILED_OFFERED, SAVED_ROUTE_ONLY, prompt_ids


class FakeClock:
    """Seconds that pass only when a fake generator decodes."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeGen:
    """Decodes ``speed`` tokens per fake second (``speeds`` by prompt overrides it); its ids are
    ``ids`` except where ``differ`` names a prompt."""

    def __init__(self, clock: FakeClock, speed: float, speeds: dict | None = None, differ: str = "") -> None:
        self.clock, self.speed, self.speeds, self.differ = clock, speed, speeds or {}, differ
        self.prompts: list[str] = []  # every generate, warm-up included
        self.lengths: list[int] = []  # and its max_new_tokens

    def generate(self, prompt: str, max_new_tokens: int):
        self.prompts.append(prompt)
        self.lengths.append(max_new_tokens)
        self.clock.t += max_new_tokens / self.speeds.get(prompt, self.speed)
        ids = [9, 9] if prompt == self.differ else [1, ord(prompt[0])]
        return SimpleNamespace(new_tokens=max_new_tokens, token_ids=ids)


def fakes(clock: FakeClock, table: dict[str, FakeGen | None]):
    """``make`` over fake generators by short label (see :func:`cand`; None or missing: fails to build)."""
    built: list[str] = []
    by_label = {cand(short).label: g for short, g in table.items()}

    def make(c: Candidate):
        built.append(c.label)
        g = by_label.get(c.label)
        if g is None:
            raise SelfspecError("no such thing here")
        return g

    return make, built


def cand(label: str) -> Candidate:
    """``ar@stock`` / ``self-spec@onednn:int8`` -> a Candidate."""
    method, rest = label.split("@")
    kernels, _, precision = rest.partition(":")
    opts = {"draft_kernels": precision} if precision else {}
    return Candidate(method, opts, kernels, precision)


PROMPTS = ["a", "b", "c", "d"]


def test_labels_name_method_kernels_and_draft_precision():
    assert cand("pld@stock").label == "pld@stock"
    assert cand("self-spec@onednn:int8").label == "self-spec@onednn, draft int8"
    assert autoselect.auto_label(cand("self-spec@stock:same")) == "auto→self-spec@stock, draft as verify"


def test_select_takes_the_fastest_identical_entry():
    table = {"ar@stock": 20.0, "pld@stock": 26.0, "msn@stock": 31.0, "jacobi@stock": 22.0}
    assert autoselect.select(table) == "msn@stock"
    assert autoselect.select(table, {"msn@stock": False}) == "pld@stock"  # differs from ar: never chosen
    assert autoselect.select({"ar@stock": 20.0, "pld@stock": 20.0}) == "ar@stock"  # a tie is not a speedup
    assert autoselect.select({"ar@stock": 0.0}) is None and autoselect.select({}) is None


def test_halving_picks_the_fastest_pair_prunes_and_disqualifies():
    """Every pair decodes the pruning prompt; the best 4 two more, interleaved; the best 2 the last.
    The winner is the fastest over everything it decoded, not the first round's leader."""
    clock = FakeClock()
    gens = {
        "ar@stock": FakeGen(clock, 10), "ar@onednn": FakeGen(clock, 8),
        "msn@stock": FakeGen(clock, 60, differ="a"),  # fastest, but its ids differ from ar's
        "msn@onednn": FakeGen(clock, 12),
        "pld@stock": FakeGen(clock, 30, speeds={"a": 50}),  # leads the pruning round only
        "pld@onednn": FakeGen(clock, 25, differ="c"),  # differs on a later prompt: disqualified there
        "self-spec@stock:same": FakeGen(clock, 20), "self-spec@stock:int8": FakeGen(clock, 35),
        "self-spec@onednn:int8": FakeGen(clock, 28), "jacobi@stock": None,  # fails to build
    }
    make, _ = fakes(clock, gens)
    cands = [cand(label) for label in gens]
    cal = autoselect.measure(make, cands, PROMPTS, reference="ar", max_new_tokens=40, clock=clock)
    assert cal.identical == {"msn@stock": False, "pld@onednn": False}
    assert "jacobi@stock" in cal.errors and "jacobi@stock" not in cal.speeds
    # the two fastest, and the fastest reference: plain decoding is always measured against them
    assert list(cal.finalists()) == ["ar@stock", "pld@stock", "self-spec@stock, draft int8"]
    assert autoselect.select(cal.finalists(), cal.identical) == "self-spec@stock, draft int8"
    assert cal.pruned()["self-spec@onednn, draft int8"] == pytest.approx(28)  # pruned after round 1
    assert gens["msn@onednn"].prompts == ["a", "a"]  # warm-up + the pruning prompt only
    assert gens["self-spec@onednn:int8"].prompts == ["a", "a", "b", "c"]
    assert gens["pld@stock"].prompts == ["a", "a", "b", "c", "d"]
    # the reference ran every prompt a candidate on its kernels ran, once each (untimed past round 0)
    assert gens["ar@stock"].prompts == ["a", "a", "b", "c", "d"]
    assert gens["ar@onednn"].prompts == ["a", "a", "b", "c"]


def test_a_budget_cuts_later_rounds_to_what_fits():
    """Round 0 (every candidate once) costs 13.2 fake seconds; of a 20 s budget, round 1 then fits
    one prompt for the two fastest only, and round 2 nothing: the choice is made on what ran."""
    clock = FakeClock()
    gens = {"ar@stock": FakeGen(clock, 10), "pld@stock": FakeGen(clock, 20), "msn@stock": FakeGen(clock, 15),
            "jacobi@stock": FakeGen(clock, 12)}
    make, _ = fakes(clock, gens)
    cal = autoselect.measure(make, [cand(label) for label in gens], PROMPTS, reference="ar", max_new_tokens=40,
                             budget_s=20.0, clock=clock, prune_tokens=None)
    assert gens["pld@stock"].prompts == ["a", "a", "b"] and gens["msn@stock"].prompts == ["a", "a", "b"]
    assert gens["jacobi@stock"].prompts == ["a", "a"]  # pruned: the budget kept two finalists
    assert list(cal.finalists()) == ["ar@stock", "pld@stock", "msn@stock"]
    assert autoselect.select(cal.finalists(), cal.identical) == "pld@stock"
    # a budget spent by round 0: the two fastest still meet on one more prompt, nothing else runs;
    # the one that was faster on the pruning prompt alone (msn) loses over both
    clock2 = FakeClock()
    gens2 = {label: FakeGen(clock2, g.speed) for label, g in gens.items()}
    gens2["msn@stock"] = FakeGen(clock2, 15, speeds={"a": 25})
    make2, _ = fakes(clock2, gens2)
    cal2 = autoselect.measure(make2, [cand(label) for label in gens2], PROMPTS, reference="ar", max_new_tokens=40,
                              budget_s=1.0, clock=clock2, prune_tokens=None)
    assert gens2["msn@stock"].prompts == ["a", "a", "b"] and gens2["pld@stock"].prompts == ["a", "a", "b"]
    assert gens2["jacobi@stock"].prompts == ["a", "a"]
    assert gens2["ar@stock"].prompts == ["a", "a", "b"]  # timed: the reference ids of prompt b
    assert list(cal2.finalists()) == ["ar@stock", "pld@stock", "msn@stock"]
    assert autoselect.select(cal2.finalists(), cal2.identical) == "pld@stock"


def test_a_busy_machine_stops_round_0_at_its_share_of_the_budget():
    """Busy (other processes took our CPUs), round 0 times no further configuration once
    BUSY_CUT of the budget is spent, and no later round runs: the calibration stays near its
    budget. Quiet, the same calibration times every configuration (the busy probe only ever stops
    round 0 early). Each candidate here costs 4 fake seconds (4 warm-up + 40 tokens at 11 tok/s)."""
    def run(busy: bool):
        clock = FakeClock()
        gens = {label: FakeGen(clock, 11) for label in ("ar@stock", "ar@onednn", "pld@stock", "msn@stock",
                                                          "jacobi@stock", "pld@onednn")}
        make, _ = fakes(clock, gens)
        cal = autoselect.measure(make, [cand(label) for label in gens], PROMPTS, reference="ar", max_new_tokens=40,
                                 budget_s=40.0, clock=clock, prune_tokens=None, busy=lambda: busy)
        return cal, gens, clock.t

    cal, gens, spent = run(busy=True)
    assert cal.untimed == ["msn@stock", "jacobi@stock", "pld@onednn"]  # 12 s spent > BUSY_CUT of 40 s
    assert list(cal.speeds) == ["ar@stock", "ar@onednn", "pld@stock"]
    assert all(g.prompts == ["a", "a"] for g in list(gens.values())[:3])  # warm-up + round 0, no later round
    assert spent <= autoselect.BUSY_CUT * 40.0 + 4 * 1.01
    quiet, quiet_gens, _ = run(busy=False)
    assert not quiet.untimed and set(quiet.speeds) == set(quiet_gens) and max(quiet.reached.values()) >= 1


def test_a_busy_calibration_keeps_plain_decoding_and_is_redone_when_quiet(tiny, monkeypatch):
    """Where a busy machine stopped round 0 early, auto keeps the fastest plain (reference)
    configuration it timed rather than choose on short runs, says so, caches it as busy, and a quiet
    start measures every configuration again."""
    clock = FakeClock()
    speeds = {"ar@stock": 10, "pld@stock": 20, "self-spec@stock:int8": 30, "pld@onednn": 15}
    make, _ = fakes(clock, {label: FakeGen(clock, s) for label, s in speeds.items()})
    cands = [cand(label) for label in speeds]

    class BusyMonitor(FakeMonitor):
        def others_so_far(self):
            return 0.9 if self.contended else 0.0

    def choose(busy: bool, busy_now: bool):
        return autoselect.choose(tiny, make, cands, "ar", prompts=PROMPTS, clock=clock,
                                 monitor=lambda: BusyMonitor(busy), busy_now=lambda: busy_now)

    monkeypatch.setattr(calibration, "BUSY_CUT", 0.0)  # every fake second is past the cut
    busy = choose(busy=True, busy_now=True)
    monkeypatch.undo()
    assert busy.candidate == cand("ar@stock") and busy.busy and not busy.cached
    assert choose(busy=False, busy_now=True).cached  # still busy: the busy choice stands
    quiet = choose(busy=False, busy_now=False)  # quiet now: measured again, every configuration
    assert quiet.candidate == cand("self-spec@stock:int8") and not quiet.cached and not quiet.busy


def test_machine_busy_reads_other_processes_share_not_the_load_average():
    """``machine_busy`` watches the CPUs for a moment (sleep and readings injected): a high load
    average left by a finished busy spell is not busy; other processes taking our CPUs now is."""
    from selfspec.core.machine import LoadMonitor

    def monitor(share: float, load: float):
        ticks = iter([0.0, 1.0])

        def sample(cpus, helpers):
            t = next(ticks)
            return t, 0.0, (share * t * 256, 0.0), load  # 256 CPUs' worth: the share saturates at 1
        return lambda: LoadMonitor(sampler=sample)

    assert autoselect.machine_busy(sample_s=1.0, sleep=lambda s: None, monitor=monitor(0.0, 9.0)) is False
    assert autoselect.machine_busy(sample_s=1.0, sleep=lambda s: None, monitor=monitor(0.8, 0.1)) is True


def test_round_0_prunes_on_fewer_tokens_and_the_budget_projects_full_ones():
    """Every candidate decodes the pruning prompt at PRUNE_TOKENS, the later rounds at the full
    length (the reference too, on the same lengths), and the budget projects a later round at its
    own length: here about 1 s of round 0 per candidate at 8 tokens is 5 s a prompt at 40, so of a
    15 s budget round 1 fits one prompt for the two fastest only."""
    clock = FakeClock()
    gens = {"ar@stock": FakeGen(clock, 8), "pld@stock": FakeGen(clock, 8.2), "msn@stock": FakeGen(clock, 8.5)}
    make, _ = fakes(clock, gens)
    cal = autoselect.measure(make, [cand(label) for label in gens], PROMPTS, reference="ar", max_new_tokens=40,
                             budget_s=15.0, clock=clock, prune_tokens=8)
    assert gens["msn@stock"].lengths == [autoselect.WARMUP_TOKENS, 8, 40]
    assert gens["pld@stock"].lengths == [autoselect.WARMUP_TOKENS, 8, 40]
    assert gens["ar@stock"].lengths == [autoselect.WARMUP_TOKENS, 8, 40]  # pruned, but the reference ids at 40
    assert set(cal.finalists()) == {"ar@stock", "msn@stock", "pld@stock"}
    assert autoselect.PRUNE_TOKENS < autoselect.CALIBRATION_TOKENS


def test_plain_decoding_stays_a_finalist_and_wins_a_near_tie():
    """A speculative configuration that led the short pruning prompt but decodes slower than ar
    over the later prompts is not chosen: ar, pruned by rank, is kept and measured beside it."""
    clock = FakeClock()
    gens = {"ar@stock": FakeGen(clock, 20), "ar@onednn": FakeGen(clock, 18),
            "pld@onednn": FakeGen(clock, 19, speeds={"a": 30}), "self-spec@onednn:int8": FakeGen(clock, 18.5,
                                                                                            speeds={"a": 29}),
            "msn@stock": FakeGen(clock, 15, speeds={"a": 28}), "jacobi@onednn": FakeGen(clock, 14, speeds={"a": 27}),
            "self-spec@stock:int8": FakeGen(clock, 14, speeds={"a": 26})}
    make, _ = fakes(clock, gens)
    cal = autoselect.measure(make, [cand(label) for label in gens], PROMPTS, reference="ar", max_new_tokens=40,
                             clock=clock)
    assert set(cal.finalists()) == {"ar@stock", "pld@onednn"}  # ar, 6th on the pruning prompt, was kept
    assert "ar@onednn" in cal.pruned()  # the fastest reference only (its ids still checked the onednn ones)
    assert gens["ar@stock"].prompts == ["a", "a", "b", "c", "d"]
    assert autoselect.select(cal.finalists(), cal.identical) == "ar@stock"


def test_fit_round_shrinks_prompts_then_finalists():
    assert autoselect.fit_round(2, 4, [1.0, 2.0, 3.0, 4.0], None) == (2, 4)
    assert autoselect.fit_round(2, 4, [1.0, 2.0, 3.0, 4.0], 20.0) == (2, 4)
    assert autoselect.fit_round(2, 4, [1.0, 2.0, 3.0, 4.0], 12.0) == (1, 4)
    assert autoselect.fit_round(2, 4, [1.0, 2.0, 3.0, 4.0], 5.0) == (1, 2)
    assert autoselect.fit_round(2, 4, [1.0, 2.0, 3.0, 4.0], 2.0) is None
    assert autoselect.fit_round(1, 2, [1.0], 5.0) == (1, 1)


def test_a_fixed_method_chooses_kernels_without_a_reference():
    clock = FakeClock()
    gens = {"pld@stock": FakeGen(clock, 30), "pld@onednn": FakeGen(clock, 34, differ="b")}
    make, built = fakes(clock, gens)
    cal = autoselect.measure(make, [cand(label) for label in gens], PROMPTS, reference=None, clock=clock)
    assert built == ["pld@stock", "pld@onednn"]  # no ar built: nothing to compare the user's method with
    assert autoselect.select(cal.finalists(), cal.identical) == "pld@onednn"
    assert gens["pld@onednn"].prompts == ["a", "a", "b", "c", "d"]


def test_a_reason_shared_by_every_failed_candidate_is_the_error(tiny):
    """A draft model with another tokenizer fails on every kernels backend: the user reads that
    reason, not "no candidate ran"; different reasons are each named with their candidate."""
    clock = FakeClock()
    cands = [cand("draft-model@stock"), cand("draft-model@onednn")]
    reason = "draft model 'x' uses a different tokenizer than the target; pick a draft of the same family"

    def fail(c: Candidate):
        raise SelfspecError(reason)

    with pytest.raises(SelfspecError) as e:
        autoselect.choose(tiny, fail, cands, None, remeasure=True, prompts=PROMPTS, clock=clock,
                          monitor=lambda: FakeMonitor(False), busy_now=lambda: False)
    assert str(e.value) == reason

    def fail_by_kernels(c: Candidate):
        raise SelfspecError(f"{c.kernels} is not here")

    with pytest.raises(SelfspecError) as e:
        autoselect.choose(tiny, fail_by_kernels, cands, None, remeasure=True, prompts=PROMPTS, clock=clock,
                          monitor=lambda: FakeMonitor(False), busy_now=lambda: False)
    assert "draft-model@stock: stock is not here" in str(e.value) and "onednn is not here" in str(e.value)


def test_candidates_come_from_the_registry(tiny):
    cands = autoselect.candidates(tiny, METHODS.values(), ["stock", "onednn"])
    labels = [c.label for c in cands]
    assert labels[:2] == ["ar@stock", "ar@onednn"]  # the reference first, on every kernels
    assert {"pld@stock", "msn@onednn", "jacobi@stock"} <= set(labels)
    assert not any(c.method in ("eagle2", "sdsat", "draft-model", "sdsat-lossy") for c in cands)
    # no skip config for the tiny model: self-spec runs as the int8 self-draft (nothing skipped), only
    selfs = [c for c in cands if c.method == "self-spec"]
    assert [c.label for c in selfs] == ["self-spec@stock, draft int8", "self-spec@onednn, draft int8"]
    assert all(c.options == {"skip_attention": (), "skip_mlp": (), "draft_kernels": "int8"} for c in selfs)
    no_int8 = autoselect.candidates(tiny, METHODS.values(), ["stock"], AutoContext(draft_precisions=("same",)))
    assert not any(c.method == "self-spec" for c in no_int8)
    with_draft = autoselect.candidates(tiny, METHODS.values(), ["stock"], AutoContext(draft_model="some-draft"))
    assert Candidate("draft-model", {"draft_model": "some-draft"}, "stock") in with_draft


def test_a_tuned_skip_config_replaces_the_int8_self_draft(tiny, tmp_path, monkeypatch):
    """Your own model: the int8 self-draft until ``selfspec tune`` has written a skip config to
    the home, then the tuned config, on each draft precision (the next load reads it)."""
    from selfspec.drafters.skip_config import SkipConfig, config_hash, user_config_path

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    ctx = AutoContext(draft_precisions=("same", "int8"))
    before = [c for c in autoselect.candidates(tiny, METHODS.values(), ["stock"], ctx) if c.method == "self-spec"]
    assert [c.precision for c in before] == ["int8"] and before[0].options["skip_mlp"] == ()
    SkipConfig(model=tiny.name, config_hash=config_hash(tiny.model), num_layers=3, skip_attention=(1,),
               skip_mlp=()).save(user_config_path(tiny.name))
    after = [c for c in autoselect.candidates(tiny, METHODS.values(), ["stock"], ctx) if c.method == "self-spec"]
    assert [(c.precision, c.options) for c in after] == [("same", {"draft_kernels": "same"}),
                                                         ("int8", {"draft_kernels": "int8"})]


def test_draft_precisions_are_part_of_the_cross_product(tiny):
    spec = MethodSpec("toy", object, lambda *a: None, True, "toy",
                      auto=AutoCandidacy(ALWAYS.options, "draft_kernels", ("same", "int8")))
    lossy = MethodSpec("toy-lossy", object, lambda *a: None, False, "lossy", auto=ALWAYS)
    labels = [c.label for c in autoselect.candidates(tiny, [spec, lossy], ["stock", "int8"])]
    # int8 drafts on int8 verify kernels are the "same" variant; a lossy method is never a candidate
    assert labels == ["toy@stock, draft as verify", "toy@stock, draft int8", "toy@int8, draft as verify"]


def test_bf16_drafts_are_candidates_only_where_they_can_pay(tiny):
    spec = MethodSpec("toy", object, lambda *a: None, True, "toy",
                      auto=AutoCandidacy(ALWAYS.options, "draft_kernels", ("same", "int8", "bf16")))
    native = AutoContext(draft_precisions=("same", "int8", "bf16"))
    emulated = AutoContext(draft_precisions=("same", "int8"))
    assert [c.precision for c in autoselect.candidates(tiny, [spec], ["stock"], native)] == ["same", "int8", "bf16"]
    assert [c.precision for c in autoselect.candidates(tiny, [spec], ["stock"], emulated)] == ["same", "int8"]


def test_candidates_of_a_fine_tuned_model(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "ft"
    shutil.copytree(tiny_dir, d)
    (d / "selfspec_finetune.json").write_text(json.dumps({"method": "space", "new_ids": [5]}))
    methods = [c.method for c in autoselect.candidates(load_model(str(d), kernels="stock"), METHODS.values(),
                                                       ["stock"])]
    assert "space" in methods and "sdsat" not in methods and "space-lossy" not in methods


def test_calibration_prompts_mix_code_and_chat():
    prompts = autoselect.calibration_prompts(4)
    assert len(prompts) == 4 and len(set(prompts)) == 4


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir), kernels="stock")


class FakeMonitor:
    """A LoadMonitor that reports what the test says."""

    def __init__(self, busy: bool) -> None:
        self.contended = busy
        self.others_share, self.wall = None, 0.0  # unknown: the load average's verdict (contended) stands

    def start(self):
        return self

    def stop(self):
        return self

    def summary(self) -> dict:
        return {"contended": self.contended}

    def others_so_far(self) -> float | None:
        return None  # unknown: round 0 is never cut


def chooser(tiny, clock: FakeClock, counts: list[int]):
    """``choose`` over fakes where self-spec@stock is the fastest; ``counts`` grows per calibration."""
    speeds = {"ar@stock": 10, "pld@stock": 20, "self-spec@stock:int8": 30, "pld@onednn": 15}
    gens = {label: FakeGen(clock, s) for label, s in speeds.items()}
    make, _ = fakes(clock, gens)
    cands = [cand(label) for label in speeds]

    def choose(remeasure: bool = False, busy: bool = False, busy_now: bool = False) -> Choice:
        before = clock.t
        choice = autoselect.choose(tiny, make, cands, "ar", remeasure=remeasure, prompts=PROMPTS, clock=clock,
                                   monitor=lambda: FakeMonitor(busy), busy_now=lambda: busy_now)
        if clock.t > before:
            counts.append(1)
        return choice

    return choose, cands


def test_choice_is_cached_and_a_corrupt_cache_is_measured_again(tiny):
    counts: list[int] = []
    choose, cands = chooser(tiny, FakeClock(), counts)
    first = choose(remeasure=True)
    assert first.candidate == cand("self-spec@stock:int8") and not first.cached and len(counts) == 1
    assert set(first.table) == {"ar@stock", "self-spec@stock, draft int8", "pld@stock"}
    again = choose()
    assert again.cached and again.candidate == first.candidate and len(counts) == 1  # from the cache
    path, key = autoselect.cache_path(tiny, cands), autoselect.cache_key(tiny, cands)
    assert autoselect.read_cache(key, cands) is not None
    good = json.loads(path.read_text())
    data = good["data"]
    for corrupt in ("{not json", json.dumps({**good, "data": {**data, "choice": "warp-drive@stock"}}),
                    json.dumps({**good, "data": {"choice": "x"}}), json.dumps([1, 2]),
                    json.dumps({**good, "data": {**data, "table": {"pld@stock": "fast"}}}),
                    json.dumps({**good, "data": {**data, "busy": "no"}}),
                    json.dumps({**good, "schema": good["schema"] + 1}),  # another layout: measured again
                    json.dumps({**good, "kind": "cost-profile"}), json.dumps({**good, "key": key + "x"}),
                    json.dumps(data)):  # a file written before the store
        path.write_text(corrupt)
        assert autoselect.read_cache(key, cands) is None
        assert choose().candidate == first.candidate
    assert len(counts) == 11  # each corrupt cache was measured again, never trusted
    assert not choose(remeasure=True).cached and len(counts) == 12


def test_a_busy_calibration_is_redone_on_a_quiet_start(tiny):
    counts: list[int] = []
    choose, _ = chooser(tiny, FakeClock(), counts)
    busy = choose(remeasure=True, busy=True)
    assert busy.busy and len(counts) == 1
    assert choose(busy_now=True).cached and len(counts) == 1  # still busy: the cached choice stands
    quiet = choose(busy_now=False)  # quiet now: measured again, and the new one is trusted
    assert not quiet.cached and not quiet.busy and len(counts) == 2
    assert choose(busy_now=False).cached and len(counts) == 2


def test_a_single_candidate_is_not_measured(tiny):
    def make(c):
        raise AssertionError("nothing to measure")

    assert autoselect.choose(tiny, make, [cand("pld@stock")]) == Choice(cand("pld@stock"))


def spy_on_choose(monkeypatch) -> list[list[str]]:
    seen: list[list[str]] = []
    real = autoselect.choose

    def spy(target, make, cands, reference="ar", **kw):
        seen.append([c.label for c in cands])
        return real(target, make, cands, reference, **kw)

    monkeypatch.setattr(selfspec.autoselect.configure, "choose", spy)
    return seen


@COMPILED_OFFERED
@SAVED_ROUTE_ONLY
def test_auto_leaves_out_a_compiled_candidate_whose_draft_step_is_not_saved(tiny_dir, tmp_path, monkeypatch,
                                                                            int8_draft_config):
    """auto compiles nothing, a draft step included: with every verify step saved (pretended) but
    self-spec's int8 draft step not, ``self-spec@compiled, draft int8`` is no candidate (building it
    would compile the draft step inside the calibration, half a minute on SmolLM2) while the other
    compiled candidates are; once its file is there (pretended; steps run eagerly), it is one."""
    from selfspec.models.compiled_step import StaticStep

    from .conftest import pretend_draft_step_saved

    monkeypatch.setattr(selfspec.autoselect.configure, "compiled_ready", lambda target, methods: list(methods))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(StaticStep, "_step_for", lambda self, shape, kwargs: self.model.forward)
    target = load_model(str(tiny_dir), kernels="stock")
    seen = spy_on_choose(monkeypatch)
    label = "self-spec@compiled, draft int8"
    selfspec.load(target, method="auto", kernels="auto", self_test=False, remeasure=True)
    assert label not in seen[-1] and "pld@compiled" in seen[-1], seen[-1]
    assert "self-spec@stock, draft int8" in seen[-1]  # the eager int8 draft compiles nothing
    pretend_draft_step_saved(target, tmp_path)
    selfspec.load(target, method="auto", kernels="auto", self_test=False, remeasure=True)
    assert label in seen[-1], seen[-1]


def test_user_kernels_fix_the_kernels_and_a_user_method_fixes_the_method(tiny_dir, monkeypatch):
    from selfspec.kernels.auto import candidates as fp32_kernels

    seen = spy_on_choose(monkeypatch)
    target = load_model(str(tiny_dir), kernels="stock")
    g = selfspec.load(target, method="auto", kernels="stock", self_test=False)
    assert all(label.split(",")[0].endswith("@stock") for label in seen[-1]) and "ar@stock" in seen[-1]
    assert g.method.startswith("auto→") and g.method.split(",")[0].endswith("@stock") and g.kernels == "stock"
    g = selfspec.load(target, method="pld", kernels="auto", self_test=False, k=3)
    assert seen[-1] == [f"pld@{k}" for k in fp32_kernels(target.model)]  # only kernels, for pld
    assert g.method == "pld" and g.drafter is not None
    n = len(seen)
    g = selfspec.load(target, method="pld", kernels="stock", self_test=False)
    assert len(seen) == n and g.auto_choice is None  # both given: nothing to choose


def test_auto_greedy_ids_equal_ar(tiny_dir):
    g = selfspec.load(str(tiny_dir), method="auto", kernels="stock")
    assert g.method.startswith("auto→") and g.auto_table and g.auto_choice is not None
    ar = selfspec.load(g.target, method="ar")
    for seed in range(3):
        ids = prompt_ids(seed, 12)
        r, ref = g.generate(ids, max_new_tokens=40), ar.generate(ids, max_new_tokens=40)
        assert r.token_ids == ref.token_ids
        assert r.method == g.method
    assert json.loads(json.dumps(r.to_dict()))["method"].startswith("auto→")


def test_auto_refuses_method_options(tiny_dir):
    with pytest.raises(SelfspecError, match="auto"):
        selfspec.load(str(tiny_dir), method="auto", kernels="stock", k=3)


def test_a_new_skip_config_invalidates_the_cached_choice(tiny):
    """Installing or tuning a draft (here a skip config) changes the cache key: measured again."""
    from selfspec.drafters.skip_config import user_config_path

    counts: list[int] = []
    choose, _ = chooser(tiny, FakeClock(), counts)
    choose(remeasure=True)
    assert choose().cached and len(counts) == 1
    p = user_config_path(tiny.name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{}")
    try:
        assert not choose().cached and len(counts) == 2
    finally:
        p.unlink()


def test_a_new_compiled_step_code_invalidates_a_choice_among_compiled_candidates(tiny, monkeypatch):
    """A choice that timed the compiled backend is keyed on its steps' code version (layout,
    Inductor options, pass): a new layout (16 lanes on AVX-512 made the step 4x faster there) has it
    measured again; a choice among eager backends only keeps its key (negative control)."""
    from selfspec.autoselect.choice import cache_key
    from selfspec.models import aot_step

    compiled = [Candidate("ar", {}, "stock"), Candidate("ar", {}, "compiled")]
    eager = [Candidate("ar", {}, "stock"), Candidate("ar", {}, "onednn")]
    before = cache_key(tiny, compiled), cache_key(tiny, eager)
    monkeypatch.setattr(aot_step, "PRODUCT_LAYOUT", "gemv-blocked4-rows8")
    assert cache_key(tiny, compiled) != before[0]
    assert cache_key(tiny, eager) == before[1]


@COMPILED_OFFERED
@SAVED_ROUTE_ONLY
def test_auto_times_the_compiled_backend_only_for_methods_whose_steps_are_saved(tiny_dir, tmp_path, monkeypatch):
    """auto compiles nothing: with no step saved here it leaves the compiled backend out; where
    ar's one step is saved (pretended; the step runs eagerly) ar@compiled is a candidate, the
    speculative methods, whose 7 block sizes are not all saved, are not; the choice stays exact."""
    from selfspec.models.compiled_step import StaticStep

    from .conftest import REAL_COMPILED_READY

    monkeypatch.setattr(selfspec.autoselect.configure, "compiled_ready", REAL_COMPILED_READY)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(StaticStep, "_step_for", lambda self, shape, kwargs: self.model.forward)
    seen = spy_on_choose(monkeypatch)
    target = load_model(str(tiny_dir), kernels="stock")
    selfspec.load(target, method="auto", kernels="auto", self_test=False)
    assert seen[-1] and not any(label.endswith("@compiled") for label in seen[-1])
    with pytest.raises(SelfspecError, match="selfspec compile"):
        selfspec.load(target, method="auto", kernels="compiled", self_test=False)
    (tmp_path / "aot").mkdir()
    (tmp_path / "aot" / "step-1x512-pretend.bin").write_bytes(b"")
    blocks = selfspec.autoselect.configure.compiled_blocks  # ar's are pld's too (the prompt's): here its one step
    monkeypatch.setattr(selfspec.autoselect.configure, "compiled_blocks", lambda m: (1,) if m == "ar" else blocks(m))
    monkeypatch.setattr(StaticStep, "missing", lambda self, capacity, sizes, want_hidden:
                        [] if tuple(sizes) == (1,) else [(2, capacity, want_hidden)])
    g = selfspec.load(target, method="auto", kernels="auto", self_test=False, remeasure=True)
    assert [label for label in seen[-1] if label.endswith("@compiled")] == ["ar@compiled"]
    assert g.target is target.runner(g.kernels) and target.backend == "stock"  # nothing switched
    # chosen on compiled (forced here): a request whose larger static cache has no saved steps runs on
    # the best configuration measured without them, exact on its kernels; one that fits runs compiled
    monkeypatch.setattr(autoselect.choice, "select", lambda table, identical=None: "ar@compiled")
    monkeypatch.setattr(StaticStep, "missing", lambda self, capacity, sizes, want_hidden:
                        [] if tuple(sizes) == (1,) and capacity == 512 else [(1, capacity, want_hidden)])
    g = selfspec.load(target, method="auto", kernels="auto", self_test=False, remeasure=True)
    assert g.method == "auto→ar@compiled" and g.fallback is not None
    ids = prompt_ids(1, 12)
    short, long = g.generate(ids, max_new_tokens=20), g.generate(ids, max_new_tokens=400)
    assert short.kernels == "compiled" and long.kernels != "compiled" and long.method == f"auto→{g.fallback.label}"
    assert g.last_method == long.method  # what the server reports for the request
    ref = selfspec.load(target, method="ar", kernels=long.kernels, self_test=False).generate(ids, max_new_tokens=400)
    assert long.token_ids == ref.token_ids
    assert g.generate(ids, max_new_tokens=20).kernels == "compiled"  # and back
    g = selfspec.load(target, method="auto", kernels="compiled", self_test=False, remeasure=True)
    assert g.method == "auto→ar@compiled" and g.auto_choice is not None  # the one candidate there
    ar = selfspec.load(g.target, method="ar")
    ids = prompt_ids(0, 12)
    assert g.generate(ids, max_new_tokens=20).token_ids == ar.generate(ids, max_new_tokens=20).token_ids


def test_a_server_chooses_among_configurations_whose_requests_share_a_batch(tiny, monkeypatch):
    """``batching``: no draft head, no draft model, no compiled step (their requests would decode one
    at a time), no draft forwards of its own (they would run one request after another); the
    candidates auto then times are those, and the generator it returns batches."""
    from selfspec.autoselect.configure import for_batches

    cands = [cand("ar@stock"), cand("pld@compact"), cand("eagle2@compact"), cand("hass@stock"),
             cand("draft-model@onednn"), cand("pld@compiled"), cand("self-spec@stock")]
    assert [c.label for c in for_batches(cands)] == ["ar@stock", "pld@compact"]
    assert all(not METHODS[c.method].draft_weights for c in for_batches(cands))
    assert METHODS["self-spec"].draft_forwards  # its draft forwards would run one request after another

    import selfspec.autoselect.configure as configure

    timed: list[list[str]] = []
    real = configure.choose

    def choose(target, make, cs, *args, **kwargs):
        timed.append([c.label for c in cs])
        return real(target, make, cs, *args, **kwargs)

    monkeypatch.setattr(configure, "candidates", lambda *a, **k: [cand("ar@stock"), cand("eagle2@stock"),
                                                                   cand("pld@stock")])
    monkeypatch.setattr(configure, "choose", choose)
    g = selfspec.load(tiny, method="auto", kernels="stock", self_test=False, measure=False, batching=True)
    assert timed == [["ar@stock", "pld@stock"]] and g.batchable()
    selfspec.load(tiny, method="auto", kernels="stock", self_test=False, measure=False)
    assert timed[-1] == ["ar@stock", "eagle2@stock", "pld@stock"]  # one stream: every candidate


def test_a_server_times_onednn_where_one_stream_times_compact(tiny_gguf_dir, monkeypatch):
    """A server's auto times ``onednn`` (row-invariant, and faster than compact's AVX2 build in wide
    batches), with ``compact`` beside it only where compact's AVX-512 build runs, never ``stock``
    (its rows depend on the batch); one stream's times ``compact`` in place of ``onednn``, beside
    ``stock``."""
    from selfspec.kernels.compact import available

    if available(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("no compact kernels here")
    import selfspec.autoselect.configure as configure

    timed: list[set[str]] = []
    real = configure.choose

    def choose(target, make, cs, *args, **kwargs):
        timed.append({c.kernels for c in cs})
        return real(target, make, cs, *args, **kwargs)

    monkeypatch.setattr(configure, "choose", choose)
    monkeypatch.delenv("SELFSPEC_KERNELS")  # the tests' stock: auto's own choice here
    import selfspec.kernels.auto as kernels_auto

    monkeypatch.setattr(kernels_auto, "compact_isa", lambda: "avx2")
    g = selfspec.load(str(tiny_gguf_dir), method="auto", self_test=False, measure=False, batching=True)
    selfspec.load(str(tiny_gguf_dir), method="auto", self_test=False, measure=False)
    assert timed[0] == {"onednn"}
    assert "compact" in timed[1] and "stock" in timed[1] and "onednn" not in timed[1]
    monkeypatch.setattr(kernels_auto, "compact_isa", lambda: "avx512")
    selfspec.load(str(tiny_gguf_dir), method="auto", self_test=False, measure=False, batching=True, remeasure=True)
    assert timed[2] == {"compact", "onednn"}
    assert g.batchable()


def test_a_server_times_batches_and_caches_their_choice_apart(tiny, monkeypatch):
    """A server's auto times each candidate on batches of ``BATCH_WIDTH`` calibration prompts
    (``generate_batch``) and caches that choice under a key of its own; one stream's decodes alone."""
    import selfspec.autoselect.configure as configure
    from selfspec.autoselect.batches import BATCH_WIDTH, BatchDecoder
    from selfspec.autoselect.choice import cache_key

    seen: list[tuple[type, int]] = []
    real = configure.choose

    def choose(target, make, cs, *args, **kwargs):
        d = make(cs[0])
        seen.append((type(d), kwargs["width"]))
        return real(target, make, cs, *args, **kwargs)

    monkeypatch.setattr(configure, "candidates", lambda *a, **k: [cand("ar@stock"), cand("pld@stock")])
    monkeypatch.setattr(configure, "choose", choose)
    selfspec.load(tiny, method="auto", kernels="stock", self_test=False, measure=False, batching=True)
    selfspec.load(tiny, method="auto", kernels="stock", self_test=False, measure=False)
    assert seen[0] == (BatchDecoder, BATCH_WIDTH)
    assert seen[1][1] == 1 and seen[1][0] is not BatchDecoder
    cands = [cand("ar@stock"), cand("pld@stock")]
    assert cache_key(tiny, cands, BATCH_WIDTH) != cache_key(tiny, cands) == cache_key(tiny, cands, 1)
