"""The llama.cpp peer's worker process: runs a GGUF through llama-cpp-python, away from the bench.

The bench starts this file as a script (``python llamacpp_worker.py serve GGUF ...``), so a crash
of llama.cpp (a segfault in its kernels) ends this process, never the bench, which reports it as
a crash. It imports nothing from selfspec. Protocol, one JSON object a line:

* ``serve``: after loading, the worker writes ``{"ready": true, "n_vocab": V, "desc": ..., "version": ...}``
  (or ``{"error": ...}`` and exits 1). Then, for each request ``{"ids": [...], "max_new_tokens":
  N, "eos": [...]}`` on stdin, it decodes greedily from exactly those token ids (no BOS added, no
  prefix reused from the previous request) and writes ``{"token_ids": [...], "wall_s": s}``: the
  generated ids up to and including an EOS id or ``N`` tokens, and the wall time of the prompt
  evaluation and decoding. It exits at the end of stdin.
* ``quantize SRC DST --ftype f32``: ``llama_model_quantize`` SRC into DST (F32: every tensor
  dequantised); exit 0 when DST was written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Protocol


class Backend(Protocol):
    """A loaded model that streams greedy tokens."""

    n_vocab: int
    desc: str
    version: str

    def stream(self, ids: list[int]) -> Iterator[int]:
        """Greedy tokens after exactly ``ids``, from an empty cache, without end."""


class LlamaBackend:
    """llama-cpp-python's ``Llama`` on one GGUF, decoding greedily (temperature 0, no penalties)."""

    def __init__(self, gguf: str, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.version = getattr(llama_cpp, "__version__", "?")
        buf = (llama_cpp.ctypes.c_char * 256)()
        try:
            llama_cpp.llama_model_desc(self.llm.model, buf, 256)
            self.desc = buf.value.decode(errors="replace")
        except (AttributeError, TypeError):
            self.desc = ""

    def stream(self, ids: list[int]) -> Iterator[int]:
        self.llm.reset()  # no prompt prefix reused from the previous request: every prompt is prefilled
        return self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0,
                                 reset=True)


def decode(tokens: Iterable[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The first ``max_new_tokens`` of ``tokens``, cut after the first EOS id (kept, as the bench's
    own methods keep it)."""
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    for tok in tokens:
        t = int(tok)
        out.append(t)
        if len(out) >= max_new_tokens or t in eos:
            break
    return out


def serve(load: Callable[[], Backend], stdin: IO[str], stdout: IO[str]) -> int:
    """Load a backend with ``load``, then answer requests until the end of ``stdin``."""
    try:
        backend = load()
    except Exception as e:  # noqa: BLE001 (any load failure is reported to the bench, in one line)
        stdout.write(json.dumps({"error": f"{type(e).__name__}: {e}".splitlines()[0]}) + "\n")
        stdout.flush()
        return 1
    stdout.write(json.dumps({"ready": True, "n_vocab": backend.n_vocab, "desc": backend.desc,
                             "version": backend.version}) + "\n")
    stdout.flush()
    for line in stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            t0 = time.perf_counter()
            ids = decode(backend.stream(list(req["ids"])), int(req["max_new_tokens"]), set(req.get("eos", [])))
            reply: dict = {"token_ids": ids, "wall_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001
            reply = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
    return 0


def quantize(src: str, dst: str, ftype: str) -> int:
    """``llama_model_quantize`` ``src`` to ``dst`` (requantizing a quantized model allowed)."""
    import llama_cpp

    types = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = types[ftype]
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), llama_cpp.ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llamacpp_worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("gguf")
    s.add_argument("--n-ctx", type=int, default=4096)
    s.add_argument("--threads", type=int, default=1)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("--ftype", default="f32", choices=["f32", "f16"])
    args = p.parse_args(argv)
    if args.cmd == "quantize":
        return quantize(args.src, args.dst, args.ftype)
    return serve(lambda: LlamaBackend(args.gguf, args.n_ctx, args.threads), sys.stdin, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
