"""A server's auto times batches: :class:`selfspec.autoselect.batches.BatchDecoder`."""

from __future__ import annotations

from dataclasses import dataclass

import selfspec
from selfspec.autoselect.batches import BatchDecoder


@dataclass
class Result:
    token_ids: list[int]
    new_tokens: int


class FakeBatch:
    """Records each batch; request j of a batch makes ``len(prompt)`` tokens, ids ``[len(prompt)]``."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def generate_batch(self, prompts, max_batch=None, **kw):
        self.batches.append(list(prompts))
        return [Result([len(p), kw["max_new_tokens"]], len(p)) for p in prompts]


def test_each_prompt_is_timed_with_the_ones_after_it_cyclically():
    fake = FakeBatch()
    d = BatchDecoder(fake, ["a", "bb", "ccc", "dddd", "eeeee"], width=3)
    r = d.generate("dddd", max_new_tokens=7)
    assert fake.batches == [["dddd", "eeeee", "a"]]
    assert r.token_ids == [4, 7]  # the asked prompt's ids: the reference check compares them
    assert r.new_tokens == 4 + 5 + 1  # the batch's tokens: the calibration's speed is the aggregate


def test_a_batch_is_never_wider_than_the_prompts_and_a_stranger_decodes_alone():
    fake = FakeBatch()
    d = BatchDecoder(fake, ["a", "bb"], width=4)
    d.generate("bb", max_new_tokens=2)
    d.generate("warm-up", max_new_tokens=2)
    assert fake.batches == [["bb", "a"], ["warm-up"]]


def test_a_real_batch_gives_the_solo_ids_of_the_asked_prompt(tiny_dir):
    """On the tiny model: the asked prompt's ids are its solo run's, and the tokens count every request."""
    g = selfspec.load(str(tiny_dir), method="ar", kernels="onednn", self_test=False, measure=False)
    prompts = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 2, 9]]
    d = BatchDecoder(g, prompts, width=3)  # type: ignore[arg-type]  # token-id prompts
    r = d.generate(prompts[1], max_new_tokens=6)
    solo = g.generate(prompts[1], max_new_tokens=6)
    assert r.token_ids == solo.token_ids
    assert r.new_tokens == sum(g.generate(p, max_new_tokens=6).new_tokens for p in prompts)
