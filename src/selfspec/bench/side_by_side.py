"""The demo's measurement (``selfspec demo``): ``ar``, a speculative method and ``transformers``
``generate`` on one prompt, warmed up, then timed interleaved; the fastest run of each counts (as
``timeit`` does). The CLI only prints what :func:`side_by_side` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.machine import LoadMonitor
from .peers import PeerOutput, run_peer

if TYPE_CHECKING:
    from ..generator import GenerationResult

WARM_TOKENS = 8  # each contender decodes this many tokens once before anything is timed


@dataclass(frozen=True)
class SideBySide:
    """The fastest run of each contender on one prompt, and what compares them.

    Attributes:
        ar / spec: the :class:`~selfspec.generator.GenerationResult` of ``ar`` and of the method.
        hf: ``transformers`` ``generate`` (fp32, stock kernels) on the same token ids.
        runs: timed runs per contender; load_note: the machine was busy (None: it was not).
    """

    ar: GenerationResult
    spec: GenerationResult
    hf: PeerOutput
    runs: int
    load_note: str | None

    @property
    def hf_tokens_per_s(self) -> float:
        return len(self.hf.token_ids) / self.hf.wall_s if self.hf.wall_s > 0 else 0.0

    @property
    def speedup(self) -> float:
        """The method's wall time over ``ar``'s (same tokens, greedy)."""
        return self.ar.wall_s / self.spec.wall_s

    @property
    def speedup_vs_hf(self) -> float:
        """Over ``generate``, per token (``generate`` may stop at another length under sampling)."""
        return self.hf.wall_s * self.ar.new_tokens / max(len(self.hf.token_ids), 1) / self.spec.wall_s

    @property
    def same_ids(self) -> bool:
        return self.ar.token_ids == self.spec.token_ids

    @property
    def same_ids_hf(self) -> bool:
        return self.ar.token_ids == self.hf.token_ids  # both keep the EOS token


def side_by_side(ar, spec, prompt: str, gen: dict, runs: int = 2) -> SideBySide:
    """Warm up, then time ``ar``, ``spec`` (two :class:`~selfspec.generator.SpeculativeGenerator` on one
    model) and ``generate`` ``runs`` times each, interleaved, on ``prompt`` with the generation
    keywords ``gen`` (``seed`` set: every contender draws the same one)."""
    from ..decoding.text import encode_prompt

    target = ar.target
    ids = encode_prompt(target.tokenizer, prompt, gen["chat"], target.model.config.vocab_size)

    def hf_generate(max_new_tokens: int) -> PeerOutput:
        # transformers as users run it: fp32, stock kernels
        return run_peer("hf", target.runner("stock").model, ids, max_new_tokens, gen["temperature"], gen["top_p"],
                        gen["top_k"], gen["seed"])

    warm = dict(gen, max_new_tokens=WARM_TOKENS)
    ar.generate(prompt, **warm)
    spec.generate(prompt, **warm)
    hf_generate(WARM_TOKENS)
    with LoadMonitor() as load:  # was the machine busy before or during the timed runs?
        timed = [(ar.generate(prompt, **gen), spec.generate(prompt, **gen), hf_generate(gen["max_new_tokens"]))
                 for _ in range(runs)]  # interleaved; the fastest run of each counts
    a = min((t[0] for t in timed), key=lambda r: r.wall_s)
    s = min((t[1] for t in timed), key=lambda r: r.wall_s)
    hf = min((t[2] for t in timed), key=lambda r: r.wall_s)
    return SideBySide(a, s, hf, runs, load.note())
