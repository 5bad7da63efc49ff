"""The public API: ``selfspec.load(..., threads=N, progress=...)``."""

import io
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

import selfspec
import selfspec.api
from selfspec.errors import SelfspecError


def test_load_takes_a_thread_count_and_restores_torch_s(tiny_dir):
    """On a busy machine one thread can be many times faster than torch's default; the API had no
    way to say so. The generator decodes on its threads and leaves the caller's as they were."""
    torch.set_num_threads(2)
    try:
        g = selfspec.load(str(tiny_dir), "pld", threads=1, k=3, auto_k=False)
        assert g.threads == 1 and torch.get_num_threads() == 2
        seen = {torch.get_num_threads() for _ in g.stream("w1 w2 w3", max_new_tokens=6, chat=False)}
        assert seen == {1} and torch.get_num_threads() == 2
        r = g.generate("w1 w2 w3", max_new_tokens=6, chat=False)
        assert torch.get_num_threads() == 2
        assert r.token_ids == selfspec.load(str(tiny_dir), "ar").generate("w1 w2 w3", max_new_tokens=6,
                                                                           chat=False).token_ids
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("threads", [0, -2, 1.5, True])
def test_a_bad_thread_count_is_one_line(tiny_dir, threads):
    with pytest.raises(SelfspecError, match="threads must be an integer >= 1"):
        selfspec.load(str(tiny_dir), "ar", threads=threads)


def test_a_generator_corrects_its_drafters_cost_profile_when_asked(tiny_dir, tmp_path, monkeypatch):
    """The loop times every verify forward into the generator's own OnlineCost (no process-wide
    state, no exit hook); ``save_cost_correction`` writes the corrected profile, and only then."""
    from selfspec.core import store
    from selfspec.core.cost import MIN_OBSERVATIONS, CostProfile

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    g = selfspec.load(str(tiny_dir), "pld", kernels="stock", self_test=False)
    online = g.online_cost
    assert online is not None and online.profile is g.drafter.sizer.profile
    assert selfspec.load(str(tiny_dir), "ar", kernels="stock", self_test=False).online_cost is None
    before = online.profile.path.read_text()
    steps = 0
    while not online.estimates():
        r = g.generate("the cat sat on the mat", max_new_tokens=16, ignore_eos=True)
        steps += len(r.committed_per_step) - 1  # every verify step after the prompt is timed once
        assert sum(online.count.values()) == steps
    assert max(online.count.values()) >= MIN_OBSERVATIONS
    assert online.profile.path.read_text() == before  # requests never write: later loads read what was cached
    assert g.save_cost_correction() == online.profile.path
    assert store.read_at(online.profile.path, online.profile.key, CostProfile).source == "corrected"


def _files(home) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())


def test_load_with_measure_off_measures_and_writes_nothing(tiny_dir, tmp_path, monkeypatch):
    """``measure=False``: no calibration, no cost profile, no self-test record, no cost correction:
    auto falls back to plain ``ar`` (nothing cached) and a cost-sized method drafts fixed sizes;
    once a measuring load has cached a choice and profiles, ``measure=False`` uses them. Negative
    control: the measuring load writes files into the same home."""
    import importlib

    from selfspec.core import cost

    choice = importlib.import_module("selfspec.autoselect.choice")

    home = tmp_path / "home"
    monkeypatch.setenv("SELFSPEC_HOME", str(home))
    monkeypatch.delenv("SELFSPEC_KERNELS")

    def no_timing(*a, **kw):
        raise AssertionError("measured with measure=False")

    with monkeypatch.context() as m:
        m.setattr(cost, "measure", no_timing)
        m.setattr(choice, "calibrate", no_timing)
        g = selfspec.load(str(tiny_dir), measure=False)
        assert g.method.startswith("auto→ar@")
        pld = selfspec.load(str(tiny_dir), "pld", kernels="stock", measure=False)
        assert pld.drafter.sizer.profile is None  # nothing cached: fixed sizes
        r = pld.generate([5, 9, 11, 5, 9], max_new_tokens=12)
        assert r.token_ids == g.generate([5, 9, 11, 5, 9], max_new_tokens=12).token_ids
        assert pld.save_cost_correction() is None
    assert _files(home) == [] if home.exists() else True
    measured = selfspec.load(str(tiny_dir))  # the negative control: a measuring load writes its records
    assert home.exists() and _files(home)
    before = _files(home)
    with monkeypatch.context() as m:
        m.setattr(cost, "measure", no_timing)
        m.setattr(choice, "calibrate", no_timing)
        again = selfspec.load(str(tiny_dir), measure=False)
        assert again.method == measured.method  # the cached choice
        cached = selfspec.load(str(tiny_dir), "pld", kernels="stock", measure=False)
    assert _files(home) == before
    assert cached.drafter.sizer.profile is not None or not any("stock" in f for f in before)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _noting_load(*args, **kwargs):
    """Stands in for the real load: one note, as a conversion or a calibration logs it."""
    logging.getLogger("selfspec.models").info("converting the model (once)")
    return SimpleNamespace()


@pytest.mark.parametrize("progress, terminal, handled, shown", [
    (True, False, True, True),     # asked for: shown anywhere
    (False, True, False, False),   # refused: never
    (None, True, False, True),     # default in a terminal where nothing handles the logger
    (None, False, False, False),   # default in a script whose stderr is a file or pipe
    (None, True, True, False),     # default where the program configured logging: the notes go there
])
def test_load_shows_its_long_steps_in_a_terminal(monkeypatch, progress, terminal, handled, shown):
    monkeypatch.setattr(selfspec.api, "_load", _noting_load)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()] if handled else [])
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logger = logging.getLogger("selfspec")
    before = (list(logger.handlers), logger.level, logger.propagate)
    selfspec.load("anything", progress=progress)
    assert ("selfspec: converting the model (once)" in err.getvalue()) == shown, err.getvalue()
    assert (list(logger.handlers), logger.level, logger.propagate) == before  # put back as it was
