"""The method flags' help, generated from the methods' config fields."""

from selfspec.options import _flag_help, flag_uses


def test_a_switch_s_help_is_one_short_entry_per_field():
    """`--fixed-k`'s help was a 25-line paragraph: each method's whole auto_k help, repeated."""
    every = flag_uses()
    text = _flag_help("--fixed-k", every)
    assert len(text) < 450, text
    assert text.startswith("pld, draft-model, self-spec: sets auto_k to False (auto_k: ")
    assert "jacobi: sets auto_m to False" in text and "msn: with --fixed-k, --k sets tree_size" in text
    assert text.count("sets auto_k") == 1


def test_more_threads_than_cores_warns_once(caplog, monkeypatch):
    import logging
    import os

    from selfspec.config import check_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        assert check_threads(2) == 2
        assert not caplog.records
        assert check_threads(99) == 99
    (rec,) = caplog.records
    assert "threads=99" in rec.getMessage() and "2 cores" in rec.getMessage()


def test_too_many_new_tokens_names_no_cli_flag(tiny_dir):
    """The Python API's error names the amount, not the CLI's flag."""
    import pytest

    import selfspec
    from selfspec.errors import SelfspecError

    g = selfspec.load(str(tiny_dir), method="ar", kernels="stock", self_test=False, measure=False)
    with pytest.raises(SelfspecError, match="ask for at most") as e:
        g.generate([5, 6, 7], max_new_tokens=10**9)
    assert "--" not in str(e.value)
