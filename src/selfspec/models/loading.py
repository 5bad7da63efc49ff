"""Resolve what the user typed as ``--model`` and load a stock HF causal LM with its tokenizer.

Accepted: a bundled name (``selfspec models list``), a local HF directory (safetensors only), a
``.gguf`` file (converted once into the cache), or a hub id (where a hub is reachable).
``trust_remote_code`` is off unless the caller turns it on.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from ..core import kv_cache
from ..errors import SelfspecError
from ..paths import selfspec_home
from . import bundled
from .adapter import layer_windows
from .runner import LoadedModel, Runner

__all__ = ["DTYPES", "DEVICES", "LoadedModel", "Runner", "load_model", "resolve_device", "resolve_dtype",
           "resolve_path"]

log = logging.getLogger("selfspec.models")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


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


def gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return selfspec_home() / "models" / f"gguf-{path.stem}-{key}"


def gguf_config(path: Path):
    """The transformers config of a GGUF file, read from its metadata (no weights), or None where
    transformers cannot read it (the conversion then says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:  # noqa: BLE001 - a pre-check only: the conversion reports what went wrong, in one line
        return None


def check_decodable(config) -> None:
    """Refuse, in one line naming the family, a model whose layers keep a state a rejected draft
    could not be taken back from (recurrent, linear or chunked attention); None: nothing to check."""
    if config is None:
        return
    layer_windows(config)
    kv_cache.new_cache(config)


def converted_models() -> list[tuple[Path, int]]:
    """The GGUF files converted into the cache (``$SELFSPEC_HOME/models/gguf-*``) and their sizes in bytes."""
    root = selfspec_home() / "models"
    dirs = sorted(root.glob("gguf-*")) if root.is_dir() else []
    return [(d, sum(f.stat().st_size for f in d.rglob("*") if f.is_file())) for d in dirs if d.is_dir()]


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
        out = gguf_cache_dir(p)
        if out.is_dir() and bundled.verify_manifest(out) is None:
            return out, ""
        check_decodable(gguf_config(p))  # refused before a conversion of minutes and gigabytes
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
) -> Runner:
    """Load model ``spec`` for inference (eval mode, no grad); returns its runner on concrete backend
    ``kernels``.
    ``runner.base`` is the :class:`LoadedModel`; ``runner.runner(k)`` is another backend's runner
    over the same weights.

    ``release_fp32`` frees the fp32 weights behind converted layers (saves memory; the model
    then runs on that backend only)."""
    from ..kernels import KERNELS

    if kernels not in KERNELS:
        raise SelfspecError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNELS)}")
    if kernels == "auto":
        raise SelfspecError("load_model takes concrete kernels; auto is chosen by selfspec.load (with the method) "
                            "or selfspec.autoselect.kernels.fastest_runner")
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
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except ValueError as e:
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
                raise
            # an architecture transformers runs only through its eager attention (Gemma 2's logit softcap)
            log.info("%s: transformers has no sdpa attention for this architecture; it attends through eager "
                     "attention (one request at a time: batching needs sdpa)", spec)
            model = AutoModelForCausalLM.from_pretrained(source, **{**kwargs, "attn_implementation": "eager"})
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
    check_decodable(model.config)  # at load: a layer kind that cannot be rolled back is refused in one line
    model.to(dev).eval()  # type: ignore[arg-type]  # transformers' @wraps-decorated `to`: typed unbound (self first)
    model.requires_grad_(False)
    loaded = LoadedModel(model, tok, spec, path)
    runner = loaded.runner(kernels)
    if release_fp32 and kernels not in ("stock", "compiled"):
        loaded.release_fp32(kernels)
    if os.environ.get("SELFSPEC_VERBOSE"):
        log.info(f"loaded {spec} from {source} on {dev} ({dt}, {kernels} kernels)")
    return runner
