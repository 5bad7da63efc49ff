import pytest
import torch

from selfspec.core.tree import DraftTree


def test_chain_derivations():
    t = DraftTree.chain([5, 6, 7, 8])
    assert t.is_chain
    assert t.depths.tolist() == [0, 1, 2, 3]
    assert t.paths == [[0, 1, 2, 3]]
    assert torch.equal(t.ancestor_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_tree_derivations():
    #      0
    #    1   2
    #    3  4 5
    t = DraftTree(torch.tensor([9, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 0, 1, 2, 2]))
    assert not t.is_chain
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert t.children == [[1, 2], [3], [4, 5], [], [], []]
    assert t.paths == [[0, 1, 3], [0, 2, 4], [0, 2, 5]]
    m = t.ancestor_mask
    assert m[4].tolist() == [True, False, True, False, True, False]
    assert m[3].tolist() == [True, True, False, True, False, False]
    assert not m[1, 2] and not m[2, 1]


def test_truncate_depth_reindexes():
    t = DraftTree(torch.tensor([9, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 1, 0, 3, 4]))
    s = t.truncate_depth(1)
    assert s.token_list == [9, 1, 3]
    assert s.parent_list == [-1, 0, 0]
    assert t.truncate_depth(5) is t
    assert t.truncate_depth(0).token_list == [9]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1]])
def test_rejects_bad_parents(parents):
    with pytest.raises(ValueError):
        DraftTree(torch.arange(len(parents)), torch.tensor(parents))
