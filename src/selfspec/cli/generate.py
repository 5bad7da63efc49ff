"""``selfspec generate``: stream one prompt's text through a method, with its stats line."""

from __future__ import annotations

import argparse
import json
import sys

from .common import COLOURS, RESET, add_gen_args, add_model_args, gen_kwargs, load_generator, setup, stats_line


def add_parser(sub) -> None:
    """Register ``selfspec generate`` on the subcommand set ``sub``."""
    g = sub.add_parser("generate", help="generate text, streaming it as drafts are accepted")
    add_model_args(g)
    add_gen_args(g)
    g.add_argument("--show-accepted", nargs="?", const="auto", default=None, choices=["auto", "always"],
                   help="colour tokens by the step that accepted them")
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    g.add_argument("prompt", help="the prompt text")
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup(args)
    g = load_generator(args, args.method)
    kw = gen_kwargs(args)
    if kw["chat"] and g.target.tokenizer is not None and not getattr(g.target.tokenizer, "chat_template", None):
        print(f"selfspec: {g.target.name} has no chat template (a base model): the prompt is continued as plain "
              "text; pass --no-chat to say so", file=sys.stderr)
    if args.json:
        r = g.generate(args.prompt, **kw)
        print(json.dumps(r.to_dict()))
        g.save_cost_correction()
        return 0
    colour = args.show_accepted and sys.stdout.isatty() or args.show_accepted == "always"
    try:
        for step, (piece, _) in enumerate(g.stream_steps(args.prompt, **kw)):
            if piece:
                if args.show_accepted:
                    piece = f"{COLOURS[step % len(COLOURS)]}{piece}{RESET}" if colour else f"[{piece}]"
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:  # the interruption's message on a line of its own, not after the text
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    print(stats_line(g.last_result), file=sys.stderr)
    g.save_cost_correction()
    return 0
