"""The one timing harness: cases interleaved round by round, warm-up rounds dropped, each call
undone untimed; the clock is injected (nothing sleeps)."""

from __future__ import annotations

from selfspec.core.timing import interleaved


class Ticks:
    """A clock that advances by what the cases say they cost."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self, device=None) -> float:
        return self.t


def test_cases_are_interleaved_and_the_warm_up_is_dropped():
    clock, order, resets, rounds = Ticks(), [], [], []

    def case(name: str, cost: float):
        def run() -> None:
            order.append(name)
            clock.t += cost
        return run

    times = interleaved({"a": case("a", 1.0), "b": case("b", 3.0)}, rounds=3, warmup=2, clock=clock,
                        reset=lambda n: resets.append(n) or setattr(clock, "t", clock.t + 100.0),
                        on_round=rounds.append)
    assert order == ["a", "b"] * 5 and resets == order and rounds == [0, 1, 2, 3, 4]
    assert times == {"a": [1.0] * 3, "b": [3.0] * 3}  # the resets' 100 s are not timed


def test_no_warm_up_keeps_every_round():
    clock = Ticks()
    times = interleaved({1: lambda: setattr(clock, "t", clock.t + 2.0)}, rounds=2, warmup=0, clock=clock)
    assert times == {1: [2.0, 2.0]}
