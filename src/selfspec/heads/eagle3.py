"""The EAGLE-3 draft head: fused low / middle / high target features into a ``midlayer`` over
``[embedding; hidden]``, with its own norm and LM head over a reduced draft vocabulary.

Layout (the one vLLM's and SGLang's ``llama_eagle3.py`` and SafeAILab's ``cnets.py`` load; see
``docs/methods/hass.md`` "EAGLE-3 heads"):

* ``fc``: ``Linear(3·H_t -> H)``, no bias, over the target's hidden states at three layers
  ``feature_layers`` (indices into ``transformers``' ``hidden_states`` tuple: 0 = embeddings,
  i = the input of decoder layer i), concatenated low, middle, high. EAGLE-3 picks
  ``(2, L // 2, L - 3)`` for a target of L layers.
* ``midlayer``: one stock ``transformers`` ``LlamaDecoderLayer`` (EAGLE-3 heads are Llama layers
  whatever the target family) whose q/k/v projections take ``2H`` inputs, plus ``hidden_norm``:
  ``a = attn([input_layernorm(E(x)); hidden_norm(h)])``, ``h' = h + a``,
  ``out = h' + mlp(post_attention_layernorm(h'))``.
* ``norm`` and ``lm_head`` (``[N, H]``): logits over the draft vocabulary (``d2t``: draft index
  i is target token ``i + d2t[i]``); the full vocabulary when the head has none.

Index alignment (as EAGLE-1/2, ``heads/eagle.py``): draft position i reads the fused target
features at i and the token ``x_{i+1}``; its output (the midlayer's pre-norm hidden state) gives
the logits of ``x_{i+2}`` and is fed back, without ``fc``, as the hidden input of the next
drafting step. The target's embedding is shared and frozen (passed in, never saved).

Files: as EAGLE-2 heads (``model.safetensors``, ``config.json``, ``selfspec_head.json``) with
``head_arch: "eagle3"`` and ``feature_layers`` in the metadata;
:func:`selfspec.heads.checkpoints.load_draft_head` loads a directory of either kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ..core import kv_cache
from ..core.draft_vocab import DraftVocab
from ..errors import SelfspecError
from .eagle import HEAD_FORMAT, arch_hash, fill_head, read_head_state, read_meta, save_head_files

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

HEAD_ARCH = "eagle3"
ARCH_FIELD = "head_arch"  # selfspec_head.json: "eagle3"; absent for EAGLE-1/2 heads


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice for a target of ``num_layers`` decoder layers: the inputs of layers 2,
    L // 2 and L - 3 (``hidden_states`` indices), clamped into ``[0, L - 1]`` and sorted for
    the small models of the tests."""
    top = num_layers - 1
    picked = (min(2, top), min(num_layers // 2, top), max(num_layers - 3, 0))
    return tuple(sorted(picked))  # type: ignore[return-value]


def resolve_feature_layers(num_layers: int, layers: Sequence[int] | None = None) -> tuple[int, int, int]:
    """``layers`` checked (three ``hidden_states`` indices in ``[0, L - 1]``: the inputs of
    decoder layers, which every engine can capture), or EAGLE-3's default when None or empty."""
    picked = tuple(int(i) for i in layers) if layers else default_feature_layers(num_layers)
    if len(picked) != 3 or not all(0 <= i < num_layers for i in picked):
        raise SelfspecError(f"EAGLE-3 feature layers must be three hidden-state indices in [0, {num_layers - 1}] "
                            f"(the inputs of decoder layers), not {list(picked)}")
    return picked


def draft_config(target_config, draft_vocab_size: int, feature_layers: Sequence[int]) -> LlamaConfig:
    """The midlayer's Llama config from the target's dimensions, RoPE and norm epsilon (one layer,
    no attention or MLP biases), with ``draft_vocab_size``, ``target_hidden_size`` and the
    feature layers recorded."""
    t = target_config
    h, heads = int(t.hidden_size), int(t.num_attention_heads)
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default",
                                                   "rope_theta": float(getattr(t, "rope_theta", 10000.0))}
    cfg = LlamaConfig(
        vocab_size=int(t.vocab_size), hidden_size=h, intermediate_size=int(t.intermediate_size), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=int(getattr(t, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(t, "head_dim", None) or h // heads), hidden_act=getattr(t, "hidden_act", "silu"),
        max_position_embeddings=int(getattr(t, "max_position_embeddings", 4096)),
        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)), rope_parameters=dict(rope), attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, bos_token_id=getattr(t, "bos_token_id", None),
        eos_token_id=getattr(t, "eos_token_id", None), pad_token_id=getattr(t, "pad_token_id", None))
    cfg.draft_vocab_size = int(draft_vocab_size)
    cfg.target_hidden_size = h
    cfg.eagle_feature_layers = [int(i) for i in feature_layers]
    cfg.use_cache = True
    cfg._attn_implementation = "sdpa"
    return cfg


class Eagle3Head(nn.Module):
    """One-layer EAGLE-3 draft head for a given target (see module docstring).

    Attributes:
        config: the midlayer's ``LlamaConfig`` (one layer; ``draft_vocab_size``,
            ``target_hidden_size``).
        feature_layers: the three ``hidden_states`` indices it reads, low to high.
        fc: ``Linear(3·H_t -> H)``, no bias.
        midlayer: stock ``LlamaDecoderLayer`` with 2H-input q/k/v and ``hidden_norm``.
        norm: final RMSNorm before ``lm_head``.
        lm_head: ``Linear(H -> N)`` over the draft vocabulary (N = V without one).
        draft_vocab: the draft vocabulary, or None for the full one.
        rotary_emb: the midlayer's rotary embedding (no weights).
    """

    head_arch = HEAD_ARCH

    def __init__(self, target: nn.Module, feature_layers: Sequence[int] | None = None,
                 draft_vocab: DraftVocab | None = None) -> None:
        """
        Args:
            target: the stock HF causal LM the head drafts for (its config; weights not kept).
            feature_layers: three ``hidden_states`` indices in ``[0, L - 1]`` (None or empty: EAGLE-3's).
            draft_vocab: the reduced draft vocabulary (None: the full vocabulary).
        """
        super().__init__()
        tcfg = cast("PreTrainedConfig", target.config)
        layers = resolve_feature_layers(int(tcfg.num_hidden_layers), feature_layers)
        vocab_size = int(tcfg.vocab_size)
        if draft_vocab is not None and draft_vocab.vocab_size != vocab_size:
            raise SelfspecError(f"draft vocabulary for {draft_vocab.vocab_size} tokens, the target has {vocab_size}")
        self.feature_layers: tuple[int, int, int] = layers
        self.target_arch = arch_hash(tcfg)
        n = draft_vocab.size if draft_vocab is not None else vocab_size
        cfg = draft_config(tcfg, n, layers)
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * int(tcfg.hidden_size), h, bias=False)
        layer = LlamaDecoderLayer(cfg, layer_idx=0)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # EAGLE-3: attention over [embedding; hidden]
            setattr(attn, name, nn.Linear(2 * h, getattr(attn, name).out_features, bias=False))
        layer.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.midlayer = layer
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, n, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=cfg)
        self.draft_vocab = draft_vocab
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def set_draft_vocab(self, vocab: DraftVocab | None) -> None:
        """Draft over ``vocab`` (None: the full vocabulary): a new ``lm_head`` of that many rows
        (kept when the size is unchanged); saved with the head."""
        n = vocab.size if vocab is not None else int(self.config.vocab_size)
        if n != self.lm_head.out_features:
            w = self.lm_head.weight
            self.lm_head = nn.Linear(self.hidden_size, n, bias=False, device=w.device, dtype=w.dtype)
        self.config.draft_vocab_size = n
        self.draft_vocab = vocab

    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> None:
        """Start ``lm_head`` from the target's LM-head rows of the draft vocabulary and ``norm``
        from the target's final norm (where the shapes agree): a warm start for training."""
        out = cast("PreTrainedModel", target).get_output_embeddings()
        w = getattr(out, "original", out).weight
        rows = self.draft_vocab.ids_on(w.device) if self.draft_vocab is not None else slice(None)
        if w.shape[1] == self.hidden_size:
            self.lm_head.weight.copy_(w[rows].to(self.lm_head.weight.dtype))
        final = getattr(getattr(getattr(target, "model", target), "norm", None), "weight", None)
        if final is not None and final.shape == (self.hidden_size,):
            self.norm.weight.copy_(final.to(self.norm.weight.dtype))

    def select_features(self, hidden: Sequence[torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fused input features from a target forward's ``hidden_states`` (each ``[T, H_t]``
        or ``[B, T, H_t]``): ``[..., 3·H_t]``, optionally only ``rows`` (``[M]`` indices, dim 0)."""
        picked = [hidden[i] for i in self.feature_layers]
        if rows is not None:
            picked = [x.index_select(0, rows) for x in picked]
        return torch.cat(picked, dim=-1)

    def project(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """``[E(x); h]`` with ``h = fc(features)`` for fused target features (``[B, T, 3·H_t]``) or
        ``h = features`` for the head's own outputs (``[B, T, H]``): ``[B, T, 2H]``."""
        if features.shape[-1] == self.fc.in_features:
            features = self.fc(features)
        elif features.shape[-1] != self.hidden_size:
            raise ValueError(f"EAGLE-3 head input of width {features.shape[-1]}: expected {self.fc.in_features} "
                             f"(fused target features) or {self.hidden_size} (its own outputs)")
        return torch.cat([token_embeds.to(features.dtype), features], dim=-1)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache=None) -> torch.Tensor:
        """Run the head over T new draft positions.

        Args:
            features: ``[B, T, 3·H_t]`` fused target features, or ``[B, T, H]`` the head's own
                outputs (drafting steps after the first).
            token_embeds: ``[B, T, H]`` target embedding of the token that followed each position.
            positions: ``[B, T]`` int64 RoPE positions.
            mask: ``[B, 1, T, S]`` bool, True = attend, over ``S - T`` cached positions then the T new.
            cache: a ``DynamicCache`` with one layer (appended to), or None.

        Returns:
            ``[B, T, H]`` the midlayer's pre-norm outputs (fed back; :meth:`logits` for tokens).
        """
        return self.layer_forward(self.project(features, token_embeds), positions, mask, cache)

    def layer_forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        """The midlayer on projected inputs ``x = [E(x); h]`` (``[B, T, 2H]``) -> ``[B, T, H]``."""
        layer = self.midlayer
        emb, h = x.split(self.hidden_size, dim=-1)
        a = torch.cat([layer.input_layernorm(emb), cast(LlamaRMSNorm, layer.hidden_norm)(h)], dim=-1)
        pe = self.rotary_emb(h, position_ids=positions)
        attn, _ = layer.self_attn(hidden_states=a, attention_mask=mask, position_embeddings=pe,
                                  **kv_cache.cache_arg(layer.self_attn, cache))
        h = h + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` outputs -> ``[..., N]`` draft-vocabulary logits (``lm_head(norm(h))``)."""
        return self.lm_head(self.norm(h))

    # -- files ---------------------------------------------------------------------------------

    def save(self, out: Path | str, meta: dict) -> Path:
        """Write ``model.safetensors``, ``config.json`` and ``selfspec_head.json`` into ``out``."""
        return save_head_files(self, out, {"format": HEAD_FORMAT, "arch": self.target_arch, ARCH_FIELD: HEAD_ARCH,
                                           "bias": False, "feature_layers": list(self.feature_layers)}, meta)


def load_eagle3_head(path: Path | str, target: nn.Module, meta: dict | None = None) -> tuple[Eagle3Head, dict]:
    """Load a saved EAGLE-3 head for ``target``; refuses another architecture or a mismatch."""
    path = Path(path)
    meta = meta if meta is not None else read_meta(path)
    if meta.get(ARCH_FIELD) != HEAD_ARCH:
        raise SelfspecError(f"draft head {path} is not an EAGLE-3 head")
    state, vocab = read_head_state(path, target, meta)
    return fill_head(Eagle3Head(target, meta.get("feature_layers"), vocab), state, path), meta


def target_features(head: nn.Module, hidden: Sequence[torch.Tensor], rows: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """What ``head`` reads from a target forward's ``hidden_states`` (each ``[T, H_t]``): the last
    (post-norm) one for EAGLE-1/2 heads, ``[T, H_t]``; the fused three for EAGLE-3, ``[T, 3·H_t]``;
    optionally only ``rows`` (``[M]`` indices)."""
    if isinstance(head, Eagle3Head):
        return head.select_features(hidden, rows)
    last = hidden[-1]
    return last if rows is None else last.index_select(0, rows)
