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
