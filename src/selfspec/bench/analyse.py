"""The third step of ``selfspec bench`` (after :func:`~selfspec.bench.runner.plan` and
:func:`~selfspec.bench.runner.run`): the summary against each contender's ``ar``, the target's
top-2 gap where greedy ids differ, HumanEval pass@1, the cost profiles, plots and the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..errors import SelfspecError
from .options import entry_name
from .provenance import commits_of
from .report import failure_summary, summarize, write_report

if TYPE_CHECKING:
    from ..core.machine import LoadMonitor
    from .runner import BenchRun


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


def analyse(b: BenchRun, run_load: LoadMonitor) -> dict:
    """Summarise the run's records (``meta.json``, ``report.md``, ``report.json``, plots); returns
    the summary by contender."""
    from ..core.machine import threads_hint

    meta, target, backends = b.meta, b.target, b.backends
    assert target is not None  # loaded by runner.load_contenders before anything is analysed
    names = b.names
    records = [r for r in b.done.values() if r["method"] in names and r["prompt_id"] in {p.id for p in b.prompts}]
    busy = sum(1 for r in records if r.get("contended"))
    meta["environment"]["contended"] = run_load.contended or busy > 0
    meta["load"] = dict(run_load.summary(), contended_runs=busy, runs=len(records))
    meta["commits"] = commits_of(records)  # each record keeps the revision it was measured at
    (b.out / "meta.json").write_text(json.dumps(meta, indent=1))
    if meta["environment"]["contended"]:
        print(f"selfspec: machine was busy during the timing ({busy} of {len(records)} timed runs contended; "
              f"load up to {run_load.load or 0:.1f} on {run_load.summary()['machine_cores']} cores): speedups are "
              f"noisy{threads_hint()}", file=sys.stderr)
    baselines = {n: entry_name("ar", b.backend_of[n]) for n in b.generators}
    # peers run fp32 on stock kernels: compared with ar there, else with ar on the first backend
    baselines.update(dict.fromkeys(b.peers, entry_name("ar", "stock" if "stock" in backends else backends[0])))
    failed = {r["method"] for r in records if r.get("failure")}  # a peer that crashed gets no figure at all
    ran, records = records, [r for r in records if r["method"] not in failed]
    summary = summarize(records, names, baselines)
    summary = {n: failure_summary(ran, n) if n in failed else summary[n]
               for n in names if n in failed or n in summary}
    by_id = {p.id: p for p in b.prompts}
    for name, s in summary.items():  # where greedy outputs differ: how close was the target to a tie there?
        on = target.runner(b.backend_of.get(name, "stock"))
        for d in s.get("differences", []):
            ar_rec = b.done.get((d["prompt_id"], s["baseline"], d["repeat"]))
            if ar_rec is not None:
                ctx = b.prompt_ids(by_id[d["prompt_id"]], d["repeat"]) + ar_rec["token_ids"][: d["position"]]
                d["ar_top2_gap"] = top2_gap(on.model, ctx)
    if any("problem" in p.meta for p in b.prompts):
        humaneval_scores(records, by_id, target.tokenizer, summary, b.out)
    profiles = {}
    for backend in backends:
        profile = target.runner(backend).cost_profile()
        assert profile is not None  # measured where none is cached (None only with measure=False)
        profiles[backend] = profile.to_json()
    meta["cost_profiles"] = profiles
    try:  # plots first: the report links the ones that were written
        from .plots import plot_all

        plot_all(b.out, {n: x for n, x in summary.items() if n not in failed}, records, profiles, str(b.args.model))
    except SelfspecError as e:
        print(f"selfspec: no plots: {e}", file=sys.stderr)
    write_report(b.out, meta, summary)
    return summary
