"""Skip configs: the tuned draft of ``self-spec`` for one model, as a JSON file.

Written by ``selfspec tune MODEL --method self-spec``; found by ``selfspec.load(...,
method="self-spec")`` in this order: an explicit ``skip_config`` path, the user's tuned configs
(``$SELFSPEC_HOME/skip_configs/<model>.json``), the configs shipped in the package
(``selfspec/data/skip_configs/<model>.json``). A config for another model (other name or other
architecture hash) is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..errors import SelfspecError
from ..models.skipping import SkipSet
from ..paths import model_key, selfspec_home

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

FORMAT = "selfspec-skip-config/1"
ARCH_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size")


@dataclass(frozen=True)
class GammaSettings:
    """Adaptive draft-exit constants of the paper (Draft & Verify, Table 6 and Eq. 2-4).

    Attributes:
        gamma0: initial confidence threshold gamma.
        alpha: target acceptance rate; gamma rises while the smoothed acceptance is at or below it.
        epsilon: step of the gamma update.
        beta1: smoothing of the acceptance rate AR.
        beta2: smoothing of gamma.
        max_draft: K, the longest draft.
    """

    gamma0: float = 0.6
    alpha: float = 0.85
    epsilon: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    max_draft: int = 12


@dataclass(frozen=True)
class DraftCost:
    """Seconds of one-token forwards (after a ``context``-token cache) with sub-layers skipped.

    Attributes:
        full: nothing skipped (T(1)).
        no_attention: every attention sub-layer skipped.
        no_mlp: every MLP sub-layer skipped.
        floor: everything skipped (embedding, norms, LM head).
        num_layers: decoder blocks.
    """

    full: float
    no_attention: float
    no_mlp: float
    floor: float
    num_layers: int

    def ratio(self, skip: SkipSet) -> float:
        """Predicted draft cost of one token with ``skip``, in units of T(1) (linear in the
        number of kept sub-layers of each kind)."""
        n = self.num_layers
        attn = max(self.full - self.no_attention, 0.0) * (n - len(skip.attention)) / n
        mlp = max(self.full - self.no_mlp, 0.0) * (n - len(skip.mlp)) / n
        return (self.floor + attn + mlp) / self.full

    def to_json(self) -> dict:
        return {"full_s": self.full, "no_attention_s": self.no_attention, "no_mlp_s": self.no_mlp,
                "floor_s": self.floor, "num_layers": self.num_layers}

    @classmethod
    def from_json(cls, d: dict) -> DraftCost:
        return cls(float(d["full_s"]), float(d["no_attention_s"]), float(d["no_mlp_s"]), float(d["floor_s"]),
                   int(d["num_layers"]))


@dataclass(frozen=True)
class SkipConfig:
    """A tuned skip set with what it was tuned on."""

    model: str
    config_hash: str
    num_layers: int
    skip_attention: tuple[int, ...]
    skip_mlp: tuple[int, ...]
    gamma: GammaSettings = field(default_factory=GammaSettings)
    search: dict = field(default_factory=dict)  # objective, score, trials, backend, machine, ...
    draft_vocab: int = 0  # reduced draft vocabulary size (0: full), see selfspec.core.draft_vocab
    draft_kernels: str = "same"  # kernels of the draft passes (int8: a quantised copy of the weights)

    @property
    def skip(self) -> SkipSet:
        return SkipSet.of(self.skip_attention, self.skip_mlp)

    def priors(self) -> tuple[float, float] | None:
        """What the search measured for this skip set, to start the cost-aware budget from:
        ``(acceptance of drafts, draft cost of one token in units of T(1))``, or None."""
        try:
            cost = DraftCost.from_json(self.search["draft_cost"]).ratio(self.skip)
            alpha = float(self.search["acceptance"])
        except (KeyError, TypeError, ValueError):
            return None
        return min(max(alpha, 0.05), 0.95), cost

    def to_json(self) -> dict:
        d = asdict(self)
        d["skip_attention"], d["skip_mlp"] = list(self.skip_attention), list(self.skip_mlp)
        return {"format": FORMAT, **d}

    @classmethod
    def from_json(cls, d: dict, source: str = "skip config") -> SkipConfig:
        try:
            if d.get("format") != FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {FORMAT!r}")
            return cls(model=str(d["model"]), config_hash=str(d["config_hash"]), num_layers=int(d["num_layers"]),
                       skip_attention=tuple(int(i) for i in d["skip_attention"]),
                       skip_mlp=tuple(int(i) for i in d["skip_mlp"]),
                       gamma=GammaSettings(**d.get("gamma", {})), search=dict(d.get("search", {})),
                       draft_vocab=int(d.get("draft_vocab", 0)), draft_kernels=str(d.get("draft_kernels", "same")))
        except (KeyError, TypeError, ValueError) as e:
            raise SelfspecError(f"{source} is not a valid skip config ({e}); "
                                f"write one with: selfspec tune MODEL --method self-spec") from e

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path


def config_hash(model: torch.nn.Module) -> str:
    """Hash of the architecture fields that a skip set depends on (12 hex digits)."""
    cfg = cast("PreTrainedConfig", model.config).to_dict()
    text = json.dumps({k: cfg.get(k) for k in ARCH_KEYS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def user_config_path(name: str) -> Path:
    return selfspec_home() / "skip_configs" / f"{model_key(name)}.json"


def shipped_config_path(name: str) -> Path | None:
    p = resources.files("selfspec") / "data" / "skip_configs" / f"{model_key(name)}.json"
    return Path(str(p)) if p.is_file() else None


def read(path: str | Path) -> SkipConfig:
    p = Path(path)
    if not p.is_file():
        raise SelfspecError(f"skip config {p} does not exist; write one with: selfspec tune MODEL --method self-spec")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SelfspecError(f"skip config {p} is not readable JSON ({e})") from e
    return SkipConfig.from_json(data, str(p))


def check_matches(cfg: SkipConfig, name: str, model: torch.nn.Module, source: str) -> None:
    """Refuse a config tuned for another model."""
    h = config_hash(model)
    tune = f"selfspec tune --model {name} --method self-spec"
    if model_key(cfg.model) == model_key(name) and cfg.config_hash != h:  # "tuned for 'm' ... not 'm'" read oddly
        raise SelfspecError(
            f"skip config {source} was tuned for another model named '{cfg.model}' (architecture "
            f"{cfg.config_hash}; this one is {h}); tune this one with: {tune}, or pass --skip-config FILE"
        )
    if model_key(cfg.model) != model_key(name) or cfg.config_hash != h:
        raise SelfspecError(
            f"skip config {source} was tuned for model '{cfg.model}' (architecture {cfg.config_hash}), not "
            f"'{model_key(name)}' (architecture {h}); tune one with: {tune}"
        )


def find(name: str, model: torch.nn.Module, path: str = "") -> tuple[SkipConfig, str] | None:
    """The skip config for a model: ``path`` if given, else the user's, else the shipped one.

    Returns:
        ``(config, source)`` or None when there is none.
    """
    if path:
        cfg = read(path)
        check_matches(cfg, name, model, path)
        return cfg, str(path)
    for p in (user_config_path(name), shipped_config_path(name)):
        if p is not None and p.is_file():
            cfg = read(p)
            check_matches(cfg, name, model, str(p))
            return cfg, str(p)
    return None
