"""Back-off while drafting does not pay, and the probes that let it recover:
:class:`ProbeSchedule` (valued in units of T(1) from the cost model) and :class:`Backoff` (the same
schedule driven by measured tokens per second), which with a confidence calibration makes
:class:`TreeSizer`, the sizer of EAGLE trees. Fed measured seconds only outside rejection
sampling (see :mod:`selfspec.drafters.budget`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.cost import CostProfile
from .estimators import COST_EMA, FIRST_PROBE, MAX_PROBE, PLAIN_RATE, ConfidenceCalibration

if TYPE_CHECKING:
    from ..core.acceptance import Verdict
    from ..core.tree import DraftTree
    from ..decoding.protocol import Budget
    from ..decoding.state import StepTime


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

    def due(self, width: int = 1) -> bool:
        """One step on which drafting does not pay: True when a probe is due (the interval then
        doubles, up to ``max_probe``). In a batch of ``width`` requests (continuous batching) the
        interval is ``width`` times longer: a probe draft stalls every request of the batch (their
        packed forward waits for it), so the batch as a whole probes as often as one request alone.
        On a 2-core EPYC (SmolLM2, self-spec with its int8 draft, 8 requests x 64 tokens) the
        unscaled probes cost the batch a fifth of its throughput against plain batched steps."""
        self.since += 1
        if self.since < self.every * max(width, 1):
            return False
        self.since = 0
        self.every = min(2 * self.every, self.max_probe)
        return True

    def pick(self, best: int, rate: float, probe: int | None = None, width: int = 1) -> int:
        """The draft size for this step, given :func:`best_rate`'s ``best`` size and its ``rate``
        (units of T(1)): ``best`` when it pays; else ``probe`` (default ``best``) when a probe is
        due (:meth:`due`, in a batch of ``width`` requests), else 0 (a plain step)."""
        if not best:
            return 0
        if rate > PLAIN_RATE:
            self.pays()
            return best
        return (best if probe is None else probe) if self.due(width) else 0


@dataclass(frozen=True)
class TreeDraft:
    """A :class:`TreeSizer`'s record of a step that ran the draft head: the path probability of
    each drafted node of the proposed tree, in tree order (empty when none was worth verifying)."""

    path_probs: tuple[float, ...]


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


class TreeSizer:
    """The :class:`~selfspec.decoding.protocol.Sizer` of EAGLE trees, fed by the controller:
    whether to draft at all (:class:`Backoff`, on the measured seconds of drafted and plain
    steps) and the acceptance of a node against its draft path probability
    (:class:`~.estimators.ConfidenceCalibration`), which prices tree levels and sizes.

    Args:
        profile: the target's verify-cost profile (None: fixed trees, no back-off).
        backoff: back off to plain steps while drafting does not pay.
        calibrate: learn the calibration (else path probabilities are taken as they are).
    """

    def __init__(self, profile: CostProfile | None, backoff: bool = True, calibrate: bool = True) -> None:
        self.profile = profile
        self.width = 1  # always 1: head methods decode one request at a time (MethodSpec.draft_weights)
        self.backoff = Backoff(profile.t1 if profile is not None and backoff else None)
        self.calibration = ConfidenceCalibration() if calibrate else None

    def new_prompt(self) -> None:
        """Nothing restarts with a request (the :class:`~selfspec.decoding.protocol.Sizer` step)."""

    def observe(self, budget: Budget[TreeSizer, TreeDraft], tree: DraftTree, verdict: Verdict,
                step: StepTime) -> None:
        """Every drafted node's calibration (on the accepted path or not); the step's seconds
        into the back-off: a drafted step (the drafter recorded a :class:`TreeDraft`) with what it
        committed, a plain step while backed off (what drafting must beat). Under rejection
        sampling (no seconds) only the calibration."""
        made = budget.made
        drafted = made is not None
        if made is not None and self.calibration is not None:
            accepted = set(verdict.accepted_nodes)
            for i, p in enumerate(made.path_probs):
                self.calibration.observe_one(p, i + 1 in accepted)
        if step.step_s is None:
            return
        if drafted:
            self.backoff.record(verdict.num_accepted + 1, step.step_s)
        elif self.backoff.off:
            self.backoff.record_plain(step.step_s)
