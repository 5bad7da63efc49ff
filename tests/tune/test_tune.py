"""``selfspec tune --method self-spec`` end to end on a tiny model: both objectives, the config
it writes is picked up by ``load``, the search resumes, and bad input is one line with exit 2."""

from __future__ import annotations

import json

import pytest

import selfspec
from selfspec.cli import main
from selfspec.models.loading import load_model
from selfspec.tune.search import seed_sets

from ..conftest import prompt_ids


@pytest.fixture()
def calib(tmp_path):
    """Calibration prompts in the tiny tokenizer's words (its chat template is absent)."""
    path = tmp_path / "calib.jsonl"
    rows = [{"id": f"c{i}", "prompt": " ".join(f"w{t}" for t in prompt_ids(i, 6, 90)), "chat": False}
            for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tune(tiny_dir, tmp_path, calib, *extra):
    return main(["tune", str(tiny_dir), "--prompts", str(calib), "--calib-prompts", "2", "--calib-tokens", "6",
                 "--state", str(tmp_path / "state"), "--out", str(tmp_path / "skip.json"), *extra])


@pytest.mark.parametrize("objective", ["proxy", "speed"])
def test_tune_end_to_end(tiny_dir, tmp_path, calib, capsys, objective):
    assert _tune(tiny_dir, tmp_path, calib, "--objective", objective, "--trials", "9") == 0
    out = capsys.readouterr().out
    assert "skip config:" in out
    cfg = json.loads((tmp_path / "skip.json").read_text())
    assert cfg["search"]["objective"] == objective and cfg["search"]["trials"] == 9
    assert cfg["num_layers"] == 3 and cfg["model"] == tiny_dir.name
    # the written config drives self-spec, and greedy output stays that of ar
    target = load_model(str(tiny_dir))
    g = selfspec.load(target, "self-spec", skip_config=str(tmp_path / "skip.json"), self_test=False)
    assert list(g.drafter.skip.attention) == cfg["skip_attention"]
    ar = selfspec.load(target, "ar", self_test=False)
    p = prompt_ids(5, 9)
    assert g.generate(p, max_new_tokens=16).token_ids == ar.generate(p, max_new_tokens=16).token_ids


def test_tune_resumes_and_refuses_other_settings(tiny_dir, tmp_path, calib, capsys, monkeypatch):
    n_seeds = len(seed_sets(3))
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", str(n_seeds)) == 0
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", str(n_seeds + 3)) == 0
    assert json.loads((tmp_path / "skip.json").read_text())["search"]["trials"] == n_seeds + 3
    capsys.readouterr()
    with monkeypatch.context() as m:  # refused before anything is measured
        def measured(*a, **k):
            raise AssertionError("measured before the search state was checked")
        m.setattr("selfspec.tune.self_spec.measure_draft_cost", measured)
        m.setattr("selfspec.models.loading.Runner.cost_profile", measured)
        assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", "4", "--calib-tokens", "5") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fresh" in err
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", "2", "--fresh") == 0
    assert json.loads((tmp_path / "skip.json").read_text())["search"]["trials"] == 2


def test_tune_time_budget_stops_early(tiny_dir, tmp_path, calib):
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", "1000", "--time-budget", "2") == 0
    assert json.loads((tmp_path / "skip.json").read_text())["search"]["trials"] < 1000


@pytest.mark.parametrize("args,msg", [
    (["--method", "pld"], "self-spec only"),
    (["--trials", "0"], "--trials"),
    (["--time-budget", "-1"], "--time-budget"),
    (["--calib-category", "poetry"], "no calibration prompt"),
])
def test_tune_bad_input(tiny_dir, tmp_path, calib, capsys, args, msg):
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", *args) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


@pytest.mark.parametrize("args,msg", [
    (["--out", "{tmp}/a-file/skip.json"], "is a file, not a directory"),
    (["--state", "{tmp}/a-file/state"], "--state {tmp}/a-file/state cannot be created: {tmp}/a-file is a file"),
    (["--device", "mps"], "MPS (Apple GPU) is not available"),
])
def test_tune_refuses_outputs_and_devices_before_loading(refuse_loading, tiny_dir, tmp_path, calib, capsys, monkeypatch,
                                                         args, msg):
    import selfspec.models.loading as loading

    monkeypatch.setattr(loading, "_mps_available", lambda: False)
    (tmp_path / "a-file").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", *args) == 2
    err = capsys.readouterr().err
    assert msg.replace("{tmp}", str(tmp_path)) in err and err.count("\n") == 1 and "Traceback" not in err


def test_tune_takes_the_model_as_model_flag_too(tiny_dir, tmp_path, calib, capsys):
    """Every other command takes --model; tune took only a positional MODEL."""
    assert main(["tune", "--model", str(tiny_dir), "--prompts", str(calib), "--calib-prompts", "2", "--calib-tokens",
                 "6", "--objective", "proxy", "--trials", "3", "--out", str(tmp_path / "skip.json")]) == 0
    assert (tmp_path / "skip.json").is_file()
    assert main(["tune", "a", "--model", "b"]) == 2 and "two models given" in capsys.readouterr().err
    assert main(["tune"]) == 2 and "needs a model: --model MODEL" in capsys.readouterr().err


def test_tune_under_int8_drafts_and_a_reduced_vocab(tiny_dir, tmp_path, calib, capsys):
    """The search scores drafts as they will run (int8 copy, reduced LM head), stores both in the
    skip config, and self-spec then drafts that way with output unchanged."""
    from ..conftest import VOCAB, write_draft_ranking

    target = load_model(str(tiny_dir))
    write_draft_ranking(target.name, VOCAB, list(range(0, VOCAB, 3)))
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", "5", "--draft-kernels", "int8",
                 "--draft-vocab", "32") == 0
    cfg = json.loads((tmp_path / "skip.json").read_text())
    assert cfg["draft_kernels"] == "int8" and cfg["draft_vocab"] == 32
    g = selfspec.load(target, "self-spec", skip_config=str(tmp_path / "skip.json"), self_test=False)
    assert g.drafter.layers is not None and g.drafter.lm_head.vocab.size >= 32
    ar = selfspec.load(target, "ar", self_test=False)
    p = prompt_ids(5, 9)
    assert g.generate(p, max_new_tokens=16).token_ids == ar.generate(p, max_new_tokens=16).token_ids
    capsys.readouterr()
    assert _tune(tiny_dir, tmp_path, calib, "--objective", "proxy", "--trials", "5", "--draft-vocab", "-1",
                 "--fresh") == 2


def test_a_result_slower_than_ar_is_not_installed(tiny_dir, tmp_path, calib, capsys, monkeypatch):
    """tune saved, and self-spec then used by itself, a skip config that measured 0.94x ar."""
    import selfspec.tune.self_spec as ts
    from selfspec.drafters.skip_config import user_config_path
    from selfspec.models.skipping import SkipSet
    from selfspec.tune.search import SearchResult

    skip = SkipSet(attention=(1,), mlp=())
    monkeypatch.setattr(ts, "search", lambda *a, **k: SearchResult(skip, 9.4, {"tokens_per_s": 9.4, "speedup": 0.94},
                                                                   3, 1.0, [(9.4, skip, {})]))
    argv = ["tune", "--model", str(tiny_dir), "--prompts", str(calib), "--calib-prompts", "2", "--calib-tokens", "6",
            "--state", str(tmp_path / "state"), "--trials", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert not user_config_path(str(tiny_dir)).exists() and (tmp_path / "state" / ts.SLOWER_FILE).is_file()
    assert "not installed: it measured 0.94x ar" in out and f"--skip-config {tmp_path / 'state'}" in out
    assert main([*argv, "--out", str(tmp_path / "mine.json")]) == 0  # asked for by name: written there
    assert (tmp_path / "mine.json").is_file() and "not installed" not in capsys.readouterr().out
