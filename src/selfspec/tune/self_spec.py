"""``selfspec tune MODEL --method self-spec``: find the skip set, write the skip config.

Calibration prompts are never evaluation prompts: the default set
(``selfspec/data/calibration.jsonl``) was written for tuning and shares nothing with the
built-in benchmark prompts, MT-bench or HumanEval.
"""

from __future__ import annotations

import datetime
import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..core.machine import machine_id
from ..drafters.self_spec import DRAFT_EXITS, draft_parts
from ..drafters.skip_config import GammaSettings, SkipConfig, config_hash, user_config_path
from ..errors import SelfspecError
from ..kernels.switch import DRAFT_KERNELS
from ..models.loading import Runner
from ..models.skipping import SkipSet, decoder_layers
from ..paths import check_output_dir, check_output_file, model_key, selfspec_home
from .objectives import ProxyObjective, SpeedObjective, measure_draft_cost
from .search import SearchResult, check_state, search

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

OBJECTIVES = ("speed", "proxy")


@dataclass(frozen=True)
class TuneOptions:
    """Settings of one search.

    Attributes:
        objective: ``speed`` (measured decode tokens/s, the paper's) or ``proxy`` (teacher-forced
            agreement + measured cost table; cheaper, deterministic).
        trials: total trials to complete (a resumed search counts earlier ones).
        time_budget: stop starting trials after this many seconds of this run (None: no limit).
        prompts: calibration JSONL (``prompt``, optional ``id``/``category``); empty = built-in set.
        category: use only calibration prompts of this category (empty = all).
        num_prompts: calibration prompts used (first N after the category filter).
        new_tokens: tokens decoded (or continued, for the proxy) per calibration prompt.
        draft_exit: exit rule the skip set is tuned for (``cost`` or ``gamma``).
        rerank: proxy only: measure the speed of the best N distinct proxy trials and keep the
            fastest (0 = trust the proxy).
        seed: sampler seed.
        state_dir: search state (default ``$SELFSPEC_HOME/tune/<model>-<objective>-<backend>``).
        fresh: discard a previous search state instead of resuming it.
        out: skip config path (default ``$SELFSPEC_HOME/skip_configs/<model>.json``, which
            ``selfspec.load(..., method="self-spec")`` picks up).
        gamma: adaptive-exit constants written into the config.
        draft_vocab: reduced draft vocabulary size the skip set is searched (and stored) with (0: full).
        draft_kernels: kernels of the draft passes searched (and stored) with (``int8``: quantised copy).
    """

    objective: str = "speed"
    trials: int = 60
    time_budget: float | None = None
    prompts: str = ""
    category: str = ""
    num_prompts: int = 4
    new_tokens: int = 32
    draft_exit: str = "cost"
    rerank: int = 0
    seed: int = 0
    state_dir: str = ""
    fresh: bool = False
    out: str = ""
    gamma: GammaSettings = GammaSettings()
    draft_vocab: int = 0
    draft_kernels: str = "same"

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SelfspecError(f"unknown objective '{self.objective}'; choose one of: {', '.join(OBJECTIVES)}")
        if self.draft_exit not in DRAFT_EXITS:
            raise SelfspecError(f"unknown draft exit '{self.draft_exit}'; choose one of: {', '.join(DRAFT_EXITS)}")
        if self.trials < 1 or self.num_prompts < 1 or self.new_tokens < 2 or self.rerank < 0:
            raise SelfspecError("--trials and --calib-prompts must be >= 1, --calib-tokens >= 2, --rerank >= 0")
        if self.draft_vocab < 0 or self.draft_kernels not in DRAFT_KERNELS:
            raise SelfspecError(f"--draft-vocab must be >= 0 and --draft-kernels one of {', '.join(DRAFT_KERNELS)}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise SelfspecError("--time-budget must be a positive number of seconds")
        if self.out:  # where the results go: checked before a model loads
            check_output_file(self.out)
        if self.state_dir:
            check_output_dir(self.state_dir, "--state")


def calibration_prompts(target: Runner, opts: TuneOptions) -> tuple[list[str], list[list[int]]]:
    """Ids and token ids of the calibration prompts (chat-templated)."""
    from ..bench.datasets import load_dataset
    from ..decoding.text import encode_prompt

    path = opts.prompts or str(importlib.resources.files("selfspec") / "data" / "calibration.jsonl")
    rows = load_dataset(path)
    if opts.category:
        rows = [r for r in rows if r.category == opts.category]
        if not rows:
            raise SelfspecError(f"no calibration prompt has category '{opts.category}' in {path}")
    rows = rows[: opts.num_prompts]
    return [r.id for r in rows], [encode_prompt(target.tokenizer, r.text, r.chat,
                                                cast("PreTrainedConfig", target.model.config).vocab_size)
                                  for r in rows]


def tune_self_spec(target: Runner, opts: TuneOptions, progress: bool = True) -> tuple[SkipConfig, Path]:
    """Search a skip set for ``target`` on its current kernels backend; write and return the
    skip config and its path: where ``selfspec.load`` uses it automatically, unless ``opts.out``
    names another path or it measured slower than ``ar`` (then into the state directory)."""
    opts.check()
    num_layers = len(decoder_layers(target.model))
    ids, prompts = calibration_prompts(target, opts)
    backend = target.backend
    settings = {"model": model_key(target.name), "config_hash": config_hash(target.model), "backend": backend,
                "objective": opts.objective, "prompts": ids, "new_tokens": opts.new_tokens,
                "draft_exit": opts.draft_exit, "machine": machine_id(), "draft_vocab": opts.draft_vocab,
                "draft_kernels": opts.draft_kernels}
    state = Path(opts.state_dir) if opts.state_dir else (
        selfspec_home() / "tune" / f"{model_key(target.name)}-{opts.objective}-{backend}")
    check_state(state, settings, opts.fresh)  # before the minutes of measuring below
    objective: SpeedObjective | ProxyObjective
    extra: dict[str, object]
    if opts.objective == "speed":
        objective = SpeedObjective(target, prompts, opts.new_tokens, opts.draft_exit, opts.gamma, opts.draft_vocab,
                                   opts.draft_kernels)
        extra = {"ar_tokens_per_s": objective.ar_tps}
    else:
        profile = target.cost_profile()
        assert profile is not None  # None only when asked not to measure
        parts = draft_parts(target, opts.draft_vocab, opts.draft_kernels)
        cost = measure_draft_cost(target.model, parts=parts)
        objective = ProxyObjective(target, prompts, opts.new_tokens, opts.draft_exit, opts.gamma, profile, cost,
                                   parts=parts)
        extra = {"draft_cost": cost.to_json()}
    result = search(objective, num_layers, state, settings, opts.trials, opts.time_budget, opts.seed, opts.fresh,
                    progress)
    best, score, info = result.best, result.score, dict(result.info)
    if opts.objective == "proxy" and opts.rerank:
        best, score, info, extra["rerank"] = _rerank(target, opts, prompts, result)
    search_meta = {"objective": opts.objective, "score": score, **info, "trials": result.trials,
                   "search_seconds": round(result.seconds, 1), "backend": backend, "machine": machine_id(),
                   "calibration_prompts": ids, "new_tokens": opts.new_tokens, "draft_exit": opts.draft_exit,
                   "skip_ratio": best.ratio(num_layers), "date": datetime.date.today().isoformat(), **extra}
    cfg = SkipConfig(model=model_key(target.name), config_hash=config_hash(target.model), num_layers=num_layers,
                     skip_attention=best.attention, skip_mlp=best.mlp, gamma=opts.gamma, search=search_meta,
                     draft_vocab=opts.draft_vocab, draft_kernels=opts.draft_kernels)
    slower = measured_speedup(search_meta)
    if not opts.out and slower is not None and slower < 1.0:  # not where load picks it up by itself
        path = cfg.save(state / SLOWER_FILE)
    else:
        path = cfg.save(opts.out or user_config_path(target.name))
    return cfg, path


SLOWER_FILE = "slower-than-ar.json"  # a result that measured slower than ar: kept in the state dir, not installed


def measured_speedup(search_meta: dict) -> float | None:
    """The measured speedup over ``ar`` of a search's result (speed objective, or proxy with
    ``--rerank``), None when only predicted. A config below 1.0 is not installed where
    ``selfspec.load`` finds it by itself (``--out`` still writes it)."""
    for key in ("speedup", "measured_speedup"):
        if isinstance(search_meta.get(key), (int, float)):
            return float(search_meta[key])
    return None


def _rerank(target: Runner, opts: TuneOptions, prompts: list[list[int]], result: SearchResult
            ) -> tuple[SkipSet, float, dict, list[dict]]:
    """Measure the decode speed of the best ``opts.rerank`` distinct proxy trials; keep the fastest."""
    speed = SpeedObjective(target, prompts, opts.new_tokens, opts.draft_exit, opts.gamma)
    seen: list[SkipSet] = []
    for _, skip, _ in result.ranked:
        if skip.size and skip not in seen:
            seen.append(skip)
        if len(seen) == opts.rerank:
            break
    rows = []
    for skip in seen:
        proxy = next(r for r in result.ranked if r[1] == skip)
        ev = speed(skip)
        rows.append({"skip_attention": list(skip.attention), "skip_mlp": list(skip.mlp), "proxy": proxy[0],
                     **ev.info, "proxy_info": proxy[2]})
    best = max(range(len(rows)), key=lambda i: rows[i]["tokens_per_s"])
    info = {**rows[best]["proxy_info"], "measured_tokens_per_s": rows[best]["tokens_per_s"],
            "measured_speedup": rows[best]["speedup"], "ar_tokens_per_s": speed.ar_tps}
    return seen[best], rows[best]["proxy"], info, rows
