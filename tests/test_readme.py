"""The README's test command is what CI runs, and its demo command names a real subcommand."""

from pathlib import Path

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
