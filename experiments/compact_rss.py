"""Resident memory of SmolLM2-135M loaded on one kernels backend, after a short decode (issue 62).

Each backend in a process of its own (``python experiments/compact_rss.py compact``; then ``onednn``,
``stock``): ``compact`` holds the GGUF blocks beside the fp32 copy, ``onednn`` a prepacked copy of
every weight beside it.
"""

from __future__ import annotations

import resource
import sys

import psutil

import selfspec


def main() -> None:
    kernels = sys.argv[1] if len(sys.argv) > 1 else "compact"
    g = selfspec.load("smollm2-135m-instruct", method="ar", kernels=kernels, progress=False, self_test=False)
    g.generate("Hello", max_new_tokens=4)
    rss = psutil.Process().memory_info().rss / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"{kernels}: RSS {rss:.0f} MiB, peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()
