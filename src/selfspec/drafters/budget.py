"""The draft-budget toolkit: how much to draft, from the measured verify cost profile and the
acceptance seen so far. Every drafter that sizes its drafts uses these pieces:

* :func:`best_rate` - THE valuation: the draft size with the most expected tokens per unit of
  verify cost, against a plain step's one token per T(1) (:data:`PLAIN_RATE`).
  :func:`expected_tokens` and :func:`prefix_products` turn acceptance chances into its input.
* :class:`~.backoff.ProbeSchedule` - THE back-off: while drafting does not pay, draft anyway every
  :data:`FIRST_PROBE` steps so the estimates can recover; the interval doubles after each probe
  up to :data:`MAX_PROBE` and resets once drafting pays, so a draft that never pays costs ever less.
* :class:`~.estimators.DecayedRates` - acceptance estimates with exponential forgetting, started from a prior.
* :class:`~.backoff.Backoff` - the same schedule driven by measured tokens per second (EAGLE trees).
* :class:`GammaExit` (Draft & Verify's adaptive exit) and :class:`DraftRule` - self-spec's step
  rule over a :class:`ChainBudget`, shared by its drafter and the tuner's proxy objective.
* Each of :class:`ChainBudget`, :class:`DraftRule` and :class:`PositionalAcceptance` is a
  :class:`~selfspec.decoding.protocol.Sizer`: the drafter consults it while proposing, and the
  controller feeds it every verified step (``observe``) with the seconds the loop measured.
  Under rejection sampling (``state.rejection``) those seconds are None and timing-driven
  decisions are skipped, so a draft depends on the request alone.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.cost import CostProfile
from .backoff import ProbeSchedule
from .estimators import (
    CHAIN_DECAY,
    COST_EMA,
    FIRST_PROBE,
    MAX_PROBE,
    PLAIN_RATE,
    PRIOR_WEIGHT,
    RATE_DECAY,
    ConfidenceCalibration,
    DecayedRates,
)
from .skip_config import GammaSettings

if TYPE_CHECKING:
    from ..core.acceptance import Verdict
    from ..core.tree import DraftTree
    from ..decoding.protocol import Budget
    from ..decoding.state import StepTime


@dataclass(frozen=True)
class ChainDraft:
    """A :class:`ChainBudget`'s record of a draft whose making cost time (a model drafted it):
    ``drafted`` tokens (the verified prefix may be shorter), their confidences in draft order.
    A proposal without one (copied or guessed drafts) teaches acceptance only, not draft cost."""

    drafted: int
    confidences: tuple[float, ...]


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
        self.width = 1  # requests verifying in the same packed forward (set by the controller each step)
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
        profile = self.profile
        if profile is None:
            return min(self.k, room)
        a = min(self.alpha, 0.999)
        w = self.width  # in a batch, costs are in units of the batch's plain step, T(w) (CostProfile.shared)
        c = self.draft_cost / profile.t1 * w / profile.ratio(w) if profile.t1 > 0 else 0.0
        tokens = [(1 - a ** (k + 1)) / (1 - a) for k in range(1, min(self.k, room) + 1)]
        best_k, rate = best_rate(tokens, lambda k: profile.shared(k + 1, w) + k * c)
        return self.probe.pick(best_k, rate, width=w)  # does not pay: probe now and then, at the best length

    def best_prefix(self, confidences: list[float]) -> int:
        """How many of the drafted tokens to verify, given each one's draft confidence.

        The chance that the first d drafts are all accepted is estimated as the product of their
        calibrated confidences (:class:`ConfidenceCalibration` of the draft's probability of its
        own token, learned from this budget's verified drafts); the expected tokens of verifying
        d drafts, 1 + sum of those products, are weighed against T(d + 1). Drafting cost is
        already spent, so it does not change the choice. Without a profile all drafts are kept.
        """
        profile = self.profile
        if profile is None or not confidences:
            return len(confidences)
        chances = prefix_products(self.calibration(c) for c in confidences)
        best_d, rate = best_rate(expected_tokens(chances), lambda d: profile.shared(d + 1, self.width))
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

    def new_prompt(self) -> None:
        """Nothing restarts with a request (the :class:`~selfspec.decoding.protocol.Sizer` step)."""

    def observe(self, budget: Budget[ChainBudget, ChainDraft], tree: DraftTree, verdict: Verdict,
                step: StepTime) -> None:
        """The :class:`~selfspec.decoding.protocol.Sizer` step: the verified chain's acceptance;
        where the drafter recorded a :class:`ChainDraft` also the draft's measured cost and its
        confidences."""
        made = budget.made
        if made is not None:
            self.update(tree.size - 1, verdict.num_accepted, step.draft_s, made.drafted, made.confidences)
        else:
            self.update(tree.size - 1, verdict.num_accepted)


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
        self.width = 1  # requests verifying in the same packed forward (set by the controller each step)
        prior = list(prior or [])
        self.acceptance = DecayedRates([prior[j] if j < len(prior) else 0.3 for j in range(max_k)], decay)
        self.probe = ProbeSchedule(first_probe, max_probe)

    def rates(self) -> list[float]:
        return self.acceptance.rates()

    def cost(self, k: int, verify_tokens: int | None = None) -> float:
        """T(k + 1) of the draft step plus T(``verify_tokens``) (default k + 1, a chain) of the
        verify step, in units of T(1) (of the batch's plain step in a batch: ``CostProfile.shared``)."""
        assert self.profile is not None  # priced only with a profile (value and choose check)
        return self.profile.shared(k + 1, self.width) + self.profile.shared(verify_tokens or k + 1, self.width)

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
        ks: Sequence[int]
        size: int | None
        if tree is not None:
            ks, size = ([tree[0]] if room >= 1 else []), tree[1]
        else:
            ks, size = range(1, min(self.max_k, room) + 1), None
        best, rate = best_rate(self.tokens(max(ks, default=0)), lambda k: self.cost(k, size), ks)
        return self.probe.pick(best, rate, width=self.width)

    def update(self, proposed: int, accepted: int) -> None:
        for j in range(min(proposed, accepted + 1, self.max_k)):
            self.acceptance.observe(j, j < accepted)

    def new_prompt(self) -> None:
        """Nothing restarts with a request (the :class:`~selfspec.decoding.protocol.Sizer` step)."""

    def observe(self, budget: Budget[PositionalAcceptance, None], tree: DraftTree, verdict: Verdict,
                step: StepTime) -> None:
        """The :class:`~selfspec.decoding.protocol.Sizer` step: acceptance by position along the
        verified tree's depth (a step that verified no draft teaches nothing)."""
        depth = int(tree.depths.max())
        if depth > 0:
            self.update(depth, verdict.num_accepted)


class GammaExit:
    """The paper's adaptive draft exit (Draft & Verify Eq. 2-4).

    After each verification with ``a`` of ``d`` drafts accepted: ``AR_e = a / d``;
    ``AR <- beta1 * AR + (1 - beta1) * AR_e`` (``AR = AR_e`` at the first cycle of a prompt);
    ``gamma~ = gamma + eps`` if ``AR <= alpha`` else ``gamma - eps``;
    ``gamma <- beta2 * gamma + (1 - beta2) * gamma~``. Gamma is carried across prompts and AR is
    reset at each prompt, as in the paper's evaluation code.
    """

    def __init__(self, settings: GammaSettings) -> None:
        self.s = settings
        self.gamma = settings.gamma0
        self.ar: float | None = None

    def new_prompt(self) -> None:
        self.ar = None

    def stop(self, confidence: float) -> bool:
        """After keeping a draft of this confidence: stop drafting?"""
        return confidence < self.gamma

    def update(self, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        ar_e = accepted / drafted
        self.ar = ar_e if self.ar is None else self.s.beta1 * self.ar + (1 - self.s.beta1) * ar_e
        target = self.gamma + self.s.epsilon if self.ar <= self.s.alpha else self.gamma - self.s.epsilon
        self.gamma = self.s.beta2 * self.gamma + (1 - self.s.beta2) * target


class DraftRule:
    """THE self-spec rule of one step, over a budget and a gamma exit: how long the draft may run
    (:meth:`max_draft`), when it stops (:meth:`stop_after`), how much of it is verified
    (:meth:`verify_count`) and what verification teaches (:meth:`update`; :meth:`observe` as the
    drafter's :class:`~selfspec.decoding.protocol.Sizer`, fed by the controller). The drafter
    decodes with it and the tuner's proxy objective replays it (``tune/objectives.simulate``), so
    the two cannot drift. Holds references, not copies: updates land in the budget and the exit."""

    def __init__(self, budget: ChainBudget, gamma: GammaExit, draft_exit: str, auto_k: bool,
                 min_confidence: float) -> None:
        self.budget, self.gamma, self.draft_exit, self.auto_k = budget, gamma, draft_exit, auto_k
        self.min_confidence = min_confidence if auto_k else 0.0
        self.p_all = 1.0

    def max_draft(self, room: int) -> int:
        """The longest draft this step (0: a plain step), at most ``room``."""
        if not self.auto_k:
            return min(self.budget.k, room)
        k = self.budget.choose(room)
        if self.draft_exit == "gamma" and k > 0:  # the budget only decides whether to draft at all
            return min(self.budget.k, room)
        return k

    def start(self) -> None:
        """A draft begins."""
        self.p_all = 1.0

    def stop_after(self, confidence: float) -> bool:
        """After drafting a token of this confidence: stop the draft here?"""
        self.p_all *= self.budget.calibration(confidence)
        if self.draft_exit == "gamma":
            return self.gamma.stop(confidence)
        return self.draft_exit == "cost" and self.p_all < self.min_confidence

    def verify_count(self, confidences: list[float]) -> int:
        """How many of the drafted tokens (their confidences, in order) to verify."""
        if self.draft_exit == "cost" and self.auto_k:
            return self.budget.best_prefix(confidences)
        return len(confidences)

    @property
    def profile(self) -> CostProfile | None:
        return self.budget.profile

    @profile.setter
    def profile(self, profile: CostProfile | None) -> None:
        self.budget.profile = profile

    @property
    def width(self) -> int:
        """Requests verifying in the same packed forward (the budget's; set by the controller)."""
        return self.budget.width

    @width.setter
    def width(self, width: int) -> None:
        self.budget.width = width

    def update(self, verified: int, accepted: int, draft_seconds: float | None, drafted: int,
               confidences: Sequence[float]) -> None:
        """``accepted`` of ``verified`` drafts were kept; drafting ``drafted`` took ``draft_seconds``."""
        self.budget.update(verified, accepted, draft_seconds, drafted, confidences)
        self.gamma.update(accepted, verified)

    def new_prompt(self) -> None:
        """A new request: the gamma exit starts its prompt (the :class:`~selfspec.decoding.protocol.Sizer` step)."""
        self.gamma.new_prompt()

    def observe(self, budget: Budget[DraftRule, ChainDraft], tree: DraftTree, verdict: Verdict,
                step: StepTime) -> None:
        """The :class:`~selfspec.decoding.protocol.Sizer` step (a plain step teaches nothing)."""
        made = budget.made
        if made is not None and made.drafted:
            self.update(tree.size - 1, verdict.num_accepted, step.draft_s, made.drafted, made.confidences)
