"""The README's test command is what CI runs, and its demo command names a real subcommand."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_two_setup_commands_and_ci_runs_the_test_one():
    cmds = _commands()
    assert len(cmds) == 2
    demo, test = cmds
    assert "selfspec demo" in demo
    assert "pytest" in test
    assert test in (ROOT / ".ci" / "run").read_text()


def test_ci_also_runs_the_full_proof_of_losslessness():
    """The README "Tests" commands for the statistical, real-model, matrix and load tiers, and for
    the compiled tier on the public route, are in .ci/run."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Tests", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    full = [line.split("  #", 1)[0].strip() for line in block.splitlines() if "not slow" in line]
    assert len(full) == 2 and "statistical or real_model or matrix" in full[0]
    assert "SELFSPEC_COMPILE_ROUTE=public" in full[1] and '-k "compiled' in full[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert all(command in ci for command in full)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_markdown_links_stay_inside_the_repo():
    """Users have the repository, nothing beside it: no `../shared/...` references, and every
    relative link `](path)` of README.md and docs/**/*.md names a file or folder in the repo."""
    import re

    bad = []
    for md in _markdown_files():
        text = md.read_text()
        rel = md.relative_to(ROOT)
        if "../shared" in text:
            bad.append(f"{rel}: mentions ../shared")
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # http(s), mailto, ... and anchors in the same file
            path = (md.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{rel}: link to {target} (no such file in the repo)")
    assert not bad, "\n".join(bad)



@pytest.mark.parametrize("folder", ["scripts", "experiments"])
def test_a_folders_readme_names_every_file(folder):
    """scripts/README.md sorts every script (live or a recorded run), experiments/README.md lists every
    experiment: a new file must be added there."""
    text = (ROOT / folder / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / folder).iterdir())
               if p.is_file() and p.name != "README.md" and f"`{p.name}`" not in text]
    assert not missing, f"{folder}/README.md does not list {missing}"
