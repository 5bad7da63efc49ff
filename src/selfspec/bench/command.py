"""``selfspec bench`` end to end: :func:`~selfspec.bench.runner.plan`, then
:func:`~selfspec.bench.runner.run`, then :func:`~selfspec.bench.analyse.analyse`."""

from __future__ import annotations

import sys

from .analyse import analyse
from .options import BenchOptions
from .runner import plan, run


def run_bench(args: BenchOptions) -> int:
    """Run the benchmark ``args`` describes; 0 when done (user errors raise :class:`SelfspecError`)."""
    b = plan(args)
    run_load = run(b)
    for g in b.generators.values():  # the run's verify timings correct the cached cost profiles (next load on)
        g.save_cost_correction()
    analyse(b, run_load)
    print((b.out / "report.md").read_text())
    print(f"records: {b.records_path}", file=sys.stderr)
    return 0
