"""llama.cpp and OpenVINO GenAI as bench peers: what a CPU user would run instead, on the same
weights and prompt ids.

``--peers llama.cpp`` runs two peers through llama-cpp-python (the optional extra
``selfspec[llamacpp]``): ``llama.cpp`` on the model's own GGUF (a bundled model's shipped GGUF,
the ``.gguf`` file the model was loaded from, or ``--llama-gguf``) and ``llama.cpp-f32`` on that
GGUF requantized to F32 with ``llama_model_quantize`` (cached in ``$SELFSPEC_HOME/gguf``), and
``llama.cpp-q8_0`` on its Q8_0 requantization (**lossy**); ``--peers llama.cpp-f32`` runs only the
F32 one. ``--peers openvino`` (the extra ``selfspec[openvino]``) runs OpenVINO GenAI's
``LLMPipeline``, which reads GGUF itself (block-quantized types and F16; not F32: "Unsupported
quantization type") three ways: ``openvino-f32`` (its most exact: f32 arithmetic, f32 KV cache, no
dynamic quantization of activations, on the GGUF's F16 requantization: our fp32 weights rounded to
f16; on SmolLM2's own Q4_1 blocks OpenVINO computes another function, its ids apart from ours from
the first tokens), ``openvino`` (OpenVINO's default precision on the model's own GGUF: **lossy**)
and ``openvino-pld`` (its prompt-lookup speculative decoding, as ``openvino-f32``). The model's own
quantized GGUF on llama.cpp and OpenVINO's default precision change the weights or the arithmetic:
reports label them lossy (:data:`LOSSY_PEERS`). They all
decode greedily from the bench's own prompt token ids (chat template applied by our tokenizer; no
BOS added, no prompt prefix reused between prompts), so their ids compare with ``ar``'s.

Each peer runs in a worker process (:mod:`selfspec.bench.peer_worker`): a crash of llama.cpp
(its quantized kernels segfault on some CPUs) ends the worker, and the bench records that run as
failed, with the signal, and reports the peer as crashed instead of a figure. The next prompt
starts a fresh worker; a worker that cannot load the GGUF is not started again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import SelfspecError, missing_dependency
from ..paths import selfspec_home
from .peers import PeerOutput

log = logging.getLogger(__name__)

LLAMA_CPP = "llama.cpp"
LLAMA_CPP_F32 = "llama.cpp-f32"
LLAMA_CPP_Q8 = "llama.cpp-q8_0"
LLAMA_PEERS = (LLAMA_CPP, LLAMA_CPP_F32, LLAMA_CPP_Q8)
OPENVINO = "openvino"
OPENVINO_PEERS = ("openvino-f32", OPENVINO, "openvino-pld")
WORKER_PEERS = (*LLAMA_PEERS, *OPENVINO_PEERS)
"""The peers that run in a worker process (:class:`WorkerPeer`), on a GGUF."""
LOSSY_PEERS = (LLAMA_CPP, LLAMA_CPP_Q8, OPENVINO)
"""Peers that do not compute what the model's fp32 weights compute: llama.cpp on the model's own
quantized GGUF or its Q8_0 requantization (and their 8-bit activations), OpenVINO at its default
precision (bf16/f16 arithmetic, compressed weights). Reports label them lossy."""
WORKER = Path(__file__).with_name("peer_worker.py")
_ENGINE_ARGS = {"openvino-f32": ["--engine", "openvino", "--precision", "f32"],
                OPENVINO: ["--engine", "openvino", "--precision", "default"],
                "openvino-pld": ["--engine", "openvino", "--precision", "f32", "--prompt-lookup"]}
_REQUANT = {LLAMA_CPP_F32: "f32", LLAMA_CPP_Q8: "q8_0", "openvino-f32": "f16", "openvino-pld": "f16"}
"""The type each peer's GGUF is requantized to first (by llama.cpp). OpenVINO refuses F32 GGUFs, and
decompresses SmolLM2's Q4_1 blocks into another function (ids apart from ``ar``'s from the first
tokens on 10 of 10 prompts); on the F16 requantization at f32 precision its ids equal ``ar``'s (10
of 10, 2026-11-30, AVX2): F16 holds the Q4_1 values up to f16 rounding."""


def expand_peers(peers: list[str]) -> list[str]:
    """``llama.cpp`` stands for the three llama.cpp peers (own GGUF, F32, Q8_0), ``openvino`` for
    the three OpenVINO peers; other names are kept."""
    groups = {LLAMA_CPP: LLAMA_PEERS, OPENVINO: OPENVINO_PEERS}
    out: list[str] = []
    for p in peers:
        out += list(groups.get(p, [p]))
    return list(dict.fromkeys(out))


def engine_args(peer: str) -> list[str]:
    """The worker's options that select ``peer``'s engine and precision (none: llama.cpp)."""
    return list(_ENGINE_ARGS.get(peer, []))


def requant(peer: str) -> str | None:
    """The type (``f32``, ``f16``, ``q8_0``) ``peer`` requantizes the model's GGUF to (with llama.cpp)
    before it runs it, or None: it runs the GGUF as shipped."""
    return _REQUANT.get(peer)


def require_llama_cpp(purpose: str = "the bench peer llama.cpp") -> None:
    """One-line error, with the install command, unless llama-cpp-python is installed (it is not
    imported here: only the worker process loads it)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise missing_dependency("llama-cpp-python", "llamacpp", purpose)


def require_peers(peers: list[str]) -> None:
    """One-line error, with the install command, unless what ``peers`` need is installed:
    OpenVINO GenAI for the OpenVINO peers, llama-cpp-python for the llama.cpp peers and for any
    requantized GGUF (the OpenVINO f32 peers' F16 one); neither is imported here."""
    if any(p in OPENVINO_PEERS for p in peers) and importlib.util.find_spec("openvino_genai") is None:
        raise missing_dependency("openvino-genai", "openvino", "the bench peer openvino")
    if any(p in LLAMA_PEERS for p in peers):
        require_llama_cpp()
    for p in peers:
        kind = requant(p)
        if kind is not None:
            require_llama_cpp(f"the bench peer {p} (its {kind.upper()} GGUF is made by llama.cpp)")


def model_gguf(model: str, given: str | None = None) -> Path:
    """The model's own GGUF: ``given`` (``--llama-gguf``), the ``.gguf`` file ``model`` names, or a
    bundled model's shipped GGUF (downloaded again once; see
    :func:`selfspec.models.bundled.original_gguf`)."""
    from ..models import bundled

    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise SelfspecError(f"--llama-gguf {given}: no such file")
        return path
    if str(model).endswith(".gguf") and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    if model in bundled.BUNDLED:
        return bundled.original_gguf(model)
    raise SelfspecError(f"the llama.cpp peer runs the model's own GGUF, and {model} has none known: pass "
                        "--llama-gguf PATH (a GGUF of the same weights and tokenizer)")


def requant_path(src: Path, ftype: str = "f32") -> Path:
    """Where the ``ftype`` requantization of ``src`` is cached (keyed by its path, size and mtime)."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return selfspec_home() / "gguf" / f"{src.stem}-{key}.{ftype}.gguf"


def describe_exit(returncode: int) -> str:
    """``SIGSEGV`` for a process killed by a signal, ``exit status N`` otherwise."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


@dataclass(frozen=True)
class PeerFailure:
    """A peer run that produced no output: ``message`` says why (a crash names its signal)."""

    message: str


@dataclass
class WorkerPeer:
    """One llama.cpp or OpenVINO peer: a GGUF served by a worker process, restarted after a crash.

    Attributes:
        name: the peer's name in records (one of :data:`WORKER_PEERS`).
        gguf: the model's own GGUF.
        n_ctx: context size for the worker (prompt plus generated tokens must fit).
        threads: llama.cpp threads (the bench's torch threads, so both use the same cores).
        requant: requantize ``gguf`` to this type first (``f32``, ``q8_0``; :func:`requant`) and run that.
        engine: the worker's options for the engine and its precision (:func:`engine_args`).
        vocab_size: the model's vocabulary size; a GGUF of another size is refused as another model.
        command: how to start the worker (tests start a fake one).
    """

    name: str
    gguf: Path
    n_ctx: int
    threads: int
    requant: str | None = None
    engine: list[str] = field(default_factory=list)
    vocab_size: int | None = None
    command: list[str] = field(default_factory=lambda: [sys.executable, str(WORKER)])
    info: dict = field(default_factory=dict)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _stderr: IO[str] | None = field(default=None, repr=False)
    _dead: PeerFailure | None = field(default=None, repr=False)

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        lines = [x.strip() for x in self._stderr.read().splitlines() if x.strip()]
        return f": {lines[-1][:200]}" if lines else ""

    def _weights(self) -> Path | PeerFailure:
        """The GGUF to run: the own one, or its requantization (made once, in a worker)."""
        if not self.requant:
            return self.gguf
        kind = self.requant.upper()
        out = requant_path(self.gguf, self.requant)
        if out.is_file():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SelfspecError(f"cannot write the {kind} GGUF to {out.parent} ({e.strerror or e}); set SELFSPEC_HOME "
                                "to a writable directory") from e
        log.info("requantizing %s to %s -> %s", self.gguf, kind, out)
        print(f"selfspec: requantizing {self.gguf.name} to {kind} for the {self.name} peer (once) ...", file=sys.stderr)
        tmp = out.with_suffix(".tmp")
        r = subprocess.run([*self.command, "quantize", str(self.gguf), str(tmp), "--ftype", self.requant],
                           capture_output=True, text=True)
        if r.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            tail = [x for x in (r.stderr or "").splitlines() if x.strip()][-1:]
            return PeerFailure(f"{self.name}: requantizing {self.gguf.name} to {kind} failed "
                               f"({describe_exit(r.returncode)}){': ' + tail[0][:200] if tail else ''}")
        tmp.replace(out)
        return out

    @property
    def pid(self) -> int | None:
        """The worker process's id while it runs (its CPU time is the bench's own, not load)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> PeerFailure | None:
        """Start the worker (after requantizing, for F32) and wait until it has loaded the GGUF;
        a failure to load is kept, and every later run of this peer reports it."""
        if self._dead is not None:
            return self._dead
        if self._proc is not None:
            return None
        weights = self._weights()
        if isinstance(weights, PeerFailure):
            self._dead = weights
            return weights
        if self._stderr is not None:  # the previous worker's, after a crash
            self._stderr.close()
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [*self.command, "serve", str(weights), "--n-ctx", str(self.n_ctx), "--threads", str(self.threads),
             *self.engine],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
        assert self._proc.stdout is not None  # stdout=PIPE
        line = self._proc.stdout.readline()
        hello = json.loads(line) if line.strip() else None
        if hello is None or "error" in hello:
            rc = self._proc.wait()
            why = (f"could not load it: {hello['error']}" if hello
                   else f"crashed ({describe_exit(rc)}){self._stderr_tail()}")
            self._dead = PeerFailure(f"{self.name} on {weights.name}: {why}")
            self._proc = None
            return self._dead
        if self.vocab_size is not None and hello.get("n_vocab") != self.vocab_size:
            self.close()
            self._dead = PeerFailure(f"{self.name}: {weights.name} has a vocabulary of {hello.get('n_vocab')} tokens, "
                                     f"the model {self.vocab_size}: not the same model")
            return self._dead
        engine = "openvino" if "openvino" in self.engine else "llama.cpp"
        self.info = {"gguf": str(weights), "desc": hello.get("desc", ""), "engine": engine,
                     "version": hello.get("version", ""), "lossy": self.name in LOSSY_PEERS,
                     "n_ctx": self.n_ctx, "threads": self.threads}
        return None

    def generate(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> PeerOutput | PeerFailure:
        """Greedy ids after ``ids`` and the worker's wall time, or why there are none (a crash
        ends the worker; the next call starts a fresh one)."""
        failed = self.start()
        if failed is not None:
            return failed
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        req = {"ids": list(ids), "max_new_tokens": max_new_tokens, "eos": sorted(eos)}
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line.strip():
            rc = self._proc.wait()
            tail = self._stderr_tail()
            self._proc = None
            return PeerFailure(f"{self.name} crashed ({describe_exit(rc)}) on a prompt of {len(ids)} tokens{tail}")
        reply = json.loads(line)
        if "error" in reply:
            return PeerFailure(f"{self.name} failed: {reply['error']}")
        return PeerOutput(list(reply["token_ids"]), float(reply["wall_s"]))

    def close(self) -> None:
        """End the worker (closing its stdin ends it)."""
        if self._proc is not None:
            try:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
