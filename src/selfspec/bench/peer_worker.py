"""The worker process of the llama.cpp and OpenVINO peers: runs a GGUF through llama-cpp-python
(``--engine llama.cpp``) or OpenVINO GenAI's ``LLMPipeline`` (``--engine openvino``), away from the bench.

The bench starts this file as a script (``python peer_worker.py serve GGUF ...``), so a crash
of a peer (a segfault in its kernels) ends this process, never the bench, which reports it as
a crash. It imports nothing from selfspec. Protocol, one JSON object a line:

* ``serve``: after loading, the worker writes ``{"ready": true, "n_vocab": V, "desc": ..., "version": ...}``
  (or ``{"error": ...}`` and exits 1). Then, for each request ``{"ids": [...], "max_new_tokens":
  N, "eos": [...]}`` on stdin, it decodes greedily from exactly those token ids (no BOS added, no
  prefix reused from the previous request) and writes ``{"token_ids": [...], "wall_s": s}``: the
  generated ids up to and including an EOS id or ``N`` tokens, and the wall time of the prompt
  evaluation and decoding. It exits at the end of stdin.
* ``quantize SRC DST --ftype f32|f16|q8_0``: ``llama_model_quantize`` SRC into DST (F32: every tensor
  dequantised); exit 0 when DST was written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Protocol, cast


class Backend(Protocol):
    """A loaded model that streams greedy tokens (a backend that cannot stream instead has
    ``generate(ids, max_new_tokens, eos) -> list[int]``, cut as :func:`decode` cuts)."""

    n_vocab: int
    desc: str
    version: str

    def stream(self, ids: list[int]) -> Iterator[int]:
        """Greedy tokens after exactly ``ids``, from an empty cache, without end."""


class WholeBackend(Protocol):
    """A loaded model that cannot stream: a :class:`Backend` with ``generate`` in place of ``stream``."""

    n_vocab: int
    desc: str
    version: str

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        """Greedy tokens after exactly ``ids``, cut as :func:`decode` cuts."""


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


class OpenVinoBackend:
    """OpenVINO GenAI's ``LLMPipeline`` on one GGUF (it reads GGUF itself), on the CPU, decoding
    greedily from exactly the given token ids (``TokenizedInputs``: its own chat template and
    tokenizer are not used, so its ids compare with ``ar``'s).

    ``precision``: ``f32`` is its most exact configuration: ``INFERENCE_PRECISION_HINT`` f32, an
    f32 KV cache and no dynamic quantization of activations (its GGUF reader takes block-quantized
    and F16 GGUFs, not F32: the bench gives it the F16 requantization, see
    :data:`selfspec.bench.llamacpp._REQUANT`);
    ``default`` leaves OpenVINO's own choice (bf16 or f16
    arithmetic where the CPU has it, an 8-bit KV cache, activations quantized dynamically for
    compressed weights: lossy). ``prompt_lookup``: its
    prompt-lookup speculative decoding (``num_assistant_tokens`` drafted from n-grams of the prompt)."""

    def __init__(self, gguf: str, threads: int, precision: str = "f32", prompt_lookup: bool = False) -> None:
        import openvino as ov
        import openvino_genai as ov_genai

        self._ov, self._genai = ov, ov_genai
        props: dict = {"INFERENCE_NUM_THREADS": threads}
        if precision == "f32":
            props.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32", DYNAMIC_QUANTIZATION_GROUP_SIZE=0)
        if prompt_lookup:
            props["prompt_lookup"] = True
        self.pipe = ov_genai.LLMPipeline(gguf, "CPU", **props)
        self.prompt_lookup = prompt_lookup
        try:  # its tokenizer's vocabulary (not checked: the bench gives ids, and reading it fails on byte tokens)
            self.n_vocab = len(self.pipe.get_tokenizer().get_vocab_vector())
        except Exception:  # noqa: BLE001 - e.g. a UnicodeDecodeError on a byte-level token
            self.n_vocab = -1
        self.version = getattr(ov_genai, "__version__", "?")
        self.desc = f"openvino {precision}{' prompt-lookup' if prompt_lookup else ''}"

    def generate(self, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
        import numpy as np

        if max_new_tokens <= 0:
            return []
        cfg = self.pipe.get_generation_config()
        cfg.max_new_tokens = max_new_tokens
        cfg.do_sample = False
        cfg.repetition_penalty = 1.0
        cfg.stop_token_ids = set(eos)
        cfg.stop_strings = set()
        if self.prompt_lookup:
            cfg.num_assistant_tokens = 5
            cfg.max_ngram_size = 3
        inputs = self._genai.TokenizedInputs(self._ov.Tensor(np.array([ids], dtype=np.int64)),
                                             self._ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
        out = [int(t) for t in self.pipe.generate(inputs, cfg).tokens[0]]
        if len(out) > max_new_tokens and out[:len(ids)] == ids:  # a release that returns the prompt too
            out = out[len(ids):]
        return decode(iter(out), max_new_tokens, eos)


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


def serve(load: Callable[[], Backend | WholeBackend], stdin: IO[str], stdout: IO[str]) -> int:
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
            prompt, n, eos = list(req["ids"]), int(req["max_new_tokens"]), set(req.get("eos", []))
            whole = getattr(backend, "generate", None)
            ids = whole(prompt, n, eos) if whole is not None else decode(cast(Backend, backend).stream(prompt), n, eos)
            reply: dict = {"token_ids": ids, "wall_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001
            reply = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
    return 0


def quantize(src: str, dst: str, ftype: str) -> int:
    """``llama_model_quantize`` ``src`` to ``dst`` (requantizing a quantized model allowed)."""
    import llama_cpp

    types = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
             "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = types[ftype]
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), llama_cpp.ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peer_worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("gguf")
    s.add_argument("--n-ctx", type=int, default=4096)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--engine", default="llama.cpp", choices=["llama.cpp", "openvino"])
    s.add_argument("--precision", default="f32", choices=["f32", "default"], help="openvino only")
    s.add_argument("--prompt-lookup", action="store_true", help="openvino only")
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("--ftype", default="f32", choices=["f32", "f16", "q8_0"])
    args = p.parse_args(argv)
    if args.cmd == "quantize":
        return quantize(args.src, args.dst, args.ftype)
    if args.engine == "openvino":
        return serve(lambda: OpenVinoBackend(args.gguf, args.threads, args.precision, args.prompt_lookup),
                     sys.stdin, sys.stdout)
    return serve(lambda: LlamaBackend(args.gguf, args.n_ctx, args.threads), sys.stdin, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
