"""A stand-in for the llama.cpp worker where llama-cpp-python is absent: the real worker's
protocol (:func:`selfspec.bench.peer_worker.serve`) over greedy continuations looked up in
``$FAKE_LLAMA_TABLE`` (a JSON object from a prompt's ids, as JSON text, to the tiny model's greedy
tokens, computed by the test) so that, like llama.cpp on the same weights, its ids equal ``ar``'s;
prompts not in it get 10, 11, 12, ... It imports neither torch nor transformers, so it starts at
once. ``$FAKE_LLAMA_CRASH`` makes it die by SIGSEGV, as llama.cpp's kernels do on some CPUs:
``load`` (while loading), ``quantize`` (while requantizing) or ``token:N`` (on a prompt holding
token id N); only when the served file's name contains ``$FAKE_LLAMA_CRASH_ON`` (default: always)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator

from selfspec.bench import peer_worker

CRASH = os.environ.get("FAKE_LLAMA_CRASH", "")
CRASH_ON = os.environ.get("FAKE_LLAMA_CRASH_ON", "")


def segfault() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSEGV)


class FakeBackend:
    def __init__(self, gguf: str) -> None:
        self.crashes = CRASH_ON in os.path.basename(gguf)
        if CRASH == "load" and self.crashes:
            segfault()
        table = os.environ.get("FAKE_LLAMA_TABLE")
        self.table = json.loads(open(table).read()) if table else {}
        self.n_vocab = int(os.environ.get("FAKE_LLAMA_VOCAB", "96"))
        self.desc = f"fake {os.path.basename(gguf)}"
        self.version = "0.0-fake"

    def stream(self, ids: list[int]) -> Iterator[int]:
        if CRASH.startswith("token:") and self.crashes and int(CRASH.split(":")[1]) in ids:
            segfault()
        return iter(self.table.get(json.dumps(ids), itertools.count(10)))


def main() -> int:
    if sys.argv[1] == "quantize":
        if CRASH == "quantize":
            segfault()
        shutil.copy(sys.argv[2], sys.argv[3])
        return 0
    gguf = sys.argv[2]
    return peer_worker.serve(lambda: FakeBackend(gguf), sys.stdin, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
