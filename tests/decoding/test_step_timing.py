"""The loop times every step on the state's injected clock and hands the drafter what it measured
(``state.step_time``); drafters size drafts from that, never from a stopwatch of their own. Fake
clocks drive it here: no test sleeps, and the outcome does not depend on this machine's speed."""

from __future__ import annotations

import pytest

import selfspec
from selfspec.core import store
from selfspec.core.cost import CostProfile
from selfspec.decoding.state import StepTime
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.models.loading import load_model

from ..conftest import VOCAB, prompt_ids
from .wrapped import Wrapped

PROMPT = prompt_ids(1, 6)


class TickClock:
    """Advances by ``tick`` seconds at every reading (0: a frozen clock); counts its readings."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick, self.reads = 0.0, tick, 0

    def __call__(self, device=None) -> float:
        self.reads += 1
        self.t += self.tick
        return self.t


class Recording(Wrapped):
    """Wraps a drafter and keeps the ``step_time`` each ``observe`` got."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.seen = []

    def observe(self, state, proposal, verdict, out):
        self.seen.append(state.step_time)
        self.inner.observe(state, proposal, verdict, out)


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(str(tiny_dir), kernels="stock")


@pytest.fixture
def flat_cost(target):
    """A flat cost profile at 10 ms a forward (every cost-sized draft pays if drafting is free)."""
    key = target.cost_key
    qs = tuple(range(1, 65))
    store.write(key, CostProfile(qs, (0.01,) * len(qs), 256, key, (0.01,) * len(qs), (0.0,) * len(qs), 3), "profile")


@pytest.mark.parametrize("temperature, sampling", [(0.0, "coupled"), (0.8, "coupled"), (0.8, "rejection")])
def test_every_observe_gets_the_steps_seconds_on_the_injected_clock(target, temperature, sampling):
    ar = selfspec.load(target, "ar", self_test=False)
    ref = ar.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3, sampling=sampling).token_ids
    g = selfspec.load(target, "ar", self_test=False)
    g.drafter = rec = Recording(ScriptedDrafter(ref, 3, 2, VOCAB))
    g.clock = clock = TickClock(1.0)
    r = g.generate(PROMPT, max_new_tokens=16, temperature=temperature, seed=3, sampling=sampling)
    assert rec.seen and clock.reads > 2 * len(rec.seen)
    if sampling == "rejection":  # the text depends on the drafts: nothing may be sized from the clock
        assert set(rec.seen) == {StepTime()}
    else:  # one reading before propose, one after it, one after the verdict
        assert set(rec.seen) == {StepTime(draft_s=1.0, step_s=2.0)}
        assert r.token_ids == ref
    assert r.wall_s > 0 and r.wall_s == int(r.wall_s)  # the request's wall time too: whole ticks of the fake clock


@pytest.mark.parametrize("method", ["self-spec", "draft-model"])
def test_chain_drafts_are_sized_from_the_loops_clock(target, tiny_dir, flat_cost, method):
    """The same drafter and prompt: free drafting (a frozen clock) drafts on most steps; drafts
    that cost an hour each (every clock reading an hour later) back off to probes. Ids identical."""
    opts = {"skip_attention": (), "skip_mlp": ()} if method == "self-spec" else {"draft_model": str(tiny_dir)}
    ref = selfspec.load(target, "ar", self_test=False).generate(PROMPT, max_new_tokens=40).token_ids
    drafted = {}
    for name, tick in (("free", 0.0), ("costly", 3600.0)):
        g = selfspec.load(target, method, self_test=False, **opts)  # the draft is the target: always right
        g.clock = TickClock(tick)
        r = g.generate(PROMPT, max_new_tokens=40)
        assert r.token_ids == ref
        drafted[name] = sum(1 for d in r.drafted_per_step if d > 0)
    assert drafted["free"] >= 5 and drafted["costly"] <= 4, drafted
