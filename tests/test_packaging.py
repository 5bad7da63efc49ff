"""The wheel users install carries every file the package reads: each file under
``src/selfspec/data`` (skip configs, draft vocabularies, heads, adapters, prompts) is inside the
wheel built from this tree. (CI installs the tree editable, where a file left out of
``package-data`` would still be found.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "selfspec" / "data"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("tree")
    # a clean copy of what a build reads: a build/ or *.egg-info left in the tree would hand setuptools
    # files from an earlier build, and a missing pattern would go unnoticed
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(src)], capture_output=True, text=True)
    if res.returncode != 0 and "No module named" in res.stderr:
        pytest.skip(f"cannot build a wheel here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr
    (found,) = out.glob("selfspec-*.whl")
    return found


def test_every_data_file_is_in_the_wheel(wheel):
    shipped = {f"selfspec/data/{p.relative_to(DATA).as_posix()}" for p in DATA.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped, "no data files found under src/selfspec/data"
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
    missing = sorted(shipped - inside)
    assert not missing, f"the wheel lacks {len(missing)} shipped file(s), e.g. {missing[:3]}; add them to " \
                        "[tool.setuptools.package-data] in pyproject.toml"
    assert "selfspec/py.typed" in inside
