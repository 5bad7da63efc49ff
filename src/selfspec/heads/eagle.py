"""The EAGLE draft head: ``fc([E(x_{i+1}); f_i])`` into one decoder layer of the target's family.

Index alignment (the most common source of bugs, see ``docs/methods/hass.md``): draft position
``i`` consumes the target feature ``f_i`` (the target's last hidden state *after* its final norm,
i.e. the LM-head input) and the token ``x_{i+1}`` that followed it; its output ``f̂_{i+1}``
estimates the target feature at ``i + 1``, and ``lm_head(f̂_{i+1})`` predicts ``x_{i+2}``.

The head owns only ``fc`` and the decoder layer (a stock ``transformers`` layer class of the
target's family, with its input norm replaced by identity, as in EAGLE); the target's embedding
and LM head are shared and frozen, so they are passed in by the caller and never saved.

Files of a saved head (directory): ``model.safetensors`` (``fc.*``, ``layers.0.*``, and with a
reduced draft vocabulary EAGLE-3's ``d2t`` ``[N]`` int64 offsets and ``t2d`` ``[V]`` bool),
``config.json`` (the target's config with ``num_hidden_layers = 1`` and ``bias``),
``selfspec_head.json`` (format, method, target name and architecture hash, ``draft_vocab_size``
when reduced, training settings and metrics). A reduced head's draft LM head is the target's LM
head at the subset's rows (:mod:`selfspec.core.draft_vocab`), so it is not stored.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from safetensors.torch import load_file
from torch import nn

from ..core import kv_cache
from ..core.draft_vocab import DraftVocab
from ..errors import SelfspecError
from ..models.skipping import decoder_layers
from ..paths import save_safetensors

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

HEAD_FORMAT = "selfspec-eagle-head/1"
META_FILE = "selfspec_head.json"
WEIGHTS_FILE = "model.safetensors"
ARCH_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "vocab_size", "rope_theta", "head_dim")

M = TypeVar("M", bound=nn.Module)


def _rotary_of(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", model)
    rot = getattr(base, "rotary_emb", None)
    if rot is None:
        raise SelfspecError(f"{type(model).__name__} has no rotary embedding module; EAGLE heads support "
                            "RoPE decoders (Llama, Qwen2, Mistral families)")
    return rot


def arch_hash(config) -> str:
    """The architecture fields a head depends on, as a short string (stored with the head)."""
    d = config.to_dict()
    return json.dumps({k: d.get(k) for k in ARCH_KEYS}, sort_keys=True)


class EagleHead(nn.Module):
    """One-layer EAGLE draft head for a given target.

    Attributes:
        config: the target's config with one hidden layer (and ``bias`` for ``fc``).
        fc: ``Linear(2H -> H)`` over ``[token embedding; feature]`` (that order).
        layers: one stock decoder layer of the target's family, input norm = identity.
        rotary_emb: the target family's rotary embedding (no weights).
    """

    def __init__(self, target: nn.Module, bias: bool = True) -> None:
        super().__init__()
        layer_cls = type(decoder_layers(target)[0])
        rot_cls = type(_rotary_of(target))
        cfg = copy.deepcopy(cast("PreTrainedConfig", target.config))
        cfg.num_hidden_layers = 1
        cfg.bias = bias
        cfg.use_cache = True
        cfg._attn_implementation = "sdpa"
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = cfg.layer_types[:1]
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bias)
        layer = layer_cls(cfg, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = rot_cls(config=cfg)
        self.draft_vocab: DraftVocab | None = None  # set_draft_vocab: the draft LM head's subset
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)

    def set_draft_vocab(self, vocab: DraftVocab | None) -> None:
        """Draft over ``vocab`` (None: the full vocabulary); saved with the head."""
        self.draft_vocab = vocab

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def project(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """``fc([E(x); f])``: ``[B, T, H]`` x2 -> ``[B, T, H]``."""
        return self.fc(torch.cat([token_embeds.to(features.dtype), features], dim=-1))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache=None) -> torch.Tensor:
        """Run the head over T new draft positions.

        Args:
            features: ``[B, T, H]`` feature of each position (target feature or a draft output).
            token_embeds: ``[B, T, H]`` target embedding of the token that followed it.
            positions: ``[B, T]`` int64 RoPE positions (the index of the paired feature).
            mask: ``[B, 1, T, S]`` bool, True = attend, over the ``S - T`` cached positions
                followed by the T new ones.
            cache: a ``DynamicCache`` with one layer (appended to), or None.

        Returns:
            ``[B, T, H]`` predicted next features ``f̂``.
        """
        return self.layer_forward(self.project(features, token_embeds), positions, mask, cache)

    def layer_forward(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        """The decoder layer on already projected inputs ``h`` (``[B, T, H]``)."""
        pe = self.rotary_emb(h, position_ids=positions)
        return self.layers[0](h, attention_mask=mask, position_ids=positions,
                              **kv_cache.cache_arg(self.layers[0], cache),
                              use_cache=cache is not None, position_embeddings=pe)

    # -- files ---------------------------------------------------------------------------------

    def save(self, out: Path | str, meta: dict) -> Path:
        """Write ``model.safetensors``, ``config.json`` and ``selfspec_head.json`` into ``out``."""
        return save_head_files(self, out, {"format": HEAD_FORMAT, "arch": arch_hash(self.config),
                                           "bias": self.fc.bias is not None}, meta)


def save_head_files(head: nn.Module, out: Path | str, head_meta: dict, meta: dict) -> Path:
    """Write a draft head (EAGLE-2 or EAGLE-3) into ``out``: its weights in ``model.safetensors``
    (with the ``d2t`` / ``t2d`` maps of a reduced draft vocabulary), ``head.config`` as
    ``config.json``, and ``head_meta`` + the vocabulary size + ``meta`` as ``selfspec_head.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    extra: dict = {}
    vocab = cast("DraftVocab | None", head.draft_vocab)  # an EagleHead's or an Eagle3Head's
    if vocab is not None:
        state["d2t"], state["t2d"] = vocab.d2t(), vocab.t2d()
        extra["draft_vocab_size"] = vocab.size
    save_safetensors(state, out / WEIGHTS_FILE, metadata={"format": "pt"})
    cfg = cast("PreTrainedConfig", head.config).to_dict()
    cfg.pop("_attn_implementation_autoset", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    (out / META_FILE).write_text(json.dumps({**head_meta, **extra, **meta}, indent=2) + "\n")
    return out


def read_meta(path: Path | str) -> dict:
    """The head's ``selfspec_head.json``; one-line errors for a missing or foreign directory."""
    path = Path(path)
    f = path / META_FILE
    if not path.exists():
        raise SelfspecError(f"head directory {path} does not exist; pass a directory written by "
                            "`selfspec train hass --model MODEL --out DIR`")
    if not path.is_dir():
        raise SelfspecError(f"head {path} is a file, not a directory; pass a directory written by "
                            "`selfspec train hass --model MODEL --out DIR`")
    if not f.is_file():
        raise SelfspecError(f"{path} is not a selfspec draft head (no {META_FILE}); train one with "
                            "`selfspec train hass --model MODEL --out DIR`")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise SelfspecError(f"{f} is not valid JSON ({e.msg}); retrain or restore the head") from e
    if meta.get("format") != HEAD_FORMAT:
        raise SelfspecError(f"{f} has format {meta.get('format')!r}, expected {HEAD_FORMAT!r}")
    return meta


def read_head_state(path: Path | str, target: nn.Module,
                    meta: dict) -> tuple[dict[str, torch.Tensor], DraftVocab | None]:
    """A saved head's tensors (``d2t`` / ``t2d`` taken out) and its reduced draft vocabulary (None:
    the full one), after checking that it was trained for ``target``'s architecture and that its
    vocabulary is consistent (ids unique and in range, ``t2d`` and ``draft_vocab_size`` agreeing)."""
    path = Path(path)
    tcfg = cast("PreTrainedConfig", target.config)
    if meta["arch"] != arch_hash(tcfg):
        raise SelfspecError(f"draft head {path} was trained for another architecture "
                            f"(target '{meta.get('target', '?')}'); train one for this model")
    state = load_file(str(path / WEIGHTS_FILE))
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        return state, None
    vocab = int(tcfg.vocab_size)
    ids = torch.arange(d2t.numel()) + d2t.long()
    if (meta.get("draft_vocab_size", d2t.numel()) != d2t.numel() or ids.numel() == 0 or int(ids.min()) < 0
            or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel()
            or (t2d is not None and (t2d.numel() != vocab or not bool(t2d.bool()[ids].all())
                                     or int(t2d.bool().sum()) != ids.numel()))):
        raise SelfspecError(f"draft head {path} has an inconsistent reduced vocabulary (d2t / t2d / "
                            "draft_vocab_size); retrain or restore the head")
    return state, DraftVocab(ids, vocab)


def fill_head(head: M, state: dict[str, torch.Tensor], path: Path | str, what: str = "draft head") -> M:
    """Load ``state`` into ``head`` (every tensor, nothing else: a one-line error names a mismatch)
    and put it in eval mode."""
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SelfspecError(f"{what} {path} does not fit this target (missing {missing[:2]}, "
                            f"unexpected {unexpected[:2]})")
    return head.eval()


def load_head(path: Path | str, target: nn.Module) -> tuple[EagleHead, dict]:
    """Load a saved head for ``target``; refuses a head trained for another architecture. EAGLE-3
    heads (``head_arch: "eagle3"``) are loaded by :func:`selfspec.heads.checkpoints.load_draft_head`,
    which loads any kind."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("head_arch", "eagle") != "eagle":
        raise SelfspecError(f"draft head {path} is an {meta['head_arch']} head, not an EAGLE-1/2 one; load it with "
                            "selfspec.heads.checkpoints.load_draft_head")
    state, vocab = read_head_state(path, target, meta)
    head = EagleHead(target, bias=bool(meta.get("bias", True)))
    head.set_draft_vocab(vocab)
    return fill_head(head, state, path), meta
