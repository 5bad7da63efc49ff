"""Bayesian optimisation over skip sets (``selfspec tune MODEL --method self-spec``).

The search space is one yes/no per attention sub-layer and one per MLP sub-layer (2 * L bits).
We use optuna's TPE sampler (a Bayesian optimiser with a tree-structured Parzen density model)
rather than the paper's ``bayesian-optimization`` GP: it takes binary parameters natively (no
continuous relaxation thresholded at 0.5), tolerates the noisy, discontinuous objective of wall
clock timing, scales to 60 dimensions without a GP's cubic cost, and its journal storage makes
the search resumable after an interrupt for free. Seed points (probes) are queued first, as
the paper's code does: the empty set, the last k attention sub-layers and the last k MLPs.

State lives in ``state_dir`` (an optuna journal plus the settings it was started with); a
second run with the same settings resumes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import SelfspecError
from ..models.skipping import SkipSet
from .objectives import Evaluation


def _optuna():
    try:
        import optuna
    except ImportError as e:
        raise SelfspecError("selfspec tune needs optuna: pip install 'selfspec[tune]' (or pip install optuna)") from e
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def seed_sets(num_layers: int) -> list[SkipSet]:
    """Probes evaluated before the sampler takes over (Draft & Verify spec, section 7.3), scaled
    from a 30-layer model: nothing; the last 4/8/12 attention; the last 2/4/6 MLP sub-layers."""
    n = num_layers
    out = [SkipSet()]
    for k in (4, 8, 12):
        k = max(1, round(k * n / 30))
        out.append(SkipSet.of(range(n - k, n), ()))
    for k in (2, 4, 6):
        k = max(1, round(k * n / 30))
        out.append(SkipSet.of((), range(n - k, n)))
    return list(dict.fromkeys(out))


def params_of(skip: SkipSet, num_layers: int) -> dict[str, int]:
    return {**{f"attn{i}": int(i in skip.attention) for i in range(num_layers)},
            **{f"mlp{i}": int(i in skip.mlp) for i in range(num_layers)}}


def skip_of(params: dict, num_layers: int) -> SkipSet:
    return SkipSet.of([i for i in range(num_layers) if params.get(f"attn{i}")],
                      [i for i in range(num_layers) if params.get(f"mlp{i}")])


@dataclass(frozen=True)
class SearchResult:
    best: SkipSet
    score: float
    info: dict
    trials: int  # completed trials, all runs of this state included
    seconds: float  # time spent in trials, all runs of this state included
    ranked: list[tuple[float, SkipSet, dict]]  # every completed trial, best first
    # best is the best non-empty skip set: skipping nothing drafts with the whole model


def check_state(state_dir: Path, settings: dict, fresh: bool = False) -> None:
    """Refuse to resume a search state started with other ``settings`` (unless ``fresh``): raised
    before anything is measured, so a mistyped option costs no time."""
    journal, settings_path = state_dir / "journal.log", state_dir / "settings.json"
    if fresh or not (journal.exists() and settings_path.exists()):
        return
    old = json.loads(settings_path.read_text())
    if old != settings:
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        raise SelfspecError(f"the search state in {state_dir} was started with other settings ({', '.join(changed)}"
                            "); pass --fresh to start over or --state DIR for another search")


def search(objective: Callable[[SkipSet], Evaluation], num_layers: int, state_dir: Path, settings: dict,
           trials: int, time_budget: float | None = None, seed: int = 0, fresh: bool = False,
           progress: bool = True) -> SearchResult:
    """Run (or resume) the search until ``trials`` trials are complete or ``time_budget`` seconds
    of this run are spent. Ctrl-C stops it; completed trials stay in the journal.

    Args:
        objective: scores a skip set (higher is better).
        num_layers: decoder blocks L (2 * L binary parameters).
        state_dir: where the journal lives.
        settings: what the score depends on (model, objective, prompts, ...); resuming with other
            settings is refused.
    """
    optuna = _optuna()
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    check_state(state_dir, settings, fresh)
    state_dir.mkdir(parents=True, exist_ok=True)
    journal = state_dir / "journal.log"
    settings_path = state_dir / "settings.json"
    if fresh:
        journal.unlink(missing_ok=True)
        settings_path.unlink(missing_ok=True)
    settings_path.write_text(json.dumps(settings, indent=1))
    storage = JournalStorage(JournalFileBackend(str(journal)))
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=len(seed_sets(num_layers)))
    study = optuna.create_study(study_name="self-spec", storage=storage, direction="maximize", sampler=sampler,
                                load_if_exists=True)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # cut by an interrupt
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    if not study.trials:
        for s in seed_sets(num_layers):
            study.enqueue_trial(params_of(s, num_layers))
    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    t_start = time.perf_counter()
    with tqdm(total=trials, initial=min(done, trials), desc="tune self-spec", unit="trial",
              disable=not progress) as bar:
        while done < trials:
            if time_budget is not None and time.perf_counter() - t_start >= time_budget:
                break
            trial = study.ask()
            for i in range(num_layers):
                trial.suggest_categorical(f"attn{i}", [0, 1])
                trial.suggest_categorical(f"mlp{i}", [0, 1])
            skip = skip_of(trial.params, num_layers)
            try:
                ev = objective(skip)
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            for k, v in ev.info.items():
                trial.set_user_attr(k, v)
            study.tell(trial, ev.score)
            done += 1
            best = study.best_trial
            bar.set_postfix_str(f"best {best.value:.3f} (skips {len(skip_of(best.params, num_layers).attention)}"
                                f"+{len(skip_of(best.params, num_layers).mlp)})")
            bar.update()
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not completed:
        raise SelfspecError("the search completed no trial; give it more --trials or a longer --time-budget")
    ranked = sorted(((t.value, skip_of(t.params, num_layers), dict(t.user_attrs)) for t in completed),
                    key=lambda r: -r[0])
    # the empty set (the draft is the whole model) is a reference probe, never an answer
    nonempty = [r for r in ranked if r[1].size > 0] or ranked
    score, best, info = nonempty[0]
    seconds = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in completed
                  if t.datetime_complete and t.datetime_start)
    return SearchResult(best, score, info, len(completed), seconds, ranked)
