"""The drafter interface: what the decoding loop asks of a method, and what a method proposes.

A drafter sees the decode state, proposes a :class:`~selfspec.core.tree.DraftTree` rooted at the
pending token, optionally with *piggyback* query tokens that ride along in the same verify
forward (their logits come back to the drafter; their KV is never committed), and observes the
verdict to roll back its own state. How much it drafts is its :class:`Sizer`'s decision: the
controller owns the sizer, hands ``propose`` the step's :class:`Budget` (the sizer to consult
mid-draft, and where the drafter writes what it drafted), and teaches the sizer from that budget
after every step. The loop (:mod:`selfspec.decoding.loop`)
depends on this module only, never on :mod:`selfspec.drafters`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from ..core.acceptance import Verdict
from ..core.tree import DraftTree

if TYPE_CHECKING:
    from ..core.cost import CostProfile
    from .state import DecodeState, StepTime, VerifyOutput


@dataclass(frozen=True)
class Piggyback:
    """Extra query tokens appended after the tree in the verify forward.

    Attributes:
        tokens: ``[M]`` int64 token ids.
        positions: ``[M]`` int64 absolute position ids.
        mask: ``[M, N + M]`` bool: which tree nodes and piggyback tokens each one sees (the
            committed prefix is always visible).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class Proposal:
    """What a drafter proposes for one step.

    Attributes:
        tree: the draft tree rooted at the pending token.
        piggyback: extra query tokens riding along in the verify forward, or None.
        accept_rule: a sampling acceptance rule replacing the lossless one, ``(tree, target_logits
            [N, V], warper, generator) -> Verdict``. Only methods registered as not lossless may
            set it (the loop refuses it otherwise); greedy decoding never uses it.
    """

    tree: DraftTree
    piggyback: Piggyback | None = None
    accept_rule: Callable | None = None


S = TypeVar("S")
R = TypeVar("R")


@dataclass
class Budget(Generic[S, R]):
    """One step's draft budget, made by the controller from the drafter's sizer
    (:meth:`~selfspec.decoding.controller.DraftController.budget`), handed to
    :meth:`Drafter.propose`: the drafter consults ``sizer``
    while it drafts (how many tokens or nodes, when to exit) and writes what it made into
    ``made``, the sizer's own record type (tokens drafted and their confidences, the template
    nodes, the path probabilities); after verification the controller hands the same budget to
    :meth:`Sizer.observe`, which reads ``made`` as the type it knows (None: nothing was drafted
    that the sizer learns a cost or confidence from).

    Attributes:
        sizer: the sizer to consult (read-only for the drafter: it learns only from the controller).
        made: the drafter's record of the draft, or None.
    """

    sizer: S
    made: R | None = None


class LearnedState:
    """The :meth:`Drafter.snapshot` / :meth:`Drafter.restore` of a drafter whose cross-request
    state is a few attributes, named in ``request_state`` (each set in ``__init__``; a test checks)."""

    request_state: tuple[str, ...] = ()

    def snapshot(self) -> dict:
        """Deep copies of the ``request_state`` attributes, by name."""
        return {k: copy.deepcopy(getattr(self, k)) for k in self.request_state}

    def restore(self, snapshot: dict) -> None:
        """Set each attribute of ``snapshot`` (a :meth:`snapshot`) back, as a copy (the snapshot
        stays reusable)."""
        for k, v in snapshot.items():
            setattr(self, k, copy.deepcopy(v))


class DrafterBase(LearnedState):
    """What every drafter shares: :class:`LearnedState`'s snapshot and restore, and no compiled
    step of its own (:meth:`warm_up` does nothing). A drafter that drafts through a compiled step
    (``self-spec``'s int8 draft on the ``compiled`` backend) overrides :meth:`warm_up`, and its
    registry line says so (:attr:`~selfspec.drafters.spec.MethodSpec.draft_step`)."""

    def warm_up(self, capacity: int) -> float:
        """Compile (or load the saved) steps this drafter drafts through, for a ``capacity``-position
        static cache, now rather than mid-request; the seconds it took. None here: 0.0."""
        return 0.0


class Sizer(Protocol):
    """How much a drafter drafts: the policy (acceptance estimators, confidence calibration,
    back-off and probes over a cost profile) that the drafter consults while it proposes, through
    the step's :class:`Budget`, and that learns from every verified step. The controller owns it:
    it makes each step's budget, starts each request (:meth:`new_prompt`), feeds it
    (:meth:`observe`, after each step, with the seconds the loop measured) and snapshots it with
    the drafter's state; no drafter updates its sizer itself.

    Attributes:
        profile: the verify-cost profile it sizes drafts from, or None (fixed sizes). The loop
            times every verify forward into an :class:`~selfspec.core.online_cost.OnlineCost` over it
            (a correction used from the next load on).
        width: how many requests verify in the same packed forward this step (1 alone), set by
            the controller before each step; costs are then read with
            :meth:`~selfspec.core.cost.CostProfile.shared`.
    """

    profile: CostProfile | None
    width: int

    def new_prompt(self) -> None:
        """A new request starts (its prompt is about to be prefilled)."""

    def observe(self, budget: Budget, tree: DraftTree, verdict: Verdict, step: StepTime) -> None:
        """Learn from one verified step: the step's budget (its ``made`` record, of this sizer's own
        type), the verified tree, what was accepted, and the step's measured seconds (None under
        rejection sampling: learn no timing)."""


class Drafter(Protocol):
    """Interface every method implements (see ``docs/DESIGN.md``).

    Attributes:
        name: the method name (``selfspec --method NAME``).
        lossless: True when greedy ids and the sampling distribution are provably unchanged.
        needs_hidden: the verify forward must return the target's hidden states.
        sizer: what sizes its drafts (None: it drafts a fixed amount, or nothing), fed by the
            controller; part of the drafter's :meth:`snapshot`.
    """

    name: str
    lossless: bool
    needs_hidden: bool
    sizer: Sizer | None

    def snapshot(self) -> dict:
        """A copy of what the drafter learns across requests (budget and acceptance estimators,
        calibration, back-off); everything else is reset in ``prefill``."""

    def restore(self, snapshot: dict) -> None:
        """Put a :meth:`snapshot` back (the controller does before every rejection-sampled
        request, whose text depends on the draft lengths)."""

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        """Called once after the prompt forward (``out`` covers the prompt tokens)."""

    def propose(self, state: DecodeState, budget: Budget | None) -> Proposal:
        """Draft at most ``state.draft_room`` tokens deep after the pending token, as ``budget``
        (None where the drafter has no sizer) says; what was drafted goes into ``budget.made``."""

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        """Called after the accepted tokens were committed to ``state``."""

    def warm_up(self, capacity: int) -> float:
        """Compile (or load) the compiled steps the drafter drafts through, for a ``capacity``-position
        static cache; the seconds it took (0.0 for a drafter without any: :class:`DrafterBase`)."""
