"""The peers of ``selfspec bench --concurrency`` (:mod:`selfspec.serve.concurrency`): ``transformers``
``generate`` over left-padded batches, and vLLM's CPU build through its own OpenAI server in its own
venv."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import SelfspecError

VLLM_START_S = 600.0
"""How long vLLM's server may take to load before it counts as failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """An OpenAI server in a process of its own on a free loopback port, serving the model as
    ``m``, as its users run it; ``start`` waits for ``/health`` (or raises :class:`SelfspecError`
    with the log's tail), ``stop`` ends its process group. Subclasses set :attr:`cmd` and :meth:`env`."""

    name = "the server"

    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd: list[str] = []
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "HF_HUB_OFFLINE": "1"}

    def start(self) -> None:
        import httpx

        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(),
                                         start_new_session=True)
        deadline = time.monotonic() + VLLM_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SelfspecError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SelfspecError(f"{self.name} did not start in {VLLM_START_S:.0f} s: {self.tail()}")

    def tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.exists() else []
        return " | ".join(lines[-3:])[-400:]

    def version(self) -> str:
        import httpx

        try:
            return httpx.get(self.url + "/version", timeout=5).json().get("version", "?")
        except (httpx.HTTPError, ValueError):
            return "?"

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class VllmServer(ServerProcess):
    """vLLM's OpenAI server in its own venv (``python``), fp32, the model directory ``model_dir``."""

    name = "vLLM's server"

    def __init__(self, python: str, model_dir: str, log_path: Path) -> None:
        super().__init__(log_path)
        self.cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
                    "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "m",
                    "--max-model-len", "2048", "--gpu-memory-utilization", "0.15"]

    def env(self) -> dict[str, str]:
        env = {**super().env(), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}  # the cores we use
        env.pop("PYTHONPATH", None)
        return env


class SelfspecServer(ServerProcess):
    """``selfspec serve`` with ``serve_args`` (model, method, kernels, ...), in a process of its own as
    users run it. (In the benchmark's process, which loads the model and decodes the solo runs
    itself, the server's decode thread would run beside a second OpenMP pool, whose idle workers
    make libgomp throttle every pool's spin-wait: 43 against 62 tok/s at 8 clients, 12.6 against
    20.1 at one, on a 2-core EPYC.)"""

    name = "selfspec's server"

    def __init__(self, serve_args: Sequence[str], log_path: Path) -> None:
        super().__init__(log_path)
        self.cmd = [sys.executable, "-m", "selfspec.cli", "serve", *serve_args, "--host", "127.0.0.1", "--port",
                    str(self.port), "--served-model-name", "m"]

    def get(self, path: str) -> str:
        """The body of ``GET path`` (e.g. ``/metrics``)."""
        import httpx

        return httpx.get(self.url + path, timeout=10).text


def no_eos(model, max_new_tokens: int):
    """``model``'s greedy generation config of ``max_new_tokens`` with no end-of-sequence id (an
    empty list: None falls back to the model's): ``generate`` runs past EOS, as a request with
    ``ignore_eos`` does (``min_new_tokens`` would instead forbid EOS, changing the text)."""
    import copy

    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.max_new_tokens, gc.do_sample = [], max_new_tokens, False
    return gc


def transformers_batches(generator, ids: Sequence[list[int]], batch: int, max_new_tokens: int,
                         clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[list[int]]]:
    """``generate(do_sample=False)`` of the target's stock fp32 module over left-padded batches of
    ``batch`` prompts (``ids``), exactly ``max_new_tokens`` each. Returns aggregate tok/s and each
    prompt's new ids."""
    import torch

    model, tok = generator.target.base.model, generator.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    device = next(model.parameters()).device
    out_ids: list[list[int]] = []
    wall = 0.0
    for s in range(0, len(ids), batch):
        group = ids[s:s + batch]
        width = max(len(x) for x in group)
        inp = torch.tensor([[pad] * (width - len(x)) + x for x in group], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in group], device=device)
        with torch.inference_mode():
            t0 = clock()
            out = model.generate(input_ids=inp, attention_mask=mask, pad_token_id=pad,
                                 generation_config=no_eos(model, max_new_tokens))
            wall += clock() - t0
        out_ids += [out[i, width:].tolist() for i in range(len(group))]
    return len(ids) * max_new_tokens / wall, out_ids
