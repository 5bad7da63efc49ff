"""The load-time self-test's record: a pass is kept per model files, backend, code and machine, and
read instead of running the five forwards again; anything it depends on changing runs it again."""

from __future__ import annotations

import os
import shutil

import pytest

import selfspec.models.selftest as selftest
from selfspec.errors import SelfspecError
from selfspec.models.loading import LoadedModel, load_model


@pytest.fixture
def counted(monkeypatch):
    """The number of self-tests that ran (the real test, counted)."""
    runs: list[int] = []
    real = selftest.tree_self_test
    monkeypatch.setattr(selftest, "tree_self_test", lambda model, **kw: runs.append(1) or real(model, **kw))
    return runs


def test_a_passed_self_test_is_read_back_until_what_it_ran_on_changes(tiny_dir, tmp_path, monkeypatch, counted):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    t = load_model(str(model_dir))
    worst = selftest.cached_tree_self_test(t)
    assert len(counted) == 1 and worst < 1e-3
    assert selftest.cached_tree_self_test(load_model(str(model_dir))) == worst and len(counted) == 1  # read back
    selftest.cached_tree_self_test(t.runner("onednn"))  # another backend: tested again
    assert len(counted) == 2
    weights = next(model_dir.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # new weights
    selftest.cached_tree_self_test(load_model(str(model_dir)))
    assert len(counted) == 3


def test_a_model_without_files_and_a_failure_are_never_recorded(tiny_dir, tmp_path, monkeypatch, counted):
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    t = load_model(str(tiny_dir))
    in_memory = LoadedModel(model=t.model, tokenizer=t.tokenizer, name="mem", path=None).runner("stock")
    selftest.cached_tree_self_test(in_memory)
    selftest.cached_tree_self_test(in_memory)
    assert len(counted) == 2 and selftest.self_test_key(in_memory) is None

    def broken(model, **kw):
        counted.append(1)
        raise SelfspecError("tree attention self-test failed")

    monkeypatch.setattr(selftest, "tree_self_test", broken)
    for _ in range(2):  # every load tests again: no pass was recorded
        with pytest.raises(SelfspecError, match="self-test"):
            selftest.cached_tree_self_test(t)
    assert len(counted) == 4
