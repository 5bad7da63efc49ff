"""The only decode loop: prefill -> (propose -> verify -> accept -> commit -> observe)*.

Every method, ``ar`` included, runs through :func:`run`; they differ only in the drafter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from ..core import kv_cache
from ..core.acceptance import Verdict, accept_greedy, accept_sampling
from ..core.sampling import sample
from ..models.runner import Runner
from .controller import DraftController
from .protocol import Drafter, Proposal
from .state import DecodeState, VerifyOutput


def choose_token(state: DecodeState, logits: torch.Tensor) -> int:
    """The next token (text index ``len(state.ids)``) from the target's ``[V]`` logits: greedy
    argmax, the coupled Gumbel-max sample, or a draw with the request's generator."""
    if state.deterministic:
        return int(state.scores(logits, len(state.ids)).argmax())
    return sample(state.warper.probs(logits), state.generator)


def prefill(state: DecodeState, runner: Runner, drafter: Drafter) -> list[int]:
    """Run the prompt (all but nothing: the whole prompt, like ``generate``), choose the first
    token, and hand the prompt forward to the drafter. Returns the committed first token(s)."""
    device = runner.device
    now = state.clock
    t0 = now(None)
    block = runner.prefill(state.cache, torch.tensor(state.ids, dtype=torch.long), drafter.needs_hidden)
    logits, hidden = block.logits[-1], block.hidden
    first = choose_token(state, logits)
    state.stats.prefill_s += now(device) - t0
    kept = state.commit([first])
    state.stats.record(0, 0, len(kept))
    t1 = now(None)
    drafter.prefill(state, VerifyOutput(0, logits[None], None, hidden))
    state.stats.draft_s += now(None) - t1
    return kept


def verify(state: DecodeState, runner: Runner, proposal: Proposal, want_hidden: bool) -> VerifyOutput:
    """One target forward over the tree (and piggyback tokens), KV appended after ``base``, the
    committed tokens but the pending one (not read from a static cache: its length counter lives
    on the device, and reading it would be a second transfer per step)."""
    tree, pig = proposal.tree, proposal.piggyback
    base = len(state.ids) - 1  # the cache holds every committed token but the pending one
    if runner.step is None and kv_cache.cache_length(state.cache) != base:  # a host int here: free to check
        raise RuntimeError("before verifying, the cache holds "
                           f"{kv_cache.cache_length(state.cache)} positions, not the {base} committed ones")
    ids = tree.tokens
    positions = tree.depths + base
    block = None
    if pig is not None or not tree.is_chain:
        block = tree.ancestor_mask
        if pig is not None:
            n, m = tree.size, pig.tokens.numel()
            full = torch.zeros(n + m, n + m, dtype=torch.bool)
            full[:n, :n] = block
            full[n:] = pig.mask
            block = full
            ids = torch.cat([ids, pig.tokens])
            positions = torch.cat([positions, pig.positions])
    out = runner.forward(state.cache, ids, positions, block, want_hidden, base)  # a step pads to a static shape
    n = tree.size
    pig_logits = out.logits[n:] if pig is not None else None
    return VerifyOutput(base, out.logits[:n], pig_logits, out.hidden)


def accept(state: DecodeState, proposal: Proposal, out: VerifyOutput) -> Verdict:
    """Greedy / coupled: walk the tree along the target's (perturbed) argmax; a node at depth d
    chooses the token at text index ``len(ids) + d``. Rejection: recursive rejection sampling.
    A method registered as not lossless may replace the rule whenever it samples."""
    if state.warper.greedy:
        return accept_greedy(proposal.tree, out.tree_logits)
    if proposal.accept_rule is not None:  # a method registered as not lossless (checked in run)
        return proposal.accept_rule(proposal.tree, out.tree_logits, state.warper, state.generator)
    if state.deterministic:
        indices = (proposal.tree.depths + len(state.ids)).tolist()
        return accept_greedy(proposal.tree, state.scores(out.tree_logits, indices))
    return accept_sampling(proposal.tree, out.tree_logits, state.warper, state.generator)


@torch.inference_mode()
def run(state: DecodeState, runner: Runner, controller: DraftController) -> Iterator[list[int]]:
    """Decode until a stop condition; yields the token ids committed at each step. Every step is
    timed on the controller's clock; the controller gets every verify forward's time (its cost
    correction), and after each step the measured seconds (``state.step_time``) for the
    drafter's sizer, before the drafter's own ``observe``."""
    device = runner.device
    controller.start(state)
    drafter = controller.drafter
    now = state.clock
    yield prefill(state, runner, drafter)
    while not state.done:
        t0 = now(None)  # draft time: t0..t1 and t2..t3; verify time: t1..t2 (synced: the device's work)
        # requests in this step's forward: a sampled draft's length must not depend on the batch
        width = 1 if state.rejection else runner.batch_width
        budget = controller.budget(width)  # how much to draft: the sizer's, consulted mid-draft
        proposal = drafter.propose(state, budget)
        tree = proposal.tree.truncate_depth(state.draft_room)
        if tree is not proposal.tree:
            proposal = dataclasses.replace(proposal, tree=tree)
        if proposal.accept_rule is not None and drafter.lossless:
            raise RuntimeError(f"drafter {drafter.name} is registered lossless but replaced the acceptance rule")
        if tree.token_list[0] != state.pending:
            raise RuntimeError(f"drafter {drafter.name} proposed a tree whose root is not the pending token")
        t1 = now(device)
        out = verify(state, runner, proposal, drafter.needs_hidden)
        if controller.online is not None and width == 1:  # the cost correction: every solo verify forward
            pig = proposal.piggyback
            controller.verified(tree.size + (pig.tokens.numel() if pig is not None else 0), now(device) - t1)
        verdict = accept(state, proposal, out)
        kv_cache.commit(state.cache, out.base, verdict.accepted_nodes)
        t2 = now(device)
        new = tree.path_tokens(verdict.accepted_nodes[1:]) + [verdict.bonus_token]
        kept = state.commit(new)
        controller.measured(state, t1 - t0, t2 - t0)
        controller.observe(state, budget, proposal, verdict)  # the sizer learns
        drafter.observe(state, proposal, verdict, out)
        t3 = now(None)
        state.stats.draft_s += (t1 - t0) + (t3 - t2)
        state.stats.verify_s += t2 - t1
        state.stats.record(int(tree.depths.max()), verdict.num_accepted, len(kept))
        yield kept
