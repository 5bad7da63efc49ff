"""What a drafter module hands to the registry: a :class:`MethodSpec` (its config class, its
builder, whether it is lossless, a one-line help), and the helpers its config uses.

A method's options are a frozen dataclass. Each field carries its help text (and, where the
command line sets it, its flag) in ``dataclasses.field(metadata=...)``, written with
:func:`option`; ``__post_init__`` checks the values with :func:`need` and :func:`check_numbers`,
so a bad option is refused with one line naming it before any model is loaded. The CLI builds its
method flags from that metadata (``selfspec.options``), and ``selfspec bench`` takes any field as
``METHOD:key=value``.

Field metadata keys:

- ``help``: what the option does (also the flag's help, prefixed with the method names).
- ``flag``: the CLI flag that sets it, e.g. ``--k``; several methods may share one flag.
- ``value``: the flag is a switch (``store_true``) and sets the field to this value.
- ``when`` / ``unless``: the flag sets this field only when another flag is / is not given
  (``msn``: ``--k`` is ``tree_size`` with ``--fixed-k``, else ``max_nodes``).
- ``choices``: the values the flag accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..errors import SelfspecError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from ..decoding.protocol import Drafter
    from ..models.loading import Runner
    from .budget import ChainBudget


@dataclass(frozen=True)
class BuildContext:
    """What builders may use besides the target: how to load further models, and whether they may
    measure (``measure=False``: cached cost profiles and draft costs only, else fixed sizes; nothing
    is timed or written)."""

    device: object
    dtype: object
    trust_remote_code: bool
    kernels: str = "stock"
    measure: bool = True


@dataclass(frozen=True)
class AutoContext:
    """What else decides whether a method is an ``auto`` candidate.

    Attributes:
        draft_model: the draft model the user named.
        draft_precisions: the draft precisions that can pay here (None: detected on the target's
            device by :func:`selfspec.kernels.switch.draft_precisions`).
    """

    draft_model: str | None = None
    draft_precisions: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AutoCandidacy:
    """Whether and how a method takes part in ``auto`` (:mod:`selfspec.autoselect`).

    Attributes:
        options: ``options(name, target, ctx)`` -> the options (``selfspec.load`` keywords) it runs
            with as a candidate, ``{}`` for its defaults, or None where it cannot run without
            further downloads or training (no head, no skip config, no fine-tune).
        precision_option: the option that sets its draft precision (e.g. ``draft_kernels``), or
            ``""`` where it has none; ``auto`` then also chooses among ``precisions``.
        precisions: the values of ``precision_option`` that ``auto`` tries (drafts need not be
            exact: verification stays on the verify kernels, so output is unchanged).
    """

    options: Callable[[str, Runner, AutoContext], dict | None]
    precision_option: str = ""
    precisions: tuple[str, ...] = ()


def _always(name: str, target: Runner, ctx: AutoContext) -> dict:
    return {}


ALWAYS = AutoCandidacy(_always)  # runs on any model with nothing installed


def _fine_tuned(name: str, target: Runner, ctx: AutoContext) -> dict | None:
    from ..models.finetuned import read_meta

    try:
        meta = read_meta(target.path)
    except (OSError, ValueError):  # unreadable metadata: not a candidate
        return None
    return {} if meta is not None and meta.get("method") == name else None


IF_FINE_TUNED = AutoCandidacy(_fine_tuned)  # runs where the model was fine-tuned for this method


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method: the single source of its name, options, builder and losslessness.

    Attributes:
        name: the method's name (``--method NAME``, ``selfspec.load(method=NAME)``).
        config_cls: its options, a frozen dataclass validated in ``__post_init__``.
        make: ``make(spec, target, cfg, ctx)`` builds the drafter; it reads ``spec.name`` and
            ``spec.lossless`` where one drafter serves several methods.
        lossless: whether the method's output distribution is the target's (greedy is exact for
            every method).
        help: one line for ``--method`` help and the docs.
        auto: whether and how ``auto`` tries it (None: never, e.g. a lossy method).
        largest_block: the most tokens one verify forward of its defaults holds (its cost profile
            prices up to it): the ``compiled`` backend's steps up to this block are compiled ahead
            (``selfspec compile``, the benchmark's warm-up) and must be saved for ``auto`` to time
            the method there. A larger block (a user's option) compiles when met.
        draft_step: for a drafter that may draft through a compiled step of its own on the
            ``compiled`` backend (``self-spec``'s int8 draft), ``draft_step(target, cfg)``: whether
            the drafter of options ``cfg`` would compile that step now (not saved here), told without
            building it. ``selfspec compile`` builds such steps through
            :meth:`~selfspec.decoding.protocol.Drafter.warm_up`; ``auto`` leaves a candidate whose
            step is missing out, as it does one whose verify steps are. None: no step of its own.
        draft_weights: its drafter loads weights of its own (a draft model, a head). A batch builds
            one drafter per request, so such a method decodes one request at a time (batching it
            would load its draft once per slot).
        draft_forwards: its drafter runs model forwards of its own (``self-spec``: the model with
            sub-layers skipped). In a batch they run in each request's thread, one request after
            another, while the packed forward waits for all of them, so a server's ``auto`` leaves
            such a method out (``autoselect.configure.for_batches``); named, it still batches.
    """

    name: str
    config_cls: type
    make: Callable[[MethodSpec, Runner, Any, BuildContext], Drafter]
    lossless: bool
    help: str
    auto: AutoCandidacy | None = None
    largest_block: int = 64
    draft_step: Callable[[Runner, Any], bool] | None = None
    draft_weights: bool = False
    draft_forwards: bool = False

    def build(self, target: Runner, cfg: object, ctx: BuildContext) -> Drafter:
        """The drafter of this method for ``target`` with options ``cfg``."""
        drafter = self.make(self, target, cfg, ctx)
        if bool(drafter.lossless) is not self.lossless:
            raise RuntimeError(f"method {self.name} is registered {'' if self.lossless else 'not '}lossless but "
                               f"built a drafter that says lossless={drafter.lossless}")
        return drafter


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
           **cli: Any) -> Any:
    """A config field with its help and, optionally, its CLI flag (see the module docstring)."""
    meta: dict[str, Any] = {"help": help}
    if flag is not None:
        meta["flag"] = flag
    meta.update(cli)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(cfg: object, name: str) -> str:
    """How the CLI sets field ``name`` of config ``cfg``: ``" (--k)"``, or ``""`` without a flag."""
    f = next((f for f in dataclasses.fields(cfg) if f.name == name), None)  # type: ignore[arg-type]
    if f is None or "flag" not in f.metadata:
        return ""
    md = f.metadata
    extra = f" with {md['when']}" if "when" in md else f" without {md['unless']}" if "unless" in md else ""
    return f" ({md['flag']}{extra})"


def need(cfg: object, method: str, name: str, ok: bool, rule: str) -> None:
    """Refuse ``cfg`` with one line naming option ``name`` (and its flag) unless ``ok``:
    ``"pld needs k >= 1 (--k), not 0"``."""
    if not ok:
        raise SelfspecError(f"{method} needs {name} {rule}{flag_of(cfg, name)}, not {getattr(cfg, name)!r}")


_NUMBERS: dict[str, tuple[type | tuple[type, ...], str]] = {"int": (int, "an integer"),
                                                             "float": ((int, float), "a number")}


def check_numbers(cfg: object, method: str) -> None:
    """Refuse numeric fields (``int``, ``float``, ``int | None`` ...) that hold something else,
    e.g. text from ``selfspec bench --methods pld:k=four``, before any comparison trips on it."""
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        kind, _, optional = str(f.type).partition(" | ")
        if kind not in _NUMBERS:
            continue
        value = getattr(cfg, f.name)
        types, what = _NUMBERS[kind]
        if value is None and optional == "None":
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise SelfspecError(f"{method} needs {f.name} to be {what}{flag_of(cfg, f.name)}, not {value!r}")


def chain_budget(target: Runner, auto: bool, k: int, measure: bool = True) -> ChainBudget:
    """The draft-length budget of a chain drafter: sized from the target's measured verify-cost
    profile when ``auto`` (with ``measure`` off: a cached one, else always ``k``), else always ``k``."""
    from .budget import ChainBudget

    profile = target.cost_profile(measure=measure) if auto else None
    return ChainBudget(profile, k)


def finetuned_ids(target: Runner, method: str, ids: list[int], what: str,
                  option_name: str) -> tuple[list[int], dict | None]:
    """The new token ids a fine-tuned method drafts with (``sdsat``'s adaptive tokens,
    ``space``'s mask), checked against the model's vocabulary: ``ids`` when given, else those
    the model directory's ``selfspec_finetune.json`` records for ``method``; with that file's
    metadata (None without one)."""
    from ..models.bundled import FINETUNED
    from ..models.finetuned import read_meta

    embeddings = cast("PreTrainedModel", target.model).get_input_embeddings()
    vocab = cast("torch.Tensor", embeddings.weight).shape[0]
    meta = read_meta(target.path)
    if not ids:
        if meta is None or meta.get("method") != method:
            bundled = [name for name, m in FINETUNED.items() if m.method == method]
            use = f"use --model {' or '.join(bundled)}, " if bundled else ""
            raise SelfspecError(
                f"model '{target.name}' was not fine-tuned for {method} (no {method} selfspec_finetune.json): "
                f"{use}train one with `selfspec train {method} --model M --out DIR`, or name the {what} with "
                f"{option_name}=ID")
        ids = list(meta["new_ids"])
    if not ids or any(not 0 <= i < vocab for i in ids):
        raise SelfspecError(f"{method} {what} ids {ids} must be in [0, {vocab})")
    return ids, meta
