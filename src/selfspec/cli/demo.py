"""``selfspec demo``, the main job: ``ar``, a speculative method (default ``auto``) and ``transformers``
``generate`` side by side on one prompt."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .common import add_gen_args, add_model_args, gen_kwargs, kernels_label, load_generator, setup, stats_line

if TYPE_CHECKING:
    from ..generator import SpeculativeGenerator

DEMO_PROMPT = (
    "Add type hints and a docstring to this function, and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        result.append(sum(chunk) / window)\n"
    "    return result\n"
)

DEMO_RUNS = 2  # each contender runs this often, interleaved; the fastest run counts (bench/side_by_side.py)


def add_parser(sub) -> None:
    """Register ``selfspec demo`` on the subcommand set ``sub``."""
    d = sub.add_parser("demo", help="side by side: ar against a speculative method on one prompt")
    add_model_args(d)
    add_gen_args(d)
    d.add_argument("prompt", nargs="?", default=None, help="prompt (default: a code-editing prompt)")
    d.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The main job: ``ar``, a speculative method (default ``auto``) and ``transformers`` ``generate``
    side by side on the same prompt, the same model, the same number of tokens."""
    from ..bench.side_by_side import side_by_side

    setup(args)
    prompt = args.prompt or DEMO_PROMPT
    kw = gen_kwargs(args)
    if kw["seed"] is None:  # one fresh seed for every contender (each would draw its own), shown in stats
        import secrets

        kw["seed"] = secrets.randbits(31)
    spec = load_generator(args, args.method)  # auto: chooses method and kernels; ar then runs on the same kernels
    ar = load_generator(args, model=spec.target)  # the baseline
    m = side_by_side(ar, spec, prompt, kw, DEMO_RUNS)
    a, s = m.ar, m.spec
    for r in (a, s):
        print(f"===== {r.method}{'' if r.lossless else ' (NOT lossless)'} =====")
        print(r.text)
        print(stats_line(r))
        print()
    print("===== transformers generate (fp32, stock kernels) =====")
    print(f"(same token ids as {a.method})" if m.same_ids_hf
          else ar.target.tokenizer.decode(m.hf.token_ids, skip_special_tokens=True))
    print()
    print(f"model {a.model} | {a.method} and {s.method} on {kernels_label(a.kernels)} kernels | prompt "
          f"{a.prompt_tokens} tokens | {a.new_tokens} new tokens | fastest of {m.runs} runs each")
    print(f"{a.method} {a.tokens_per_s:.1f} tok/s | {s.method} {s.tokens_per_s:.1f} tok/s | transformers generate "
          f"{m.hf_tokens_per_s:.1f} tok/s")
    print(f"{s.method}: speedup {m.speedup:.2f}x over {a.method}, {m.speedup_vs_hf:.2f}x over transformers "
          f"generate | token ids identical to {a.method}: {'yes' if m.same_ids else 'NO'}, to transformers generate: "
          f"{'yes' if m.same_ids_hf else 'no (kernel rounding near a tie; see docs/performance.md)'}")
    if m.load_note:
        print(m.load_note, file=sys.stderr)
    if _compiled_left_out(args, spec):
        print("selfspec: note: auto left out the compiled step (a static-shape verify step under torch.compile), "
              "whose steps are not compiled on this machine yet: `selfspec compile` compiles them once (minutes; "
              "resumable), and auto then times it too (docs/performance.md, \"The compiled step\")"
              + measured_after_compile(spec.target.name), file=sys.stderr)
    spec.save_cost_correction()
    if kw["temperature"] == 0 and not m.same_ids and s.lossless:
        print("selfspec: error: greedy outputs differ; please report this", file=sys.stderr)
        return 1
    return 0


def measured_after_compile(model: str, family: str | None = None) -> str:
    """What the default measured after ``selfspec compile`` on this CPU family (``family``; None:
    this machine's), for the default model: a clause for the note above, from the headline runs the
    package ships (``data/measured_defaults.json``, written by ``scripts/results_to_readme.py``);
    empty when there is none for this model and family."""
    import importlib.resources
    import json

    from ..core.machine import cpu_family
    from ..paths import model_key

    data = json.loads((importlib.resources.files("selfspec") / "data" / "measured_defaults.json").read_text())
    fam = cpu_family() if family is None else family
    row = data["families"].get(fam, {}).get("compiled")
    if model_key(model) != data["model"] or not row or row.get("vs_generate") is None:
        return ""
    fresh = data["families"][fam].get("fresh") or {}
    before = (f", against {fresh['vs_generate']:.2f}x on a fresh machine" if fresh.get("vs_generate") is not None
              else "")
    return (f". On this CPU family ({fam}) the default measured {row['vs_generate']:.2f}x `transformers` `generate` "
            f"after `selfspec compile` ({row['configuration']}{before}; {row['threads']} threads, {row['run']}, "
            f"{row['date']})")


def _compiled_left_out(args: argparse.Namespace, g: SpeculativeGenerator) -> bool:
    """Whether ``auto`` chose the kernels and could not time the compiled backend because none of
    its steps were saved here (where they could be: fp32 on a CPU)."""
    choice = g.auto_choice
    if args.kernels != "auto" or choice is None or not (choice.table or choice.pruned):
        return False
    timed = [*choice.table, *choice.pruned]
    return (g.target.device.type == "cpu" and str(g.target.model.dtype) == "torch.float32"
            and not any("@compiled" in label for label in timed))
