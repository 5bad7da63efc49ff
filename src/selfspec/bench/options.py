"""The options of ``selfspec bench``: its flags (:func:`add_bench_args`) and the parsed options as
data (:class:`BenchOptions`), so ``bench`` never imports the CLI."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from ..config import SAMPLING_MODES, seed_arg
from .datasets import Prompt
from .llamacpp import WORKER_PEERS
from .peers import PEERS
from .provenance import Provenance, prompts_digest


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default=BenchOptions.methods,
                   help="comma-separated methods; ar is always included. A method may carry options after colons, "
                        "to compare variants in one run: self-spec:draft_exit=gamma, pld:k=4:auto_k=false")
    p.add_argument("--peers", default=BenchOptions.peers,
                   help=f"comma-separated peers: {', '.join((*PEERS, *WORKER_PEERS))} (llama.cpp: the model's own GGUF "
                        "(lossy) and its F32 requantization, through llama-cpp-python: pip install "
                        "'selfspec[llamacpp]'; openvino: OpenVINO GenAI at f32 on the GGUF's F16 requantization (made "
                        "by llama.cpp), on the own GGUF at its default precision (lossy) and its prompt lookup: pip "
                        "install 'selfspec[openvino]' 'selfspec[llamacpp]')")
    p.add_argument("--llama-gguf", default=None, metavar="PATH",
                   help="the GGUF the llama.cpp and OpenVINO peers run (default: the model's own: a bundled model's "
                        "shipped GGUF or the .gguf --model names)")
    p.add_argument("--dataset", default=BenchOptions.dataset, help="builtin, mt-bench, humaneval or a .jsonl file")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (questions) only")
    p.add_argument("--per-category", type=int, default=None,
                   help="first N questions of every category only (a balanced subset; before --limit)")
    p.add_argument("--turns", type=int, default=BenchOptions.turns, choices=[1, 2], help="MT-bench turns (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=BenchOptions.max_new_tokens,
                   help=f"generated tokens per prompt at most (default {BenchOptions.max_new_tokens})")
    p.add_argument("--temperature", type=float, default=BenchOptions.temperature,
                   help=f"0 = greedy (default {BenchOptions.temperature:g}); > 0 samples")
    p.add_argument("--top-p", type=float, default=BenchOptions.top_p,
                   help=f"nucleus sampling mass in (0, 1] when sampling (default {BenchOptions.top_p:g} = off)")
    p.add_argument("--top-k", type=int, default=BenchOptions.top_k,
                   help=f"sample among the k most likely tokens (default {BenchOptions.top_k} = off)")
    p.add_argument("--seed", type=seed_arg, default=BenchOptions.seed,
                   help=f"seed of the sampler when sampling (default {BenchOptions.seed})")
    p.add_argument("--sampling", default=BenchOptions.sampling, choices=SAMPLING_MODES,
                   help="how our methods sample when --temperature > 0 (default coupled; see docs/sampling.md)")
    p.add_argument("--repeats", type=int, default=BenchOptions.repeats,
                   help=f"timed runs of every prompt and method (default {BenchOptions.repeats})")
    p.add_argument("--pld-tokens", type=int, default=BenchOptions.pld_tokens,
                   help="prompt_lookup_num_tokens of the hf-pld peer")
    p.add_argument("--out", default=BenchOptions.out,
                   help=f"output directory: records.jsonl, report.md, report.json, plots (default {BenchOptions.out})")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--concurrency", default=None, metavar="LEVELS",
                   help="serve the model (selfspec serve, continuous batching) and drive it with this many concurrent "
                        "OpenAI clients, e.g. 1,2,4,8: aggregate tok/s, TTFT/TPOT percentiles, identity to the solo "
                        "run, a plot (method: --methods' one entry, default auto; --limit prompts, default 16; "
                        "--peers transformers,vllm)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --concurrency --peers vllm: the Python of vLLM's own venv "
                        "(default $SELFSPEC_VLLM_PYTHON)")


@dataclass(frozen=True)
class BenchOptions:
    """The parsed options of one ``selfspec bench`` run (see :func:`add_bench_args` and the CLI's
    model flags for their meaning and defaults; :meth:`from_namespace` takes them from the parser).

    Attributes:
        method_flags: the options each method takes from the shared method flags (``--k``,
            ``--head``, ...), by method name; a ``METHOD:key=value`` entry of ``methods`` adds to
            and overrides them. Methods not in it get none.
    """

    model: str
    methods: str = "ar,pld"
    peers: str = ""
    dataset: str = "builtin"
    limit: int | None = None
    per_category: int | None = None
    turns: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    sampling: str = "coupled"
    repeats: int = 1
    pld_tokens: int = 10
    out: str = "bench-out"
    resume: bool = False
    draft_model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    kernels: str = "auto"
    trust_remote_code: bool = False
    llama_gguf: str | None = None
    method_flags: dict[str, dict] = field(default_factory=dict)
    command_line: tuple[str, ...] | None = None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, method_flags: dict[str, dict] | None = None) -> BenchOptions:
        """The options of the parsed command line ``args`` (each field from the flag of its name;
        ``command_line`` from ``args.command_line`` where the CLI set it)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if given.get("command_line") is not None:
            given["command_line"] = tuple(given["command_line"])
        return cls(**{**given, "method_flags": dict(method_flags or {})})

    def identity(self, prompts: list[Prompt], provenance: Provenance) -> dict:
        """What must match for ``--resume`` to continue a run (see
        :func:`~selfspec.bench.provenance.check_resumable`): the machine (id and CPU flags), the
        model, the prompt set (dataset, limit, per-category, turns and a digest of the prompts)
        and the generation settings."""
        return {"machine": provenance.machine, "cpu_flags": provenance.cpu_flags,
                "model": str(self.model), "draft_model": self.draft_model, "device": self.device,
                "dtype": self.dtype, "dataset": str(self.dataset), "limit": self.limit,
                "per_category": self.per_category, "turns": self.turns, "prompts": len(prompts),
                "prompts_digest": prompts_digest(prompts), "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "sampling": self.sampling}


def entry_name(method: str, backend: str) -> str:
    """Name of a method run on a kernels backend in reports: ``pld`` on stock, ``pld@int8`` else; a
    configuration ``auto`` chose names its kernels itself (``auto→self-spec@stock, draft int8``)."""
    from ..autoselect import AUTO_PREFIX

    return method if backend == "stock" or method.startswith(AUTO_PREFIX) else f"{method}@{backend}"
