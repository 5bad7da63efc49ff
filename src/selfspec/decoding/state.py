"""Explicit per-request decode state: committed ids, cache, RNG, stopping and statistics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..config import GenerationConfig
from ..core.acceptance import tally_by_depth
from ..core.sampling import GumbelNoise, Warper, perturbed
from ..core.timing import now

Clock = Callable[["torch.device | None"], float]
"""Seconds since an arbitrary origin once the device's queued work has run (:func:`~selfspec.core.timing.now`)."""


@dataclass(frozen=True)
class VerifyOutput:
    """Target outputs of one forward (prefill or verify).

    Attributes:
        base: target cache length before the forward.
        tree_logits: ``[N, V]`` logits at each tree node (for the prefill: ``[1, V]``, last token).
        piggyback_logits: ``[M, V]`` logits of piggyback tokens, or None.
        hidden: per-layer hidden states ``[N + M, H]`` (prefill: ``[P, H]``) when a drafter asked.
    """

    base: int
    tree_logits: torch.Tensor
    piggyback_logits: torch.Tensor | None = None
    hidden: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class StepTime:
    """The current step's seconds as the loop measured them on the state's clock, handed to the
    drafter's sizer by the controller (drafters never time themselves). Both None under rejection sampling,
    where no draft may be sized from the wall clock, and on a step not yet measured.

    Attributes:
        draft_s: the drafter's ``propose``.
        step_s: ``propose`` to the committed verdict (draft + verify + accept): what a step costs.
    """

    draft_s: float | None = None
    step_s: float | None = None


@dataclass
class StepStats:
    """Counters for one request (names as in ``docs/DESIGN.md`` section 5)."""

    steps: int = 0  # target forwards that produced tokens (prefill included)
    committed_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)  # depth of the verified tree
    accepted_per_step: list[int] = field(default_factory=list)  # drafts it accepted
    proposed_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0

    def record(self, tree_depth: int, num_accepted: int, committed: int) -> None:
        tally_by_depth(self.proposed_by_depth, self.accepted_by_depth, tree_depth, num_accepted)
        self.steps += 1
        self.committed_per_step.append(committed)
        self.drafted_per_step.append(tree_depth)
        self.accepted_per_step.append(num_accepted)

    def acceptance_by_depth(self) -> list[float]:
        """Acceptance at depth d (:func:`~selfspec.core.acceptance.acceptance_by_depth`)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_depth, self.proposed_by_depth)]


@dataclass
class DecodeState:
    """Everything one request owns. Invariant between steps: ``cache`` holds the KV of
    ``ids[:-1]``; ``ids[-1]`` is the pending token.

    Attributes:
        ids: prompt ids followed by generated ids.
        prompt_len: number of prompt ids.
        cfg: the request's generation config.
        warper: temperature / top-k / top-p, shared by draft and target.
        generator: the request's RNG (sampling only).
        cache: the target's KV cache.
        eos_ids: ids that end generation (unless ``cfg.ignore_eos``).
        stop_check: returns how many generated tokens to keep when a stop string completed.
        noise: the Gumbel noise of ``coupled`` sampling (None when greedy or ``rejection``).
        clock: what every step is timed with (injected in tests: no test sleeps).
        step_time: the current step's measured seconds, set by the loop before ``observe``.
    """

    ids: list[int]
    prompt_len: int
    cfg: GenerationConfig
    warper: Warper
    generator: torch.Generator
    cache: DynamicCache
    eos_ids: frozenset[int]
    stop_check: Callable[[list[int]], int | None] | None = None
    noise: GumbelNoise | None = None
    finish_reason: str | None = None
    stats: StepStats = field(default_factory=StepStats)
    clock: Clock = now
    step_time: StepTime = field(default_factory=StepTime)

    @property
    def deterministic(self) -> bool:
        """Every token is the argmax of :meth:`scores` (greedy, or ``coupled`` sampling): the
        output does not depend on the draft, and verification is a greedy tree walk."""
        return self.warper.greedy or self.noise is not None

    @property
    def rejection(self) -> bool:
        """``rejection`` sampling: the text depends on the drafts, so drafters must size them
        from nothing but the request itself and the load-time cost profile (no wall clock, no
        state from earlier requests) for a seed to reproduce a sample."""
        return not self.deterministic

    def scores(self, logits: torch.Tensor, indices: int | list[int]) -> torch.Tensor:
        """What the choice of a token is the argmax of, when :attr:`deterministic`.

        Args:
            logits: ``[V]`` or ``[N, V]`` raw logits (of the target, or a draft's guess of them).
            indices: the text index (position in ``ids``) of the token each row chooses: an int
                for ``[V]``, a list of N ints for ``[N, V]``.

        Returns:
            the logits themselves when greedy; warped logits + Gumbel noise when ``coupled``.
        """
        if self.warper.greedy:
            return logits
        if self.noise is None:
            raise RuntimeError("DecodeState.scores is only defined for greedy or coupled sampling")
        return perturbed(logits, self.warper, self.noise, indices)

    def draft_index(self, depth: int) -> int:
        """Text index of a drafted token at tree depth ``depth`` (the pending token is depth 0)."""
        return len(self.ids) - 1 + depth

    @property
    def pending(self) -> int:
        return self.ids[-1]

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def draft_room(self) -> int:
        """How many drafted tokens after the pending one can still be used (a step also adds a
        bonus token, so one fewer than the tokens left)."""
        return max(0, self.cfg.max_new_tokens - len(self.generated) - 1)

    def commit(self, new: list[int]) -> list[int]:
        """Append accepted tokens, applying EOS, max_new_tokens and stop strings.

        Returns:
            the tokens actually kept (a prefix of ``new``).
        """
        kept: list[int] = []
        for t in new:
            self.ids.append(t)
            kept.append(t)
            if len(self.generated) >= self.cfg.max_new_tokens:
                self.finish_reason = "length"
                break
            if t in self.eos_ids and not self.cfg.ignore_eos:
                self.finish_reason = "eos"
                break
        if self.stop_check is not None:
            keep = self.stop_check(self.generated)
            if keep is not None:
                drop = len(self.generated) - keep
                if drop:
                    del self.ids[-drop:]
                    kept = kept[: len(kept) - drop]
                self.finish_reason = "stop"
        return kept
