"""The demo's measurement: every contender warmed up, then timed interleaved, the fastest run of
each kept; the ratios are computed from those runs."""

from __future__ import annotations

import selfspec
from selfspec.bench.side_by_side import side_by_side
from selfspec.models.loading import load_model


def test_side_by_side_keeps_the_fastest_interleaved_run_of_each(tiny_dir):
    target = load_model(str(tiny_dir), kernels="stock")
    ar = selfspec.load(target, "ar", self_test=False)
    spec = selfspec.load(target, "pld", self_test=False)
    calls: list[str] = []
    walls: dict[str, list[float]] = {"ar": [], "pld": []}
    for name, g in (("ar", ar), ("pld", spec)):

        def spy(*a, _real=g.generate, _name=name, **kw):
            calls.append(f"{_name}:{kw['max_new_tokens']}")
            r = _real(*a, **kw)
            if kw["max_new_tokens"] == 16:
                walls[_name].append(r.wall_s)
            return r

        g.generate = spy
    gen = dict(max_new_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=3, chat=False, ignore_eos=True)
    m = side_by_side(ar, spec, "w5 w6 w7 w8", gen, runs=3)
    assert calls == ["ar:8", "pld:8"] + ["ar:16", "pld:16"] * 3  # warm-up, then interleaved
    assert m.ar.wall_s == min(walls["ar"]) and m.spec.wall_s == min(walls["pld"])
    assert m.same_ids and m.same_ids_hf and len(m.hf.token_ids) == 16 and m.runs == 3
    assert m.speedup == m.ar.wall_s / m.spec.wall_s
    assert m.speedup_vs_hf == m.hf.wall_s / m.spec.wall_s  # same length: per token is per run
