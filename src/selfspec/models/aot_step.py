"""Saved compiled steps: the warm start of the ``compiled`` backend without Dynamo's trace.

Inductor's own cache keeps the generated code between processes, but every new process still
traces the model's Python (11-16 s for SmolLM2's 30 layers on a 2-core AVX2 VM) before it finds
that code. ``torch.compile(...).aot_compile`` (PyTorch >= 2.10) captures one shape's step ahead of
time into a file that loads without tracing (3.4 s, then 0.1 s for the first call, there).

A saved step is one shape of one model on one machine, and it is saved with no guards (Dynamo
cannot serialise the identity guards on the model), so nothing checks it when it runs. This
module does: the file's name is a hash of everything the graph was specialised on (the padded
block, cache capacity and hidden-states flag; the model's class, config, dtype, device,
attention and linear-layer classes; the machine, thread count, torch / transformers versions and
torch's install directory), and the step only
calls it with that exact shape, under inference mode, on that model. A file that does not load
is compiled again and replaced. CPU only: on CUDA the step keeps ``torch.compile`` with CUDA
graphs, which these files do not carry.

Two things ``transformers``' modelling code needs on load: its decorated ``forward`` functions,
which pickle cannot name, travel as external data; and the module references in the saved
bytecode, named after the saving process's object ids, are bound again to the modules of the
same name in this process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..core.machine import machine_id
from ..kernels.gemv import LAYOUT as PRODUCT_LAYOUT
from ..kernels.gqa_attention import WINDOW
from ..kernels.int8 import DRAFT_LAYOUT as INT8_DRAFT_LAYOUT
from ..kernels.onednn import SHARED_PRODUCTS_PASS, shared_products_pass
from ..kernels.swap import linear_layers
from ..paths import file_lock

log = logging.getLogger(__name__)

# A module a graph refers to, as the saving process named it: ``___module_<dotted name, "." -> "_">_<id>_c<n>``,
# where n counts the earlier steps that process compiled with the same reference (c1 for its second step).
_MODULE_REF = re.compile(r"'(___module_(\w+?)_\d+_c\d+)'")


KNOWN_TORCH = ("2.13",)
"""The torch releases (major.minor) whose private internals this module was written and tested
against: turning a saved step's guards off, binding its module references again, and Inductor's
ISA probe. On another release the CPU's ``compiled`` backend is not offered (:func:`route`)."""
ROUTE_ENV = "SELFSPEC_COMPILE_ROUTE"
"""``public``: compile CPU steps with ``torch.compile`` and its own caches in every process (no
private torch internals, no saved steps); unset or ``saved``: this module's saved steps where
:func:`route` allows them."""


def route(device: torch.device) -> str | None:
    """How the ``compiled`` backend compiles its steps on ``device``: ``saved`` (this module: steps
    compiled ahead of time and saved, loaded without tracing; CPU, a torch of :data:`KNOWN_TORCH`
    with ``aot_compile``), ``public`` (``torch.compile`` with its own caches: CUDA, where CUDA graphs
    need it; or ``$SELFSPEC_COMPILE_ROUTE=public``), or None: a CPU torch this module does not know,
    where the backend is not offered (the ``onednn`` runner runs instead, with a note)."""
    if device.type != "cpu" or os.environ.get(ROUTE_ENV, "").strip() == "public":
        return "public"
    if ".".join(torch.__version__.split("+")[0].split(".")[:2]) not in KNOWN_TORCH:
        return None
    try:  # imports only: building a torch.compile wrapper to ask would import Inductor's compiler (1.3 s)
        from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph  # noqa: F401
    except ImportError:
        return "public"
    return "saved" if getattr(torch._dynamo.config, "enable_aot_compile", False) else "public"


def supported(device: torch.device) -> bool:
    """Whether steps on ``device`` are saved and loaded (:func:`route` is ``saved``)."""
    return route(device) == "saved"


def artifact_path(directory: str, model: torch.nn.Module, shape: tuple[int, int, bool]) -> Path:
    """The file of ``model``'s step of ``shape`` = (padded block, cache capacity, hidden states)
    under ``directory``: named by a hash of everything the compiled graph depends on."""
    return artifact_paths(directory, model, [shape])[0]


WHERE_FROM = ("_name_or_path",)
"""Config keys that say where the weights were read from, left out of saved steps' names: a step
takes the weights as inputs, so a copy of a model in another directory or a fine-tune of the same
architecture (``smollm2-135m-instruct-msn``) loads the steps saved for the model (tested)."""


@functools.cache
def code_digest() -> str:
    """A digest of the sources of selfspec's code that a step traces (``kernels/``, ``models/``), part
    of every saved step's name: a step saved by other code (an upgrade, an edited checkout, the
    tests' shared cache across commits) is compiled again rather than loaded."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("kernels", "models"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def artifact_paths(directory: str, model: torch.nn.Module, shapes: list[tuple[int, int, bool]],
                   linears: set[type] | None = None, layout: bool = False) -> list[Path]:
    """:func:`artifact_path` of each of ``shapes``, the model's part of the key computed once (a
    walk over its layers and its config: 7 ms on SmolLM2, which ``auto`` asked for 44 times).

    Args:
        linears: the classes of the linear layers of the module tree whose steps are named, with
            (``layout``) or without the few-row layout: a question about files on disk, answered
            without building that tree (the int8 draft step's file, named without quantising the
            model: ``kernels.int8.layer_classes``); None: the layers ``model`` holds."""
    import transformers

    config: Any = model.config  # an HF model's (nn.Module types its attributes as Tensor | Module)
    if linears is None:
        layers = linear_layers(model)
        linears = {type(m) for _, _, m in layers}
        layout = any(getattr(m, "blocked", None) is not None for _, _, m in layers)
    key = {
        "model": type(model).__qualname__,
        "config": {k: v for k, v in json.loads(config.to_json_string(use_diff=False)).items() if k not in WHERE_FROM},
        "dtype": str(model.dtype),
        "device": str(next(model.parameters()).device),
        "attention": config._attn_implementation,
        "window": WINDOW,  # the static attention's keyword, which the graph takes
        "linears": sorted({f"{c.__module__}.{c.__qualname__}" for c in linears}),
        "passes": SHARED_PRODUCTS_PASS,
        "inductor": INDUCTOR_OPTIONS,
        "one_token": PRODUCT_LAYOUT if layout else None,
        "machine": machine_id(),  # CPU model, thread count, torch version
        "torch_dir": str(Path(torch.__file__).parent),  # its kernels' build key names the install's headers
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "code": code_digest(),
    }
    out = []
    for shape in shapes:
        digest = hashlib.sha256(json.dumps({**key, "shape": list(shape)}, sort_keys=True, default=str).encode())
        out.append(Path(directory) / "aot" / f"step-{shape[0]}x{shape[1]}{'-hidden' if shape[2] else ''}-"
                                              f"{digest.hexdigest()[:24]}.bin")
    return out


def _external(model: torch.nn.Module) -> dict[str, object]:
    """The model's ``forward`` and every function its decorators wrap, by stable names."""
    out: dict[str, object] = {}
    f: Callable | None
    f, i = type(model).forward, 0
    while f is not None and i < 16:
        out[f"forward{i}"] = f
        f, i = getattr(f, "__wrapped__", None), i + 1
    return out


def module_refs(message: str) -> list[tuple[str, str]]:
    """The module references a saved step could not resolve, from the error that names them:
    ``[(reference, module name with "." as "_")]``."""
    return _MODULE_REF.findall(message)


def _module_named(mangled: str) -> object | None:
    """The loaded module whose dotted name, with dots as underscores, is ``mangled``."""
    for name, module in list(sys.modules.items()):
        if module is not None and name.replace(".", "_") == mangled:
            return module
    return None


INDUCTOR_OPTIONS = {"realize_reads_threshold": 1, "size_asserts": False}
"""Inductor settings of the CPU step (saved steps' names include them).

- ``realize_reads_threshold``: a value computed by cheap arithmetic (an RMSNorm's output, say) is
  stored once when more than one loop reads it, instead of recomputed inside each: the products of a
  few-row block (:mod:`~selfspec.kernels.gemv`) read each row of their input once per weight block,
  and recomputing a normalised row there made a 4-token block of SmolLM2 3.7x slower than a 1-token
  one (8.4 against 30.8 ms on a 2-layer cut, AVX2).
- ``size_asserts`` off: the generated wrapper checked the size and strides of every input at every
  call (about 600 checks a step on SmolLM2: the weights are inputs), 5-7% of a one-token step and
  4-6% of an 8-token one on AVX-512 (``docs/lab-notes/compiled-step.md``, "Attention over the written
  positions"). The step's inputs cannot differ from those it was compiled for: each saved step is
  one padded block on one cache capacity (both in its name), its inputs are built by
  :class:`~selfspec.models.compiled_step.StaticStep` at exactly that shape, and the weights and
  static caches keep their layout for the model's life."""


def code_version() -> str:
    """What a CPU step's generated code depends on besides the model, its shapes and the machine:
    the graph pass, the Inductor options and the few-row layout (each also in saved steps' names),
    the attention over the written positions only, and the int8 draft's product (self-spec's draft
    step, whose saved files the layer classes name).
    ``auto``'s cached choice and the step's cost profile (``LoadedModel.cost_key``) are keyed on
    it, so a layout or option that changes the compiled step's speed (16 lanes on AVX-512, say) has
    the step timed again."""
    return json.dumps({"passes": SHARED_PRODUCTS_PASS, "inductor": INDUCTOR_OPTIONS, "layout": PRODUCT_LAYOUT,
                       "int8_draft": INT8_DRAFT_LAYOUT, "window": WINDOW}, sort_keys=True, default=str)


def cpu_step_options() -> dict:
    """``torch.compile`` options of the CPU step, ahead of time or not: the shared-products pass
    (:func:`~selfspec.kernels.onednn.shared_products_pass`) and :data:`INDUCTOR_OPTIONS`."""
    return {"post_grad_custom_pre_pass": shared_products_pass(), **INDUCTOR_OPTIONS}


LOCK_WAIT_S = 1800.0
"""The longest a process waits for another to finish compiling the same step (then it compiles the
step itself): a 1.5B model's largest step compiles in minutes on 2 cores."""


@contextlib.contextmanager
def step_lock(path: Path | None, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Held while the step saved at ``path`` is first loaded, compiled and called: a second process
    that needs the same step (another server, a benchmark's worker, a test worker) waits for the
    first to save it, then loads it instead of compiling it too. A lock file beside the step
    (``<name>.lock``, left in place); the operating system releases it when its holder exits.
    Where no lock can be taken (no ``path``, a read-only directory, ``wait_s`` spent) the step
    compiles as before, with the reason logged."""
    from filelock import Timeout

    with contextlib.ExitStack() as held:
        if path is not None:
            try:
                held.enter_context(file_lock(Path(f"{path}.lock"),
                                             f"another process is compiling {path.name}; waiting for it ...", wait_s))
            except (OSError, Timeout) as e:
                log.info(f"compiling {path.name} without waiting for other processes ({type(e).__name__}: {e})")
        yield


def compile_step(model: torch.nn.Module, kwargs: dict, path: Path | None) -> Callable:
    """Compile ``model.forward`` for the shapes of ``kwargs`` ahead of time; save it to ``path``
    (when given and writable). Returns ``fn(model, **kwargs)``."""
    compiled = torch.compile(model.forward, dynamic=False, fullgraph=True,
                             options={"guard_filter_fn": lambda entries: [False for _ in entries],
                                      **cpu_step_options()})
    with _probed_isa(path.parent) if path is not None else contextlib.nullcontext():
        fn = compiled.aot_compile(((), kwargs))  # type: ignore[attr-defined]  # torch.compile's type lacks aot_compile
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(path), external_data=_external(model))
        except Exception as e:  # noqa: BLE001 - a step that cannot be saved still runs
            log.warning(f"could not save the compiled step to {path} ({type(e).__name__}: {e}); the next process "
                        "compiles it again")
    return fn


def load_step(path: Path, model: torch.nn.Module) -> Callable | None:
    """The saved step at ``path`` as ``fn(model, **kwargs)``, or None (with the reason logged)
    when it is missing or does not load here."""
    if not path.is_file():
        return None
    from torch._dynamo.aot_compile import AOTCompiledFunction

    data = path.read_bytes()
    env = dict(type(model).forward.__globals__)
    try:
        with _probed_isa(path.parent):  # once per step, whatever the retries below
            for _ in range(64):
                try:
                    return AOTCompiledFunction.deserialize(data, f_globals=env,
                                                           external_closure_data=_external(model))
                except RuntimeError as e:
                    missing = [(full, _module_named(short)) for full, short in module_refs(str(e)) if full not in env]
                    if not missing or any(m is None for _, m in missing):
                        raise
                    env.update(missing)
            raise RuntimeError("too many module references")
    except Exception as e:  # noqa: BLE001 - compile again instead
        log.info(f"the saved compiled step {path.name} does not load here ({type(e).__name__}: "
                 f"{str(e)[:200]}); compiling it again")
        return None


ISA_RECORD = "vector-isa.json"


def _isa_candidates() -> list[str] | None:
    """The vector instruction sets Inductor probes on this x86 CPU (those its flags list), by
    name; None elsewhere or where Inductor's probe is not the one this code knows."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        from torch._inductor import cpu_vec_isa

        flags = cpu_vec_isa.x86_isa_checker()
        return [str(i) for i in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
    except Exception:  # noqa: BLE001 - a private API: without it, the probe runs as usual
        return None


@contextlib.contextmanager
def _probed_isa(directory: Path) -> Iterator[None]:
    """Load a step without Inductor's probe of the CPU's vector instruction sets where an earlier
    process on this machine ran that probe and every set the CPU's flags list passed it (the
    record in ``directory``); then record what this process's probe found.

    The probe builds a test library per set and loads it in a child Python (0.3-0.5 s a set, once
    per process, at every warm start). With the record, Inductor treats the listed sets as valid,
    which is what its probe found for them on this machine, toolchain and torch version."""
    from torch._inductor import config

    record_file = directory / ISA_RECORD
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        record = {}
    candidates = _isa_candidates()
    trusted = (config.cpp.vec_isa_ok is None and candidates is not None
               and record.get(machine_id()) == candidates)
    with config.patch({"cpp.vec_isa_ok": True} if trusted else {}):
        yield
    if trusted or candidates is None or config.cpp.vec_isa_ok is not None:
        return
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    record[machine_id()] = [str(i) for i in valid_vec_isa_list()]  # cached: the probe above ran it
    with contextlib.suppress(OSError):
        tmp = record_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(record_file)
