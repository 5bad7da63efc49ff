"""What ``auto`` chose, per request: :class:`AutoGenerator`, a generator whose configuration ``auto``
chose, which sends a request its compiled steps cannot serve without compiling to the best
configuration ``auto`` measured off the compiled backend (:class:`CompiledFallback`). The decode
loop and :class:`~selfspec.generator.SpeculativeGenerator` know nothing of it: choosing lives in
:mod:`selfspec.autoselect` only."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ..decoding.state import DecodeState
from ..decoding.text import encode_prompt
from ..generator import SpeculativeGenerator
from ..models.compiled_step import capacity_for
from .calibration import Choice

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

log = logging.getLogger("selfspec.auto")


@dataclass
class CompiledFallback:
    """Where a configuration ``auto`` chose on the compiled backend runs a request whose static
    cache (its prompt + new tokens) needs compiled steps that are not saved here: ``auto`` never
    compiles mid-request (each step takes most of a minute), so such a request runs on the best
    configuration ``auto`` measured without the compiled step, lossless on its own kernels.

    Attributes:
        sizes: the verify-block sizes of the compiled configuration.
        label: the configuration used instead (``pld@onednn``).
        build: builds its generator on the same loaded model (once, on first need).
        generator: the one built.
        saved: by static-cache size, whether every step of ``sizes`` is saved (checked once each,
            from the files on disk).
    """

    sizes: tuple[int, ...]
    label: str
    build: Callable[[], SpeculativeGenerator]
    generator: SpeculativeGenerator | None = None
    saved: dict[int, bool] = field(default_factory=dict)


class AutoGenerator(SpeculativeGenerator):
    """A :class:`~selfspec.generator.SpeculativeGenerator` of the configuration ``auto`` chose
    (``choice``), with the per-request route of a compiled choice (``fallback``, or None). The
    prompt is tokenized once, whichever generator decodes it."""

    def __init__(self, target, method: str, drafter, lossless: bool, choice: Choice,
                 fallback: CompiledFallback | None = None, measure: bool = True,
                 recipe: tuple[str, dict, bool] | None = None) -> None:
        super().__init__(target, method, drafter, lossless, measure=measure, recipe=recipe)
        self.auto_choice = choice
        self.auto_table = choice.table
        self.fallback = fallback

    def _instead(self, ids: list[int], max_new_tokens: int) -> SpeculativeGenerator | None:
        """The fallback's generator where this request's compiled steps are not saved here."""
        fb, step = self.fallback, self.target.step
        if fb is None or step is None:
            return None
        capacity = capacity_for(len(ids) + max_new_tokens)
        if capacity not in fb.saved:
            fb.saved[capacity] = not step.missing(capacity, fb.sizes, self.drafter.needs_hidden)
        if fb.saved[capacity]:
            return None
        if fb.generator is None:
            log.info(f"auto: this request needs a {capacity}-position static cache, whose compiled steps are not "
                     f"saved here: it runs on {fb.label} (auto never compiles mid-request; `selfspec compile "
                     f"--max-tokens {len(ids) + max_new_tokens}` compiles them once)")
            fb.generator = fb.build()
        return fb.generator

    def steps(self, prompt, chat: bool = True, **gen_kwargs) -> Iterator[tuple[DecodeState, list[int]]]:
        """:meth:`SpeculativeGenerator.steps` on the generator this request runs on."""
        if self.fallback is None or self.target.step is None:
            yield from super().steps(prompt, chat, **gen_kwargs)
            return
        ids = encode_prompt(self.tokenizer, prompt, chat, cast("PreTrainedModel", self.target.model).config.vocab_size)
        other = self._instead(ids, int(gen_kwargs.get("max_new_tokens", 128)))
        if other is None:
            yield from super().steps(ids, chat, **gen_kwargs)
            return
        self.last_method = other.method
        yield from other.steps(ids, chat, **gen_kwargs)
        self.last_result = other.last_result
