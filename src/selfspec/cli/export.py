"""``selfspec export``: a trained draft head as the EAGLE draft vLLM, SGLang or SafeAILab EAGLE loads."""

from __future__ import annotations

import argparse

from ..errors import SelfspecError


def add_parser(sub) -> None:
    """Register ``selfspec export`` on the subcommand set ``sub``."""
    ex = sub.add_parser("export", help="export a trained draft head as the EAGLE draft vLLM, SGLang or EAGLE loads")
    ex.add_argument("head", metavar="HEAD",
                    help="a head directory (selfspec train hass), or eagle2 / hass: the model's installed head")
    ex.add_argument("--model", required=True, help="its target model (checks, and the embedding for EAGLE)")
    ex.add_argument("--engine", required=True, choices=["vllm", "sglang", "eagle"],
                    help="the loader to write for: vllm, sglang or eagle (SafeAILab EAGLE's cnets1.py)")
    ex.add_argument("--out", required=True, help="output directory")
    ex.add_argument("--dtype", choices=["fp16", "bf16"], default=None,
                    help="serving dtype of the weights (default: the target checkpoint's if bf16, else fp16)")
    ex.add_argument("--with-embeddings", action="store_true",
                    help="also write embed_tokens.weight (--engine eagle only; vLLM and SGLang use the target's)")
    ex.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    ex.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    ex.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write a trained head as an EAGLE-1/2 draft that vLLM, SGLang or SafeAILab EAGLE loads."""
    from pathlib import Path

    from ..drafters.eagle import EAGLE2, HASS
    from ..heads import find_head_dir
    from ..heads.export import check_export_dir, default_dtype, export_head, serve_hint
    from ..models.loading import load_model

    check_export_dir(args.out, args.force)  # before the model loads
    target = load_model(args.model, "cpu", "float32", args.trust_remote_code)
    head = args.head
    if head in (EAGLE2.name, HASS.name) and not Path(head).is_dir():  # the model's installed head
        found = find_head_dir(target.name, head)
        if found is None:
            raise SelfspecError(f"no trained {head} head for model '{target.name}': train one with `selfspec train "
                                f"hass --model {target.name} --out DIR` and pass DIR")
        head = str(found)
    dtype = args.dtype or default_dtype(target.path)
    res = export_head(head, target.model, args.engine, args.out, dtype, args.with_embeddings, args.force)
    print(f"{args.engine} EAGLE draft: {res.out} ({', '.join(res.files)}; {res.dtype})")
    hint = serve_hint(res, str(target.path or target.name), target.path)
    for note in [*(f"note: {n}" for n in res.notes), *(h for h in hint if h.startswith("note:"))]:
        print(note)  # what needs doing first, then the command
    for line in hint:
        if not line.startswith("note:"):
            print(line)
    return 0
