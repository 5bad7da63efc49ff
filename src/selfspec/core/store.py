"""The measurement store: everything selfspec measures on a machine and reads back on later loads,
as typed records with a schema version, each keyed by the one function :func:`key`.

The kinds (:class:`Kind`): verify cost profiles (:class:`~selfspec.core.cost.CostProfile`), ``auto``'s
choice of configuration (``autoselect.choice.AutoRecord``), the kernels choice of commands without a
method (:class:`KernelsChoice`), a self-spec draft's cost against a verify forward (:class:`DraftRatio`)
and a passed tree self-test (:class:`SelfTestPass`).

A record is one JSON file under ``$SELFSPEC_HOME/profiles`` (or the per-user cache where the home is
read-only: :func:`~selfspec.paths.cache_file`), named by a hash of its key::

    {"schema": 1, "kind": "draft-ratio", "key": "draft-ratio|smollm2-...|...", "data": {...}}

Reading gives None for a record that is missing, unreadable, corrupt (invalid JSON, or data its
type's ``from_json`` rejects), of another schema version, or of another kind or key: it is measured
again, never trusted. Files written before the store (no ``schema``) read as None too.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from .machine import machine_id

SCHEMA = 1
"""The version of every record's layout; a record of another version is measured again."""
DIRECTORY = "profiles"
"""The store's directory under the selfspec home (and under the per-user cache)."""
CORRUPT = (OSError, ValueError, KeyError, TypeError, AttributeError)
"""What a missing, unreadable or malformed record raises while it is read and parsed."""


class Kind(str, enum.Enum):
    """What a record holds (the first field of its key)."""

    COST_PROFILE = "cost-profile"
    AUTO_CHOICE = "auto-choice"
    KERNELS_CHOICE = "kernels-choice"
    DRAFT_RATIO = "draft-ratio"
    SELF_TEST = "self-test"


class Record(Protocol):
    """A record type: its kind, and its data to and from JSON (``from_json`` raises one of
    :data:`CORRUPT` on data it cannot take)."""

    KIND: ClassVar[Kind]

    def to_json(self) -> dict: ...

    @classmethod
    def from_json(cls, d: dict) -> Any: ...


R = TypeVar("R")


def key(kind: Kind, model: torch.nn.Module, name: str, backend: str, *detail: object) -> str:
    """The key of a record of ``kind`` about ``model`` (called ``name``) on ``backend``: the one place
    a key is built. It names the kind, the model (name and a hash of its config), its dtype and
    device (the GPU's name on CUDA), the backend, the machine (CPU, thread count, torch:
    :func:`~selfspec.core.machine.machine_id`) and the kind's ``detail`` (what else the measurement
    depends on), ``|``-separated."""
    p = next(model.parameters())
    dev = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else str(p.device)
    config: Any = model.config
    cfg_hash = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    return "|".join([Kind(kind).value, name, cfg_hash, str(p.dtype), dev, backend, machine_id(),
                     *(str(d) for d in detail)])


def file_name(record_key: str) -> str:
    """The file name of the record of ``record_key``."""
    return f"{hashlib.sha256(record_key.encode()).hexdigest()[:20]}.json"


def path(record_key: str) -> Path:
    """Where the record of ``record_key`` is read: the home's store, or the per-user cache's where
    the home is read-only and the record is not in it (:func:`~selfspec.paths.cache_file`)."""
    from ..paths import cache_file

    return cache_file(DIRECTORY, file_name(record_key))


def write_path(record_key: str) -> Path | None:
    """Where the record of ``record_key`` is written now (None: nowhere writable)."""
    from ..paths import writable_cache_dir

    d = writable_cache_dir(DIRECTORY)
    return None if d is None else d / file_name(record_key)


def _kind_of(record: type) -> Kind:
    return record.KIND  # type: ignore[attr-defined]


def read_at(where: Path, record_key: str, record: type[R]) -> R | None:
    """The record of ``record_key`` (of type ``record``) in the file ``where``; None when missing,
    unreadable, corrupt, of another schema version, kind or key."""
    try:
        d = json.loads(where.read_text())
        if d["schema"] != SCHEMA or d["kind"] != _kind_of(record).value or d["key"] != record_key:
            return None
        return record.from_json(d["data"])  # type: ignore[attr-defined]
    except CORRUPT:  # JSONDecodeError is a ValueError
        return None


def read(record_key: str, record: type[R]) -> R | None:
    """The stored record of ``record_key`` (see :func:`read_at`)."""
    return read_at(path(record_key), record_key, record)


def write_at(where: Path, record_key: str, rec: Record) -> None:
    """Write ``rec`` as the record of ``record_key`` to the file ``where``, atomically (raises
    OSError)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(_body(record_key, rec))
        tmp.replace(where)
    finally:
        tmp.unlink(missing_ok=True)


def _body(record_key: str, rec: Record) -> str:
    return json.dumps({"schema": SCHEMA, "kind": rec.KIND.value, "key": record_key, "data": rec.to_json()}, indent=1)


def write(record_key: str, rec: Record, what: str) -> Path | None:
    """Store ``rec`` as the record of ``record_key`` where it can be written (atomically); None,
    with a one-line note naming ``what``, where nowhere is writable: measured again next time
    (:func:`~selfspec.paths.write_cache_file`)."""
    from ..paths import write_cache_file

    return write_cache_file(DIRECTORY, file_name(record_key), _body(record_key, rec), what)


@dataclass(frozen=True)
class DraftRatio:
    """A self-spec draft token's time over a verify forward's (``drafters.skip_draft``)."""

    KIND: ClassVar[Kind] = Kind.DRAFT_RATIO
    ratio: float

    def to_json(self) -> dict:
        return {"ratio": self.ratio}

    @classmethod
    def from_json(cls, d: dict) -> DraftRatio:
        ratio = float(d["ratio"])
        if not ratio > 0:
            raise ValueError("a draft ratio is positive")
        return cls(ratio)


@dataclass(frozen=True)
class SelfTestPass:
    """A passed tree self-test and its largest logit difference (``models.selftest``)."""

    KIND: ClassVar[Kind] = Kind.SELF_TEST
    worst: float

    def to_json(self) -> dict:
        return {"worst": self.worst}

    @classmethod
    def from_json(cls, d: dict) -> SelfTestPass:
        return cls(float(d["worst"]))


@dataclass(frozen=True)
class KernelsChoice:
    """The fastest fp32 backend where no method is at hand, and each backend's proxy time
    (``autoselect.kernels``)."""

    KIND: ClassVar[Kind] = Kind.KERNELS_CHOICE
    backend: str
    seconds: dict[str, float]

    def to_json(self) -> dict:
        return {"backend": self.backend, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict) -> KernelsChoice:
        if not isinstance(d["backend"], str):
            raise TypeError("a kernels choice names a backend")
        return cls(d["backend"], {str(k): float(v) for k, v in d["seconds"].items()})
