"""``selfspec demo``'s note on a fresh machine: what the default measured after ``selfspec compile``
on this CPU family, read from the headline runs the package ships."""

from __future__ import annotations

import importlib.resources
import json

from selfspec.cli.demo import measured_after_compile
from selfspec.core.machine import cpu_family


def _shipped() -> dict:
    return json.loads((importlib.resources.files("selfspec") / "data" / "measured_defaults.json").read_text())


def test_the_note_quotes_the_shipped_after_compile_figure_of_the_family():
    data = _shipped()
    fam, stages = next((f, s) for f, s in data["families"].items() if s.get("compiled", {}).get("vs_generate"))
    row = stages["compiled"]
    note = measured_after_compile(data["model"], fam)
    assert f"On this CPU family ({fam})" in note and f"{row['vs_generate']:.2f}x `transformers` `generate`" in note
    assert row["run"] in note and row["date"] in note and row["configuration"] in note
    if stages.get("fresh", {}).get("vs_generate") is not None:
        assert f"against {stages['fresh']['vs_generate']:.2f}x on a fresh machine" in note


def test_no_figure_for_another_model_or_an_unmeasured_family():
    data = _shipped()
    assert measured_after_compile("/models/my-own-llama", next(iter(data["families"]))) == ""
    assert measured_after_compile(data["model"], "unknown") == ""
    assert measured_after_compile(f"/somewhere/{data['model']}", "no such family") == ""


def test_cpu_family_from_flags():
    assert cpu_family("avx2+avx512f+avx512_vnni+avx512_bf16+amx_int8") == "AMX Intel Xeon"
    assert cpu_family("avx2+avx512f+avx512_vnni") == "AVX-512 VNNI"
    assert cpu_family("avx2") == "AVX2"
    assert cpu_family("avx2+avx512f+avx512_vnni", "Intel(R) Xeon(R) Processor|threads=2|torch=2.13.0+cpu") \
        == "Intel Xeon AVX-512"
    assert cpu_family("avx2+avx512f+avx512_vnni", "AMD EPYC 9R14|threads=2|torch=2.13.0+cpu") == "AVX-512 VNNI"
    assert cpu_family("") == "unknown"
