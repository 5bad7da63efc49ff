"""selfspec: faster generation from Hugging Face language models without changing what they generate.

Quick start::

    import selfspec
    g = selfspec.load(model="smollm2-135m-instruct", method="auto")
    r = g.generate("Write a Python function that reverses a string.", max_new_tokens=64)
    print(r.text, r.tokens_per_s, r.mean_accepted)

The public names are imported on first use (``torch`` and ``transformers`` take seconds to
import), so ``import selfspec`` and the CLI's argument parsing start at once, and Ctrl-C during
start-up is handled by the CLI like any other time.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from .errors import SelfspecError

try:  # one source: the package metadata (pyproject.toml's version, as installed)
    __version__ = _metadata.version("selfspec")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "load": ".api",
    "SpeculativeGenerator": ".api",
    "Generator": ".api",
    "GenerationResult": ".api",
    "GenerationConfig": ".config",
    "KERNELS": ".kernels",
    "METHODS": ".registry",
}

__all__ = ["load", "Generator", "SpeculativeGenerator", "GenerationResult", "GenerationConfig", "SelfspecError",
           "METHODS", "KERNELS", "__version__"]

if TYPE_CHECKING:
    from .api import GenerationResult, SpeculativeGenerator, load
    from .config import GenerationConfig
    from .kernels import KERNELS
    from .registry import METHODS

    Generator = SpeculativeGenerator


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'selfspec' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = getattr(module, "SpeculativeGenerator" if name == "Generator" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
