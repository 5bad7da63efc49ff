"""The drafter interface, and the drafter that proposes nothing (``ar``).

A drafter sees the decode state, proposes a :class:`~selfspec.core.tree.DraftTree` rooted at the
pending token, optionally with *piggyback* query tokens that ride along in the same verify
forward (their logits come back to the drafter; their KV is never committed), and observes the
verdict to roll back its own state and adapt its budget.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..core.acceptance import Verdict
from ..core.tree import DraftTree

if TYPE_CHECKING:
    from ..decoding.state import DecodeState, VerifyOutput


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


class Drafter(Protocol):
    """Interface every method implements (see ``docs/DESIGN.md``).

    Attributes:
        name: the method name (``selfspec --method NAME``).
        lossless: True when greedy ids and the sampling distribution are provably unchanged.
        needs_hidden: the verify forward must return the target's hidden states.
    """

    name: str
    lossless: bool
    needs_hidden: bool

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        """Called once after the prompt forward (``out`` covers the prompt tokens)."""

    def propose(self, state: DecodeState) -> Proposal:
        """Draft at most ``state.draft_room`` tokens deep after the pending token."""

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        """Called after the accepted tokens were committed to ``state``."""


class NullDrafter:
    """Proposes nothing: each step verifies only the pending token, i.e. plain decoding."""

    name = "ar"
    lossless = True
    needs_hidden = False

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        return Proposal(DraftTree.chain([state.pending]))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        pass


def _request_state_attrs(drafter) -> list[str]:
    """Attributes of a drafter that adapt during requests: the budget and acceptance estimators
    (objects defined in ``selfspec.drafters``) and plain numbers. Models, caches, tensors and
    generators are excluded: drafters reset those in ``prefill``."""
    names = []
    for k, v in vars(drafter).items():
        mod = type(v).__module__ or ""
        if mod.startswith("selfspec.drafters") or isinstance(v, (int, float)):
            names.append(k)
    return names


def snapshot_request_state(drafter) -> dict:
    """A copy of what a drafter learns across requests (see :func:`restore_request_state`)."""
    return {k: copy.deepcopy(getattr(drafter, k)) for k in _request_state_attrs(drafter)}


def restore_request_state(drafter, snapshot: dict) -> None:
    """Reset a drafter's learned budget state to ``snapshot``.

    Under ``rejection`` sampling the draft lengths change how much randomness a step consumes,
    so the text depends on them; restoring the state from load time before each such request
    makes a seeded sample independent of earlier requests. Greedy and ``coupled`` outputs never
    depend on drafts, so there the estimates carry over and keep improving.
    """
    for k, v in snapshot.items():
        setattr(drafter, k, copy.deepcopy(v))
