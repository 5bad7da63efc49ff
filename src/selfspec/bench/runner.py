"""``selfspec bench``: every method and peer on the same prompts, in one process, against ``ar``.

One run is three steps: :func:`plan` (validate everything cheap, read the prompts, resume the
records), :func:`run` (load the contenders, warm them up, time every (repeat, prompt, contender)
interleaved) and :func:`~selfspec.bench.analyse.analyse` (summary, the top-2 gaps where greedy ids
differ, HumanEval pass@1, cost profiles, plots, the report). One JSONL record per (prompt, method,
repeat) is appended and flushed as soon as it is measured, so an interrupted run keeps what it
finished and ``--resume`` continues it.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from tqdm.auto import tqdm

from ..errors import SelfspecError
from ..models.compiled_step import capacity_for
from ..paths import check_output_dir
from ..registry import compiled_blocks
from .datasets import Prompt, load_dataset
from .llamacpp import (
    LOSSY_PEERS,
    OPENVINO_PEERS,
    WORKER_PEERS,
    PeerFailure,
    WorkerPeer,
    engine_args,
    expand_peers,
    model_gguf,
    requant,
    require_peers,
)
from .options import BenchOptions, add_bench_args, entry_name
from .peers import PEERS, run_peer
from .provenance import Provenance, check_resumable, package_version, source_revision
from .records import PACKED, RECORDS, read_records, records_file

if TYPE_CHECKING:
    from ..generator import SpeculativeGenerator
    from ..models.runner import Runner

__all__ = ["BenchOptions", "BenchRun", "add_bench_args", "entry_name", "parse_method", "plan", "run"]


def environment() -> dict:
    """The machine and software this process measures on: machine id, versions, CPU flags and the
    selfspec source revision (``git``: the commit of a git checkout, else ``selfspec VERSION``;
    ``dirty``: tracked files differ from it, None when unknown)."""
    import transformers

    from ..core.machine import cpu_flags, machine_id

    commit, dirty = source_revision()
    return {"machine": machine_id(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(), "git": commit,
            "dirty": dirty, "selfspec": package_version(), "cpu_flags": cpu_flags()}


def _option_value(text: str) -> object:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_method(entry: str) -> tuple[str, dict]:
    """``"self-spec:draft_exit=gamma:k=8"`` -> ``("self-spec", {"draft_exit": "gamma", "k": 8})``."""
    method, *parts = entry.split(":")
    opts = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise SelfspecError(f"bad method entry '{entry}': options are written METHOD:key=value")
        opts[key.strip()] = _option_value(value.strip())
    return method.strip(), opts


def _record_key(r: dict) -> tuple:
    return (r["prompt_id"], r["method"], r["repeat"])


@dataclass
class BenchRun:
    """One bench run as it goes: what :func:`plan` decided and read, and what :func:`run` loaded
    and measured.

    Attributes:
        args: the options.
        methods: the method entries (``ar`` first); peers: the peers (llama.cpp ones expanded).
        gen: the generation settings every contender runs with.
        prompts: the prompt set; prov: where and at what revision it is measured.
        out: the output directory; done: the records so far, by (prompt id, contender, repeat).
        gguf: the GGUF the llama.cpp peers run (None without them).
        target: the loaded model's stock runner (the peers run it; every generator runs a runner
            of the same weights, one per backend).
        generators: the methods' generators by report name; backend_of / options_of: their kernels
            and options.
        backends: the kernels the generators ended on; draft_model: hf-assisted's assistant.
        meta: ``meta.json``'s content.
    """

    args: BenchOptions
    methods: list[str]
    peers: list[str]
    gen: dict
    prompts: list[Prompt]
    prov: Provenance
    out: Path
    done: dict[tuple, dict]
    gguf: Path | None = None
    target: Runner | None = None
    generators: dict[str, SpeculativeGenerator] = field(default_factory=dict)
    backend_of: dict[str, str] = field(default_factory=dict)
    options_of: dict[str, dict] = field(default_factory=dict)
    backends: list[str] = field(default_factory=list)
    draft_model: torch.nn.Module | None = None
    meta: dict = field(default_factory=dict)

    @property
    def records_path(self) -> Path:
        return self.out / RECORDS

    @property
    def names(self) -> list[str]:
        """Every contender by report name: the methods' generators, then the peers."""
        return list(self.generators) + self.peers

    @property
    def eos(self) -> list[int]:
        """The model's end-of-sequence ids, as the llama.cpp peers are given them."""
        return sorted(next(iter(self.generators.values())).eos_ids)

    @property
    def llama_names(self) -> list[str]:
        return [p for p in self.peers if p in WORKER_PEERS]

    def prompt_ids(self, p: Prompt, rep: int = 0) -> list[int]:
        """The token ids of prompt ``p`` as every contender gets them (a second MT-bench turn
        continues from ``ar``'s first answer in the same repeat)."""
        from ..decoding.text import encode_prompt

        assert self.target is not None  # loaded by load_contenders before any prompt is encoded
        text: str | list[dict] = p.text
        if "turn1_id" in p.meta:
            first = self.done[(p.meta["turn1_id"], entry_name("ar", self.backends[0]), rep)]
            answer = self.target.tokenizer.decode(first["token_ids"], skip_special_tokens=True)
            text = [{"role": "user", "content": p.turns[0]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": p.turns[1]}]
        config: Any = self.target.model.config  # a transformers config (nn.Module's attributes type as Tensor | Module)
        return encode_prompt(self.target.tokenizer, text, p.chat, config.vocab_size)


def plan(args: BenchOptions) -> BenchRun:
    """Everything checked before a model loads (peers, options, the output directory), the prompts
    read and, with ``--resume``, the earlier records (from this machine and configuration only)."""
    from ..config import GenerationConfig
    from ..registry import method_config

    methods = [m for m in dict.fromkeys(["ar", *[m.strip() for m in args.methods.split(",") if m.strip()]])]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS and p not in WORKER_PEERS:
            raise SelfspecError(f"unknown peer '{p}'; choose from {', '.join((*PEERS, *WORKER_PEERS))}")
    peers = expand_peers(peers)
    if any(p in WORKER_PEERS for p in peers):
        require_peers(peers)
        if args.temperature > 0:
            raise SelfspecError("the llama.cpp and OpenVINO peers decode greedily only: drop them or use "
                                "--temperature 0")
    if "hf-assisted" in peers and not args.draft_model:
        raise SelfspecError("peer hf-assisted needs --draft-model")
    if args.repeats < 1:
        raise SelfspecError("--repeats must be at least 1")
    check_output_dir(args.out)  # before the prompts and the model load
    gen: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, top_k=args.top_k, seed=args.seed, sampling=args.sampling)
    GenerationConfig(**gen)  # validate before loading anything
    for m in methods:
        base_method, extra = parse_method(m)
        if base_method == "auto":
            if extra:
                raise SelfspecError("auto takes no options in --methods (it chooses a method and its settings)")
            continue
        method_config(base_method, {**({} if base_method == "ar" else args.method_flags.get(base_method, {})),
                                    **extra})
    prompts = load_dataset(args.dataset, args.limit, args.turns, args.per_category)
    prov = Provenance.here(args.command_line if args.command_line is not None else sys.argv)
    b = BenchRun(args, methods, peers, gen, prompts, prov, Path(args.out), {})
    found = records_file(b.out)
    if found is not None:
        if not args.resume:
            raise SelfspecError(f"{found} exists; pass --resume to continue it or choose another --out")
        for r in read_records(b.out):  # a line cut by an interrupt is skipped
            b.done[_record_key(r)] = r
        check_resumable(b.out, args.identity(prompts, prov), list(b.done.values()))  # another machine or config
        # rewrite without the cut line, so appended records start on a line of their own (a packed run
        # is continued as plain records: pack it again when done)
        tmp = b.records_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in b.done.values()))
        tmp.replace(b.records_path)
        (b.out / PACKED).unlink(missing_ok=True)
    b.out.mkdir(parents=True, exist_ok=True)
    b.gguf = model_gguf(str(args.model), args.llama_gguf) if b.llama_names else None  # may download it once
    return b


def load_contenders(b: BenchRun) -> None:
    """The model, every method's generator on every kernels backend asked for (``auto``: as
    ``selfspec generate`` chooses), ``ar`` on every backend that ended up used, hf-assisted's
    draft model; ``meta.json`` written."""
    from ..api import load
    from ..models.loading import load_model

    args = b.args
    b.target = target = load_model(args.model, args.device, args.dtype, args.trust_remote_code)
    for backend in args.kernels.split(","):
        # auto: as `selfspec generate` chooses: each method's kernels, auto's whole configuration
        for j, m in enumerate(b.methods):
            base_method, extra = parse_method(m)
            opts = {} if base_method == "ar" else args.method_flags.get(base_method, {})
            g = load(model=target, method=base_method, self_test=j == 0, kernels=backend, **{**opts, **extra})
            # auto: named as it ran (auto→pld@stock); a method on chosen kernels: pld@onednn
            name = entry_name(g.method if base_method == "auto" else m, g.kernels)
            b.generators[name], b.backend_of[name], b.options_of[name] = g, g.kernels, {**opts, **extra}
    b.backends = list(dict.fromkeys(b.backend_of.values()))
    for backend in b.backends:  # every entry's baseline: ar on its kernels
        name = entry_name("ar", backend)
        if name not in b.generators:
            b.generators[name] = load(model=target, method="ar", self_test=False, kernels=backend)
            b.backend_of[name], b.options_of[name] = backend, {}
    if "hf-assisted" in b.peers:  # reuse a method's copy of --draft-model where one runs on stock kernels
        from ..registry import draft_model_of

        b.draft_model = cast("torch.nn.Module | None", next(
            (draft_model_of(g) for name, g in b.generators.items()
             if b.backend_of[name] == "stock" and draft_model_of(g) is not None
             and b.options_of[name].get("draft_model") == args.draft_model), None))
        if b.draft_model is None:
            assert args.draft_model is not None  # plan refuses hf-assisted without --draft-model
            b.draft_model = load_model(args.draft_model, args.device, args.dtype, args.trust_remote_code).model
    b.meta = {"model": args.model, "draft_model": args.draft_model, "dataset": args.dataset,
              "prompts": len(b.prompts), "per_category": args.per_category, "methods": b.methods,
              "kernels": b.backends, "peers": b.peers, "generation": b.gen, "repeats": args.repeats,
              "environment": environment(), "command": list(b.prov.command),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_flags": b.prov.cpu_flags,
              "identity": args.identity(b.prompts, b.prov)}
    (b.out / "meta.json").write_text(json.dumps(b.meta, indent=1))


def warm_up(b: BenchRun) -> dict[str, WorkerPeer]:
    """Every method and peer once on a short generation; the llama.cpp peers started (returned)."""
    args, warm, short = b.args, b.prompts[0], min(16, b.args.max_new_tokens)
    capacities = None  # the static caches the prompts need (compiled backend), found once
    for g in b.generators.values():
        g.generate(b.prompt_ids(warm), **dict(b.gen, max_new_tokens=short))
        if g.target.step is not None:  # compiled: every block size a method proposes compiled before timing,
            if capacities is None:  # for the cache size of every prompt
                capacities = sorted({capacity_for(len(b.prompt_ids(p)) + args.max_new_tokens) for p in b.prompts})
            choice = g.auto_choice  # auto's label names more than the method
            sizes = compiled_blocks(choice.candidate.method if choice is not None else g.method)
            s = sum(g.target.step.warm_up(c, sizes, g.drafter.needs_hidden) for c in capacities)
            s += sum(g.drafter.warm_up(c) for c in capacities)  # a draft through a compiled step of its own
            print(f"selfspec: compiled {g.method}'s step for blocks of {', '.join(map(str, sizes))} "
                  f"({', '.join(map(str, capacities))}-position caches) in {s:.0f} s", file=sys.stderr)
    # peers run b.target, the model as transformers loads it (fp32, stock kernels)
    assert b.target is not None  # loaded by load_contenders
    llama_peers: dict[str, WorkerPeer] = {}
    if b.llama_names:
        assert b.gguf is not None
        config: Any = b.target.model.config  # a transformers config (nn.Module's attributes type as Tensor | Module)
        longest = max(len(b.prompt_ids(p)) for p in b.prompts if "turn1_id" not in p.meta)
        n_ctx = -(-(args.turns * (longest + args.max_new_tokens) + 64) // 256) * 256
        llama_peers = {n: WorkerPeer(n, b.gguf, n_ctx, torch.get_num_threads(), requant=requant(n),
                                     engine=engine_args(n),
                                     # OpenVINO counts its tokenizer's vocabulary, not the model's (padded) one
                                     vocab_size=None if n in OPENVINO_PEERS else config.vocab_size)
                       for n in b.llama_names}
    for p in b.peers:
        if p in llama_peers:
            po = llama_peers[p].generate(b.prompt_ids(warm), short, b.eos)
            if isinstance(po, PeerFailure):
                print(f"selfspec: peer {p}: {po.message}", file=sys.stderr)
            continue
        run_peer(p, b.target.model, b.prompt_ids(warm), short, args.temperature, args.top_p, args.top_k, args.seed,
                 b.draft_model, args.pld_tokens)
    b.meta["peer_info"] = {n: lp.info for n, lp in llama_peers.items()}
    return llama_peers


def measure_one(b: BenchRun, name: str, pr: Prompt, rep: int, llama_peers: dict[str, WorkerPeer]) -> dict:
    """The record of one timed run of contender ``name`` on prompt ``pr`` (repeat ``rep``)."""
    from ..core.machine import LoadMonitor

    args, ids = b.args, b.prompt_ids(pr, rep)
    rec = {"prompt_id": pr.id, "category": pr.category, "method": name, "repeat": rep,
           "backend": b.backend_of.get(name, "stock"), "prompt_tokens": len(ids),
           "temperature": args.temperature, "sampling": args.sampling, "time": time.time(), **b.prov.record_fields()}
    helpers: tuple[int, ...] = ()
    if name in llama_peers and llama_peers[name].start() is None and (pid := llama_peers[name].pid):
        helpers = (pid,)  # the worker decodes for us: its CPU time is not load
    mon = LoadMonitor(helpers=helpers).start()
    if name in b.generators:
        r = b.generators[name].generate(ids, **b.gen)
        mon.stop()
        rec.update(kind="method", token_ids=r.token_ids, new_tokens=r.new_tokens, wall_s=r.wall_s,
                   draft_s=r.draft_s, verify_s=r.verify_s, prefill_s=r.prefill_s, steps=r.steps,
                   committed_per_step=r.committed_per_step, drafted_per_step=r.drafted_per_step,
                   accepted_per_step=r.accepted_per_step,
                   lossless=r.lossless, finish_reason=r.finish_reason)
    elif name in llama_peers:  # in its own process: a crash is a failed run, never a figure
        po = llama_peers[name].generate(ids, args.max_new_tokens, b.eos)
        mon.stop()
        rec.update(kind="peer", lossless=name not in LOSSY_PEERS, peer_info=llama_peers[name].info)
        if isinstance(po, PeerFailure):
            rec.update(token_ids=[], new_tokens=0, wall_s=0.0, failure=po.message)
            print(f"selfspec: peer {name} on {pr.id}: {po.message}", file=sys.stderr)
        else:
            rec.update(token_ids=po.token_ids, new_tokens=len(po.token_ids), wall_s=po.wall_s)
    else:
        assert b.target is not None  # loaded by load_contenders
        po = run_peer(name, b.target.model, ids, args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                      args.seed, b.draft_model, args.pld_tokens)
        mon.stop()
        rec.update(kind="peer", token_ids=po.token_ids, new_tokens=len(po.token_ids), wall_s=po.wall_s,
                   lossless=True)
    rec["contended"] = mon.contended  # the machine was busy with other work: a noisy timing
    return rec


def run(b: BenchRun):
    """Load, warm up and time every (repeat, prompt, contender) not yet done, interleaved; each
    record appended and flushed as it is measured. Returns the load monitor of the timed part."""
    from ..core.machine import LoadMonitor

    load_contenders(b)
    llama_peers = warm_up(b)
    names = b.names
    todo = [(rep, pr, n) for rep in range(b.args.repeats) for pr in b.prompts for n in names
            if (pr.id, n, rep) not in b.done]
    # the whole timed part (each record also gets its own); the peers' workers decode for us: their CPU
    # time is not load (counted as load, a run with llama.cpp F32 read as 32% busy on a quiet machine)
    run_load = LoadMonitor(helpers=tuple(lp.pid for lp in llama_peers.values() if lp.pid)).start()
    try:
        with open(b.records_path, "a") as f, tqdm(total=len(todo), desc="bench", unit="run") as bar:
            for rep, pr, name in todo:
                rec = measure_one(b, name, pr, rep, llama_peers)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                b.done[_record_key(rec)] = rec
                speed = f"{rec['new_tokens'] / rec['wall_s']:.1f} tok/s" if rec["wall_s"] else "failed"
                bar.set_postfix_str(f"{name} {speed}")
                bar.update()
    finally:
        for lp in llama_peers.values():
            lp.close()
    return run_load.stop()
