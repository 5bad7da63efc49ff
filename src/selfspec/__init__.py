"""selfspec: faster generation from Hugging Face language models without changing what they generate.

Quick start::

    import selfspec
    g = selfspec.load(model="smollm2-135m-instruct", method="pld")
    r = g.generate("Write a Python function that reverses a string.", max_new_tokens=64)
    print(r.text, r.tokens_per_s, r.mean_accepted)
"""

from .api import GenerationResult, SpeculativeGenerator, load
from .config import GenerationConfig
from .errors import SelfspecError
from .kernels import KERNELS
from .registry import METHODS

Generator = SpeculativeGenerator
__version__ = "0.1.0"
__all__ = ["load", "Generator", "SpeculativeGenerator", "GenerationResult", "GenerationConfig", "SelfspecError",
           "METHODS", "KERNELS", "__version__"]
