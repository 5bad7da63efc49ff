"""A drafter wrapped by a test: everything delegated to the inner drafter, so a test overrides
only what it watches (the loop invariant, the step times, the cache during a draft)."""

from __future__ import annotations


class Wrapped:
    """Delegates the whole :class:`~selfspec.decoding.protocol.Drafter` protocol to ``inner``
    (it learns nothing itself: ``sizer``, ``snapshot`` and ``restore`` are the inner drafter's)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.lossless, self.needs_hidden = inner.name, inner.lossless, inner.needs_hidden

    @property
    def sizer(self):
        return self.inner.sizer

    def snapshot(self):
        return self.inner.snapshot()

    def restore(self, snapshot):
        self.inner.restore(snapshot)

    def prefill(self, state, out):
        self.inner.prefill(state, out)

    def propose(self, state, budget=None):
        return self.inner.propose(state, budget)

    def observe(self, state, proposal, verdict, out):
        self.inner.observe(state, proposal, verdict, out)
