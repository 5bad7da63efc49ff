"""Swap a model's ``nn.Linear`` layers for another implementation, in place, without forking
modelling code: HF models call ``self.q_proj(x)`` etc., so any module with the same call
signature works. Replacement happens on a runner's own module tree when it is built
(:func:`share_copy`); each replacement keeps the original layer it was made from."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel


class SwappedLinear(nn.Module):
    """Base class of replacement layers: ``forward(x[..., in_features]) -> [..., out_features]``.

    Attributes:
        original: the ``nn.Linear`` it replaced (its weight stays shared with e.g. tied embeddings).
        in_features, out_features: as in ``nn.Linear``.
    """

    backend = "?"
    original: nn.Linear  # in the instance's __dict__, not a submodule (see __init__)

    def __init__(self, original: nn.Linear) -> None:
        super().__init__()
        # Stored outside the module tree so state_dict / parameters() do not see it twice.
        self.__dict__["original"] = original
        self.in_features = original.in_features
        self.out_features = original.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"


def original_of(layer: nn.Linear | SwappedLinear) -> nn.Linear:
    """The ``nn.Linear`` behind a swapped layer (the layer itself if it is not swapped)."""
    return layer.original if isinstance(layer, SwappedLinear) else layer


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear | SwappedLinear]]:
    """Every ``(parent, attribute name, layer)`` whose layer is an ``nn.Linear`` or a swapped one."""
    found: list[tuple[nn.Module, str, nn.Linear | SwappedLinear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (nn.Linear, SwappedLinear)):
                found.append((parent, name, child))
    return found


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], only: set[int] | None = None) -> int:
    """Replace every linear layer (or those whose ``id`` is in ``only``) by ``make(original)``;
    returns how many were replaced. Called on a runner's own module tree when it is built
    (:meth:`~selfspec.models.runner.LoadedModel.runner`), never on one that runs."""
    n = 0
    for parent, name, child in linear_layers(model):
        if only is not None and id(child) not in only:
            continue
        setattr(parent, name, make(original_of(child)))
        n += 1
    return n


def use_attention(model: nn.Module, name: str) -> None:
    """Give ``model`` (a runner's own module tree, with its own config) the attention function ``name``."""
    hf = cast("PreTrainedModel", model)
    if hf.config._attn_implementation != name:
        hf.set_attn_implementation(name)


def current_backend(model: nn.Module) -> str:
    """``stock`` if no layer is swapped, else the swapped layers' backend name."""
    for _, _, child in linear_layers(model):
        if isinstance(child, SwappedLinear):
            return child.backend
    return "stock"


def flatten(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x[..., K]`` as a contiguous ``[M, K]`` matrix, plus the leading shape to restore."""
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def release_originals(model: nn.Module) -> int:
    """Free the fp32 weights kept behind swapped layers (a model loaded for one backend for
    good, e.g. a draft model, need not hold both copies). Weights shared with the input
    embedding are kept. Returns the number of bytes freed; the model cannot go back to
    ``stock`` afterwards."""
    get_embeddings = getattr(model, "get_input_embeddings", None)  # a transformers model's
    keep = get_embeddings().weight.data_ptr() if get_embeddings is not None else None
    freed = 0
    for _, _, child in linear_layers(model):
        if isinstance(child, SwappedLinear) and child.original.weight.data_ptr() != keep:
            w = child.original.weight
            freed += w.numel() * w.element_size()
            child.original.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
    return freed


def released(model: nn.Module) -> bool:
    """Whether :func:`release_originals` freed the fp32 weights behind this model's swapped layers
    (read from the layers themselves: an empty original weight)."""
    return any(isinstance(child, SwappedLinear) and child.original.weight.numel() == 0
               for _, _, child in linear_layers(model))


def share_copy(model: nn.Module) -> nn.Module:
    """A new module tree with the structure of ``model`` over the same tensors: every module is a
    new object (its own children, parameters and buffers dictionaries, hooks and attributes),
    every parameter and buffer is the same tensor, and the copy has a copy of the model's config,
    so that installing layers or an attention function on the copy leaves ``model`` as it is.
    Costs no tensor memory (SmolLM2: about 3 ms)."""
    configs: dict[int, object] = {}
    done: dict[int, nn.Module] = {}

    def config_of(cfg: object) -> object:
        if id(cfg) not in configs:
            configs[id(cfg)] = copy.deepcopy(cfg)
        return configs[id(cfg)]

    def walk(m: nn.Module) -> nn.Module:
        if id(m) in done:
            return done[id(m)]
        new = copy.copy(m)  # a new __dict__ with the same values
        done[id(m)] = new
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_forward_hooks",
                     "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            value = m.__dict__.get(name)
            if value is not None:
                new.__dict__[name] = copy.copy(value)
        new.__dict__["_modules"] = {k: (walk(c) if c is not None else None) for k, c in m._modules.items()}
        cfg = m.__dict__.get("config")
        if cfg is not None and hasattr(cfg, "to_json_string"):  # a transformers config: the copy's own
            new.__dict__["config"] = config_of(cfg)
        return new

    return walk(model)


def _where(t: torch.Tensor) -> int:
    """Where a tensor's data is (its data pointer; an opaque tensor such as oneDNN's packed weight
    has none: its identity)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def _held(obj: object, depth: int, seen: set[int]) -> list[tuple[int, int]]:
    """``(where, bytes)`` of what ``obj``'s attributes hold: tensors, and down to ``depth`` levels
    the plain objects it holds (an int8 layer's matmul, a group's shared product); an object that
    states its own ``nbytes`` (an opaque packed weight, e.g. fbgemm's) counts that; not modules."""
    out = []
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            if v.numel():
                out.append((_where(v), v.numel() * v.element_size()))
        elif isinstance(getattr(v, "nbytes", None), int) and id(v) not in seen:
            seen.add(id(v))
            out.append((id(v), v.nbytes))
        elif depth and hasattr(v, "__dict__") and not isinstance(v, (nn.Module, type)) and id(v) not in seen:
            seen.add(id(v))
            out += _held(v, depth - 1, seen)
    return out


def layer_bytes(model: nn.Module, base: nn.Module) -> int:
    """Bytes that ``model``'s modules hold beyond ``base``'s parameters and buffers (a backend's
    packed, quantised or re-laid-out copies of the weights): tensors in the modules' attributes
    and buffers, and in the plain objects they hold (:func:`_held`)."""
    seen = {_where(t) for t in (*base.parameters(), *base.buffers()) if t.numel()}
    visited: set[int] = set()
    total = 0
    for m in model.modules():
        held = _held(m, 3, visited) + [(_where(b), b.numel() * b.element_size()) for b in m._buffers.values()
                                       if b is not None and b.numel()]
        for where, nbytes in held:
            if where not in seen:
                seen.add(where)
                total += nbytes
    return total
