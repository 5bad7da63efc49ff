import pytest
import torch

from selfspec.core.acceptance import accept_greedy
from selfspec.core.tree import DraftTree

V = 10


def logits_for(best: list[int]) -> torch.Tensor:
    x = torch.zeros(len(best), V)
    for i, b in enumerate(best):
        x[i, b] = 5.0
    return x


@pytest.mark.parametrize("j", range(5))
def test_chain_right_for_exactly_j(j):
    truth = [1, 2, 3, 4, 5]  # target argmax after root, d1, d2, d3, d4
    draft = [t if i < j else (t + 1) % V for i, t in enumerate(truth[:4])]
    tree = DraftTree.chain([0, *draft])
    v = accept_greedy(tree, logits_for(truth))
    assert v.num_accepted == j
    assert v.accepted_nodes == list(range(j + 1))
    assert v.bonus_token == truth[j]


def test_root_only_is_plain_decoding():
    v = accept_greedy(DraftTree.chain([4]), logits_for([7]))
    assert v.accepted_nodes == [0] and v.bonus_token == 7


def test_tree_follows_matching_branch():
    # root children: 1 (wrong) and 2 (right); node 2's children 3 (wrong), 4 (right)
    tree = DraftTree(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 2, 2]))
    best = [2, 9, 4, 9, 6]
    v = accept_greedy(tree, logits_for(best))
    assert v.accepted_nodes == [0, 2, 4]
    assert v.bonus_token == 6
