"""The CPU dry run of ``scripts/gpu_check.sh`` (issue 31): the GPU check's code paths on tiny
shapes, so that the script works the first time it meets a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.matrix  # ~50 s on 2 cores: CI's second command, keeping the default tier under 10 minutes
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "SELFSPEC_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "== gpu_check summary ==" in r.stdout and (tmp_path / "gpu_check.log").is_file()
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["section_errors"] == {}
    assert report["tests"]["passed"] >= 1 and report["tests"]["failed"] == 0
    fp32 = report["halfprec"]["summary"]["float32"]
    assert fp32["errors"] == [] and fp32["identical"] == fp32["prompts"] > 0
    speed = report["speed"]["tiny-llama"]
    assert speed["ar_equals_generate"] and set(speed["T_ms"]) == {"1", "2", "4", "8"}
    assert speed["oracle"] and all(o["identical"] for o in speed["oracle"].values())
    train = report["train"]
    assert all(train[k]["returncode"] == 0 for k in ("hass-eagle2", "hass-eagle3", "sdsat-lora"))
    assert train["hass-eagle2"]["resume"] == "ok"
