"""The draft controller: what every method shares around its drafts, owned by one generator and
run by the loop (:func:`selfspec.decoding.loop.run`).

It owns:

* **the clock** (injected; :func:`~selfspec.core.timing.now` by default): every step is timed on
  it, and the drafter's ``observe`` gets what the loop measured (``state.step_time``), so no
  drafter keeps a stopwatch and tests drive draft sizing with fake clocks;
* **the cost profile's online correction** (:class:`~selfspec.core.online_cost.OnlineCost` over
  the drafter's profile): the loop times every verify forward into it, and
  :meth:`save_cost_correction` writes it back at an explicit point (no exit hook, nothing global);
* **per-request state**: what the drafter learns across requests (``drafter.snapshot()``) is
  snapshotted at load and restored (``drafter.restore``) before every rejection-sampled request,
  whose text depends on the draft lengths, so a seed reproduces a sample whatever ran before.

* **the sizer**: how much a drafter drafts is its sizer's decision (a
  :class:`~selfspec.decoding.protocol.Sizer` from ``drafters/budget.py``, ``backoff.py``,
  ``msn.py``, ``eagle.py``). Each step the controller makes the step's
  :class:`~selfspec.decoding.protocol.Budget` (:meth:`DraftController.budget`), which ``propose``
  consults mid-draft and records what it drafted into; after the step it hands the sizer that
  budget, the verified tree, the verdict and the step's measured seconds
  (:meth:`DraftController.observe`). No drafter updates its own sizer or times itself.
"""

from __future__ import annotations

from pathlib import Path

from ..core.acceptance import Verdict
from ..core.online_cost import OnlineCost
from ..core.timing import now
from .protocol import Budget, Drafter, Proposal
from .state import Clock, DecodeState, StepTime


class DraftController:
    """The clock, the cost correction, the sizer's learning and the per-request state of one
    generator's drafter.

    Attributes:
        drafter: the method's drafter (the loop calls its ``prefill / propose / observe``).
        clock: what every step is timed with.
        online: the drafter's cost profile corrected by this generator's verify timings (None
            when the drafter sizes nothing from a profile).
    """

    def __init__(self, drafter: Drafter, clock: Clock = now) -> None:
        self.clock = clock
        self.drafter = drafter

    @property
    def drafter(self) -> Drafter:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        """A new drafter: its load-time request state and profile become the controller's."""
        self._drafter = drafter
        self._fresh = drafter.snapshot()
        profile = drafter.sizer.profile if drafter.sizer is not None else None
        self.online = OnlineCost(profile) if profile is not None else None

    def start(self, state: DecodeState) -> None:
        """Before a request: its steps are timed on the controller's clock, and under rejection
        sampling the drafter starts from its load-time state."""
        state.clock = self.clock
        state.step_time = StepTime()
        if state.rejection:
            self.reset()
        if self._drafter.sizer is not None:
            self._drafter.sizer.new_prompt()

    def budget(self, width: int = 1) -> Budget | None:
        """This step's budget for ``propose`` (None where the drafter has no sizer); ``width``
        requests verify in the same packed forward (1: alone), which the sizer prices its draft by."""
        sizer = self._drafter.sizer
        if sizer is None:
            return None
        sizer.width = width
        return Budget(sizer)

    def reset(self) -> None:
        """The drafter forgets what it learned since it was adopted (its load-time snapshot)."""
        self._drafter.restore(self._fresh)

    def verified(self, block: int, seconds: float) -> None:
        """One verify forward of ``block`` tokens took ``seconds``."""
        if self.online is not None:
            self.online.observe(block, seconds)

    def measured(self, state: DecodeState, draft_s: float, step_s: float) -> None:
        """The step's propose took ``draft_s`` and the whole step ``step_s``: what ``observe``
        sees (nothing under rejection sampling: no draft may be sized from the clock)."""
        state.step_time = StepTime() if state.rejection else StepTime(draft_s, step_s)

    def observe(self, state: DecodeState, budget: Budget | None, proposal: Proposal, verdict: Verdict) -> None:
        """After a verified step: the drafter's sizer learns from the step's budget (with
        ``state.step_time``)."""
        sizer = self._drafter.sizer
        if sizer is not None and budget is not None:
            sizer.observe(budget, proposal.tree, verdict, state.step_time)

    def save_cost_correction(self) -> Path | None:
        """Write the corrected cost profile back to the cache (see
        :meth:`~selfspec.core.online_cost.OnlineCost.persist`); the path, or None."""
        return self.online.persist() if self.online is not None else None
