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

import torch

from .config import GenerationConfig, check_threads, stop_strings
from .core.kv_cache import new_cache
from .core.online_cost import OnlineCost
from .core.sampling import GumbelNoise, Warper
from .core.timing import now
from .decoding.controller import DraftController
from .decoding.loop import run
from .decoding.state import Clock, DecodeState
from .decoding.text import IncrementalDetokenizer, StopTextFilter, encode_prompt, make_stop_check, text_before_stop
from .errors import SelfspecError
from .models.compiled_step import MIN_CAPACITY, capacity_for
from .models.runner import Runner
from .registry import METHODS, BuildContext, method_config

log = logging.getLogger("selfspec.auto")


@dataclass
class GenerationResult:
    """What one request produced (the JSON of ``selfspec generate --json``).

    ``steps`` counts target forwards that produced tokens (the prompt forward included), so
    ``mean_accepted`` (tau) = ``new_tokens / steps`` is 1.0 for ``ar``.
    """

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
    finish_reason: str = ""
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    committed_per_step: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    kernels: str = "stock"
    seed: int | None = None
    sampling: str = "greedy"

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
        saved: by static-cache size, whether every step of ``sizes`` is saved (checked once each).
    """

    sizes: tuple[int, ...]
    label: str
    build: Callable[[], SpeculativeGenerator]
    generator: SpeculativeGenerator | None = None
    saved: dict[int, bool] = field(default_factory=dict)


class SpeculativeGenerator:
    """A verify runner plus one method. One request at a time per generator; several generators
    over one loaded model may run at once (in threads), each on runners of its own configuration,
    which nothing switches: each gives exactly its solo output.

    It runs on ``threads`` torch CPU threads when set (restored after each request).
    """

    def __init__(self, target: Runner, method: str, drafter, lossless: bool, threads: int | None = None,
                 clock: Clock = now, measure: bool = True) -> None:
        self.target = target
        # the drafter, the clock every step is timed on (tests inject a fake one), the cost
        # profile's correction from verify timings and the drafter's per-request state
        self.controller = DraftController(drafter, clock)
        self.threads = check_threads(threads)
        self.kernels = target.backend
        self.method = method
        self.lossless = lossless
        self.last_result: GenerationResult | None = None
        self.auto_choice = None  # where auto chose the configuration: its autoselect.Choice
        self.auto_table: dict[str, float] | None = None  # ... and the finalists' calibration tokens/s by label
        self.fallback: CompiledFallback | None = None  # auto on compiled: requests whose steps are not saved
        self.last_method: str | None = None  # what the latest request ran on: ``method``, or its fallback's
        self.measure = measure  # False (load(measure=False)): nothing written, the cost correction included
        gc = target.model.generation_config
        eos = gc.eos_token_id if gc is not None and gc.eos_token_id is not None else None
        if eos is None and target.tokenizer is not None:
            eos = target.tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def drafter(self):
        """The method's drafter (setting another one gives the controller its state and profile)."""
        return self.controller.drafter

    @drafter.setter
    def drafter(self, drafter) -> None:
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

    def save_cost_correction(self):
        """Write the drafter's cost profile back to the cache, corrected by the verify timings of
        this generator's requests (where some block size was timed often enough); the next load
        sizes drafts from it. An explicit step (the CLI takes it when a command ends), never
        mid-process: a profile read by a later load of this process stays the one it read.
        Returns the path written, or None (also when loaded with ``measure=False``)."""
        return self.controller.save_cost_correction() if self.measure else None

    def _state(self, prompt: str | Sequence[int], cfg: GenerationConfig, chat: bool) -> DecodeState:
        model = self.target.model
        ids = encode_prompt(self.tokenizer, prompt, chat, model.config.vocab_size)
        ctx = self.target.context_length
        if len(ids) >= ctx:
            raise SelfspecError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}; shorten it")
        if len(ids) + cfg.max_new_tokens > ctx:
            raise SelfspecError(
                f"max_new_tokens {cfg.max_new_tokens} is beyond the context: the prompt has {len(ids)} tokens and "
                f"the model's context is {ctx}; use --max-new-tokens {ctx - len(ids)} or less"
            )
        device = self.target.device
        if cfg.seed is None:  # a fresh seed, reported in the result so the run can be reproduced
            cfg = dataclasses.replace(cfg, seed=secrets.randbits(31))
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        warper = Warper(float(cfg.temperature), cfg.top_k, float(cfg.top_p))
        coupled = not warper.greedy and cfg.sampling == "coupled"
        step = self.target.step  # the compiled backend's static-shape step, on a static cache
        capacity = capacity_for(len(ids) + cfg.max_new_tokens) if step is not None else None
        return DecodeState(
            ids=list(ids), prompt_len=len(ids), cfg=cfg, warper=warper, generator=gen,
            cache=step.take_cache(capacity) if step is not None else new_cache(model.config), step=step,
            eos_ids=self.eos_ids,
            stop_check=make_stop_check(self.tokenizer, cfg.stop),
            noise=GumbelNoise(cfg.seed) if coupled else None,
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
            lossless=self.lossless, prompt_tokens=state.prompt_len, finish_reason=state.finish_reason or "",
            draft_s=st.draft_s, verify_s=st.verify_s, prefill_s=st.prefill_s,
            committed_per_step=list(st.committed_per_step), drafted_per_step=list(st.drafted_per_step),
            accepted_per_step=list(st.accepted_per_step),
            kernels=self.kernels, seed=None if state.warper.greedy else state.cfg.seed,
            sampling="greedy" if state.warper.greedy else state.cfg.sampling,
        )

    def _instead(self, prompt: str | Sequence[int], cfg: GenerationConfig, chat: bool) -> SpeculativeGenerator | None:
        """The generator of :attr:`fallback` where this request's compiled steps are not saved here."""
        fb, step = self.fallback, self.target.step
        if fb is None or step is None:
            return None
        n = len(encode_prompt(self.tokenizer, prompt, chat, self.target.model.config.vocab_size))
        capacity = capacity_for(n + cfg.max_new_tokens)
        if capacity not in fb.saved:
            fb.saved[capacity] = not step.missing(capacity, fb.sizes, self.drafter.needs_hidden)
        if fb.saved[capacity]:
            return None
        if fb.generator is None:
            log.info(f"auto: this request needs a {capacity}-position static cache, whose compiled steps are not "
                     f"saved here: it runs on {fb.label} (auto never compiles mid-request; `selfspec compile "
                     f"--max-tokens {n + cfg.max_new_tokens}` compiles them once)")
            fb.generator = fb.build()
        return fb.generator

    def steps(self, prompt, chat: bool = True, **gen_kwargs) -> Iterator[tuple[DecodeState, list[int]]]:
        """The decode loop, one item per verify step: ``(state, ids committed at it)``. The state is
        live (``state.stats``, ``state.done``, ``state.finish_reason``); stop iterating to cancel
        the request (nothing is left behind). ``gen_kwargs`` are :class:`GenerationConfig` fields;
        ``last_result`` is set once the loop ends."""
        cfg = GenerationConfig(**gen_kwargs)
        other = self._instead(prompt, cfg, chat)
        self.last_method = other.method if other is not None else self.method
        if other is not None:
            yield from other.steps(prompt, chat, **gen_kwargs)
            self.last_result = other.last_result
            return
        state = self._state(prompt, cfg, chat)
        try:
            with torch_threads(self.threads):  # under rejection sampling the controller restores the load-time state
                t0 = self.clock(None)
                for new in run(state, self.target.model, self.controller):
                    yield state, new
                self.last_result = self._result(state, self.clock(None) - t0)
        finally:  # finished, failed or cancelled: the compiled backend's static cache serves the next request
            if state.step is not None:
                state.step.give_back(state.cache)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = True,
                 stop: str | Sequence[str] = (), ignore_eos: bool = False, sampling: str = "coupled",
                 include_stop: bool = False) -> GenerationResult:
        """Generate from a text prompt (chat-templated unless ``chat=False``) or a list of token
        ids (used as is). Greedy when ``temperature == 0``; otherwise ``sampling`` says how (see
        :class:`~selfspec.config.GenerationConfig`): with the default ``coupled``, the same seed
        gives the same text for every method. ``seed=None`` draws one (``result.seed``)."""
        for _ in self.steps(prompt, chat, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop=stop_strings(stop), ignore_eos=ignore_eos, sampling=sampling,
                             include_stop=include_stop):
            pass
        return self.last_result

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, chat: bool = True,
               stop: str | Sequence[str] = (), ignore_eos: bool = False, sampling: str = "coupled",
               include_stop: bool = False) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; ``last_result`` holds the stats afterwards.
        The pieces join to ``last_result.text`` (a stop string is held back, then dropped)."""
        for piece, _ in self.stream_steps(prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, stop,
                                          ignore_eos, sampling, include_stop):
            if piece:
                yield piece

    def stream_steps(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                     top_k: int = 0, seed: int | None = None, chat: bool = True, stop: str | Sequence[str] = (),
                     ignore_eos: bool = False, sampling: str = "coupled",
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


def build(target: Runner, method: str, options: dict, trust_remote_code: bool,
          sizes: tuple[int, ...] = (1,), measure: bool = True) -> SpeculativeGenerator:
    """``method`` with ``options`` verified on runner ``target``, through the registry. On the
    compiled backend, the steps of blocks of ``sizes`` compile (or load from the cache) now, not
    mid-request. ``measure`` off: nothing is timed or written (cached measurements, else fixed sizes)."""
    ctx = BuildContext(device=target.device, dtype=target.model.dtype, trust_remote_code=trust_remote_code,
                       kernels=target.backend, measure=measure)
    spec = METHODS[method]
    drafter = spec.build(target, method_config(method, options), ctx)
    if target.step is not None:
        target.step.warm_up(MIN_CAPACITY, sizes, drafter.needs_hidden)
    return SpeculativeGenerator(target, method, drafter, spec.lossless, measure=measure)
