"""``selfspec demo``, the main job: ``ar``, a speculative method (default ``auto``) and ``transformers``
``generate`` side by side on one prompt."""

from __future__ import annotations

import argparse
import sys

from .common import add_gen_args, add_model_args, gen_kwargs, kernels_label, load_generator, setup, stats_line

DEMO_PROMPT = (
    "Add type hints and a docstring to this function, and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        result.append(sum(chunk) / window)\n"
    "    return result\n"
)

DEMO_RUNS = 2  # each contender runs this often, interleaved; the fastest run counts (as timeit does)


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
    from ..bench.peers import run_peer
    from ..decoding.text import encode_prompt

    setup(args)
    prompt = args.prompt or DEMO_PROMPT
    kw = gen_kwargs(args)
    if kw["seed"] is None:  # one fresh seed for every contender (each would draw its own), shown in stats
        import secrets

        kw["seed"] = secrets.randbits(31)
    spec = load_generator(args, args.method)  # auto: chooses method and kernels; ar then runs on the same kernels
    ar = load_generator(args, model=spec.target)  # the baseline
    target = ar.target
    ids = encode_prompt(target.tokenizer, prompt, kw["chat"], target.model.config.vocab_size)

    def hf_generate(max_new_tokens: int):
        target.use_kernels("stock", keep=True)  # transformers as users run it: fp32, stock kernels
        try:
            return run_peer("hf", target.model, ids, max_new_tokens, kw["temperature"], kw["top_p"], kw["top_k"],
                            kw["seed"])
        finally:
            target.use_kernels(ar.kernels, keep=True)

    warm = dict(kw, max_new_tokens=8)
    ar.generate(prompt, **warm)
    spec.generate(prompt, **warm)
    hf_generate(8)
    from ..core.machine import LoadMonitor

    with LoadMonitor() as load:  # was the machine busy before or during the timed runs?
        runs: list[tuple] = [(ar.generate(prompt, **kw), spec.generate(prompt, **kw),
                              hf_generate(kw["max_new_tokens"]))
                             for _ in range(DEMO_RUNS)]  # interleaved; the fastest run of each counts
    a, s, hf = (min((run[i] for run in runs), key=lambda r: r.wall_s) for i in range(3))
    hf_wall = hf.wall_s
    for r in (a, s):
        print(f"===== {r.method}{'' if r.lossless else ' (NOT lossless)'} =====")
        print(r.text)
        print(stats_line(r))
        print()
    same = a.token_ids == s.token_ids
    same_hf = a.token_ids == hf.token_ids  # both keep the EOS token
    hf_tps = len(hf.token_ids) / hf_wall if hf_wall > 0 else 0.0
    print("===== transformers generate (fp32, stock kernels) =====")
    print(f"(same token ids as {a.method})" if same_hf
          else target.tokenizer.decode(hf.token_ids, skip_special_tokens=True))
    print()
    print(f"model {a.model} | {a.method} and {s.method} on {kernels_label(a.kernels)} kernels | prompt "
          f"{a.prompt_tokens} tokens | {a.new_tokens} new tokens | fastest of {DEMO_RUNS} runs each")
    print(f"{a.method} {a.tokens_per_s:.1f} tok/s | {s.method} {s.tokens_per_s:.1f} tok/s | transformers generate "
          f"{hf_tps:.1f} tok/s")
    vs_hf = hf_wall * a.new_tokens / max(len(hf.token_ids), 1) / s.wall_s
    print(f"{s.method}: speedup {a.wall_s / s.wall_s:.2f}x over {a.method}, {vs_hf:.2f}x over transformers "
          f"generate | token ids identical to {a.method}: {'yes' if same else 'NO'}, to transformers generate: "
          f"{'yes' if same_hf else 'no (kernel rounding near a tie; see docs/performance.md)'}")
    if load.note():
        print(load.note(), file=sys.stderr)
    spec.save_cost_correction()
    if kw["temperature"] == 0 and not same and s.lossless:
        print("selfspec: error: greedy outputs differ; please report this", file=sys.stderr)
        return 1
    return 0
