"""Resolve what the user typed as ``--model`` and load a stock HF causal LM with its tokenizer.

Accepted: a bundled name (``selfspec models list``), a local HF directory (safetensors only), a
``.gguf`` file (converted once into the cache), or a hub id (where a hub is reachable).
``trust_remote_code`` is off unless the caller turns it on.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.cost import CostProfile, load_or_measure, profile_key
from ..errors import SelfspecError
from ..kernels.swap import KernelState
from ..paths import selfspec_home
from . import bundled
from .compiled_step import StaticStep

log = logging.getLogger("selfspec.models")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A stock ``AutoModelForCausalLM`` in eval mode plus its tokenizer.

    Attributes:
        model: the HF model (``attn_implementation`` sdpa or eager, so 4-D masks are honoured).
        tokenizer: its tokenizer.
        name: what the user asked for (shown in reports).
        path: the local directory the weights came from (None for a hub id).
        backend: the linear-layer kernels in use (``stock``, ``onednn``, ``int8`` or ``compiled``;
            see :mod:`selfspec.kernels`). ``int8`` is a quantised model.
        kernel_state: what kernel switches remember (kept layers, the attention function before),
            kept here rather than on the model.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path | None
    backend: str = "stock"
    kernel_state: KernelState = field(default_factory=KernelState, repr=False)
    _step: StaticStep | None = field(default=None, repr=False)

    @property
    def step(self) -> StaticStep | None:
        """The compiled static-shape verify step on the ``compiled`` backend (made on first use,
        then kept with its compiled graphs), else None: verification runs eagerly."""
        if self.backend != "compiled":
            return None
        if self._step is None:
            self._step = StaticStep(self.model)
        return self._step

    @property
    def cost_key(self) -> str:
        """The cache key of :meth:`cost_profile` (``core.cost.profile_key``; the one place it is
        built for a loaded model): ``+step`` where the backend verifies through its own step, and
        then the version of the step's code (:func:`~selfspec.models.aot_step.code_version`: a new
        layout or Inductor option makes another step, whose profile is measured anew)."""
        if self.step is None:
            return profile_key(self.model, self.name, self.backend)
        from .aot_step import code_version

        version = hashlib.sha256(code_version().encode()).hexdigest()[:12]
        return f"{profile_key(self.model, self.name, self.backend, stepped=True)}|step-code={version}"

    def cost_profile(self, hidden: bool = False, extra_qs: tuple[int, ...] = (),
                     remeasure: bool = False) -> CostProfile:
        """The verify cost profile T(q) of this model on its current backend, cached per machine
        (:func:`~selfspec.core.cost.load_or_measure`): timed through the compiled step on the
        ``compiled`` backend (with hidden states when the method verifies with them, ``hidden``),
        else through the eager forward."""
        return load_or_measure(self.model, self.cost_key, self.name, remeasure=remeasure, extra_qs=extra_qs,
                               step=self.step, hidden=hidden)

    def use_kernels(self, kernels: str, keep: bool = False) -> str:
        """Switch this model's linear layers to ``kernels`` (in place); returns the backend."""
        from ..kernels import apply_kernels

        self.backend = apply_kernels(self.model, kernels, self.name, keep, self.kernel_state)
        return self.backend

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SelfspecError(f"unknown dtype '{dtype}'; choose one of: float32, bfloat16, float16")
    return DTYPES[dtype]


DEVICES = "auto, cpu, cuda, cuda:N or mps"  # what --device takes


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device of ``--device`` (``auto``: CUDA if available, else the CPU); a device this
    machine does not have is a one-line error."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise SelfspecError(f"unknown device '{device}'; use {DEVICES}") from e
    if dev.type not in ("cpu", "cuda", "mps"):
        raise SelfspecError(f"unsupported device '{device}'; use {DEVICES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SelfspecError(f"device '{device}' requested but no CUDA device is available; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SelfspecError(f"device '{device}' requested but this machine has {torch.cuda.device_count()} CUDA "
                                f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if dev.type == "mps" and not _mps_available():
        raise SelfspecError(f"device '{device}' requested but MPS (Apple GPU) is not available here; use --device "
                            "cpu (or auto)")
    return dev


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return selfspec_home() / "models" / f"gguf-{path.stem}-{key}"


def resolve_path(spec: str) -> tuple[Path | None, str]:
    """Map a model spec to a local directory (pulling / converting if needed), or a hub id.

    Returns:
        ``(directory, "")`` for local weights, ``(None, hub_id)`` for a hub id.
    """
    if spec in bundled.BUNDLED or spec in bundled.FINETUNED:
        return bundled.pull(spec), ""
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise SelfspecError(f"GGUF file not found: {spec}")
        bundled.check_gguf(p)
        out = _gguf_cache_dir(p)
        if out.is_dir() and bundled.verify_manifest(out) is None:
            return out, ""
        with bundled.build_lock(out):
            if not (out.is_dir() and bundled.verify_manifest(out) is None):  # else: built while we waited
                bundled.convert_gguf(p, out, {"gguf": str(p.resolve())})
        return out, ""
    if p.is_dir():
        if not any(p.glob("*.safetensors")):
            raise SelfspecError(
                f"no .safetensors weights in {spec}: selfspec loads safetensors only (pickle files can run code); "
                "convert the checkpoint with save_pretrained(..., safe_serialization=True)"
            )
        if (p / bundled.MANIFEST).is_file():
            reason = bundled.verify_manifest(p)
            if reason is not None:
                raise SelfspecError(f"{spec} is corrupt ({reason}); delete it or pull/convert it again")
        return p, ""
    if p.exists():
        raise SelfspecError(f"{spec} is a file, not a model: pass a model directory, a .gguf file or a bundled name")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return None, spec
    if spec.startswith((".", "/", "~")) or "/" in spec or os.sep in spec:  # a path, not a name
        raise SelfspecError(f"no such directory: {spec} (--model takes a local HF directory, a .gguf file, a bundled "
                            "name or a hub id like org/name)")
    raise SelfspecError(
        f"unknown model '{spec}': use a bundled name ({', '.join([*bundled.BUNDLED, *bundled.FINETUNED])}), "
        "a local HF directory, a .gguf file or a hub id like org/name"
    )


def load_model(
    spec: str,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    kernels: str = "stock",
    release_fp32: bool = False,
) -> LoadedModel:
    """Load model ``spec`` for inference (eval mode, no grad), its linear layers on ``kernels``.

    ``release_fp32`` frees the fp32 weights behind converted layers (saves memory; the model
    then stays on that backend)."""
    from ..kernels import KERNELS

    if kernels not in KERNELS:
        raise SelfspecError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNELS)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    path, hub_id = resolve_path(spec)
    source = str(path) if path is not None else hub_id
    kwargs = dict(dtype=dt, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
                  use_safetensors=True)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as e:
        if path is None:
            raise SelfspecError(
                f"could not load '{hub_id}' from the Hugging Face Hub (no network, unknown id, or no safetensors "
                f"weights: {str(e).splitlines()[0]}); pass a bundled name or a local directory instead"
            ) from e
        raise SelfspecError(f"could not load the model in {path}: {str(e).splitlines()[0]}") from e
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise SelfspecError(
                f"{spec} needs custom code from its repository; pass --trust-remote-code if you trust it"
            ) from e
        raise SelfspecError(f"could not load {spec}: {str(e).splitlines()[0]}") from e
    model.to(dev).eval()
    model.requires_grad_(False)
    loaded = LoadedModel(model, tok, spec, path)
    if kernels != "stock":
        loaded.use_kernels(kernels)
        if release_fp32 and loaded.backend not in ("stock", "compiled"):
            from ..kernels import release_originals

            release_originals(model)
    if os.environ.get("SELFSPEC_VERBOSE"):
        log.info(f"loaded {spec} from {source} on {dev} ({dt}, {loaded.backend} kernels)")
    return loaded
