"""``scripts/acceptance_curve.py`` (issue 32): accuracy-vs-tokens curves from a training run's
validations, and the tokens a method needs by the cost model, on a synthetic run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_dir(tmp_path: Path, final: bool) -> Path:
    out = tmp_path / "run"
    vals = []
    for step in (0, 8, 16, 32, 64, 128):
        lt = 0 if step == 0 else math.log10(step * 100)
        vals.append({"step": step, "acc1": 0.1 * lt, "acc2": 0.05 * lt, "acc3": 0.02 * lt})
    state = {"step": 128, "val": vals, "history": [],
             "options": {"finetune": {"val_fraction": 0.0, "batch_size": 4}}}
    if final:
        (out / "train").mkdir(parents=True)
        (out / "train" / "history.json").write_text(json.dumps(state))
    else:
        ck = out / "train" / "checkpoints" / "step_125"
        ck.mkdir(parents=True)
        (ck / "trainer_state.json").write_text(json.dumps(state))
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "selfspec_finetune.json").write_text(json.dumps({"examples": 400, "tokens": 10_000}))
    return out


def test_curve_fits_per_decade_and_finds_the_tokens_needed(tmp_path):
    run = _run_dir(tmp_path, final=False)  # read from the latest checkpoint while training goes on
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps({"methods": {"sdsat": {"forced": {"draft_cost_T1": 0.0, "verify_cost_T1": 1.0,
                                                                  "acceptance_by_depth": [0.1, 0.0, 0.0]}}}}))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "acceptance_curve.py"), "--run", f"sdsat={run}",
                        "--diagnostics", str(diag), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "out" / "curves.json").read_text())["methods"]["sdsat"]
    assert got["tokens_per_step"] == 100.0  # 10,000 tokens over 400 / 4 steps per epoch
    assert abs(got["fits"]["acc1"]["per_decade"] - 0.1) < 1e-9  # acc1 = 0.1 log10(tokens) exactly
    # tau = 1 + a1 + a1 a2 + a1 a2 a3 reaches 1.2 x (0 + 1) where a1 (1 + a2 (1 + a3)) = 0.2
    t = got["tokens_for_1.2x"]
    a1, a2, a3 = (c * math.log10(t) for c in (0.1, 0.05, 0.02))
    assert 1 + a1 + a1 * a2 + a1 * a2 * a3 >= 1.2 and t < 100 * 1.1 * 128
    assert (tmp_path / "out" / "curves.md").read_text().count("| sdsat |") == 1


def test_a_bad_run_spec_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "acceptance_curve.py"), "--run", "nodir",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "METHOD=DIR" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_keep_adds_a_run_beside_the_earlier_rows(tmp_path):
    run = _run_dir(tmp_path, final=True)
    script = [sys.executable, str(ROOT / "scripts" / "acceptance_curve.py")]
    out = tmp_path / "out"
    assert subprocess.run([*script, "--run", f"sdsat={run}", "--out", str(out)], timeout=120).returncode == 0
    r = subprocess.run([*script, "--run", f"msn={run}", "--out", str(out), "--keep"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert set(json.loads((out / "curves.json").read_text())["methods"]) == {"sdsat", "msn"}
    assert "| sdsat |" in (out / "curves.md").read_text() and "| msn |" in (out / "curves.md").read_text()
    subprocess.run([*script, "--run", f"msn={run}", "--out", str(out)], timeout=120, check=True)  # without --keep
    assert set(json.loads((out / "curves.json").read_text())["methods"]) == {"msn"}
