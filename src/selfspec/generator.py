"""A loaded model plus one method: :class:`SpeculativeGenerator` (``generate``, ``stream``,
``steps``) and what one request produces, :class:`GenerationResult`. :func:`selfspec.load`
(:mod:`selfspec.api`) builds it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from .config import GenerationConfig, check_threads, stop_strings
from .core.online_cost import OnlineCost
from .core.sampling import GumbelNoise, Warper
from .core.timing import now
from .decoding.controller import DraftController
from .decoding.loop import run
from .decoding.protocol import Drafter
from .decoding.state import Clock, DecodeState
from .decoding.text import IncrementalDetokenizer, StopTextFilter, encode_prompt, make_stop_check, text_before_stop
from .errors import SelfspecError
from .models.batch_run import Work, is_batch, per_request
from .models.compiled_step import MIN_CAPACITY
from .models.runner import Runner
from .registry import METHODS, BuildContext, method_config

log = logging.getLogger("selfspec.auto")


@dataclass
class GenerationResult:
    """What one request produced (the JSON of ``selfspec generate --json``).

    ``steps`` counts target forwards that produced tokens (the prompt forward included), so
    ``mean_accepted`` (tau) = ``new_tokens / steps`` is 1.0 for ``ar``."""

    text: str
    token_ids: list[int]
    new_tokens: int
    steps: int
    mean_accepted: float
    acceptance_by_depth: list[float]
    wall_s: float
    tokens_per_s: float
    method: str
    model: str
    lossless: bool
    prompt_tokens: int = 0
    finish_reason: str = ""  # OpenAI's, as in the CLI and the server: stop (EOS or a stop string), length
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    committed_per_step: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    kernels: str = "stock"
    seed: int | None = None
    sampling: str = "greedy"
    batch_invariant: bool | None = None  # decoded in a batch: whether its tokens are exactly its solo run's

    JSON_KEYS = ("text", "token_ids", "new_tokens", "steps", "mean_accepted", "acceptance_by_depth", "wall_s",
                 "tokens_per_s", "method", "model", "lossless", "seed", "sampling", "finish_reason", "kernels")

    def to_dict(self, full: bool = False) -> dict:
        """The result as JSON-ready dict: :data:`JSON_KEYS` (``selfspec generate --json``), or with
        ``full`` every field. In the short form ``finish_reason`` is OpenAI's: ``stop`` (end of
        sequence or a stop string) or ``length`` (``max_new_tokens``); ``kernels`` names the
        linear-layer backend that ran."""
        d = asdict(self)
        if full:
            return d
        out = {k: d[k] for k in self.JSON_KEYS}
        out["finish_reason"] = "length" if self.finish_reason == "length" else "stop"
        return out


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block on ``threads`` torch CPU threads (None: as they are), then restore them."""
    if threads is None or threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SpeculativeGenerator:
    """A verify runner plus one method. One request at a time per generator; several generators
    over one loaded model may run at once (in threads), each on runners of its own configuration,
    which nothing switches: each gives exactly its solo output.

    It runs on ``threads`` torch CPU threads when set (restored after each request).
    """

    def __init__(self, target: Runner, method: str, drafter: Drafter, lossless: bool, threads: int | None = None,
                 clock: Clock = now, measure: bool = True, recipe: tuple[str, dict, bool] | None = None) -> None:
        self.target = target
        # the drafter, the clock every step is timed on (tests inject a fake one), the cost
        # profile's correction from verify timings and the drafter's per-request state
        self.controller = DraftController(drafter, clock)
        self.threads = check_threads(threads)
        self.kernels = target.backend
        self.method = method
        self.lossless = lossless
        self.last_result: GenerationResult | None = None
        self.auto_choice: Any = None  # where auto chose the configuration: its autoselect.Choice
        self.auto_table: dict[str, float] | None = None  # ... and the finalists' calibration tokens/s by label
        self.last_method: str | None = None  # what the latest request ran on (``method``, unless auto routed it)
        self.recipe = recipe  # (method, options, trust_remote_code): how to build a drafter per batched request
        self.last_batch_sizes: list[int] = []  # requests per packed forward of the latest batch
        self.last_results: list[GenerationResult | None] = []  # each request's result of the latest stream_batch
        self.measure = measure  # False (load(measure=False)): nothing written, the cost correction included
        gc: Any = target.model.generation_config
        eos: Any = gc.eos_token_id if gc is not None and gc.eos_token_id is not None else None
        if eos is None and target.tokenizer is not None:
            eos = target.tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    @property
    def drafter(self) -> Drafter:
        """The method's drafter (setting another one gives the controller its state and profile)."""
        return self.controller.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        self.controller.drafter = drafter

    @property
    def clock(self) -> Clock:
        """What every step of every request is timed with."""
        return self.controller.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self.controller.clock = clock

    @property
    def online_cost(self) -> OnlineCost | None:
        """The drafter's cost profile corrected by this generator's verify timings (None: none)."""
        return self.controller.online

    def save_cost_correction(self) -> Path | None:
        """Write the drafter's cost profile back to the cache, corrected by the verify timings of
        this generator's requests (where some block size was timed often enough); the next load
        sizes drafts from it. An explicit step (the CLI takes it when a command ends), never
        mid-process: a profile read by a later load of this process stays the one it read.
        Returns the path written, or None (also when loaded with ``measure=False``)."""
        return self.controller.save_cost_correction() if self.measure else None

    def _state(self, prompt: str | Sequence[int], cfg: GenerationConfig, chat: bool) -> DecodeState:
        config: Any = self.target.model.config
        ids = encode_prompt(self.tokenizer, prompt, chat, config.vocab_size)
        ctx = self.target.context_length
        if len(ids) >= ctx:
            raise SelfspecError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}; shorten it")
        if len(ids) + cfg.max_new_tokens > ctx:
            raise SelfspecError(
                f"{cfg.max_new_tokens} new tokens are beyond the context: the prompt has {len(ids)} tokens and "
                f"the model's context is {ctx}; ask for at most {ctx - len(ids)}"
            )
        device = self.target.device
        seed = secrets.randbits(31) if cfg.seed is None else cfg.seed  # a fresh one is reported in the result
        cfg = dataclasses.replace(cfg, seed=seed)  # so the run can be reproduced
        gen = torch.Generator(device=device).manual_seed(seed)
        warper = Warper(float(cfg.temperature), cfg.top_k, float(cfg.top_p))
        coupled = not warper.greedy and cfg.sampling == "coupled"
        return DecodeState(
            ids=list(ids), prompt_len=len(ids), cfg=cfg, warper=warper, generator=gen,
            cache=self.target.new_cache(len(ids) + cfg.max_new_tokens),  # static on the compiled backend
            eos_ids=self.eos_ids,
            stop_check=make_stop_check(self.tokenizer, cfg.stop),
            noise=GumbelNoise(seed) if coupled else None,
        )

    def _result(self, state: DecodeState, wall: float) -> GenerationResult:
        gen = state.generated
        st = state.stats
        text = self.tokenizer.decode(gen, skip_special_tokens=True) if self.tokenizer is not None else ""
        if state.finish_reason == "stop" and not state.cfg.include_stop:
            text = text_before_stop(text, state.cfg.stop)
        return GenerationResult(
            text=text, token_ids=list(gen), new_tokens=len(gen), steps=st.steps,
            mean_accepted=len(gen) / st.steps if st.steps else 0.0,
            acceptance_by_depth=st.acceptance_by_depth(), wall_s=wall,
            tokens_per_s=len(gen) / wall if wall > 0 else 0.0, method=self.method, model=self.target.name,
            lossless=self.lossless, prompt_tokens=state.prompt_len,
            finish_reason="stop" if state.finish_reason == "eos" else state.finish_reason or "",  # as the server says
            draft_s=st.draft_s, verify_s=st.verify_s, prefill_s=st.prefill_s,
            committed_per_step=list(st.committed_per_step), drafted_per_step=list(st.drafted_per_step),
            accepted_per_step=list(st.accepted_per_step),
            kernels=self.kernels, seed=None if state.warper.greedy else state.cfg.seed,
            sampling="greedy" if state.warper.greedy else state.cfg.sampling,
        )

    def steps(self, prompt: str | Sequence[int], chat: bool = True,
              **gen_kwargs: Any) -> Iterator[tuple[DecodeState, list[int]]]:
        """The decode loop, one item per verify step: ``(state, ids committed at it)``. The state is
        live (``state.stats``, ``state.done``, ``state.finish_reason``); stop iterating to cancel
        the request (nothing is left behind). ``gen_kwargs`` are :class:`GenerationConfig` fields;
        ``last_result`` is set once the loop ends."""
        cfg = GenerationConfig(**gen_kwargs)
        self.last_method = self.method
        state = self._state(prompt, cfg, chat)
        try:
            with torch_threads(self.threads):  # under rejection sampling the controller restores the load-time state
                t0 = self.clock(None)
                for new in run(state, self.target, self.controller):
                    yield state, new
                self.last_result = self._result(state, self.clock(None) - t0)
        finally:  # finished, failed or cancelled: the compiled backend's static cache serves the next request
            self.target.release(state.cache)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = True,
                 stop: str | Sequence[str] = (), ignore_eos: bool = False, sampling: str = "coupled",
                 include_stop: bool = False) -> GenerationResult:
        """Generate from a text prompt (chat-templated unless ``chat=False``) or a list of token
        ids (used as is). Greedy when ``temperature == 0``; otherwise ``sampling`` says how (see
        :class:`~selfspec.config.GenerationConfig`): with the default ``coupled``, the same seed
        gives the same text for every method. ``seed=None`` draws one (``result.seed``)."""
        if is_batch(prompt):
            return self.generate_batch(  # type: ignore[return-value]  # a list of prompts: a list of results
                list(prompt), max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                seed=seed, chat=chat, stop=stop, ignore_eos=ignore_eos, sampling=sampling, include_stop=include_stop)
        for _ in self.steps(prompt, chat, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop=stop_strings(stop), ignore_eos=ignore_eos, sampling=sampling,
                             include_stop=include_stop):
            pass
        return cast(GenerationResult, self.last_result)  # set when the loop ends

    def sibling(self, target: Any) -> SpeculativeGenerator:
        """A generator of the same method and options with a drafter of its own, verifying through
        ``target`` (a batch's :class:`~selfspec.models.batch.SlotRunner` over this generator's
        runner): one request of a batch. Measures nothing (the drafter reads cached measurements)."""
        if self.recipe is None:
            raise SelfspecError("batched decoding builds a drafter per request: use a generator made by selfspec.load")
        method, options, trust_remote_code = self.recipe
        drafter, lossless = build_drafter(self.target, method, options, trust_remote_code, measure=False)
        return SpeculativeGenerator(target, self.method, drafter, lossless, clock=self.clock, measure=False)

    def batchable(self) -> bool:
        """Whether this generator's requests can share packed forwards: an eager verify runner, a
        known recipe for their drafters, drafters that load no weights of their own
        (:attr:`~selfspec.drafters.spec.MethodSpec.draft_weights`) and an attention function that
        takes the packed path's masks (:func:`~selfspec.models.batch.packable`). Else they decode
        one at a time."""
        from .models.batch import packable

        return (self.target.step is None and self.recipe is not None and not METHODS[self.recipe[0]].draft_weights
                and packable(cast(Any, self.target.model).config._attn_implementation))

    def generate_batch(self, prompts: Sequence[Any], max_batch: int | None = None,
                       **gen_kwargs: Any) -> list[GenerationResult]:
        """Decode ``prompts`` together: each in a decode loop of its own (its own drafter, cache and
        RNG), their verify and prompt blocks packed into one forward per step
        (:class:`~selfspec.models.batch.Batcher`; continuous: a request that ends leaves the batch).
        ``gen_kwargs`` are :meth:`generate`'s. On a row-invariant backend (``onednn``, ``int8``)
        every request's tokens are those of its solo run; on ``stock`` they may differ where two
        tokens' logits nearly tie (``result.batch_invariant``). The compiled backend decodes them one
        after the other.

        Args:
            prompts: text prompts, token-id lists or conversations, one per request.
            max_batch: the most requests in one forward (default: all of them).
            gen_kwargs: :meth:`generate`'s; ``max_new_tokens`` and ``seed`` may also be one per prompt.
        """
        if not prompts:
            return []
        each = per_request(len(prompts), gen_kwargs)
        if not self.batchable():
            log.info("%s decodes a batch's prompts one after the other (%s)", self.method,
                     "the compiled backend's static-shape step" if self.target.step is not None
                     else "no recipe to build a drafter per prompt" if self.recipe is None
                     else "its drafter loads weights of its own" if METHODS[self.recipe[0]].draft_weights
                     else f"{cast(Any, self.target.model).config._attn_implementation} attention takes no packed masks")
            return [self.generate(p, **kw) for p, kw in zip(prompts, each)]
        results: list[GenerationResult | None] = [None] * len(prompts)
        for _ in self._batch(prompts, each, max_batch, results, streaming=False):
            pass
        return cast(list[GenerationResult], results)  # every request's, or run_batch raised

    def stream_batch(self, prompts: Sequence[Any], max_batch: int | None = None,
                     **gen_kwargs: Any) -> Iterator[tuple[int, str]]:
        """:meth:`stream` for several prompts decoded together as in :meth:`generate_batch`:
        yields ``(prompt index, text piece)`` as each request's tokens are accepted (each prompt's
        pieces join to its text); ``last_results`` holds every request's result afterwards.
        Closing the iterator early stops the batch."""
        if not prompts:
            return
        each = per_request(len(prompts), gen_kwargs)
        self.last_results = [None] * len(prompts)
        if not self.batchable():
            for i, (p, kw) in enumerate(zip(prompts, each)):
                for piece in self.stream(p, **kw):
                    yield i, piece
                self.last_results[i] = self.last_result
            return
        yield from self._batch(prompts, each, max_batch, self.last_results, streaming=True)

    def _batch(self, prompts: Sequence[Any], each: list[dict], max_batch: int | None,
               results: list[GenerationResult | None],
               streaming: bool) -> Iterator[tuple[int, str]]:
        """Decode ``prompts`` as one continuous batch (see :meth:`generate_batch`), each request's
        result into ``results``; while ``streaming``, yields ``(index, piece)`` as pieces come."""
        from .models.batch import Batcher, row_invariant
        from .models.batch_run import run_batch

        def request(i: int) -> Work:
            def work(emit: Callable[[str], None] | None) -> GenerationResult | None:
                if emit is None:
                    return gens[i].generate(prompts[i], **each[i])
                for piece in gens[i].stream(prompts[i], **each[i]):
                    emit(piece)
                return gens[i].last_result
            return work

        with torch_threads(self.threads):
            batcher = Batcher(self.target, max_batch or len(prompts))  # its forwards run on this many threads
            gens = [self.sibling(batcher.slot()) for _ in prompts]
            yield from run_batch(batcher, [request(i) for i in range(len(prompts))], results, streaming)
        invariant = row_invariant(self.kernels)
        for r in cast(list[GenerationResult], results):  # each request's, or run_batch raised
            r.batch_invariant = invariant
        self.last_batch_sizes = list(batcher.sizes)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = True,
               stop: str | Sequence[str] = (), ignore_eos: bool = False, sampling: str = "coupled",
               include_stop: bool = False) -> Iterator[Any]:
        """Yield text pieces as tokens are accepted; ``last_result`` holds the stats afterwards.
        The pieces join to ``last_result.text`` (a stop string is held back, then dropped). A list
        of prompts is :meth:`stream_batch`: ``(prompt index, piece)`` pairs, decoded as one batch."""
        if is_batch(prompt):
            yield from self.stream_batch(list(prompt), max_new_tokens=max_new_tokens, temperature=temperature,
                                         top_p=top_p, top_k=top_k, seed=seed, chat=chat, stop=stop,
                                         ignore_eos=ignore_eos, sampling=sampling, include_stop=include_stop)
            return
        for piece, _ in self.stream_steps(prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, stop,
                                          ignore_eos, sampling, include_stop):
            if piece:
                yield piece

    def stream_steps(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = True,
                     stop: str | Sequence[str] = (), ignore_eos: bool = False, sampling: str = "coupled",
                     include_stop: bool = False) -> Iterator[tuple[str, list[int]]]:
        """Like :meth:`stream`, also yielding the ids committed at each step (the last step may
        yield an empty piece with the remaining text)."""
        if self.tokenizer is None:
            raise SelfspecError("streaming text needs a tokenizer; this model has none")
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = () if include_stop else stop_strings(stop)
        text = StopTextFilter(stops)
        for state, new in self.steps(prompt, chat, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, top_k=top_k, seed=seed, stop=stop_strings(stop),
                                      ignore_eos=ignore_eos, sampling=sampling, include_stop=include_stop):
            piece = text.push(detok.push(new))
            if state.done:
                piece += text.flush(stopped=state.finish_reason == "stop")
            yield piece, new


def build_drafter(target: Runner, method: str, options: dict, trust_remote_code: bool,
                  sizes: tuple[int, ...] = (1,), measure: bool = True) -> tuple[Drafter, bool]:
    """``method``'s drafter with ``options`` over runner ``target``, through the registry, and
    whether the method is lossless. On the compiled backend, the steps of blocks of ``sizes``
    compile (or load from the cache) now, not mid-request. ``measure`` off: nothing is timed or
    written (cached measurements, else fixed sizes)."""
    ctx = BuildContext(device=target.device, dtype=target.model.dtype, trust_remote_code=trust_remote_code,
                       kernels=target.backend, measure=measure)
    spec = METHODS[method]
    drafter = spec.build(target, method_config(method, options), ctx)
    if target.step is not None:
        target.step.warm_up(MIN_CAPACITY, sizes, drafter.needs_hidden)
    return drafter, spec.lossless


def build(target: Runner, method: str, options: dict, trust_remote_code: bool,
          sizes: tuple[int, ...] = (1,), measure: bool = True) -> SpeculativeGenerator:
    """The generator of ``method`` with ``options`` verified on runner ``target`` (see
    :func:`build_drafter`)."""
    drafter, lossless = build_drafter(target, method, options, trust_remote_code, sizes, measure)
    return SpeculativeGenerator(target, method, drafter, lossless, measure=measure,
                                recipe=(method, dict(options), trust_remote_code))
