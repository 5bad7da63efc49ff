"""``selfspec train OBJECTIVE``: one subcommand per training objective, each with its own options.

``hass`` trains an EAGLE draft head on cached target features (``train/trainer.py``); ``sdsat``,
``space``, ``msn`` and ``sft`` fine-tune the model itself, LoRA or full (``train/finetune.py``), and
write a model directory. Every objective takes the common options (data, schedule, checkpoints,
device); its own options are refused by the other objectives instead of silently ignored.
Adding an objective: its module under ``train/`` and one :class:`TrainCommand` in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import seed_arg, threads_arg
from ..errors import SelfspecError

log = logging.getLogger(__name__)

HEAD_DATA = "sharegpt:224,sharegpt-answers:300,code:60"
FINETUNE_DATA = "sharegpt:224,sharegpt-answers:150,code:240"


@dataclass(frozen=True)
class TrainCommand:
    """One ``selfspec train`` objective.

    Attributes:
        name: the subcommand (``selfspec train NAME``).
        help: one line for ``selfspec train --help``.
        add_args: adds the objective's own options to its parser (the common ones are added for it).
        run: trains from the parsed options; the exit code.
        data: the default of ``--data``.
    """

    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    data: str = FINETUNE_DATA


def _add_common(p: argparse.ArgumentParser, data: str) -> None:
    p.add_argument("--model", required=True, help="target: bundled name, local HF directory, .gguf file or hub id")
    p.add_argument("--out", required=True, help="output directory (also train/ inside: checkpoints, history, plots)")
    p.add_argument("--data", default=data,
                   help="comma-separated sources: sharegpt[:N] (answers regenerated with --regenerate), "
                        "sharegpt-answers[:N] (ShareGPT's answers kept), code[:N] (Python stdlib), or a JSONL file "
                        f"of conversations (default {data}); evaluation prompts are excluded (the built-in ones "
                        "always, MT-bench and HumanEval where they can be loaded: a warning says when not)")
    p.add_argument("--max-len", type=int, default=512, help="tokens per example at most (default 512)")
    p.add_argument("--regenerate", type=int, default=0,
                   help="self-distillation: answer the ShareGPT prompts with the target (at most N tokens) and "
                        "train on its answers (default 0 = ShareGPT's answers)")
    p.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process and step (default 4)")
    p.add_argument("--seed", type=seed_arg, default=0, help="training seed (order, noise, init)")
    p.add_argument("--data-seed", type=seed_arg, default=42, help="data shuffling seed")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default 200)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda; under accelerate launch, each process trains on its own device")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"],
                   help="autocast the forward and loss in this precision (Accelerate's mixed precision; weights and "
                        "optimizer stay fp32): bf16 on GPUs and on CPUs with avx512_bf16/AMX; fp16 on GPUs only; "
                        "no: fp32. Default auto: bf16 on a GPU with bf16; on a CPU with bf16 units, bf16 where a "
                        "timed pass of the model is faster in it (logged), else fp32")
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="torch CPU threads per process, at least 1 (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _check_at_least(args: argparse.Namespace, *rules: tuple[str, int]) -> None:
    """A one-line error naming the one flag below its minimum (``(dest, minimum)`` pairs), not
    every flag the command has."""
    for dest, least in rules:
        value = getattr(args, dest)
        if value < least:
            raise SelfspecError(f"--{dest.replace('_', '-')} must be at least {least}, not {value}")


def _start(args: argparse.Namespace, outputs: tuple[str, ...]):
    """Check the common options and ``--out`` (``outputs``: the files a finished run leaves
    there), set the threads, and load the target under Accelerate:
    ``(accelerator, target, data options)``. Everything is checked before the model loads."""
    from accelerate import Accelerator

    from ..models.loading import load_model, resolve_device
    from ..paths import check_output_dir
    from .loop import check_out
    from .pipeline import DataOptions, check_data_spec

    if args.max_len < 8:
        raise SelfspecError("--max-len must be at least 8")
    check_data_spec(args.data)
    resolve_device(args.device)  # a device this machine lacks: one line, before anything loads
    out = check_output_dir(args.out)
    check_out(out, args.resume, outputs)  # an earlier run there is continued (--resume) or kept, never lost
    data = DataOptions(data=args.data, max_len=args.max_len, regenerate=args.regenerate, seed=args.data_seed)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mixed_precision == "fp16" and args.device == "cpu":
        raise SelfspecError("--mixed-precision fp16 needs a GPU (--device cuda); on a CPU use bf16 or no")
    if args.device == "cpu":  # auto may time the model: it loads first
        target = load_model(args.model, "cpu", "float32", args.trust_remote_code)
        mp = _precision(args, target.model, torch.device("cpu"))
        acc = Accelerator(cpu=True, mixed_precision=mp)
    else:
        from accelerate import PartialState

        mp = _precision(args, None, PartialState().device)
        acc = Accelerator(cpu=False, mixed_precision=mp)
        target = load_model(args.model, acc.device, "float32", args.trust_remote_code)
    return acc, target, data


def _precision(args: argparse.Namespace, model, device) -> str:
    """``--mixed-precision`` resolved (``auto`` by :mod:`~selfspec.train.precision`), and logged."""
    from ..core.machine import cpu_flag_set
    from .precision import choose

    choice = choose(args.mixed_precision, device, model, args.batch_size, args.max_len, cpu_flag_set())
    said = choice.seconds is not None or choice.precision != "no"  # fp32 unmeasured: as ever, nothing to say
    log.log(logging.INFO if said else logging.DEBUG, f"training precision: {choice.reason}")
    return choice.precision


# -- hass: a draft head ---------------------------------------------------------------------------

HEAD_METHODS = {"eagle": "eagle2", "hass": "hass"}  # the head objective -> the method that drafts with it


def _add_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--features", default=None,
                   help="feature cache directory (default OUT/features); share it between heads for ablations")
    p.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"],
                   help="head architecture: eagle2 (EAGLE-1/2: fc over [embedding; last hidden state], the target's "
                        "LM head; default) or eagle3 (fused low/middle/high layers, a midlayer over [embedding; "
                        "hidden], its own LM head over a reduced vocabulary, training-time test)")
    p.add_argument("--objective", default="hass", help="eagle (passes 1, no top-K loss) or hass (default)")
    p.add_argument("--passes", type=int, default=None,
                   help="HCA alignment passes (default: eagle 1, hass 3); --arch eagle3: training-time-test steps "
                        "(default 7)")
    p.add_argument("--topk", type=int, default=10, help="K of the top-K distillation loss (default 10)")
    p.add_argument("--topk-weight", type=float, default=None, help="its weight (default: eagle 0, hass 1)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (default 3e-4)")
    p.add_argument("--max-steps", type=int, default=0, help="optimiser steps (default 0: --epochs decides)")
    p.add_argument("--noise", type=float, default=None,
                   help="uniform noise on input features (default 0.1; --arch eagle3: 0)")
    p.add_argument("--init", default=None, help="continue from this head directory (ablation protocol)")
    p.add_argument("--no-fc-bias", action="store_true",
                   help="train fc without a bias (vLLM's EAGLE fc has none; see selfspec export; an EAGLE-3 fc never "
                        "has one)")
    p.add_argument("--feature-layers", default=None,
                   help="--arch eagle3: the three hidden-state indices A,B,C it reads (i = the input of decoder layer "
                        "i; default EAGLE-3's 2, L/2, L-3)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="reduced draft vocabulary: the N most frequent learned tokens of the training data (plus "
                        "EOS); the loss's LM head covers only them and the head stores the d2t map (default 0 = full)")


def _feature_layers(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        layers = ()
    if len(layers) != 3:
        raise SelfspecError(f"--feature-layers takes three comma-separated layer indices A,B,C, not {text!r}")
    return layers


def run_head(args: argparse.Namespace) -> int:
    """Train a draft head: data -> features -> Accelerate training (resumable at every stage)."""
    from .eagle3 import Eagle3Options
    from .trainer import TrainOptions

    eagle3 = args.arch == "eagle3"
    if args.objective not in HEAD_METHODS:
        raise SelfspecError(f"--objective must be {' or '.join(HEAD_METHODS)}, not {args.objective!r}")
    if not eagle3 and args.feature_layers is not None:
        raise SelfspecError("--feature-layers applies to --arch eagle3 (an EAGLE-2 head reads the last hidden state)")
    passes = args.passes if args.passes is not None else (7 if eagle3 else 1 if args.objective == "eagle" else 3)
    topk_w = args.topk_weight if args.topk_weight is not None else (0.0 if args.objective == "eagle" else 1.0)
    noise = args.noise if args.noise is not None else (0.0 if eagle3 else 0.1)
    if args.draft_vocab < 0:
        raise SelfspecError(f"--draft-vocab must be 0 (the full vocabulary) or a token count, not {args.draft_vocab}")
    _check_at_least(args, ("epochs", 1), ("batch_size", 1), ("max_steps", 0), ("topk", 1))
    if passes < 1:
        raise SelfspecError(f"--passes must be at least 1, not {passes}")
    if topk_w < 0:
        raise SelfspecError(f"--topk-weight must be >= 0, not {topk_w}")
    if args.lr <= 0:
        raise SelfspecError(f"--lr must be > 0, not {args.lr}")
    layers = _feature_layers(args.feature_layers)
    if eagle3:
        opts: TrainOptions | Eagle3Options = Eagle3Options(
            objective=args.objective, steps=passes, topk=args.topk, topk_weight=topk_w,
            detach=args.objective == "hass", draft_vocab=args.draft_vocab,
            epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, batch_size=args.batch_size, noise=noise,
            seed=args.seed, checkpoint_every=args.checkpoint_every, init=args.init or "")
    else:
        opts = TrainOptions(objective=args.objective, passes=passes, topk=args.topk, topk_weight=topk_w,
                            epochs=args.epochs, max_steps=args.max_steps, lr=args.lr, batch_size=args.batch_size,
                            noise=noise,
                            seed=args.seed, checkpoint_every=args.checkpoint_every, init=args.init or "",
                            fc_bias=not args.no_fc_bias, draft_vocab=args.draft_vocab)
    from ..heads.eagle import META_FILE as HEAD_FILE

    acc, target, data = _start(args, (HEAD_FILE,))
    from .features import extract_features, read_sequences
    from .pipeline import prepare_examples
    from .trainer import train_head

    out = Path(args.out)
    feat_dir = Path(args.features) if args.features else out / "features"
    if eagle3:  # the fused layers live in their own cache, keyed by the layers
        from ..heads.eagle3 import resolve_feature_layers

        layers = resolve_feature_layers(int(target.model.config.num_hidden_layers), layers)  # EAGLE-3's by default
        assert isinstance(opts, Eagle3Options)  # made above for eagle3
        opts = replace(opts, feature_layers=layers)
        feat_dir = feat_dir / f"eagle3-{'-'.join(str(i) for i in layers)}"
    if acc.is_main_process:
        examples = prepare_examples(target.model, target.tokenizer, data, feat_dir, not args.no_progress)
        extract_features(target.model, examples, feat_dir, {"model": target.name, **data.__dict__},
                         progress=not args.no_progress, layers=layers if eagle3 else None)
    acc.wait_for_everyone()
    seqs = list(read_sequences(feat_dir))
    meta = {"target": target.name, "data": data.__dict__, "sequences": len(seqs),
            "tokens": int(sum(s.input_ids.numel() for s in seqs))}
    if eagle3:
        from .eagle3 import train_eagle3

        assert isinstance(opts, Eagle3Options)  # made above for eagle3
        res = train_eagle3(target.model, seqs, out, opts, meta, resume=args.resume, progress=not args.no_progress,
                           accelerator=acc)
    else:
        assert isinstance(opts, TrainOptions)  # made above when not eagle3
        res = train_head(target.model, seqs, out, opts, meta, resume=args.resume, progress=not args.no_progress,
                         accelerator=acc)
    if acc.is_main_process:
        accs = " ".join(f"{res[f'acc{j}']:.3f}" for j in range(1, passes + 1) if f"acc{j}" in res)
        kind = "EAGLE-3 " if eagle3 else ""
        print(f"{opts.objective} {kind}head: {res['steps']} steps on {meta['tokens']} tokens ({len(seqs)} sequences); "
              f"validation top-1 agreement by drafting step: {accs or 'n/a'}")
        print(f"head: {out}   (use: --method {HEAD_METHODS[opts.objective]} --head {out})")
    return 0


# -- sdsat, space, msn, sft: fine-tune the model itself ---------------------------------------------

def _add_finetune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW peak learning rate (default 3e-4; full fine-tuning, --lora-rank 0: 1e-4)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16); 0 = full fine-tuning")
    p.add_argument("--max-steps", type=int, default=0, help="optimiser steps (default 0: --epochs decides)")


def _add_sdsat_args(p: argparse.ArgumentParser) -> None:
    _add_finetune_args(p)
    p.add_argument("--window", type=int, default=5, help="L: largest window of adaptive tokens (default 5)")
    p.add_argument("--start-fraction", type=float, default=0.1, help="share of positions starting a window (0.1)")
    p.add_argument("--adaptive-weight", type=float, default=1.0, help="w of 1/2 (L_plain + w L_adaptive) (1)")
    p.add_argument("--clean-fraction", type=float, default=0.5, help="share of sequences left clean (0.5)")
    p.add_argument("--distinct-tokens", action="store_true",
                   help="L distinct adaptive tokens (paper appendix B) instead of one repeated")
    p.add_argument("--loss-at", default="label", choices=["label", "input"],
                   help="label: the paper's eq. 6 (default); input: score the output at every adaptive token")


def _sdsat(args: argparse.Namespace):
    from .sdsat import SdsatObjective, SdsatOptions

    sd = SdsatOptions(window=args.window, start_fraction=args.start_fraction, weight=args.adaptive_weight,
                      clean_fraction=args.clean_fraction, distinct=args.distinct_tokens, loss_at=args.loss_at)
    return SdsatObjective(sd), sd.window


def _add_space_args(p: argparse.ArgumentParser) -> None:
    _add_finetune_args(p)
    p.add_argument("--masks", type=int, default=5, help="k: masks per group = tokens drafted per step (default 5)")
    p.add_argument("--p-ar", type=float, default=0.5, help="share of sequences trained as plain SFT (default 0.5)")
    p.add_argument("--groups", type=int, default=1,
                   help="mask groups per masked sequence: 1 = cut and truncate as the official code (default); "
                        "G > 1 = keep the sequence and supervise G cut points (small budgets)")
    p.add_argument("--mask-weight", type=float, default=1.0, help="loss weight of mask positions (default 1)")


def _space(args: argparse.Namespace):
    from .space import SpaceObjective, SpaceOptions

    sp = SpaceOptions(k=args.masks, p_ar=args.p_ar, groups=args.groups, mask_weight=args.mask_weight)
    return SpaceObjective(sp), sp.k


def _add_msn_args(p: argparse.ArgumentParser, noised: bool = True) -> None:
    _add_finetune_args(p)
    p.add_argument("--span", type=int, default=4,
                   help="noised tokens per example (default 4, the paper's)" if noised else
                   "noised tokens per validation example: validated like msn (default 4); training is not noised")


def _msn(args: argparse.Namespace, noised: bool = True):
    from .msn import MsnObjective, MsnOptions

    return MsnObjective(MsnOptions(span=args.span if noised else 0), eval_span=args.span), args.span


def run_finetune(args: argparse.Namespace, make: Callable[[argparse.Namespace], tuple]) -> int:
    """Fine-tune the model itself with the objective ``make(args)`` returns (with the depth of
    its drafts, whose validation accuracies are reported; LoRA or full), then write the model
    directory."""
    from .finetune import FinetuneOptions, finetune
    from .pipeline import prepare_examples

    objective, depth = make(args)
    lr = args.lr if args.lr is not None else (3e-4 if args.lora_rank else 1e-4)
    _check_at_least(args, ("epochs", 1), ("batch_size", 1), ("max_steps", 0), ("lora_rank", 0))
    if lr <= 0:
        raise SelfspecError(f"--lr must be > 0, not {lr}")
    opts = FinetuneOptions(lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank, epochs=args.epochs,
                           max_steps=args.max_steps, lr=lr, batch_size=args.batch_size, seed=args.seed,
                           checkpoint_every=args.checkpoint_every,
                           weight_decay=0.0 if args.lora_rank else 0.1)
    from ..models.finetuned import META_FILE as MODEL_FILE

    acc, target, data = _start(args, (MODEL_FILE, "config.json", "adapter"))
    out = Path(args.out)
    if acc.is_main_process:
        examples = prepare_examples(target.model, target.tokenizer, data, out / "data", not args.no_progress)
    acc.wait_for_everyone()
    if not acc.is_main_process:
        examples = prepare_examples(target.model, target.tokenizer, data, out / "data", False)
    meta = {"base": target.name, "data": data.__dict__, "examples": len(examples),
            "tokens": int(sum(e.input_ids.numel() for e in examples))}
    res = finetune(target.model, target.tokenizer, examples, objective, out, opts, meta, target.path,
                   resume=args.resume, progress=not args.no_progress, accelerator=acc)
    if acc.is_main_process:
        accs = " ".join(f"{res[f'acc{j}']:.3f}" for j in range(2, depth + 2) if f"acc{j}" in res)
        what = "draft top-1 accuracy at offsets 2..:"
        if "acc_noisy" in res:  # msn / sft: by how many noised inputs precede the prediction
            what = f"next-token accuracy after noise {res['acc_noisy']:.3f}; after 1, 2, ... noised inputs:"
        print(f"{args.what} ({'LoRA r=' + str(opts.lora_rank) if opts.lora_rank else 'full fine-tuning'}): "
              f"{res['steps']} steps on {meta['tokens']} tokens ({len(examples)} examples); validation plain loss "
              f"{res.get('plain', float('nan')):.3f}, {what} {accs or 'n/a'}")
        print(f"model: {out}   (use: --model {out} --method {args.what}, or --method ar for the same model)")
    return 0


COMMANDS: dict[str, TrainCommand] = {c.name: c for c in (
    TrainCommand("hass", "an EAGLE draft head, EAGLE or HASS objective (for --method eagle2 / hass)",
                 _add_head_args, run_head, HEAD_DATA),
    TrainCommand("sdsat", "fine-tune the model with semantic adaptive tokens (for --method sdsat)",
                 _add_sdsat_args, lambda a: run_finetune(a, _sdsat)),
    TrainCommand("space", "fine-tune the model with [MASK] groups (for --method space)",
                 _add_space_args, lambda a: run_finetune(a, _space)),
    TrainCommand("msn", "fine-tune the model on inputs with a span of ahead noise (for --method jacobi / msn)",
                 _add_msn_args, lambda a: run_finetune(a, _msn)),
    TrainCommand("sft", "plain fine-tuning on the same data, msn's control",
                 lambda p: _add_msn_args(p, noised=False), lambda a: run_finetune(a, lambda b: _msn(b, False))),
)}


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    """``selfspec train OBJECTIVE ...``: one subparser per objective of :data:`COMMANDS`."""
    tr = sub.add_parser("train", help="train with Accelerate: a draft head or the model itself ("
                                      f"{', '.join(COMMANDS)}; see selfspec train OBJECTIVE --help)")
    objectives = tr.add_subparsers(dest="what", required=True, metavar="OBJECTIVE", parser_class=type(tr))
    for c in COMMANDS.values():
        p = objectives.add_parser(c.name, help=c.help, description=c.help)
        _add_common(p, c.data)
        c.add_args(p)
        p.set_defaults(func=c.run)
