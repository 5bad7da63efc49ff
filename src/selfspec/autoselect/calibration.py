"""``auto``'s calibration: the candidate configurations (method, verify kernels, draft precision)
from the registry's specs, and their measurement by successive halving within a time budget
(:func:`measure`, :func:`fit_round`), and the pick among the finalists (:func:`select`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Protocol

from ..drafters.spec import AutoContext, MethodSpec
from ..errors import SelfspecError
from ..models.loading import Runner

log = logging.getLogger("selfspec.auto")

AUTO_PREFIX = "auto→"  # what a generator whose configuration auto chose is named with
CALIBRATION_PROMPTS = 4  # 2 code + 2 chat from the shipped calibration set
CALIBRATION_TOKENS = 32
PRUNE_TOKENS = 16  # round 0 (every candidate, once) only prunes: half the tokens halve its cost
WARMUP_TOKENS = 4
# Successive halving: (calibration prompts decoded, candidates kept into the round; None: all).
ROUNDS: tuple[tuple[int, int | None], ...] = ((1, None), (2, 4), (1, 2))
# Seconds a calibration may take: later rounds shrink (fewer prompts, then two finalists) or are
# skipped to fit, by what round 0 measured; round 0 itself is every candidate once, whatever it
# costs on a quiet machine (on a busy one it stops at BUSY_CUT of the budget), and the two fastest
# always decode one more prompt (a one-prompt choice is noise).
BUDGET_S = 60.0
BUSY_CUT = 0.25
"""On a busy machine, round 0 times no further configuration once this share of the budget is spent."""
CACHE_FORMAT = "selfspec-auto/3"  # 3: the fastest reference is always a finalist


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


class Decoded(Protocol):
    """What a :class:`Decoder`'s ``generate`` returns (``selfspec``'s ``GenerationResult``, or a fake in tests)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def new_tokens(self) -> int: ...


class Decoder(Protocol):
    """What :func:`measure` times: ``selfspec.load``'s generator, or a fake in tests."""

    def generate(self, prompt: str, max_new_tokens: int) -> Decoded: ...


@dataclass
class Calibration:
    """What :func:`measure` found, by candidate label (in candidate order).

    Attributes:
        speeds: tokens/s over every prompt the candidate decoded (timed runs only).
        reached: the last round (index into :data:`ROUNDS`) the candidate decoded in.
        identical: False where its ids differed from the reference's on the same kernels.
        errors: why a candidate could not be built or run (left out).
        untimed: candidates not timed because the machine was busy and the budget spent (round 0
            stopped early; no later round ran).
    """

    speeds: dict[str, float] = field(default_factory=dict)
    reached: dict[str, int] = field(default_factory=dict)
    identical: dict[str, bool] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    untimed: list[str] = field(default_factory=list)

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


def candidates(target: Runner, specs: Iterable[MethodSpec], kernels: Sequence[str],
               ctx: AutoContext | None = None) -> list[Candidate]:
    """The cross product of the methods in ``specs`` that are ``auto`` candidates for ``target``
    here (in ``specs`` order, the reference first), their draft precisions, and ``kernels``."""
    ctx = ctx or AutoContext()
    usable = ctx.draft_precisions
    if usable is None:
        usable = usable_precisions(next(target.model.parameters()).device.type)
    out: list[Candidate] = []
    for spec in specs:
        if spec.auto is None or not spec.lossless:
            continue
        options = spec.auto.options(spec.name, target, ctx)
        if options is None:
            continue
        variants = [(dict(options), "")]
        if spec.auto.precision_option and spec.auto.precision_option in options:  # the candidacy fixed it
            variants = [(dict(options), str(options[spec.auto.precision_option]))]
        elif spec.auto.precision_option:
            variants = [({**options, spec.auto.precision_option: p}, p) for p in spec.auto.precisions
                        if p in ("", "same") or p in usable]
        for k in kernels:
            for opts, precision in variants:
                if precision not in ("", "same") and precision == k:
                    continue  # drafts on the verify kernels: the "same" variant
                out.append(Candidate(spec.name, opts, k, precision))
    return out


def usable_precisions(device_type: str) -> tuple[str, ...]:
    """The draft precisions that can pay on this kind of device (each one left out noted, with why)."""
    from ..kernels.switch import draft_precisions

    usable, left_out = draft_precisions(device_type)
    for precision, why in left_out.items():
        log.info("auto: %s drafts left out: %s", precision, why)
    return tuple(usable)


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
            clock: Callable[[], float] = time.perf_counter, prune_tokens: int | None = PRUNE_TOKENS,
            busy: Callable[[], bool] | None = None) -> Calibration:
    """Calibrate ``cands`` greedily on ``prompts`` by successive halving over ``rounds``.

    ``make(candidate)`` builds a generator on the already loaded model (on its backend's runner,
    never switched). A candidate that fails to build or run (:class:`SelfspecError`) is left out with a
    note. With ``reference`` (a method name), every other candidate's ids must equal the
    reference method's on the same kernels and prompt (the reference is built for a kernels
    backend it is no candidate on, untimed); otherwise it is disqualified. ``budget_s`` bounds
    the whole calibration (builds included) where it can: a later round whose projected time (each
    finalist's seconds per prompt so far) would overrun it runs fewer prompts, then only the two
    fastest, or is skipped (None: no bound); the first later round always keeps one prompt for
    the two fastest. The fastest reference candidate stays in every round besides the finalists the
    round keeps, so the choice is made against plain decoding on the same prompts. Round 0, where
    every candidate decodes once and which only prunes, decodes ``prune_tokens`` (None:
    ``max_new_tokens``); the later rounds ``max_new_tokens``. Every
    candidate that reaches a round has decoded the same prompts at the same lengths as the others
    there, so speeds compare alike. ``clock`` times the runs (injected in tests).

    ``busy()`` says whether other processes took our CPUs so far: once round 0 has spent
    :data:`BUSY_CUT` of the budget on a busy machine, the candidates not yet timed are left untimed
    (:attr:`Calibration.untimed`) and no later round runs, so a busy machine's calibration stays near
    its budget (the caller keeps plain decoding and measures again on a quiet start)."""
    by_label = {c.label: c for c in cands}
    started = clock()
    cal = Calibration()
    gens: dict[str, Decoder] = {}
    tokens = dict.fromkeys(by_label, 0)
    seconds = dict.fromkeys(by_label, 0.0)
    refs: dict[tuple[str, int], list[int]] = {}
    ref_gens: dict[str, Decoder | None] = {}

    def is_reference(c: Candidate) -> bool:
        return c.method == reference and not c.options

    def reference_ids(kernels: str, i: int, n: int) -> list[int] | None:
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
            refs[(kernels, i)] = list(g.generate(prompts[i], max_new_tokens=n).token_ids)
        return refs[(kernels, i)]

    def run(label: str, i: int, n: int = max_new_tokens) -> None:
        c = by_label[label]
        t0 = clock()
        r = gens[label].generate(prompts[i], max_new_tokens=n)
        seconds[label] += clock() - t0
        tokens[label] += r.new_tokens
        ids = list(r.token_ids)
        if reference is None:
            return
        if is_reference(c):
            refs.setdefault((c.kernels, i), ids)
        elif reference_ids(c.kernels, i, n) != ids:
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
                if (cal.untimed or (gens and budget_s is not None and busy is not None
                                    and clock() - started > BUSY_CUT * budget_s and busy())):
                    cal.untimed.append(label)
                    continue
                try:
                    gens[label] = make(c)
                    gens[label].generate(prompts[0], max_new_tokens=WARMUP_TOKENS)  # one-off costs are not speed
                    for i in idx:  # each prompt index belongs to one round: one length per prompt
                        run(label, i, prune_tokens or max_new_tokens)
                except SelfspecError as e:
                    cal.errors[label] = str(e)
                    continue
                cal.reached[label] = 0
                log.info("auto: %s %.1f tok/s", label, speed(label))
            alive = [label for label in by_label if ok(label)]
            if cal.untimed:
                log.info("auto: the machine is busy and %.0f s of the %.0f s budget are spent: %d of %d configurations "
                         "not timed (%s)", clock() - started, budget_s, len(cal.untimed), len(by_label),
                         ", ".join(cal.untimed))
                break
            continue
        if len(alive) <= 1 or not idx:
            break
        keep_n = len(alive) if keep is None else keep
        ranked = sorted(alive, key=lambda lab: -speed(lab))
        per_prompt = [seconds[lab] / max(tokens[lab], 1) * max_new_tokens for lab in ranked]  # at this round's length
        fitted = fit_round(len(idx), keep_n, per_prompt,
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
        # the fastest reference stays a finalist: a speculative configuration wins only by beating plain
        # decoding head-to-head on the same prompts (a near-tie on the short pruning prompt once chose a
        # configuration slower than ar); its ids are decoded for the others anyway
        kept.update(next(([lab] for lab in ranked if is_reference(by_label[lab])), []))
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


