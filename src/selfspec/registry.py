"""The decoding methods: a table of one line per method.

Each line is the :class:`~selfspec.drafters.spec.MethodSpec` a drafter module exports: the
method's name, its config class (validated, with the help and CLI flag of every option in field
metadata), its builder and whether it is lossless. The CLI's method flags, ``--method`` help
and ``selfspec bench``'s ``METHOD:key=value`` entries are all derived from this table, so adding a
method is one line here (``docs/DESIGN.md``, "Adding a method").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .drafters import base, draft_model, eagle, jacobi, msn, prompt_lookup, sdsat, self_spec, space
from .drafters.base import NoOptions
from .drafters.spec import BuildContext, MethodSpec, option
from .errors import SelfspecError
from .models.compiled_step import PREFILL_BLOCK, block_sizes

# auto tries its candidates in this order (ar first, the reference; msn before pld and jacobi: the cost
# profile msn measures covers the block sizes they need, so a first calibration measures it once)
METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    base.AR,
    msn.SPEC,
    prompt_lookup.SPEC,
    draft_model.SPEC,
    self_spec.SPEC,
    eagle.EAGLE2,
    eagle.HASS,
    sdsat.SDSAT,
    sdsat.SDSAT_LOSSY,
    jacobi.SPEC,
    space.SPACE,
    space.SPACE_LOSSY,
)}

BASELINE = base.AR.name  # what speedups are measured against
AUTO = "auto"  # not a drafter: api.load resolves it to a method of METHODS (selfspec.autoselect)
AUTO_HELP = "the fastest lossless (method, kernels, draft precision) here, measured once and cached"


@dataclass(frozen=True)
class AutoOptions:
    """Options of ``auto``, which chooses the method and its settings itself."""

    draft_model: str = option("", "also consider draft-model with this draft (same tokenizer)", flag="--draft-model")


__all__ = ["AUTO", "AUTO_HELP", "BASELINE", "METHODS", "AutoOptions", "BuildContext", "MethodSpec", "NoOptions",
           "compiled_blocks", "draft_model_of", "method_config", "options_class"]


def options_class(method: str) -> type:
    """The config class of ``method`` (``auto`` included)."""
    if method == AUTO:
        return AutoOptions
    if method not in METHODS:
        raise SelfspecError(f"unknown method '{method}'; choose one of: {', '.join([AUTO, *METHODS])}")
    return METHODS[method].config_cls


def method_config(method: str, options: dict) -> object:
    """Validate ``options`` against the method's config class (its ``__post_init__`` checks the values)."""
    cls = options_class(method)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        valid = ", ".join(sorted(names)) or "none"
        raise SelfspecError(f"method '{method}' has no option {unknown[0]!r}; its options are: {valid}")
    try:
        return cls(**options)
    except TypeError as e:
        raise SelfspecError(f"bad options for method '{method}': {e}") from e


def compiled_blocks(method: str) -> tuple[int, ...]:
    """The ``compiled`` backend's block sizes ``method`` runs at its defaults (every padded size up
    to its :attr:`~selfspec.drafters.spec.MethodSpec.largest_block`, and up to the prompt's blocks,
    :data:`~selfspec.models.compiled_step.PREFILL_BLOCK`, for every method): compiled ahead by
    ``selfspec compile`` and the benchmark's warm-up, and saved for ``auto`` to time it there."""
    return block_sizes(max(METHODS[method].largest_block, PREFILL_BLOCK))


def draft_model_of(generator) -> object | None:
    """The separate draft model a generator's method runs (an ``nn.Module``), if it has one:
    ``selfspec bench``'s ``hf-assisted`` peer reuses it instead of loading it again."""
    return getattr(getattr(generator, "drafter", None), "draft_model", None)
