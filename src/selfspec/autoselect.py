"""``auto``: the fastest exact configuration for this model here, chosen end to end.

A configuration (:class:`Candidate`) is a method, its verify kernels (the lossless fp32 backends
that run here) and, where the method has that option, its draft precision (drafts need no
exactness: verification stays on the verify kernels). Methods come from the registry's specs
(:class:`~selfspec.drafters.spec.AutoCandidacy`); this module names none and never calls
``api.load``. The cross product is measured by greedy decode tokens/s on the shipped calibration
prompts, in the process that will decode, the kernels switched in place, by successive halving
(:data:`ROUNDS`): every candidate decodes one prompt, the fastest few two more, interleaved, the
best two the last, and the fastest over all it decoded wins (:func:`select`). Not a proxy: T(1) +
T(4) chose the slower kernels on an Intel AMX Xeon (the default ran at 0.86x the best fixed
configuration). Where the method is chosen, a candidate whose ids differ from the reference's
(``ar``) on the same kernels is disqualified. ``--method M`` leaves only kernels to choose (no
reference), ``--kernels X`` only methods, both nothing.

The choice is cached per model, machine and candidate list (a new head, skip config or fine-tune
means a new measurement); ``remeasure`` redoes it, a corrupt cache is measured again, and a
choice calibrated while the machine was busy is redone on a later start that finds it quiet.
See ``docs/DESIGN.md``, "Choosing the configuration".
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Protocol

from .core import cost
from .core.cost import profile_key, profile_path, save_cache
from .core.machine import LoadMonitor
from .drafters.spec import AutoContext, MethodSpec
from .errors import SelfspecError
from .models.loading import LoadedModel

log = logging.getLogger("selfspec.auto")

AUTO_PREFIX = "auto→"  # what a generator whose configuration auto chose is named with
CALIBRATION_PROMPTS = 4  # 2 code + 2 chat from the shipped calibration set
CALIBRATION_TOKENS = 32
WARMUP_TOKENS = 4
# Successive halving: (calibration prompts decoded, candidates kept into the round; None: all).
ROUNDS: tuple[tuple[int, int | None], ...] = ((1, None), (2, 4), (1, 2))
# Seconds a calibration may take: later rounds shrink (fewer prompts, then two finalists) or are
# skipped to fit, by what round 0 measured; round 0 itself is every candidate once, whatever it
# costs, and the two fastest always decode one more prompt (a one-prompt choice is noise).
BUDGET_S = 60.0
CACHE_FORMAT = "selfspec-auto/2"


@dataclass(frozen=True)
class Candidate:
    """One configuration: a method with its options (``selfspec.load`` keywords, the draft
    precision option included), the verify kernels, and the draft precision (``""`` where the
    method has none to choose)."""

    method: str
    options: dict = field(default_factory=dict)
    kernels: str = "stock"
    precision: str = ""

    @property
    def label(self) -> str:
        return config_label(self.method, self.kernels, self.precision)


def config_label(method: str, kernels: str, precision: str = "") -> str:
    """The one name of a configuration in reports, ``--json``, bench records and the server:
    ``self-spec@stock``, ``self-spec@onednn, draft int8`` (``same``: drafts on the verify kernels)."""
    out = f"{method}@{kernels}"
    if precision:
        out += f", draft {'as verify' if precision == 'same' else precision}"
    return out


def auto_label(candidate: Candidate) -> str:
    """What a generator whose configuration ``auto`` chose is called: ``auto→pld@stock``."""
    return AUTO_PREFIX + candidate.label


class Decoder(Protocol):
    """What :func:`measure` times: ``selfspec.load``'s generator, or a fake in tests."""

    def generate(self, prompt: str, max_new_tokens: int) -> object: ...


@dataclass
class Calibration:
    """What :func:`measure` found, by candidate label (in candidate order).

    Attributes:
        speeds: tokens/s over every prompt the candidate decoded (timed runs only).
        reached: the last round (index into :data:`ROUNDS`) the candidate decoded in.
        identical: False where its ids differed from the reference's on the same kernels.
        errors: why a candidate could not be built or run (left out).
    """

    speeds: dict[str, float] = field(default_factory=dict)
    reached: dict[str, int] = field(default_factory=dict)
    identical: dict[str, bool] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def finalists(self) -> dict[str, float]:
        """Tokens/s of the candidates that decoded in the last round reached, in candidate order."""
        if not self.reached:
            return {}
        last = max(self.reached.values())
        return {label: self.speeds[label] for label, r in self.reached.items() if r == last}

    def pruned(self) -> dict[str, float]:
        """Tokens/s of the candidates left behind in an earlier round."""
        final = self.finalists()
        return {label: s for label, s in self.speeds.items() if label not in final}


@dataclass(frozen=True)
class Choice:
    """What ``auto`` resolved to.

    Attributes:
        candidate: the chosen configuration.
        table: tokens/s of the finalists by label (the numbers the choice was made on).
        pruned: tokens/s of the candidates pruned earlier (fewer prompts: not comparable).
        cached: read from the cache rather than measured now.
        busy: the calibration ran while other processes were busy on this machine.
    """

    candidate: Candidate
    table: dict[str, float] = field(default_factory=dict)
    pruned: dict[str, float] = field(default_factory=dict)
    cached: bool = False
    busy: bool = False


def candidates(target: LoadedModel, specs: Iterable[MethodSpec], kernels: Sequence[str],
               ctx: AutoContext | None = None) -> list[Candidate]:
    """The cross product of the methods in ``specs`` that are ``auto`` candidates for ``target``
    here (in ``specs`` order, the reference first), their draft precisions, and ``kernels``."""
    ctx = ctx or AutoContext()
    usable = ctx.draft_precisions
    if usable is None:
        from .kernels.switch import draft_precisions

        usable, left_out = draft_precisions(next(target.model.parameters()).device.type)
        for precision, why in left_out.items():
            log.info("auto: %s drafts left out: %s", precision, why)
    out: list[Candidate] = []
    for spec in specs:
        if spec.auto is None or not spec.lossless:
            continue
        options = spec.auto.options(spec.name, target, ctx)
        if options is None:
            continue
        variants = [(dict(options), "")]
        if spec.auto.precision_option:
            variants = [({**options, spec.auto.precision_option: p}, p) for p in spec.auto.precisions
                        if p in ("", "same") or p in usable]
        for k in kernels:
            for opts, precision in variants:
                if precision not in ("", "same") and precision == k:
                    continue  # drafts on the verify kernels: the "same" variant
                out.append(Candidate(spec.name, opts, k, precision))
    return out


def calibration_prompts(n: int = CALIBRATION_PROMPTS) -> list[str]:
    """The first ``n`` shipped calibration prompts, alternating code and chat."""
    text = resources.files("selfspec").joinpath("data/calibration.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["prompt"])
    cats = sorted(by_cat)
    out: list[str] = []
    i = 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        for c in cats:
            if i < len(by_cat[c]) and len(out) < n:
                out.append(by_cat[c][i])
        i += 1
    return out


def select(table: dict[str, float], identical: dict[str, bool] | None = None) -> str | None:
    """The fastest entry of a calibration table (label -> tokens/s) whose ids equal the
    reference's; None when none is usable. Ties go to the earlier entry (the reference first),
    so a speculative configuration must be strictly faster to win."""
    identical = identical or {}
    best = None
    for label, speed in table.items():
        if not identical.get(label, True) or speed <= 0:
            continue
        if best is None or speed > table[best]:
            best = label
    return best


def measure(make: Callable[[Candidate], Decoder], cands: Sequence[Candidate], prompts: Sequence[str],
            reference: str | None = None, max_new_tokens: int = CALIBRATION_TOKENS,
            rounds: Sequence[tuple[int, int | None]] = ROUNDS, budget_s: float | None = BUDGET_S,
            clock: Callable[[], float] = time.perf_counter) -> Calibration:
    """Calibrate ``cands`` greedily on ``prompts`` by successive halving over ``rounds``.

    ``make(candidate)`` builds a generator on the already loaded model (switching its kernels in
    place). A candidate that fails to build or run (:class:`SelfspecError`) is left out with a
    note. With ``reference`` (a method name), every other candidate's ids must equal the
    reference method's on the same kernels and prompt (the reference is built for a kernels
    backend it is no candidate on, untimed); otherwise it is disqualified. ``budget_s`` bounds
    the whole calibration (builds included) where it can: a later round whose projected time (each
    finalist's seconds per prompt so far) would overrun it runs fewer prompts, then only the two
    fastest, or is skipped (None: no bound); the first later round always keeps one prompt for
    the two fastest. ``clock`` times the runs (injected in tests)."""
    by_label = {c.label: c for c in cands}
    started = clock()
    cal = Calibration()
    gens: dict[str, Decoder] = {}
    tokens = dict.fromkeys(by_label, 0)
    seconds = dict.fromkeys(by_label, 0.0)
    runs = dict.fromkeys(by_label, 0)
    refs: dict[tuple[str, int], list[int]] = {}
    ref_gens: dict[str, Decoder | None] = {}

    def is_reference(c: Candidate) -> bool:
        return c.method == reference and not c.options

    def reference_ids(kernels: str, i: int) -> list[int] | None:
        if (kernels, i) not in refs:
            if kernels not in ref_gens:
                ref = Candidate(str(reference), {}, kernels)
                try:
                    ref_gens[kernels] = gens.get(ref.label) or make(ref)
                except SelfspecError as e:
                    log.warning("auto: the reference %s could not run (%s)", ref.label, e)
                    ref_gens[kernels] = None
            g = ref_gens[kernels]
            if g is None:
                return None
            refs[(kernels, i)] = list(g.generate(prompts[i], max_new_tokens=max_new_tokens).token_ids)
        return refs[(kernels, i)]

    def run(label: str, i: int) -> None:
        c = by_label[label]
        t0 = clock()
        r = gens[label].generate(prompts[i], max_new_tokens=max_new_tokens)
        seconds[label] += clock() - t0
        runs[label] += 1
        tokens[label] += r.new_tokens
        ids = list(r.token_ids)
        if reference is None:
            return
        if is_reference(c):
            refs.setdefault((c.kernels, i), ids)
        elif reference_ids(c.kernels, i) != ids:
            cal.identical[label] = False

    def speed(label: str) -> float:
        return tokens[label] / seconds[label] if seconds[label] > 0 else 0.0

    def ok(label: str) -> bool:
        return label not in cal.errors and cal.identical.get(label, True)

    alive: list[str] = []
    start = 0
    for r_index, (n_prompts, keep) in enumerate(rounds):
        idx = range(start, min(start + n_prompts, len(prompts)))
        start += n_prompts
        if r_index == 0:  # every candidate: built, warmed up, then decodes the pruning prompts
            for label, c in by_label.items():
                try:
                    gens[label] = make(c)
                    gens[label].generate(prompts[0], max_new_tokens=WARMUP_TOKENS)  # one-off costs are not speed
                    for i in idx:
                        run(label, i)
                except SelfspecError as e:
                    cal.errors[label] = str(e)
                    continue
                cal.reached[label] = 0
                log.info("auto: %s %.1f tok/s", label, speed(label))
            alive = [label for label in by_label if ok(label)]
            continue
        if len(alive) <= 1 or not idx:
            break
        keep_n = len(alive) if keep is None else keep
        ranked = sorted(alive, key=lambda lab: -speed(lab))
        fitted = fit_round(len(idx), keep_n, [seconds[lab] / max(runs[lab], 1) for lab in ranked],
                           None if budget_s is None else budget_s - (clock() - started))
        if fitted is None and r_index == 1:  # a choice on one short prompt each is a coin toss between
            fitted = (1, 2)  # near-equals: the two fastest always meet once more, interleaved
            log.info("auto: the %.0f s calibration budget is spent: a last prompt for the two fastest only",
                     budget_s)
        elif fitted is None:
            log.info("auto: the %.0f s calibration budget is spent: choosing among the %d measured so far",
                     budget_s, len(alive))
            break
        if fitted != (len(idx), min(keep_n, len(alive))):
            log.info("auto: round %d cut to %d prompt(s) x %d finalists to stay within %.0f s", r_index,
                     fitted[0], fitted[1], budget_s)
        idx = idx[: fitted[0]]
        keep_n = fitted[1]
        kept = set(ranked[:keep_n])
        # the reference first on each prompt, so its timed run also gives the others' reference ids
        alive = sorted((lab for lab in alive if lab in kept), key=lambda lab: not is_reference(by_label[lab]))
        for i in idx:  # interleaved, so a change of machine load hits every finalist alike
            for label in alive:
                try:
                    run(label, i)
                except SelfspecError as e:
                    cal.errors[label] = str(e)
        alive = [label for label in alive if ok(label)]
        for label in alive:
            cal.reached[label] = r_index
        log.info("auto: round %d: %s", r_index, ", ".join(f"{lab} {speed(lab):.1f}" for lab in alive))
    for label in by_label:
        if label in cal.errors:
            log.warning("auto: %s left out (%s)", label, cal.errors[label])
        elif not cal.identical.get(label, True):
            log.warning("auto: %s left out: its greedy ids differ from %s's on the same kernels; please report this",
                        label, reference)
        elif label in cal.reached:
            cal.speeds[label] = speed(label)
    cal.reached = {label: r for label, r in cal.reached.items() if label in cal.speeds}
    return cal


def fit_round(n_prompts: int, keep: int, per_prompt: Sequence[float], left_s: float | None) -> tuple[int, int] | None:
    """(prompts, finalists) of a halving round that fit in ``left_s`` seconds, or None when not even
    one prompt for the two fastest fits.

    Args:
        n_prompts: prompts the round would decode.
        keep: finalists it would keep.
        per_prompt: seconds per prompt of the alive candidates, fastest first.
        left_s: seconds left of the budget (None: no bound).
    """
    keep = min(keep, len(per_prompt))
    if left_s is None:
        return n_prompts, keep

    def cost(n: int, k: int) -> float:
        return n * sum(per_prompt[:k])

    for n, k in [(n, keep) for n in range(n_prompts, 0, -1)] + [(1, min(keep, 2))]:
        if cost(n, k) <= left_s:
            return n, k
    return None


def _artefacts(target: LoadedModel, cands: Sequence[Candidate]) -> list:
    """Size and modification time of every file the candidates' drafts are built from (shipped
    and user heads, skip configs, draft vocabulary rankings): a new head or config, installed or
    trained, invalidates the cached choice."""
    from .heads import default_head_dir, shipped_head_dir
    from .paths import model_key, selfspec_home

    key = model_key(target.name)
    data = Path(str(resources.files("selfspec"))) / "data"
    paths = [data / "skip_configs" / f"{key}.json", data / "draft_vocab" / f"{key}.json",
             selfspec_home() / "skip_configs" / f"{key}.json", selfspec_home() / "draft_vocab" / f"{key}.json"]
    for method in dict.fromkeys(c.method for c in cands):  # head directories exist for head methods only
        for d in (shipped_head_dir(target.name, method), default_head_dir(target.name, method)):
            if d is not None:
                paths += [d / "model.safetensors", d / "selfspec_head.json"]
    out = []
    for p in paths:
        try:
            st = p.stat()
            out.append([str(p), st.st_size, st.st_mtime_ns])
        except OSError:
            pass
    return out


def cache_key(target: LoadedModel, cands: Sequence[Candidate]) -> str:
    """Model, dtype, device, machine (CPU, threads, torch), candidate list and draft artefacts."""
    sig = hashlib.sha256(json.dumps([[[c.method, c.options, c.kernels, c.precision] for c in cands],
                                     _artefacts(target, cands), CALIBRATION_PROMPTS, CALIBRATION_TOKENS,
                                     list(ROUNDS)], sort_keys=True).encode()).hexdigest()
    return profile_key(target.model, target.name, "auto") + f"|{CACHE_FORMAT}|{sig[:12]}"


def cache_path(target: LoadedModel, cands: Sequence[Candidate]) -> Path:
    return profile_path(cache_key(target, cands))


def read_cache(path: Path, cands: Sequence[Candidate]) -> Choice | None:
    """The cached choice, or None when missing, corrupt or naming no current candidate."""
    by_label = {c.label: c for c in cands}

    def parse(d: dict) -> Choice | None:
        label, table, pruned, busy = d["choice"], d["table"], d["pruned"], d["busy"]
        if label not in by_label or not isinstance(busy, bool):
            return None
        return Choice(by_label[label], {str(k): float(v) for k, v in table.items()},
                      {str(k): float(v) for k, v in pruned.items()}, cached=True, busy=busy)

    return cost.read_cache(path, parse)


def machine_busy() -> bool:
    """Whether other processes keep this machine busy right now (by the load average)."""
    return LoadMonitor().start().stop().contended


def choose(target: LoadedModel, make: Callable[[Candidate], Decoder], cands: Sequence[Candidate],
           reference: str | None = None, remeasure: bool = False, prompts: Sequence[str] | None = None,
           clock: Callable[[], float] = time.perf_counter, monitor: Callable[[], LoadMonitor] = LoadMonitor,
           busy_now: Callable[[], bool] = machine_busy) -> Choice:
    """The fastest candidate for ``target`` here: cached, else measured (and cached).

    Args:
        make: builds a candidate's generator on ``target`` (see :func:`measure`).
        cands: the configurations to choose from (:func:`candidates`, or one method on several
            kernels); a single one is returned without measuring.
        reference: the method every other candidate's ids must equal on the same kernels (None
            where the method is fixed and only kernels are chosen).
        remeasure: measure even if a choice is cached.
        prompts: calibration prompts (default :func:`calibration_prompts`).
        clock, monitor, busy_now: the timer, the load monitor of the calibration, and whether
            the machine is busy now (a cached choice measured while busy is redone when quiet).
    """
    if not cands:
        raise SelfspecError("auto has no candidate configuration to choose from")
    if len(cands) == 1:
        return Choice(cands[0])
    key = cache_key(target, cands)
    if not remeasure:
        cached = read_cache(profile_path(key), cands)
        if cached is not None and not (cached.busy and not busy_now()):
            return cached
        if cached is not None:
            log.info("auto: the cached choice was measured while the machine was busy; it is quiet now: measuring "
                     "again")
    prompts = list(prompts) if prompts is not None else calibration_prompts()
    kernels = ", ".join(dict.fromkeys(c.kernels for c in cands))
    log.info("auto: measuring %d configurations (%s on %s kernels) on %d calibration prompts for %s (once; "
             "--remeasure redoes it) ...", len(cands), ", ".join(dict.fromkeys(c.method for c in cands)), kernels,
             len(prompts), target.name)
    t0 = clock()
    mon = monitor().start()
    cal = measure(make, cands, prompts, reference, clock=clock)
    mon.stop()
    table = cal.finalists()
    label = select(table, cal.identical)
    if label is None:
        raise SelfspecError("auto: no candidate configuration ran here (see the notes above)")
    choice = Choice(next(c for c in cands if c.label == label), table, cal.pruned(), busy=mon.contended)
    ranked = sorted(table.items(), key=lambda kv: -kv[1])
    log.info("auto: chose %s (%s tok/s; %.0f s%s)", label, ", ".join(f"{k} {v:.1f}" for k, v in ranked),
             clock() - t0, "; the machine was busy: measured again on a quiet start" if choice.busy else "")
    save_cache(key, {"format": CACHE_FORMAT, "choice": label, "table": table, "pruned": choice.pruned,
                     "busy": choice.busy, "load": mon.summary(), "candidates": [c.label for c in cands],
                     "prompts": len(prompts), "max_new_tokens": CALIBRATION_TOKENS}, "auto choice")
    return choice
