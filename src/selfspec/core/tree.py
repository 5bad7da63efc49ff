"""Token trees: the one proposal type of every drafter.

Node 0 is the root: the *pending* token, already chosen and committed to the text but whose
KV is not yet in the target cache. Every other node is a drafted token whose parent precedes it
(``parents[i] < i``). A chain of k drafted tokens is the tree ``parents = [-1, 0, 1, ..., k-1]``.

Masks, depths, children lists and root-to-leaf paths are derived here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Candidate continuations of the committed text.

    Attributes:
        tokens: ``[N]`` int64 token ids; ``tokens[0]`` is the pending token.
        parents: ``[N]`` int64 parent index of each node; ``parents[0] == -1`` and
            ``parents[i] < i`` (topological order).
        draft_probs: optional ``[N, V]`` float. Row ``j`` (``j >= 1``) is the distribution ``q``
            node ``j``'s token was drawn from, given its parent (and, for samplers that draw
            siblings without replacement, given the earlier siblings). Row 0 is unused. ``None``
            means every draft is deterministic (``q`` is one-hot on the drafted token), as for
            prompt lookup or greedy drafting.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError("DraftTree needs 1-D tokens and parents of the same length")
        if self.tokens.numel() == 0:
            raise ValueError("DraftTree needs at least the root node")
        par = self.parents.tolist()
        if par[0] != -1:
            raise ValueError("DraftTree: parents[0] must be -1 (node 0 is the root)")
        for i, p in enumerate(par[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"DraftTree: parents[{i}] = {p} must be in [0, {i})")
        if self.draft_probs is not None and self.draft_probs.shape[0] != self.tokens.numel():
            raise ValueError("DraftTree: draft_probs must have one row per node")

    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A chain: ``tokens[0]`` is the pending token, the rest are drafted in order."""
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.arange(-1, t.numel() - 1, dtype=torch.long)
        return cls(t, parents, draft_probs)

    @property
    def size(self) -> int:
        """Number of nodes N (root included)."""
        return int(self.tokens.numel())

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def token_list(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parent_list))

    @cached_property
    def depths(self) -> torch.Tensor:
        """``[N]`` int64 depth of each node (root = 0)."""
        d = [0] * self.size
        for i, p in enumerate(self.parent_list[1:], start=1):
            d[i] = d[p] + 1
        return torch.tensor(d, dtype=torch.long)

    @cached_property
    def children(self) -> list[list[int]]:
        """Children of each node, in node order (the order siblings are tried in)."""
        ch: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parent_list[1:], start=1):
            ch[p].append(i)
        return ch

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool: ``mask[i, j]`` is True when node j is i or an ancestor of i."""
        n = self.size
        m = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parent_list):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    @cached_property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths, one per leaf, in leaf order."""
        out = []
        for leaf in range(self.size):
            if self.children[leaf]:
                continue
            path = [leaf]
            while self.parent_list[path[-1]] >= 0:
                path.append(self.parent_list[path[-1]])
            out.append(path[::-1])
        return out

    def path_tokens(self, nodes: list[int]) -> list[int]:
        """Token ids of the given nodes."""
        return [self.token_list[i] for i in nodes]

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """The subtree of nodes at depth <= ``max_depth`` (node order and root kept)."""
        keep = (self.depths <= max_depth).nonzero().flatten()
        if keep.numel() == self.size:
            return self
        remap = {int(old): new for new, old in enumerate(keep.tolist())}
        parents = torch.tensor([-1] + [remap[self.parent_list[int(i)]] for i in keep[1:].tolist()], dtype=torch.long)
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        return DraftTree(self.tokens[keep], parents, probs)
