"""``selfspec bench``: every method and peer on the same prompts, in one process, against ``ar``.

One JSONL record per (prompt, method, repeat) is appended and flushed as soon as it is measured,
so an interrupted run keeps what it finished and ``--resume`` continues it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import SAMPLING_MODES, seed_arg
from ..errors import SelfspecError
from ..paths import check_output_dir
from .datasets import Prompt, load_dataset
from .llamacpp import LLAMA_PEERS, LlamaCppPeer, PeerFailure, expand_peers, model_gguf, require_llama_cpp
from .peers import PEERS, run_peer
from .provenance import Provenance, check_resumable, commits_of, package_version, prompts_digest, source_revision
from .report import failure_summary, summarize, write_report


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default=BenchOptions.methods,
                   help="comma-separated methods; ar is always included. A method may carry options after colons, "
                        "to compare variants in one run: self-spec:draft_exit=gamma, pld:k=4:auto_k=false")
    p.add_argument("--peers", default=BenchOptions.peers,
                   help=f"comma-separated peers: {', '.join((*PEERS, *LLAMA_PEERS))} (llama.cpp: the model's own GGUF "
                        "and its F32 requantization, through llama-cpp-python: pip install 'selfspec[llamacpp]')")
    p.add_argument("--llama-gguf", default=None, metavar="PATH",
                   help="the GGUF the llama.cpp peers run (default: the model's own: a bundled model's shipped GGUF "
                        "or the .gguf --model names)")
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
    for cast in (int, float):
        try:
            return cast(text)
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


def entry_name(method: str, backend: str) -> str:
    """Name of a method run on a kernels backend in reports: ``pld`` on stock, ``pld@int8`` else; a
    configuration ``auto`` chose names its kernels itself (``auto→self-spec@stock, draft int8``)."""
    from ..autoselect import AUTO_PREFIX

    return method if backend == "stock" or method.startswith(AUTO_PREFIX) else f"{method}@{backend}"


def _record_key(r: dict) -> tuple:
    return (r["prompt_id"], r["method"], r["repeat"])


@torch.inference_mode()
def top2_gap(model: torch.nn.Module, ids: list[int]) -> float:
    """Gap between the target's two largest logits after ``ids`` (a near-tie when tiny)."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def humaneval_scores(records: list[dict], prompts: dict, tokenizer, summary: dict, out: Path) -> None:
    """pass@1 of every method's completions (repeat 0), run by the sandboxed harness; identical
    completions are executed once."""
    from .humaneval import check, truncate_completion

    cache: dict[tuple[str, str], bool] = {}
    rows = [r for r in records if r["repeat"] == 0]
    results = []
    for r in tqdm(rows, desc="humaneval", unit="completion"):
        completion = truncate_completion(tokenizer.decode(r["token_ids"], skip_special_tokens=True))
        key = (r["prompt_id"], completion)
        if key not in cache:
            cache[key] = check(prompts[r["prompt_id"]].meta["problem"], completion)["passed"]
        results.append({"prompt_id": r["prompt_id"], "method": r["method"], "passed": cache[key]})
    with open(out / "humaneval.jsonl", "w") as f:
        for x in results:
            f.write(json.dumps(x) + "\n")
    for name, s in summary.items():
        mine = [x["passed"] for x in results if x["method"] == name]
        if mine:
            s["pass@1"] = sum(mine) / len(mine)


def run_bench(args: BenchOptions) -> int:
    """Run the benchmark ``args`` describes; 0 when done (user errors raise :class:`SelfspecError`)."""
    from ..api import load
    from ..config import GenerationConfig

    methods = [m for m in dict.fromkeys(["ar", *[m.strip() for m in args.methods.split(",") if m.strip()]])]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS and p not in LLAMA_PEERS:
            raise SelfspecError(f"unknown peer '{p}'; choose from {', '.join((*PEERS, *LLAMA_PEERS))}")
    peers = expand_peers(peers)
    llama_names = [p for p in peers if p in LLAMA_PEERS]
    if llama_names:
        require_llama_cpp()
        if args.temperature > 0:
            raise SelfspecError("the llama.cpp peers decode greedily only: drop them or use --temperature 0")
    if "hf-assisted" in peers and not args.draft_model:
        raise SelfspecError("peer hf-assisted needs --draft-model")
    if args.repeats < 1:
        raise SelfspecError("--repeats must be at least 1")
    check_output_dir(args.out)  # before the prompts and the model load
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               top_k=args.top_k, seed=args.seed, sampling=args.sampling)
    GenerationConfig(**gen)  # validate before loading anything
    from ..registry import method_config

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
    identity = args.identity(prompts, prov)

    out = Path(args.out)
    records_path = out / "records.jsonl"
    done: dict[tuple, dict] = {}
    if records_path.exists():
        if not args.resume:
            raise SelfspecError(f"{records_path} exists; pass --resume to continue it or choose another --out")
        with open(records_path) as f:
            for line in f:
                if line.strip():
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by an interrupt
                    done[_record_key(r)] = r
        check_resumable(out, identity, list(done.values()))  # refuses another machine or configuration
        # rewrite without the cut line, so appended records start on a line of their own
        tmp = records_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
        tmp.replace(records_path)
    out.mkdir(parents=True, exist_ok=True)
    gguf = model_gguf(str(args.model), args.llama_gguf) if llama_names else None  # may download it once

    from ..models.loading import load_model

    backends = args.kernels.split(",")
    generators: dict = {}
    backend_of: dict[str, str] = {}
    options_of: dict[str, dict] = {}  # the options each generator was loaded with
    target = load_model(args.model, args.device, args.dtype, args.trust_remote_code)
    for b in backends:
        chosen = b == "auto"  # as `selfspec generate` chooses: each method's kernels, auto's whole configuration
        if not chosen:
            target.use_kernels(b, keep=True)
        for j, m in enumerate(methods):
            base_method, extra = parse_method(m)
            opts = {} if base_method == "ar" else args.method_flags.get(base_method, {})
            g = load(model=target, method=base_method, self_test=j == 0, kernels="auto" if chosen else None,
                     **{**opts, **extra})
            # auto: named as it ran (auto→pld@stock); a method on chosen kernels: pld@onednn
            name = entry_name(g.method if base_method == "auto" else m, g.kernels)
            generators[name] = g
            backend_of[name] = g.kernels
            options_of[name] = {**opts, **extra}
    backends = list(dict.fromkeys(backend_of.values()))
    for b in backends:  # every entry's baseline: ar on its kernels
        if entry_name("ar", b) not in generators:
            target.use_kernels(b, keep=True)
            generators[entry_name("ar", b)] = load(model=target, method="ar", self_test=False)
            backend_of[entry_name("ar", b)] = b
            options_of[entry_name("ar", b)] = {}
    target.use_kernels("stock", keep=True)
    draft_model = None
    if "hf-assisted" in peers:  # reuse a method's copy of --draft-model where one runs on stock kernels
        from ..registry import draft_model_of

        draft_model = next((draft_model_of(g) for name, g in generators.items()
                            if backend_of[name] == "stock" and draft_model_of(g) is not None
                            and options_of[name].get("draft_model") == args.draft_model), None)
        if draft_model is None:
            draft_model = load_model(args.draft_model, args.device, args.dtype, args.trust_remote_code).model

    meta = {"model": args.model, "draft_model": args.draft_model, "dataset": args.dataset, "prompts": len(prompts),
            "per_category": args.per_category,
            "methods": methods, "kernels": backends, "peers": peers, "generation": gen, "repeats": args.repeats,
            "environment": environment(), "command": list(prov.command), "identity": identity}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))

    def prompt_ids(p: Prompt, rep: int = 0) -> list[int]:
        from ..decoding.text import encode_prompt

        text: object = p.text
        if "turn1_id" in p.meta:  # second turn: the conversation continues from ar's first answer
            first = done[(p.meta["turn1_id"], entry_name("ar", backends[0]), rep)]
            answer = target.tokenizer.decode(first["token_ids"], skip_special_tokens=True)
            text = [{"role": "user", "content": p.turns[0]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": p.turns[1]}]
        return encode_prompt(target.tokenizer, text, p.chat, target.model.config.vocab_size)

    # warm-up: every method and peer once on a short generation
    warm = prompts[0]
    for g in generators.values():
        g.generate(prompt_ids(warm), **dict(gen, max_new_tokens=min(16, args.max_new_tokens)))
    target.use_kernels("stock", keep=True)  # peers run the model as transformers loads it (fp32, stock)
    eos = sorted(next(iter(generators.values())).eos_ids)
    llama_peers: dict[str, LlamaCppPeer] = {}
    if llama_names:
        assert gguf is not None
        longest = max(len(prompt_ids(p)) for p in prompts if "turn1_id" not in p.meta)
        n_ctx = -(-(args.turns * (longest + args.max_new_tokens) + 64) // 256) * 256
        llama_peers = {n: LlamaCppPeer(n, gguf, n_ctx, torch.get_num_threads(), f32=n != LLAMA_PEERS[0],
                                       vocab_size=target.model.config.vocab_size) for n in llama_names}
    for p in peers:
        if p in llama_peers:
            po = llama_peers[p].generate(prompt_ids(warm), min(16, args.max_new_tokens), eos)
            if isinstance(po, PeerFailure):
                print(f"selfspec: peer {p}: {po.message}", file=sys.stderr)
            continue
        run_peer(p, target.model, prompt_ids(warm), min(16, args.max_new_tokens), args.temperature, args.top_p,
                 args.top_k, args.seed, draft_model, args.pld_tokens)
    meta["peer_info"] = {n: lp.info for n, lp in llama_peers.items()}

    names = list(generators) + peers
    todo = [(rep, pr, n) for rep in range(args.repeats) for pr in prompts for n in names
            if (pr.id, n, rep) not in done]
    from ..core.machine import LoadMonitor

    run_load = LoadMonitor().start()  # the whole timed part; each record also gets its own
    try:
        with open(records_path, "a") as f, tqdm(total=len(todo), desc="bench", unit="run") as bar:
            for rep, pr, name in todo:
                ids = prompt_ids(pr, rep)
                rec = {"prompt_id": pr.id, "category": pr.category, "method": name, "repeat": rep,
                       "backend": backend_of.get(name, "stock"), "prompt_tokens": len(ids),
                       "temperature": args.temperature, "sampling": args.sampling,
                       "time": time.time(), **prov.record_fields()}
                helpers: tuple[int, ...] = ()
                if name in llama_peers and llama_peers[name].start() is None and llama_peers[name].pid:
                    helpers = (llama_peers[name].pid,)  # the worker decodes for us: its CPU time is not load
                mon = LoadMonitor(helpers=helpers).start()
                if name in generators:
                    r = generators[name].generate(ids, **gen)
                    mon.stop()
                    rec.update(kind="method", token_ids=r.token_ids, new_tokens=r.new_tokens, wall_s=r.wall_s,
                               draft_s=r.draft_s, verify_s=r.verify_s, prefill_s=r.prefill_s, steps=r.steps,
                               committed_per_step=r.committed_per_step, drafted_per_step=r.drafted_per_step,
                               lossless=r.lossless,
                               finish_reason=r.finish_reason)
                elif name in llama_peers:  # in its own process: a crash is a failed run, never a figure
                    po = llama_peers[name].generate(ids, args.max_new_tokens, eos)
                    mon.stop()
                    rec.update(kind="peer", lossless=True, peer_info=llama_peers[name].info)
                    if isinstance(po, PeerFailure):
                        rec.update(token_ids=[], new_tokens=0, wall_s=0.0, failure=po.message)
                        print(f"selfspec: peer {name} on {pr.id}: {po.message}", file=sys.stderr)
                    else:
                        rec.update(token_ids=po.token_ids, new_tokens=len(po.token_ids), wall_s=po.wall_s)
                else:
                    target.use_kernels("stock", keep=True)
                    po = run_peer(name, target.model, ids, args.max_new_tokens, args.temperature, args.top_p,
                                  args.top_k, args.seed, draft_model, args.pld_tokens)
                    mon.stop()
                    rec.update(kind="peer", token_ids=po.token_ids, new_tokens=len(po.token_ids), wall_s=po.wall_s,
                               lossless=True)
                rec["contended"] = mon.contended  # the machine was busy with other work: a noisy timing
                f.write(json.dumps(rec) + "\n")
                f.flush()
                done[_record_key(rec)] = rec
                speed = f"{rec['new_tokens'] / rec['wall_s']:.1f} tok/s" if rec["wall_s"] else "failed"
                bar.set_postfix_str(f"{name} {speed}")
                bar.update()
    finally:
        for lp in llama_peers.values():
            lp.close()

    run_load.stop()
    for g in generators.values():  # the run's verify timings correct the cached cost profiles (next load on)
        g.save_cost_correction()
    from ..core.machine import threads_hint

    records = [r for r in done.values() if r["method"] in names and r["prompt_id"] in {p.id for p in prompts}]
    busy = sum(1 for r in records if r.get("contended"))
    meta["environment"]["contended"] = run_load.contended or busy > 0
    meta["load"] = dict(run_load.summary(), contended_runs=busy, runs=len(records))
    meta["commits"] = commits_of(records)  # each record keeps the revision it was measured at
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    if meta["environment"]["contended"]:
        print(f"selfspec: machine was busy during the timing ({busy} of {len(records)} timed runs contended; "
              f"load up to {run_load.load or 0:.1f} on {run_load.summary()['machine_cores']} cores): speedups are "
              f"noisy{threads_hint()}", file=sys.stderr)
    baselines = {n: entry_name("ar", backend_of[n]) for n in generators}
    # peers run fp32 on stock kernels: compared with ar there, else with ar on the first backend
    baselines.update(dict.fromkeys(peers, entry_name("ar", "stock" if "stock" in backends else backends[0])))
    failed = {r["method"] for r in records if r.get("failure")}  # a peer that crashed gets no figure at all
    ran, records = records, [r for r in records if r["method"] not in failed]
    summary = summarize(records, names, baselines)
    summary = {n: failure_summary(ran, n) if n in failed else summary[n]
               for n in names if n in failed or n in summary}
    by_id = {p.id: p for p in prompts}
    for name, s in summary.items():  # where greedy outputs differ: how close was the target to a tie there?
        target.use_kernels(backend_of.get(name, "stock"), keep=True)
        for d in s.get("differences", []):
            ar_rec = done.get((d["prompt_id"], s["baseline"], d["repeat"]))
            if ar_rec is not None:
                ctx = prompt_ids(by_id[d["prompt_id"]], d["repeat"]) + ar_rec["token_ids"][: d["position"]]
                d["ar_top2_gap"] = top2_gap(target.model, ctx)
    if any("problem" in p.meta for p in prompts):
        humaneval_scores(records, by_id, target.tokenizer, summary, out)
    from ..core.cost import load_or_measure

    profiles = {}
    for b in backends:
        target.use_kernels(b, keep=True)
        profiles[b] = load_or_measure(target.model, target.name, b).to_json()
    meta["cost_profiles"] = profiles
    try:  # plots first: the report links the ones that were written
        from .plots import plot_all

        plot_all(out, {n: x for n, x in summary.items() if n not in failed}, records, profiles, str(args.model))
    except SelfspecError as e:
        print(f"selfspec: no plots: {e}", file=sys.stderr)
    write_report(out, meta, summary)
    print((out / "report.md").read_text())
    print(f"records: {records_path}", file=sys.stderr)
    return 0
