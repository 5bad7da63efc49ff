"""``method="auto"``: selection from a calibration table, the cache (refused when corrupt), the
candidate list, and greedy ids identical to ``ar``."""

from __future__ import annotations

import json

import pytest

import selfspec
from selfspec import autoselect
from selfspec.autoselect import Candidate, Choice
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model

from .conftest import prompt_ids


def test_select_takes_the_fastest_lossless_candidate():
    table = {"ar": 20.0, "pld": 26.0, "msn": 31.0, "jacobi": 22.0}
    assert autoselect.select(table) == "msn"
    assert autoselect.select(table, {"msn": False}) == "pld"  # differs from ar: never chosen
    assert autoselect.select({"ar": 20.0, "pld": 20.0}) == "ar"  # a tie is not a speedup
    assert autoselect.select({"ar": 20.0, "pld": 19.9}) == "ar"
    assert autoselect.select({"ar": 0.0, "pld": 0.0}) == "ar"
    assert autoselect.select({}) == "ar"


def test_calibration_prompts_mix_code_and_chat():
    prompts = autoselect.calibration_prompts(4)
    assert len(prompts) == 4 and len(set(prompts)) == 4


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir), kernels="stock")


def test_candidates_of_a_plain_model(tiny):
    names = [c.method for c in autoselect.candidates(tiny)]
    assert names[0] == "ar" and {"pld", "msn", "jacobi"} <= set(names)
    assert "self-spec" not in names and "eagle2" not in names and "sdsat" not in names  # nothing installed
    with_draft = autoselect.candidates(tiny, draft_model="some-draft")
    assert with_draft[-1] == Candidate("draft-model", {"draft_model": "some-draft"})


def test_candidates_of_a_fine_tuned_model(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "ft"
    shutil.copytree(tiny_dir, d)
    (d / "selfspec_finetune.json").write_text(json.dumps({"method": "space", "new_ids": [5]}))
    names = [c.method for c in autoselect.candidates(load_model(str(d), kernels="stock"))]
    assert "space" in names


def test_measure_builds_and_ranks_with_a_fake_generator():
    """Successive halving: every candidate runs the first half; ar and the best finalists the rest."""

    class Fake:
        def __init__(self, speed: float, ids: list[int]):
            self.speed, self.ids, self.prompts = speed, ids, []

        def generate(self, prompt, max_new_tokens):
            import time

            self.prompts.append(prompt)
            time.sleep(max_new_tokens / self.speed / 1000)

            class R:
                new_tokens = max_new_tokens
                token_ids = self.ids

            return R()

    fakes = {"ar": Fake(10, [1, 2]), "pld": Fake(30, [1, 2]), "msn": Fake(60, [9, 9]), "jacobi": Fake(5, [1, 2]),
             "self-spec": Fake(20, [1, 2])}

    def make(c: Candidate):
        if c.method == "broken":
            raise SelfspecError("no such thing")
        return fakes[c.method]

    cands = [Candidate(m) for m in ("ar", "pld", "msn", "jacobi", "self-spec", "broken")]
    logged: list[str] = []
    table, identical = autoselect.measure(make, cands, ["a", "b", "c", "d"], max_new_tokens=40, finalists=2,
                                          log=logged.append)
    # the first round's rates say which prompts they are from (the choice's line gives the other half's)
    assert len(logged) == 5 and all(line.endswith("tok/s on the first 2 prompt(s)") for line in logged)
    assert identical["msn"] is False  # fastest, but its ids differ from ar's
    assert "jacobi" not in table and "broken" not in table  # not a finalist / failed to build
    assert autoselect.select(table, identical) == "pld"
    assert fakes["jacobi"].prompts == ["a", "a", "b"]  # warm-up + first half only
    assert fakes["pld"].prompts == ["a", "a", "b", "c", "d"]


def test_cache_is_used_and_corrupt_cache_is_remeasured(tiny, monkeypatch):
    calls = []

    def fake_measure(make, cands, prompts, **kw):
        calls.append([c.method for c in cands])
        return {"ar": 1.0, "pld": 2.0}, {"ar": True, "pld": True}

    monkeypatch.setattr(autoselect, "measure", fake_measure)
    make = lambda c: None  # noqa: E731 (never called: measure is faked)
    first = autoselect.choose(tiny, make, remeasure=True, progress=False)
    assert first == Choice("pld", {}, {"ar": 1.0, "pld": 2.0}) and len(calls) == 1
    again = autoselect.choose(tiny, make, progress=False)
    assert again.cached and again.method == "pld" and len(calls) == 1  # from the cache
    path = autoselect._cache_path(tiny, autoselect.candidates(tiny))
    for corrupt in ("{not json", json.dumps({"method": "warp-drive", "options": {}, "table": {}}),
                    json.dumps({"method": "pld"}), json.dumps([1, 2])):
        path.write_text(corrupt)
        assert autoselect.read_cache(path, autoselect.candidates(tiny)) is None
        assert autoselect.choose(tiny, make, progress=False).method == "pld"
    assert len(calls) == 5  # each corrupt cache was measured again, never trusted
    assert autoselect.choose(tiny, make, remeasure=True, progress=False).cached is False


def test_auto_greedy_ids_equal_ar(tiny_dir):
    g = selfspec.load(str(tiny_dir), method="auto", kernels="stock")
    assert g.method.startswith("auto→") and g.auto_table and "ar" in g.auto_table
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


def test_a_new_skip_config_invalidates_the_cached_choice(tiny, monkeypatch):
    """Installing or tuning a draft (here a skip config) changes the cache key: measured again."""
    from selfspec.drafters.skip_config import user_config_path

    calls = []

    def fake_measure(make, cands, prompts, **kw):
        calls.append(1)
        return {"ar": 1.0, "pld": 2.0}, {"ar": True, "pld": True}

    monkeypatch.setattr(autoselect, "measure", fake_measure)
    make = lambda c: None  # noqa: E731
    autoselect.choose(tiny, make, remeasure=True, progress=False)
    assert autoselect.choose(tiny, make, progress=False).cached and len(calls) == 1
    p = user_config_path(tiny.name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{}")
    try:
        assert not autoselect.choose(tiny, make, progress=False).cached and len(calls) == 2
    finally:
        p.unlink()
