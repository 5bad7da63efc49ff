"""``onednn`` backend: fp32 Linear layers through oneDNN with weights prepacked once at load.

Same model, same precision; only the summation order (rounding) differs from MKL. On CPUs where
MKL treats a few-row matrix product as separate matrix-vector products (the verify step of
speculative decoding), oneDNN's blocked kernel keeps T(q) nearly flat. Verify blocks also use
attention without KV copies (:mod:`selfspec.kernels.gqa_attention`).

The same layers run inside the ``compiled`` backend's step (:mod:`selfspec.models.compiled_step`):
Inductor lowers oneDNN's linear only for weights frozen into the graph as constants, so a traced
call goes through :func:`onednn_linear`, an operator Inductor calls as it is, the packed weight an
input like any parameter (nothing is baked into a saved step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..errors import SelfspecError
from .gemv import BLOCK as LAYOUT_ROWS
from .gemv import blocked as blocked_layout
from .gemv import gemv as few_row_product
from .gemv import takes as layout_takes
from .swap import SwappedLinear, flatten, linear_layers, original_of, swap_linears, use_attention

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the backend can run here, else the reason it cannot."""
    if device.type != "cpu":
        return f"the onednn backend runs on CPU only (model is on {device}); use --kernels stock"
    if dtype != torch.float32:
        return f"the onednn backend is fp32 only (model is {dtype}); use --dtype float32 or --kernels stock"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn); use --kernels stock"
    return None


_LIBRARY = torch.library.Library("selfspec", "DEF")  # the operator's registration lives as long as this module
_LIBRARY.define("onednn_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Registered on the library itself, not through ``torch.library.custom_op``: a custom op's kernel
# runs inside a wrapper that switches Dynamo's frame hook off and on at every call, which cost
# 30-200 us per call from inside the compiled graph (py-spy; SmolLM2 makes 121-211 calls per
# step; AVX2, 2 threads).
_LIBRARY.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("selfspec::onednn_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x[M, K] @ W.T + b -> [M, out_features]`` with ``packed`` = ``W`` in oneDNN's blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight``): the operator a compiled graph calls (see the module)."""
    return torch.ops.selfspec.onednn_linear.default(x, packed, bias, out_features)


class OneDNNLinear(SwappedLinear):
    """``y = x @ W.T + b`` with ``W`` reordered into oneDNN's blocked layout.

    Shapes: ``x[..., in_features] -> y[..., out_features]`` (fp32).

    Attributes:
        blocked: the weight in :func:`~selfspec.kernels.gemv.blocked`'s layout, for the compiled
            step's few-row blocks (:func:`add_blocked`), or None.
    """

    backend = "onednn"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__(original)
        w = original.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = None if original.bias is None else original.bias.detach()
        self.blocked: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten(x)
        if torch.compiler.is_compiling():  # traced by the compiled backend's step
            if self.blocked is not None and layout_takes(x2.shape[0]):  # a few-row block: Inductor's own loop
                return few_row_product(x2, self.blocked, self.bias).reshape(*lead, self.out_features)
            return onednn_linear(x2, self.packed, self.bias, self.out_features).reshape(*lead, self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linear layers that read the same input in the stock HF decoder layers (Llama, Qwen2,
Mistral, ...): an attention block's projections, an MLP's gate and up projections."""


class SharedProductLinear(SwappedLinear):
    """One of a group of sibling layers that read the same input (:data:`SIBLINGS`), as the
    ``compiled`` backend's step runs them: the group's product ``x @ [W_1; ...; W_n].T`` with one
    prepacked weight, of which this layer keeps its columns ``[start, start + out_features)``.
    The step computes the product once per group (:func:`shared_products_pass`): one wide matrix
    product instead of n narrow ones, which reads the weights faster and calls oneDNN fewer times
    (SmolLM2: 121 calls per step instead of 211). Eager calls (the prompt forward, drafts that run
    the model) run the stock layer.

    Shapes: ``x[..., in_features] -> y[..., out_features]`` (fp32).

    Attributes:
        blocked: this member's own weight in :func:`~selfspec.kernels.gemv.blocked`'s layout, for
            the step's few-row blocks (each member's product is its own loop there), or None.
    """

    backend = "onednn"

    def __init__(self, original: nn.Linear, packed: torch.Tensor, bias: torch.Tensor | None, start: int,
                 total: int) -> None:
        super().__init__(original)
        self.packed, self.bias, self.start, self.total = packed, bias, start, total
        self.blocked: torch.Tensor | None = None

    @staticmethod
    def group(originals: list[nn.Linear]) -> list[SharedProductLinear]:
        """The members of one group, sharing one prepacked ``[sum of out_features, K]`` weight (and
        bias, zeros where a member has none)."""
        w = torch.cat([o.weight.detach() for o in originals]).contiguous()
        bias = None
        if any(o.bias is not None for o in originals):
            bias = torch.cat([o.bias.detach() if o.bias is not None else w.new_zeros(o.out_features)
                              for o in originals])
        packed, total, start, out = torch.ops.mkldnn._reorder_linear_weight(w), w.shape[0], 0, []
        for o in originals:
            out.append(SharedProductLinear(o, packed, bias, start, total))
            start += o.out_features
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.original(x)
        x2, lead = flatten(x)
        if self.blocked is not None and layout_takes(x2.shape[0]):  # a few-row block: Inductor's own loop
            own_bias = None if self.bias is None else self.bias[self.start:self.start + self.out_features]
            return few_row_product(x2, self.blocked, own_bias).reshape(*lead, self.out_features)
        y = onednn_linear(x2, self.packed, self.bias, self.total)[:, self.start:self.start + self.out_features]
        return y.reshape(*lead, self.out_features)


def share_products(model: nn.Module) -> int:
    """Swap each group of :data:`SIBLINGS` (same input width) for :class:`SharedProductLinear`
    layers (on a runner's own module tree, when it is built); returns the number of groups."""
    groups = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            layers = [layer for layer in (getattr(parent, name, None) for name in names)
                      if isinstance(layer, (nn.Linear, SwappedLinear))]
            if len(layers) != len(names):
                continue
            originals = [original_of(layer) for layer in layers]
            if len({o.in_features for o in originals}) != 1:
                continue
            for name, member in zip(names, SharedProductLinear.group(originals)):
                setattr(parent, name, member)
            groups += 1
    return groups


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _same_tensor_key(node: object) -> object:
    """A key equal for graph values that are the same tensor: views (of one shape, strides and
    offset) of one computed value; anything else is its own key."""
    if not isinstance(node, torch.fx.Node):
        return node
    base = node
    while base.op == "call_function" and base.target in _VIEWS:
        base = cast(torch.fx.Node, base.args[0])  # a view's input: a graph value
    val = node.meta.get("val")
    if base is node or base.op == "placeholder" or not isinstance(val, torch.Tensor):
        return node  # a graph input may be mutated between two views of it: not merged
    return base, tuple(val.shape), tuple(val.stride()), val.storage_offset()


def compute_products_once(graph: torch.fx.Graph) -> None:
    """Each oneDNN product (:func:`onednn_linear` of one input, weight and bias) in ``graph`` is
    computed once: :class:`SharedProductLinear` members each ask for their group's product; after
    this, one call serves them all. For the functional graph after AOT autograd, where equal calls
    of a pure operator on equal values are one value (Inductor's ``post_grad_custom_pre_pass``:
    :func:`shared_products_pass`)."""
    seen: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.selfspec.onednn_linear.default:
            continue
        key = tuple(_same_tensor_key(a) for a in node.args)
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


SHARED_PRODUCTS_PASS = "selfspec-shared-products-1"
"""The version of :func:`shared_products_pass` (its ``uuid``; saved steps' names include it)."""


def shared_products_pass() -> object:
    """:func:`compute_products_once` as an Inductor graph pass (a ``CustomGraphPass``, whose
    ``uuid`` keys Inductor's caches), for ``torch.compile(..., options={"post_grad_custom_pre_pass":
    ...})``. Built on call: importing Inductor takes seconds, and only a compile needs it."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SharedProducts(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            compute_products_once(graph)

        def uuid(self) -> str:
            return SHARED_PRODUCTS_PASS

    return SharedProducts()


def add_blocked(model: nn.Module, budget: int) -> int | None:
    """Give ``model``'s oneDNN layers (:class:`OneDNNLinear`, :class:`SharedProductLinear`) their
    weights in the few-row layout (:func:`~selfspec.kernels.gemv.blocked`) where it is not yet
    there; layers whose width does not fit the layout keep oneDNN. Nothing is added when the copies
    would take more than ``budget`` bytes. Returns the bytes the layouts take, None when refused."""
    layers = [m for _, _, m in linear_layers(model) if isinstance(m, (OneDNNLinear, SharedProductLinear))
              and m.original.weight.dim() == 2]  # not a released weight
    todo = [m for m in layers if m.blocked is None and m.out_features % LAYOUT_ROWS == 0]
    if sum(m.original.weight.numel() * m.original.weight.element_size() for m in todo) > budget:
        return None
    if todo:  # one allocation for all: on the AVX2 VM, 0.3 s for SmolLM2's 538 MB against 1.8 s in one per layer
        w0 = todo[0].original.weight
        flat = torch.empty(sum(m.original.weight.numel() for m in todo), dtype=w0.dtype, device=w0.device)
        start = 0
        for m in todo:
            w = m.original.weight
            m.blocked = blocked_layout(w, out=flat[start:start + w.numel()])
            start += w.numel()
    return sum(m.blocked.numel() * m.blocked.element_size() for m in layers if m.blocked is not None)


def apply(model: nn.Module) -> None:
    """Swap every linear layer of ``model`` for :class:`OneDNNLinear`."""
    p = next(model.parameters())
    reason = available(p.device, p.dtype)
    if reason:
        raise SelfspecError(reason)
    swap_linears(model, OneDNNLinear)
    if cast("PreTrainedModel", model).config._attn_implementation == "sdpa":
        from .gqa_attention import NAME

        use_attention(model, NAME)
