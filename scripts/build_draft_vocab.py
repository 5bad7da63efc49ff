"""Build a model's token ranking for reduced draft vocabularies (resumable).

    python scripts/build_draft_vocab.py --model smollm2-135m-instruct [--out PATH] [--ship]

Writes ``$SELFSPEC_HOME/draft_vocab/<model>.json`` (``--ship``: ``src/selfspec/data/draft_vocab/``).
The target's answers are cached in ``$SELFSPEC_HOME/draft_vocab/<model>-answers.jsonl`` as they are
made, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfspec.models.draft_vocab import user_ranking_path
from selfspec.models.loading import load_model
from selfspec.paths import model_key
from selfspec.train.draft_vocab import build_ranking, write_ranking


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=200, help="ShareGPT prompts the target answers (default 200)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prior-convs", type=int, default=1500)
    ap.add_argument("--kernels", default="stock", help="backend for the self-distillation (int8 is fine: counts only)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ship", action="store_true", help="write into the package data instead")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_model(a.model, kernels=a.kernels)
    out = Path(a.out) if a.out else (
        Path(__file__).resolve().parents[1] / "src/selfspec/data/draft_vocab" / f"{model_key(target.name)}.json"
        if a.ship else user_ranking_path(target.name))
    cache = user_ranking_path(target.name).with_name(f"{model_key(target.name)}-answers.jsonl")
    data = build_ranking(target.model, target.tokenizer, target.name, a.prompts, a.max_new, a.prior_convs,
                         cache=cache)
    print(f"wrote {write_ranking(data, out)}: own tokens {data['source']['own_tokens']}, "
          f"coverage of own answers {data['coverage_own']}")


if __name__ == "__main__":
    main()
