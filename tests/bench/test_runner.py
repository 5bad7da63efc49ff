"""selfspec bench on a tiny model: record schema, report, plots, equality check and resume."""

import json

import pytest

from selfspec.cli import main

from ..conftest import COMPILED_OFFERED


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "category": c, "prompt": f"w{i} w{i + 1} w{i + 2} w{i} w{i + 1}", "chat": False}
            for i, c in enumerate(["a", "a", "b"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def bench(tiny_dir, dataset, out, *extra):
    return main(["bench", "--model", str(tiny_dir), "--methods", "ar,pld", "--peers", "hf,hf-pld",
                 "--dataset", str(dataset), "--max-new-tokens", "10", "--out", str(out), *extra])


def test_bench_records_report_and_resume(tiny_dir, dataset, tmp_path, capsys):
    out = tmp_path / "run"
    assert bench(tiny_dir, dataset, out) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 4
    keys = {"prompt_id", "category", "method", "repeat", "token_ids", "new_tokens", "wall_s", "kind"}
    assert all(keys <= set(r) for r in records)
    assert {r["method"] for r in records} == {"ar", "pld", "hf", "hf-pld"}
    rep = json.loads((out / "report.json").read_text())
    for name in ("pld", "hf", "hf-pld"):
        assert rep["summary"][name]["identical"] == "3/3"
    assert rep["summary"]["ar"]["tau"] == 1.0
    assert set(rep["summary"]["pld"]["by_category"]) == {"a", "b"}
    for png in ("speedup_by_category.png", "speedup_tau.png", "accepted_length_hist.png", "cost_profile.png"):
        assert (out / png).stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "| pld |" in md and "speedup" in md and "vs fastest ar" in md
    meta = json.loads((out / "meta.json").read_text())  # every result directory says how it was made
    assert meta["command"] and meta["date"].startswith("20") and "cpu_flags" in meta["environment"]
    assert meta["environment"]["git"]

    # an existing run is not overwritten by accident, and --resume adds nothing when complete
    assert bench(tiny_dir, dataset, out) == 2
    assert bench(tiny_dir, dataset, out, "--resume") == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 12


def test_resume_after_interrupt_keeps_finished_records(tiny_dir, dataset, tmp_path):
    out = tmp_path / "run"
    assert bench(tiny_dir, dataset, out) == 0
    lines = (out / "records.jsonl").read_text().splitlines()
    (out / "records.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # cut mid-record
    assert bench(tiny_dir, dataset, out, "--resume") == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines() if x.endswith("}")]
    assert len({(r["prompt_id"], r["method"]) for r in records}) == 12


def test_bad_dataset_is_a_clear_error(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    assert bench(tiny_dir, bad, tmp_path / "o") == 2
    assert "prompt" in capsys.readouterr().err


def test_an_out_that_cannot_be_created_is_one_line_before_loading(refuse_loading, tiny_dir, dataset, tmp_path, capsys):
    """It used to end in NotADirectoryError."""
    (tmp_path / "a-file").write_text("")
    assert bench(tiny_dir, dataset, tmp_path / "a-file" / "x") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {tmp_path / 'a-file' / 'x'} cannot be created" in err


def test_bench_compares_kernels_backends_in_one_run(tiny_dir, dataset, tmp_path):
    out = tmp_path / "run"
    code = main(["bench", "--model", str(tiny_dir), "--methods", "ar,pld", "--peers", "hf", "--kernels",
                 "stock,onednn,int8", "--dataset", str(dataset), "--max-new-tokens", "10", "--out", str(out)])
    assert code == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    names = {"ar", "pld", "ar@onednn", "pld@onednn", "ar@int8", "pld@int8", "hf"}
    assert {r["method"] for r in records} == names
    assert {r["backend"] for r in records if r["method"].endswith("@int8")} == {"int8"}
    rep = json.loads((out / "report.json").read_text())
    s = rep["summary"]
    assert s["pld@int8"]["baseline"] == "ar@int8" and s["pld@int8"]["identical"] == "3/3"
    assert s["pld@onednn"]["identical"] == "3/3" and s["ar@onednn"]["identical_to_hf"] == "3/3"
    assert s["pld"]["speedup_vs_hf"] is not None
    assert set(rep["meta"]["cost_profiles"]) == {"stock", "onednn", "int8"}
    assert "int8 (quantised)" in (out / "report.md").read_text()


def test_method_variants_in_one_run(tiny_dir, dataset, tmp_path, capsys):
    """``METHOD:key=value`` entries run variants of one method side by side (self-spec exits)."""
    out = tmp_path / "variants"
    code = main(["bench", "--model", str(tiny_dir), "--methods",
                 "ar,self-spec:skip_attention=1:draft_exit=gamma,pld:k=2:auto_k=false", "--dataset", str(dataset),
                 "--max-new-tokens", "10", "--out", str(out)])
    assert code == 0
    s = json.loads((out / "report.json").read_text())["summary"]
    assert s["self-spec:skip_attention=1:draft_exit=gamma"]["identical"] == "3/3"
    assert s["pld:k=2:auto_k=false"]["identical"] == "3/3"
    capsys.readouterr()
    assert main(["bench", "--model", str(tiny_dir), "--methods", "ar,pld:k", "--dataset", str(dataset),
                 "--out", str(tmp_path / "bad")]) == 2
    assert "METHOD:key=value" in capsys.readouterr().err


def test_parse_method():
    from selfspec.bench.runner import parse_method

    assert parse_method("self-spec:draft_exit=gamma:k=8:auto_k=false:gamma0=0.5") == (
        "self-spec", {"draft_exit": "gamma", "k": 8, "auto_k": False, "gamma0": 0.5})
    assert parse_method("ar") == ("ar", {})


def test_auto_is_named_as_it_ran(tiny_dir, dataset, tmp_path):
    out = tmp_path / "auto"
    code = main(["bench", "--model", str(tiny_dir), "--methods", "ar,auto", "--kernels", "stock", "--dataset",
                 str(dataset), "--max-new-tokens", "10", "--out", str(out)])
    assert code == 0
    s = json.loads((out / "report.json").read_text())["summary"]
    auto = [k for k in s if k.startswith("auto→")]
    assert len(auto) == 1 and s[auto[0]]["identical"] == "3/3"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"ar", auto[0]}


def test_auto_kernels_are_chosen_as_generate_chooses_them(tiny_dir, dataset, tmp_path):
    """``--kernels auto``: auto's whole configuration and each method's kernels are chosen by decode
    speed (not a kernels proxy first), and every entry is compared with ar on its own kernels."""
    out = tmp_path / "joint"
    assert main(["bench", "--model", str(tiny_dir), "--methods", "ar,auto,pld", "--kernels", "auto", "--dataset",
                 str(dataset), "--max-new-tokens", "10", "--out", str(out)]) == 0
    s = json.loads((out / "report.json").read_text())["summary"]
    auto = next(k for k in s if k.startswith("auto→"))
    kernels = auto.split("@")[1].split(",")[0]
    assert s[auto]["baseline"] == ("ar" if kernels == "stock" else f"ar@{kernels}")
    assert all(v["identical"] == "3/3" for k, v in s.items() if k != "hf")


def test_contended_runs_are_recorded_and_flagged(tiny_dir, dataset, tmp_path, monkeypatch, capsys):
    from selfspec.core.machine import LoadMonitor

    out = tmp_path / "quiet"
    monkeypatch.setattr(LoadMonitor, "contended", property(lambda self: False))
    assert main(["bench", "--model", str(tiny_dir), "--methods", "ar,pld", "--kernels", "stock", "--dataset",
                 str(dataset), "--max-new-tokens", "6", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["contended"] is False for r in records)
    rep = json.loads((out / "report.json").read_text())
    assert rep["meta"]["environment"]["contended"] is False and rep["meta"]["load"]["contended_runs"] == 0
    assert "Contended" not in (out / "report.md").read_text()
    assert "machine was busy" not in capsys.readouterr().err

    out = tmp_path / "busy"
    monkeypatch.setattr(LoadMonitor, "contended", property(lambda self: True))
    assert main(["bench", "--model", str(tiny_dir), "--methods", "ar,pld", "--kernels", "stock", "--dataset",
                 str(dataset), "--max-new-tokens", "6", "--out", str(out), "--threads", "2"]) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["contended"] is True for r in records)
    rep = json.loads((out / "report.json").read_text())
    assert rep["meta"]["environment"]["contended"] is True and rep["summary"]["pld"]["contended_runs"] == 3
    assert json.loads((out / "meta.json").read_text())["environment"]["contended"] is True
    md = (out / "report.md").read_text()
    assert "**Contended: the machine was busy" in md and "ar 3/3, pld 3/3" in md
    busy = [line for line in capsys.readouterr().err.splitlines() if "machine was busy during the timing" in line]
    assert len(busy) == 1 and busy[0].endswith("try --threads 1 (now 2)")  # the advice that helps


@COMPILED_OFFERED
def test_compiled_steps_are_warmed_up_for_every_cache_size_the_prompts_need(tiny_dir, tmp_path, monkeypatch):
    """A short and a long prompt need 512- and 1024-position static caches: both are compiled
    before timing (not only the longest prompt's), so no timed run pays a compile. The step runs
    eagerly here (what is tested is which shapes the bench asks for)."""
    from selfspec.models.compiled_step import StaticStep
    from selfspec.registry import compiled_blocks

    calls = []
    real = StaticStep.warm_up
    monkeypatch.setattr(StaticStep, "_step_for", lambda self, shape, kwargs: self.model.forward)
    monkeypatch.setattr(StaticStep, "warm_up", lambda self, capacity, sizes, want_hidden:
                        calls.append((capacity, len(sizes))) or real(self, capacity, sizes, want_hidden))
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": "short", "category": "a", "prompt": "w1 w2 w3", "chat": False},
            {"id": "long", "category": "a", "prompt": " ".join(f"w{i % 90}" for i in range(420)), "chat": False}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["bench", "--model", str(tiny_dir), "--methods", "pld", "--kernels", "compiled", "--dataset", str(path),
                 "--max-new-tokens", "8", "--out", str(tmp_path / "run")]) == 0
    n = len(compiled_blocks("pld"))
    assert n == 7 and {(512, n), (1024, n)} <= set(calls), calls
