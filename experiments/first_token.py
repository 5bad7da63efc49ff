"""How long a new process takes to print its first generated character (issue 34's warm start:
under 10 s with a warm compile cache), and to exit. Runs ``selfspec generate`` as a user would,
``--rounds`` times, and, with ``--baseline-src DIR`` (a checkout's ``src``, for example from
``git worktree add /tmp/old HEAD~1``), interleaves the same command run on that source so both
meet the same moments of a shared machine. Prints the median and every run.

    python experiments/first_token.py --rounds 7 --baseline-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = ["generate", "--method", "ar", "--kernels", "compiled", "--max-new-tokens", "16", "Name three colours."]


def one_run(cmd: list[str], src: str | None) -> tuple[float, float]:
    """Seconds to the first byte on stdout and to the process's exit."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src  # ahead of the editable install's path
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert p.stdout is not None
    p.stdout.read(1)
    first = time.perf_counter() - t
    p.stdout.read()
    p.wait()
    return first, time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline-src", default=None, help="a checkout's src directory to interleave with this one")
    p.add_argument("--selfspec", default=str(Path(sys.executable).with_name("selfspec")))
    p.add_argument("args", nargs="*", default=DEFAULT, help="selfspec's arguments (default: %(default)s)")
    a = p.parse_args()
    trees = {"this tree": None} | ({"baseline": a.baseline_src} if a.baseline_src else {})
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for _ in range(a.rounds):
        for name, src in trees.items():
            runs[name].append(one_run([a.selfspec, *a.args], src))
    for name, rs in runs.items():
        firsts = [f for f, _ in rs]
        print(f"{name}: first character median {statistics.median(firsts):.2f} s "
              f"{[round(f, 2) for f in firsts]}; exit median {statistics.median(e for _, e in rs):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
