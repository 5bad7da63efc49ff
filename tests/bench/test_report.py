"""Report arithmetic on synthetic records: every number is recomputable from the JSONL."""

import json

import pytest

from selfspec.bench.report import summarize
from selfspec.cli import main


def rec(pid, method, cat, n, wall, steps=None, ids=None, rep=0):
    r = {"prompt_id": pid, "method": method, "category": cat, "repeat": rep, "new_tokens": n, "wall_s": wall,
         "token_ids": ids if ids is not None else list(range(n)), "temperature": 0.0, "kind": "method"}
    if steps is not None:
        r["steps"] = steps
    return r


def test_summary_arithmetic():
    records = [
        rec("a", "ar", "x", 10, 2.0, 10), rec("b", "ar", "y", 20, 2.0, 20),
        rec("a", "pld", "x", 10, 1.0, 5), rec("b", "pld", "y", 20, 4.0, 10, ids=[0, 1, 9] + list(range(3, 20))),
    ]
    s = summarize(records, ["ar", "pld"])
    assert s["ar"]["speedup"] == 1.0 and s["ar"]["tau"] == 1.0 and s["ar"]["identical"] == "2/2"
    assert s["pld"]["tokens_per_s"] == pytest.approx(30 / 5.0)
    assert s["pld"]["speedup"] == pytest.approx((30 / 5.0) / (30 / 4.0))
    assert s["pld"]["tau"] == pytest.approx(30 / 15)
    assert s["pld"]["by_category"] == {"x": pytest.approx(10 / 5), "y": pytest.approx(5 / 10)}
    assert s["pld"]["identical"] == "1/2"
    assert s["pld"]["differences"] == [{"prompt_id": "b", "repeat": 0, "position": 2}]


def test_every_speedup_is_also_stated_against_the_fastest_ar_of_the_run():
    """A method on fast kernels measured only against ``ar`` on slow kernels flattered it (1.13x
    "vs ar" while slower than ``ar@stock``): the summary states each entry against the fastest ``ar``."""
    records = [rec("a", "ar", "x", 10, 1.0, 10), rec("a", "ar@onednn", "x", 10, 2.0, 10),
               rec("a", "pld@onednn", "x", 10, 1.6, 6), rec("b", "ar", "y", 10, 1.0, 10),
               rec("b", "ar@onednn", "y", 10, 2.0, 10), rec("b", "pld@onednn", "y", 10, 1.6, 6)]
    s = summarize(records, ["ar", "ar@onednn", "pld@onednn"], {"pld@onednn": "ar@onednn", "ar@onednn": "ar@onednn"})
    assert s["pld@onednn"]["speedup"] == pytest.approx(2.0 / 1.6)  # against its own kernels' ar: above 1
    assert s["pld@onednn"]["fastest_ar"] == "ar"
    assert s["pld@onednn"]["speedup_vs_fastest_ar"] == pytest.approx(1.0 / 1.6)  # slower than plain ar: below 1
    assert s["pld@onednn"]["by_category_vs_fastest_ar"] == {"x": pytest.approx(1 / 1.6), "y": pytest.approx(1 / 1.6)}
    assert s["ar"]["speedup_vs_fastest_ar"] == 1.0


def test_plots_say_what_their_one_is_and_mark_contended_series():
    from selfspec.bench.plots import baseline_words, category_speedups, overall_speedup, series_label

    s = {"ar": {"fastest_ar": "ar@onednn", "speedup": 1.0, "speedup_vs_fastest_ar": 0.9, "runs": 4},
         "pld": {"fastest_ar": "ar@onednn", "speedup": 1.2, "speedup_vs_fastest_ar": 1.1, "runs": 4,
                 "contended_runs": 3, "by_category": {"c": 1.2}, "by_category_vs_fastest_ar": {"c": 1.1}}}
    assert baseline_words(s) == "the fastest ar (ar@onednn)"
    assert overall_speedup(s["pld"]) == 1.1 and category_speedups(s["pld"]) == {"c": 1.1}
    assert series_label("pld", s["pld"]) == "pld [contended 3/4]" and series_label("ar", s["ar"]) == "ar"
    assert overall_speedup({"speedup": 1.3}) == 1.3  # a summary written before the fastest-ar figures


def test_ar_against_itself_is_one():
    records = [rec(p, m, "c", 7, w, 7) for p, w in [("a", 1.3), ("b", 0.7)] for m in ["ar"]]
    assert summarize(records, ["ar"])["ar"]["speedup"] == 1.0


def test_sampling_runs_skip_the_equality_check():
    records = [dict(rec("a", "ar", "x", 5, 1.0, 5), temperature=0.7), dict(rec("a", "pld", "x", 5, 1.0, 3),
                                                                          temperature=0.7)]
    assert "identical" not in summarize(records, ["ar", "pld"])["pld"]


@pytest.mark.parametrize("content,needle", [("", "no prompts"), ("{not json\n", "not valid JSON"),
                                            ('{"id": 3}\n', "prompt")])
def test_bad_dataset_files(tmp_path, capsys, tiny_dir, content, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(content)
    assert main(["bench", "--model", str(tiny_dir), "--dataset", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_missing_dataset_and_unknown_method(tmp_path, capsys, tiny_dir):
    assert main(["bench", "--model", str(tiny_dir), "--dataset", "nope.jsonl", "--out", str(tmp_path / "o")]) == 2
    assert main(["bench", "--model", str(tiny_dir), "--methods", "ar,warp", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "unknown method" in err


def test_ctrl_c_keeps_finished_records(tmp_path, capsys, tiny_dir, monkeypatch):
    import selfspec.bench.runner as runner

    real = runner.run_peer
    calls = {"n": 0}

    def interrupting(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # warm-up is call 1; interrupt during the second prompt
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "run_peer", interrupting)
    out = tmp_path / "o"
    code = main(["bench", "--model", str(tiny_dir), "--methods", "ar", "--peers", "hf", "--max-new-tokens", "4",
                 "--out", str(out)])
    assert code == 130
    lines = (out / "records.jsonl").read_text().splitlines()
    assert [json.loads(x)["method"] for x in lines] == ["ar", "hf", "ar"]


def test_acceptance_by_depth_from_records():
    from selfspec.bench.report import acceptance_by_depth

    recs = [{"drafted_per_step": [0, 3, 2, 0], "committed_per_step": [1, 4, 1, 1]},
            {"drafted_per_step": [0, 1], "committed_per_step": [1, 2]}]
    # depth 1: verified 3 times, accepted in steps (3 drafts, 4 committed) and (1 draft, 2 committed)
    assert acceptance_by_depth(recs) == [2 / 3, 1 / 2, 1 / 1]


def test_contended_runs_are_counted_and_marked(tmp_path):
    from selfspec.bench.report import write_report

    records = [dict(rec("a", "ar", "x", 10, 1.0, 10), contended=True), rec("b", "ar", "x", 10, 1.0, 10),
               rec("a", "pld", "x", 10, 0.5, 5), rec("b", "pld", "x", 10, 0.5, 5)]
    s = summarize(records, ["ar", "pld"])
    assert s["ar"]["contended_runs"] == 1 and s["pld"]["contended_runs"] == 0
    meta = {"model": "m", "dataset": "d", "prompts": 2, "repeats": 1, "generation": {"max_new_tokens": 10,
            "temperature": 0.0}, "environment": {"machine": "x", "torch": "t", "transformers": "t", "git": "g",
                                                 "contended": True},
            "load": {"load_before": 1.2, "load_after": 3.4, "machine_cores": 2}}
    write_report(tmp_path, meta, s)
    md = (tmp_path / "report.md").read_text()
    assert "**Contended: the machine was busy with other work during this run (1-min load up to 3.4 on 2 cores)" in md
    assert "Timed runs while busy: ar 1/2." in md
    meta["environment"]["contended"] = False
    write_report(tmp_path, meta, summarize(records[1:], ["ar", "pld"]))
    assert "Contended" not in (tmp_path / "report.md").read_text()


def test_the_machine_line_is_words_not_a_cache_key(tmp_path):
    from selfspec.bench.report import write_report

    records = [rec("a", "ar", "x", 10, 1.0, 10), rec("a", "pld", "x", 10, 0.5, 5)]
    meta = {"model": "m", "dataset": "d", "prompts": 1, "repeats": 1, "generation": {"max_new_tokens": 10,
            "temperature": 0.0}, "environment": {"machine": "Intel Xeon Gold|threads=2|torch=2.9", "threads": 2,
                                                 "cpu_flags": "avx2+avx512f", "torch": "2.9", "transformers": "5",
                                                 "git": "g"}}
    write_report(tmp_path, meta, summarize(records, ["ar", "pld"]))
    md = (tmp_path / "report.md").read_text()
    assert "Machine: Intel Xeon Gold, 2 threads, avx2+avx512f; torch 2.9" in md and "|threads=" not in md


def test_plots_draw_no_empty_series_and_centre_their_bars():
    """With ar on oneDNN, `hf` (no stock ar to compare with) was drawn as a name without a bar,
    `ar@onednn` as a histogram legend entry without bars, and bars sat off their ticks."""
    from collections import Counter

    from selfspec.bench.plots import bar_offsets, histogram_series, speedup_series

    def step_rec(method, committed, drafted):
        return {"method": method, "committed_per_step": committed, "drafted_per_step": drafted}

    summary = {"ar@onednn": {"baseline": "ar@onednn", "tau": 1.0, "speedup": 1.0, "by_category": {"code": 1.0}},
               "pld@onednn": {"baseline": "ar@onednn", "tau": 1.6, "speedup": 1.3, "by_category": {"code": 1.3}},
               "hf": {"baseline": "ar", "tau": None, "speedup": None, "by_category": {"code": None}}}
    records = [step_rec("ar@onednn", [1, 1, 1], [0, 0, 0]), step_rec("pld@onednn", [1, 3, 1, 2], [0, 4, 0, 4])]
    assert speedup_series(summary) == ["pld@onednn"]
    assert histogram_series(summary, records) == {"pld@onednn": Counter({3: 1, 2: 1})}
    assert bar_offsets(1, 0.8) == [0.0] and bar_offsets(2, 0.4) == [-0.2, 0.2]


def test_acceptance_by_depth_has_one_definition_for_results_and_records():
    """The bench report and a request's stats count acceptance by depth the same way (one
    function); a step cut short by EOS after accepting its drafts is not a rejection."""
    from selfspec.bench.report import acceptance_by_depth as from_records
    from selfspec.core.acceptance import acceptance_by_depth
    from selfspec.decoding.state import StepStats

    st = StepStats()
    steps = [(0, 0, 1), (3, 3, 4), (3, 1, 2), (2, 0, 1), (3, 2, 2)]  # (depth, accepted, committed): the last cut by EOS
    for d, a, c in steps:
        st.record(d, a, c)
    want = [3 / 4, 2 / 4, 1 / 3]
    assert st.acceptance_by_depth() == pytest.approx(want)
    assert acceptance_by_depth([d for d, _, _ in steps], [a for _, a, _ in steps]) == pytest.approx(want)
    rec = {"drafted_per_step": st.drafted_per_step, "committed_per_step": st.committed_per_step,
           "accepted_per_step": st.accepted_per_step}
    assert from_records([rec]) == pytest.approx(want)
    old = {k: v for k, v in rec.items() if k != "accepted_per_step"}  # a record from before: committed - 1
    assert from_records([old]) == pytest.approx([3 / 4, 1 / 4, 1 / 3])


def test_a_difference_met_in_every_repeat_is_listed_once(tmp_path):
    from selfspec.bench.report import write_report

    records = []
    for r in range(3):
        records += [rec("a", "ar", "x", 4, 1.0, 4, ids=[1, 2, 3, 4], rep=r),
                    rec("a", "pld", "x", 4, 0.5, 2, ids=[1, 2, 9, 9], rep=r)]
    records.append(rec("b", "ar", "x", 4, 1.0, 4, ids=[5, 6, 7, 8]))
    records.append(rec("b", "pld", "x", 4, 0.5, 2, ids=[5, 0, 7, 8]))
    meta = {"model": "m", "dataset": "d", "prompts": 2, "repeats": 3, "generation": {"max_new_tokens": 4,
            "temperature": 0.0}, "environment": {"machine": "x", "torch": "t", "transformers": "t", "git": "g"}}
    s = summarize(records, ["ar", "pld"])
    assert s["pld"]["identical"] == "0/4"
    write_report(tmp_path, meta, s)
    md = (tmp_path / "report.md").read_text()
    assert "- pld: a at token 2 in 3 repeats, b at token 1\n" in md
