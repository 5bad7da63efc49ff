"""The public surface: ``selfspec.load(...)`` returns a generator with ``generate``/``stream``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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
from .models.bundled import DEFAULT_MODEL
from .models.compiled_step import MIN_CAPACITY, capacity_for
from .models.loading import LoadedModel, load_model
from .models.selftest import keep_int8_promise, tree_self_test
from .registry import AUTO, BASELINE, METHODS, BuildContext, method_config

if TYPE_CHECKING:
    from .autoselect import Candidate

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
    """A target model plus one method. Not thread-safe: one request at a time.

    It runs on the kernels backend the target had when it was built: if the same loaded model
    was switched to another backend since (e.g. by another generator), it switches back; and on
    ``threads`` torch CPU threads when set (restored after each request).
    """

    def __init__(self, target: LoadedModel, method: str, drafter, lossless: bool, threads: int | None = None,
                 clock: Clock = now) -> None:
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
        Returns the path written, or None."""
        return self.controller.save_cost_correction()

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
        if self.target.backend != self.kernels:
            self.target.use_kernels(self.kernels, keep=True)
        other = self._instead(prompt, cfg, chat)
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


def load(model: str | LoadedModel = DEFAULT_MODEL, method: str = AUTO, device: str | None = "cpu",
         dtype: str | torch.dtype = "float32", trust_remote_code: bool = False, self_test: bool = True,
         kernels: str | None = None, remeasure: bool = False, threads: int | None = None,
         **method_options) -> SpeculativeGenerator:
    """Load a model and a decoding method.

    ``auto`` (the default for both ``method`` and ``kernels``, as in the CLI) chooses the
    configuration (method, verify kernels, draft precision) together, by decode tokens/s on a
    short calibration in this process, cached per model and machine (:mod:`selfspec.autoselect`).
    A method or kernels given fix that part of the choice; with both given nothing is measured.

    Args:
        model: bundled name, local HF directory, ``.gguf`` file, hub id, or an already loaded model.
        method: one of ``selfspec.METHODS`` (e.g. ``"ar"``, ``"pld"``, ``"draft-model"``), or
            ``"auto"``: the fastest lossless configuration here; the generator's ``method`` then
            reads e.g. ``"auto→self-spec@stock, draft int8"``. ``auto`` takes only ``draft_model``.
        remeasure: calibrate again instead of using the cached choice (where anything is chosen).
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto``.
        dtype: ``float32`` (default; exact greedy equality), ``bfloat16`` or ``float16``.
        trust_remote_code: allow custom modelling code from a model repository (off by default).
        self_test: check at load time that tree verification equals sequential decoding.
        kernels: linear-layer backend, one of ``selfspec.KERNELS``: ``auto`` (default for a new
            load, or ``$SELFSPEC_KERNELS`` where set: the fp32 backend that decodes the method
            fastest here, chosen with it), ``stock`` (PyTorch's kernels), ``onednn`` (fp32,
            prepacked; CPU) or ``int8`` (quantised model, opt-in). None keeps a loaded model's
            current backend.
        threads: torch CPU threads to load, measure and generate with (restored after each call;
            None: torch's choice, usually one per core). On a machine busy with other work,
            ``threads=1`` can be several times faster.
        **method_options: options of the method's config, e.g. ``draft_model="..."``, ``k=4``.
    """
    check_threads(threads)
    with torch_threads(threads):
        g = _load(model, method, device, dtype, trust_remote_code, self_test, kernels, remeasure, method_options)
    g.threads = threads
    return g


def _load(model: str | LoadedModel, method: str, device: str | None, dtype: str | torch.dtype,
          trust_remote_code: bool, self_test: bool, kernels: str | None, remeasure: bool,
          method_options: dict) -> SpeculativeGenerator:
    """:func:`load` on the threads as they are."""
    from .kernels import KERNELS, default_kernels

    if method == AUTO:
        unknown = sorted(set(method_options) - {"draft_model"})
        if unknown:
            raise SelfspecError(f"method 'auto' has no option {unknown[0]!r}; it takes only draft_model (it chooses "
                                "a method and its settings itself; name a method to set its options)")
    else:
        method_config(method, method_options)
    if kernels is not None and kernels not in KERNELS:
        raise SelfspecError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNELS)}")
    if isinstance(model, LoadedModel):
        target = model
        kernels = target.backend if kernels is None else kernels
    else:
        kernels = kernels or default_kernels()
        target = load_model(model, device, dtype, trust_remote_code, kernels="stock" if kernels == AUTO else kernels)
    if kernels != AUTO and kernels != target.backend:
        target.use_kernels(kernels)
    if self_test:
        worst = tree_self_test(target.model)
        keep_int8_promise(target, lambda m: worst)  # int8 promises bit-identical rows: checked, else stock
    if method == AUTO or kernels == AUTO:
        return _load_chosen(target, method, method_options, kernels, trust_remote_code, remeasure,
                            keep=isinstance(model, LoadedModel))
    return _build(target, method, method_options, trust_remote_code)


def _build(target: LoadedModel, method: str, options: dict, trust_remote_code: bool,
           sizes: tuple[int, ...] = (1,)) -> SpeculativeGenerator:
    """``method`` with ``options`` on ``target`` as it is now (its current kernels), through the
    registry. On the compiled backend, the steps of blocks of ``sizes`` compile (or load from the
    cache) now, not mid-request."""
    ctx = BuildContext(device=target.device, dtype=target.model.dtype, trust_remote_code=trust_remote_code,
                       kernels=target.backend)
    spec = METHODS[method]
    drafter = spec.build(target, method_config(method, options), ctx)
    if target.step is not None:
        target.step.warm_up(MIN_CAPACITY, sizes, drafter.needs_hidden)
    return SpeculativeGenerator(target, method, drafter, spec.lossless)


def compiled_ready(target: LoadedModel, methods: Sequence[str]) -> list[str]:
    """Those of ``methods`` whose compiled steps (every block size of
    :func:`~selfspec.models.compiled_step.block_sizes`, on the default static cache, with or
    without hidden states) are saved on this machine, so that ``auto`` can time them on the
    ``compiled`` backend without compiling anything (``selfspec compile`` saves them). Switches
    ``target`` to the compiled backend (keeping its current layers) only where some step of this
    model could be saved; it is left on the backend it was on."""
    from .models import aot_step
    from .models.compiled_step import block_sizes, compile_cache_dir

    d = compile_cache_dir()
    if d is None or not aot_step.supported(target.device) or target.model.dtype != torch.float32:
        return []
    if not any((Path(d) / "aot").glob(f"step-1x{MIN_CAPACITY}-*.bin")):  # nothing compiled here yet: no switch
        return []
    before = target.backend
    target.use_kernels("compiled", keep=True)
    try:
        step = target.step
        assert step is not None
        return [m for m in methods
                if any(not step.missing(MIN_CAPACITY, block_sizes(m), hidden) for hidden in (False, True))]
    finally:
        target.use_kernels(before, keep=True)


def _auto_sizes(c: Candidate) -> tuple[int, ...]:
    """The compiled block sizes of a candidate of ``auto``: all it verifies on the compiled backend
    (saved here, or it would be no candidate), loaded before it is timed so no timed run loads one."""
    from .models.compiled_step import block_sizes

    return block_sizes(c.method) if c.kernels == "compiled" else (1,)


def _load_chosen(target: LoadedModel, method: str, options: dict, kernels: str, trust_remote_code: bool,
                 remeasure: bool, keep: bool) -> SpeculativeGenerator:
    """``auto`` for the method, the kernels or both: the candidates (the registry's ``auto``
    candidates, or ``method`` alone, on every fp32 backend here or on ``kernels`` alone), the
    choice (cached, else calibrated with the kernels switched in place), and the chosen one built.
    Unless ``keep`` (a model the caller loaded, which other generators may share), the layers of
    the backends not chosen are freed."""
    from . import autoselect
    from .drafters.spec import AutoContext
    from .kernels.auto import candidates as fp32_kernels

    backends = [k for k in fp32_kernels(target.model) if k != "compiled"] if kernels == AUTO else [kernels]
    ctx = AutoContext(draft_model=options.get("draft_model") or None,  # precisions found (and noted) once
                      draft_precisions=autoselect.usable_precisions(target.device.type) if method == AUTO else ())

    def on(kernel_list: list[str]) -> list[autoselect.Candidate]:
        if method == AUTO:
            return autoselect.candidates(target, METHODS.values(), kernel_list, ctx)
        return [autoselect.Candidate(method, dict(options), k) for k in kernel_list]  # only kernels are chosen

    cands = on(backends)
    reference = BASELINE if method == AUTO else None  # a fixed method has nothing to be compared with
    if kernels in (AUTO, "compiled") and (method == AUTO or kernels == AUTO):
        # the compiled step, for the methods whose steps are saved here: auto compiles nothing itself
        compiled = on(["compiled"])
        ready = compiled_ready(target, list(dict.fromkeys(c.method for c in compiled)))
        cands = [c for c in cands if c.kernels != "compiled"] + [c for c in compiled if c.method in ready]
        if not ready:
            if kernels == "compiled":
                raise SelfspecError("auto on the compiled kernels times only steps compiled ahead, and none are "
                                    "saved here for this model: run `selfspec compile` first (minutes, once per "
                                    "machine), or name a method, e.g. --method pld")
            log.info("auto: the compiled kernels are left out: their steps are not compiled on this machine "
                     "(`selfspec compile` compiles them once, in minutes; auto then times them too)")

    def make(c: autoselect.Candidate) -> SpeculativeGenerator:
        if target.backend != c.kernels:
            target.use_kernels(c.kernels, keep=True)  # in place: the other backends' layers stay for the next
        return _build(target, c.method, c.options, trust_remote_code, _auto_sizes(c))

    choice = autoselect.choose(target, make, cands, reference, remeasure=remeasure)
    c = choice.candidate
    if len(backends) > 1 or target.backend != c.kernels:
        target.use_kernels(c.kernels, keep=keep)  # without keep: frees the layers of the backends not chosen
    g = _build(target, c.method, c.options, trust_remote_code)  # later block sizes: saved, loaded when first met
    if method == AUTO:
        g.method = autoselect.auto_label(c)
    g.auto_choice = choice
    g.auto_table = choice.table
    measured = {**choice.pruned, **choice.table}
    alt = max((x for x in cands if x.kernels != "compiled" and x.label in measured), key=lambda x: measured[x.label],
              default=None)
    if c.kernels == "compiled" and alt is not None:

        def build_alt() -> SpeculativeGenerator:
            target.use_kernels(alt.kernels, keep=True)
            h = _build(target, alt.method, alt.options, trust_remote_code)
            if method == AUTO:
                h.method = autoselect.auto_label(alt)
            return h

        g.fallback = CompiledFallback(_auto_sizes(c), alt.label, build_alt)
    return g
