"""The draft-budget toolkit: how much to draft, from the measured verify cost profile and the
acceptance seen so far. Every drafter that sizes its drafts uses these pieces:

* :func:`best_rate` - THE valuation: the draft size with the most expected tokens per unit of
  verify cost, against a plain step's one token per T(1) (:data:`PLAIN_RATE`).
  :func:`expected_tokens` and :func:`prefix_products` turn acceptance chances into its input.
* :class:`ProbeSchedule` - THE back-off: while drafting does not pay, draft anyway every
  :data:`FIRST_PROBE` steps so the estimates can recover; the interval doubles after each probe
  up to :data:`MAX_PROBE` and resets once drafting pays, so a draft that never pays costs ever less.
* :class:`DecayedRates` - acceptance estimates with exponential forgetting, started from a prior.
* :class:`Backoff` - the same schedule driven by measured tokens per second (EAGLE trees).
* Timing comes from :mod:`selfspec.core.timing` (it syncs on CUDA). Under rejection sampling
  (``state.rejection``) drafters never size drafts from the wall clock: they pass ``None``
  seconds and skip timing-driven decisions, so a draft depends on the request alone.

For a chain of k drafts, each accepted with probability alpha (the online estimate), the
expected tokens per step are ``(1 - alpha^(k+1)) / (1 - alpha)`` and the cost is
``T(k+1) + k * c`` in units of T(1), where ``c`` is the measured cost of drafting one token.
:class:`ChainBudget` picks the k with the best tokens per unit cost.

:class:`PositionalAcceptance` keeps the acceptance of each draft position separately (the
fine-tuned self-drafting methods, whose position j is a different token - adaptive token or mask
j - with its own accuracy); methods price a loop by overriding ``first_tokens`` and ``cost``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..core.cost import CostProfile

PLAIN_RATE = 1.0
"""Tokens per T(1) of a plain (undrafted) step: a draft size must beat it to be worth verifying."""
FIRST_PROBE = 8
"""Steps between probe drafts once drafting stops paying."""
MAX_PROBE = 64
"""The longest probe interval: it doubles after each probe, up to this."""
PRIOR_WEIGHT = 2.0
"""Pseudo-observations behind a prior acceptance (how fast real observations override it)."""
CHAIN_DECAY = 0.95
"""Weight of past observations per drafting step in :class:`ChainBudget`'s single acceptance rate."""
RATE_DECAY = 0.97
"""Weight of past observations per verified step in per-position / per-node rates
(:class:`PositionalAcceptance`, MSN's template nodes): each sees fewer observations per step."""
COST_EMA = 0.8
"""Weight of the past in the moving estimates of measured seconds (draft cost per token in
:class:`ChainBudget`; tokens and seconds of drafted steps in :class:`Backoff`)."""


def prefix_products(rates: Iterable[float]) -> list[float]:
    """``[a_1, a_1 a_2, ...]``: the chance that drafts 1..j are all accepted, from the acceptance
    ``a_j`` of draft j given the ones before it were accepted (or each draft's confidence)."""
    out, p = [], 1.0
    for a in rates:
        p *= a
        out.append(p)
    return out


def expected_tokens(accepted: Iterable[float], first: float = 1.0) -> list[float]:
    """Expected tokens committed by verifying the first n drafts, for n = 1, 2, ...: ``first``
    (what a step commits for sure: the target's own token) plus the chance of each of drafts
    1..n being accepted (``accepted[j]``: draft j and every draft before it on its path)."""
    out, total = [], first
    for a in accepted:
        total += a
        out.append(total)
    return out


def best_rate(tokens: Sequence[float], cost: Callable[[int], float],
              sizes: Iterable[int] | None = None) -> tuple[int, float]:
    """The draft size with the most expected tokens per unit of verify cost.

    Args:
        tokens: ``tokens[n - 1]``, the expected tokens of verifying n drafts.
        cost: the cost of that step (units of T(1), or seconds: the caller's choice).
        sizes: the sizes considered (default ``1 .. len(tokens)``).

    Returns:
        the best size n (the smallest one on ties; 0 if ``sizes`` is empty) and its rate
        ``tokens[n - 1] / cost(n)``. Drafting pays if the rate beats a plain step's
        (:data:`PLAIN_RATE` in units of T(1)); the caller decides what to do if it does not.
    """
    best_n, best = 0, float("-inf")
    for n in range(1, len(tokens) + 1) if sizes is None else sizes:
        rate = tokens[n - 1] / cost(n)
        if rate > best:
            best_n, best = n, rate
    return best_n, best


class ProbeSchedule:
    """Back-off while drafting does not pay: a probe draft every ``every`` steps, the interval
    doubling after each probe (up to ``max_probe``) and back at ``first_probe`` once drafting pays.

    Attributes:
        every: the current interval; since: steps waited since the last probe.
    """

    def __init__(self, first_probe: int = FIRST_PROBE, max_probe: int = MAX_PROBE) -> None:
        self.first_probe, self.max_probe = first_probe, max_probe
        self.every, self.since = first_probe, 0

    def pays(self) -> None:
        """Drafting pays: the next back-off starts at the first interval."""
        self.every = self.first_probe

    def due(self) -> bool:
        """One step on which drafting does not pay: True when a probe is due (the interval then
        doubles, up to ``max_probe``)."""
        self.since += 1
        if self.since < self.every:
            return False
        self.since = 0
        self.every = min(2 * self.every, self.max_probe)
        return True

    def pick(self, best: int, rate: float, probe: int | None = None) -> int:
        """The draft size for this step, given :func:`best_rate`'s ``best`` size and its ``rate``
        (units of T(1)): ``best`` when it pays; else ``probe`` (default ``best``) when a probe is
        due, else 0 (a plain step)."""
        if not best:
            return 0
        if rate > PLAIN_RATE:
            self.pays()
            return best
        return (best if probe is None else probe) if self.due() else 0


class DecayedRates:
    """Acceptance of each of a fixed set of slots (draft positions, tree template nodes): hits per
    try with exponential forgetting, from a prior worth :data:`PRIOR_WEIGHT` observations."""

    def __init__(self, prior: Iterable[float], decay: float = RATE_DECAY) -> None:
        self.decay = decay
        self.hits = [PRIOR_WEIGHT * a for a in prior]
        self.tries = [PRIOR_WEIGHT] * len(self.hits)

    def __len__(self) -> int:
        return len(self.hits)

    def rate(self, j: int) -> float:
        return self.hits[j] / self.tries[j]

    def rates(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.tries)]

    def observe(self, j: int, hit: bool) -> None:
        """Slot ``j`` was verified (tried) and accepted or not."""
        self.tries[j] = self.tries[j] * self.decay + 1.0
        self.hits[j] = self.hits[j] * self.decay + (1.0 if hit else 0.0)


class ConfidenceCalibration:
    """The chance that a draft token is accepted given its draft confidence (the draft's own
    probability of the token it proposes), learned online per confidence decile.

    A draft's confidence is a poor acceptance estimate when the draft is a near copy of the
    target: SmolLM2's whole-model int8 draft agrees with the target on 85% of the tokens it
    proposes with confidence 0.2-0.3 (MT-bench). Each decile keeps a ratio, accepted drafts per
    unit of their summed confidence, and a draft of confidence c gets ``c`` times its decile's
    ratio (at most 1; the ratio at most what takes the decile's midpoint to 1). A ratio, not the
    decile's acceptance itself: in an EAGLE tree most candidates have path probabilities far
    below 0.1, and giving each the acceptance measured for the lowest decile (0.04, from the
    candidates near 0.1 that get verified) summed to several phantom tokens and sized 64-node
    trees (3 T(1)) that committed 2. Ratios start at 1 (the identity, worth :data:`PRIOR_WEIGHT`
    drafts at the midpoint) and follow what verification shows, with :data:`RATE_DECAY`
    forgetting. Only the verified prefix up to the first rejection is observed: drafts after a
    rejection were never tested on their own.
    """

    BINS = 10

    def __init__(self, decay: float = RATE_DECAY) -> None:
        self.decay = decay
        mids = [(i + 0.5) / self.BINS for i in range(self.BINS)]
        self.hits = [PRIOR_WEIGHT * m for m in mids]  # decayed accepted drafts per decile
        self.mass = [PRIOR_WEIGHT * m for m in mids]  # decayed summed confidence of its tested drafts
        self.caps = [1.0 / m for m in mids]

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.BINS), 0), self.BINS - 1)

    def ratio(self, j: int) -> float:
        """Accepted drafts per unit of confidence in decile ``j``."""
        return min(self.hits[j] / self.mass[j], self.caps[j]) if self.mass[j] > 0 else self.caps[j]

    def __call__(self, confidence: float) -> float:
        """The estimated acceptance of a draft of this confidence."""
        return min(1.0, confidence * self.ratio(self._bin(confidence)))

    def table(self) -> list[float]:
        """Each decile's ratio, lowest first (for vectorised lookups: chance = min(1, c * ratio))."""
        return [self.ratio(j) for j in range(self.BINS)]

    def observe_one(self, confidence: float, hit: bool) -> None:
        """One draft of this confidence was tested and accepted or not."""
        j = self._bin(confidence)
        self.mass[j] = self.mass[j] * self.decay + max(confidence, 0.0)
        self.hits[j] = self.hits[j] * self.decay + (1.0 if hit else 0.0)

    def observe(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        """One verified chain: its first ``verified`` drafts (confidences in draft order) were
        checked and the first ``accepted`` of them kept."""
        for j in range(min(verified, accepted + 1, len(confidences))):
            self.observe_one(confidences[j], j < accepted)


class Backoff:
    """Plain decoding while drafted steps commit fewer tokens per second than plain steps; probes
    follow a :class:`ProbeSchedule`. Fed measured seconds, so never under rejection sampling (see
    module docstring).

    Plain steps are measured in place (:meth:`record_plain`) as soon as there are any: a step of
    the decode loop costs more than the profile's T(1) (acceptance, cache bookkeeping, the hidden
    states a head needs), and comparing drafted steps, which carry that overhead, against the bare
    T(1) switched drafting off where it paid (SmolLM2 with the 5x-token EAGLE head: 4% of steps
    drafted, 1.04x `ar`, against 1.22x drafting every step). Until a plain step is measured the
    profile's T(1) stands in.

    One drafted step is a noisy sample: with depth-1 acceptance near 0.5 it commits 1 token about
    half the time, and a step now and then costs several T(1) (a tree sized from an estimate
    that was off, a long prompt's catch-up). So decisions are taken on runs of steps, not on
    one: drafting is switched off only after ``min_steps`` drafted steps since it was last
    switched on, a probe is a burst of ``min_steps`` drafted steps judged at its end, and a step's
    seconds count at most :data:`OUTLIER` plain steps (a spike still says "does not pay" unless
    the step committed that many tokens).

    Args:
        t1: seconds of a one-token verify (the ar step), or None to always draft.
        min_steps: drafted steps behind every decision (and the length of a probe burst).
    """

    OUTLIER = 3.0
    """A drafted step's measured seconds count at most this many plain steps."""

    def __init__(self, t1: float | None, min_steps: int = 4, first_probe: int = FIRST_PROBE,
                 max_probe: int = MAX_PROBE) -> None:
        self.t1 = t1
        self.min_steps = min_steps
        self.schedule = ProbeSchedule(first_probe, max_probe)
        self.tokens = self.seconds = 0.0  # exponential moving sums over drafted steps
        self.plain_seconds = 0.0  # moving estimate of a measured plain step (0: none yet)
        self.steps = 0  # drafted steps since drafting was switched on (or since the probe began)
        self.burst = 0  # drafted steps left in the current probe
        self.off = False

    @property
    def probe_every(self) -> int:
        return self.schedule.every

    def draft_now(self) -> bool:
        """Whether to draft this step (called once per step that has room to draft)."""
        if not self.off or self.burst > 0:
            return True
        if self.schedule.due():
            self.burst = self.min_steps
            return True
        return False

    def record_plain(self, seconds: float) -> None:
        """One plain step (the pending token verified alone) took ``seconds``, timed like drafted
        steps (from the drafter's propose to its observe)."""
        if self.t1 is None:
            return
        self.plain_seconds = seconds if self.plain_seconds == 0 else (
            COST_EMA * self.plain_seconds + (1 - COST_EMA) * seconds)

    def record(self, committed: int, seconds: float) -> None:
        """One drafted step committed ``committed`` tokens in ``seconds`` (draft + verify)."""
        if self.t1 is None:
            return
        plain = self.plain_seconds or self.t1
        self.tokens = COST_EMA * self.tokens + committed
        self.seconds = COST_EMA * self.seconds + min(seconds, self.OUTLIER * plain)
        self.steps += 1
        pays = self.tokens / self.seconds >= 1.0 / plain
        if self.off:  # a probe burst: judged at its end
            self.burst = max(self.burst - 1, 0)
            if self.burst == 0 and pays:
                self.off, self.steps = False, 0
                self.schedule.pays()
        elif self.steps >= self.min_steps and not pays:
            self.off, self.schedule.since, self.steps = True, 0, 0


class ChainBudget:
    """Chooses the draft length k for chain drafters.

    Args:
        profile: the target's verify cost profile, or None to use ``k`` as a fixed length.
        k: fixed draft length when ``profile`` is None; otherwise the largest k considered.
        prior_alpha: acceptance assumed before anything was observed.
        decay: weight of old observations per step (exponential forgetting).
        probe_every / max_probe_every: the :class:`ProbeSchedule` of drafts (at the best length)
            while k = 0 looks best, so the acceptance estimate can recover.
    """

    def __init__(self, profile: CostProfile | None, k: int, prior_alpha: float = 0.6,
                 decay: float = CHAIN_DECAY, probe_every: int = FIRST_PROBE,
                 max_probe_every: int = MAX_PROBE) -> None:
        self.profile = profile
        self.k = k
        self.decay = decay
        self.probe = ProbeSchedule(probe_every, max_probe_every)
        self.calibration = ConfidenceCalibration()
        # pseudo-counts of accepted drafts and rejections (a geometric model's sufficient stats)
        self.set_prior(prior_alpha, 0.0)  # draft_cost: seconds per drafted token, running estimate

    def set_prior(self, alpha: float, draft_seconds: float) -> None:
        """Start from a known acceptance and per-token draft cost (e.g. measured when the draft
        was tuned) instead of the generic prior and a free draft, so a draft that does not pay
        is not tried at length before the estimates catch up."""
        self.accepted, self.rejected = PRIOR_WEIGHT * alpha, PRIOR_WEIGHT * (1.0 - alpha)
        self.draft_cost = draft_seconds

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, room: int) -> int:
        """Draft length for the next step, at most ``room``."""
        if self.profile is None:
            return min(self.k, room)
        a = min(self.alpha, 0.999)
        c = self.draft_cost / self.profile.t1 if self.profile.t1 > 0 else 0.0
        tokens = [(1 - a ** (k + 1)) / (1 - a) for k in range(1, min(self.k, room) + 1)]
        best_k, rate = best_rate(tokens, lambda k: self.profile.ratio(k + 1) + k * c)
        return self.probe.pick(best_k, rate)  # does not pay: probe now and then, at the best length

    def best_prefix(self, confidences: list[float]) -> int:
        """How many of the drafted tokens to verify, given each one's draft confidence.

        The chance that the first d drafts are all accepted is estimated as the product of their
        calibrated confidences (:class:`ConfidenceCalibration` of the draft's probability of its
        own token, learned from this budget's verified drafts); the expected tokens of verifying
        d drafts, 1 + sum of those products, are weighed against T(d + 1). Drafting cost is
        already spent, so it does not change the choice. Without a profile all drafts are kept.
        """
        if self.profile is None or not confidences:
            return len(confidences)
        chances = prefix_products(self.calibration(c) for c in confidences)
        best_d, rate = best_rate(expected_tokens(chances), lambda d: self.profile.ratio(d + 1))
        return best_d if rate > PLAIN_RATE else 0

    def update(self, proposed: int, accepted: int, draft_seconds: float | None = None,
               drafted: int | None = None, confidences: Sequence[float] | None = None) -> None:
        """Record one step: ``accepted`` of ``proposed`` verified drafts kept; drafting
        ``drafted`` tokens (default ``proposed``) took ``draft_seconds``; ``confidences`` (draft
        order) teach the confidence calibration."""
        if proposed > 0:
            if confidences is not None:
                self.calibration.observe(confidences, proposed, accepted)
            self.accepted = self.accepted * self.decay + accepted
            self.rejected = self.rejected * self.decay + (1 if accepted < proposed else 0)
        drafted = proposed if drafted is None else drafted
        if draft_seconds is not None and drafted > 0:
            per_tok = draft_seconds / drafted
            self.draft_cost = per_tok if self.draft_cost == 0 else COST_EMA * self.draft_cost + (1 - COST_EMA) * per_tok


class PositionalAcceptance:
    """Acceptance of draft position j given positions < j were accepted, with exponential
    forgetting; chooses k from a cost profile (see module docstring).

    A loop of k drafts commits ``first_tokens`` for sure plus drafts 1..j with the product of
    their acceptances, at a cost of :meth:`cost` (units of T(1)); subclasses price their loop by
    overriding both.
    """

    first_tokens = 2.0  # the draft step's own token and the verify step's bonus token

    def __init__(self, profile: CostProfile | None, max_k: int, prior: list[float] | None = None,
                 decay: float = RATE_DECAY, first_probe: int = FIRST_PROBE, max_probe: int = MAX_PROBE) -> None:
        self.profile, self.max_k = profile, max_k
        prior = list(prior or [])
        self.acceptance = DecayedRates([prior[j] if j < len(prior) else 0.3 for j in range(max_k)], decay)
        self.probe = ProbeSchedule(first_probe, max_probe)

    def rates(self) -> list[float]:
        return self.acceptance.rates()

    def cost(self, k: int, verify_tokens: int | None = None) -> float:
        """T(k + 1) of the draft step plus T(``verify_tokens``) (default k + 1, a chain) of the
        verify step, in units of T(1)."""
        return self.profile.ratio(k + 1) + self.profile.ratio(verify_tokens or k + 1)

    def tokens(self, k: int) -> list[float]:
        """Expected tokens of loops of 1 .. k drafts (positions past ``max_k`` add nothing)."""
        out = expected_tokens(prefix_products(self.rates()[:k]), self.first_tokens)
        return out + out[-1:] * (k - len(out))

    def value(self, k: int, verify_tokens: int | None = None) -> float:
        """Expected tokens per T(1) of a loop with k drafts whose verify step runs
        ``verify_tokens`` tokens (default: the method's); k = 0 (plain steps) is 1."""
        if k == 0 or self.profile is None:
            return PLAIN_RATE
        return self.tokens(k)[-1] / self.cost(k, verify_tokens)

    def choose(self, room: int, tree: tuple[int, int] | None = None) -> int:
        """k for the next loop (0 = a plain step), at most ``room``. ``tree`` = (depth, nodes) of a
        fixed sampling tree: then only k = its depth is considered, verified at its size."""
        if self.profile is None:
            return min(tree[0] if tree else self.max_k, room)
        if tree is not None:
            ks, size = ([tree[0]] if room >= 1 else []), tree[1]
        else:
            ks, size = range(1, min(self.max_k, room) + 1), None
        best, rate = best_rate(self.tokens(max(ks, default=0)), lambda k: self.cost(k, size), ks)
        return self.probe.pick(best, rate)

    def update(self, proposed: int, accepted: int) -> None:
        for j in range(min(proposed, accepted + 1, self.max_k)):
            self.acceptance.observe(j, j < accepted)
