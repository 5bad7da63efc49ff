"""One transfer to the host per verify step (issue 34, item 4), counted on a CPU.

:class:`~tests.decoding.host_reads.HostReads` counts reads of device-resident values on the host
(a sync each on a GPU). The drafter's own work (propose, observe) is not counted: these tests
pin the loop's verify, accept and commit, on the growing cache and on the compiled backend's
static cache (its padded step run eagerly: the loop's code is the same). With
``SELFSPEC_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh``) the same counts hold on a GPU, where
each read is a real sync.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.models.loading import load_model

from ..conftest import TEST_DEVICE, VOCAB, prompt_ids
from .host_reads import HostReads
from .wrapped import Wrapped

PROMPT = prompt_ids(1, 12)


class Uncounted(Wrapped):
    """Pauses the count while the inner drafter works; records the count at each proposal."""

    def __init__(self, inner, reads: HostReads) -> None:
        super().__init__(inner)
        self.reads = reads
        self.at_propose: list[int] = []

    def propose(self, state, budget=None):
        self.at_propose.append(self.reads.count)
        self.reads.paused = True
        try:
            return self.inner.propose(state, budget)
        finally:
            self.reads.paused = False

    def observe(self, state, proposal, verdict, out):
        self.reads.paused = True
        try:
            self.inner.observe(state, proposal, verdict, out)
        finally:
            self.reads.paused = False


def test_host_reads_counts_reads_of_device_values_only():
    model = torch.nn.Linear(4, 3)
    with HostReads(model) as r:
        host = torch.tensor([1.0, 2.0])
        float(host[0]), host.tolist()  # host tensors: free
        assert r.count == 0
        y = model(torch.ones(4))  # computed from parameters: on the device
        z = (y * 2).argmax()
        moved = torch.tensor([3]).to(torch.device("cpu"))  # moved to the device
        made = torch.arange(3, device="cpu")  # made there
        int(z), y.tolist(), bool(y.sum() > 0), moved.item(), made.cpu()
        r.paused = True
        y.tolist()  # not counted while paused
    assert r.count == 5 and r.where == ["__int__", "tolist", "__bool__", "item", "cpu"]


@pytest.fixture(scope="module", params=["stock", "compiled"])
def target(request, tiny_dir):
    t = load_model(str(tiny_dir), device=TEST_DEVICE, kernels=request.param)
    if t.step is not None:
        t.step.compile = False  # the static-shape step, eagerly: what is counted is the loop around it
    return t


@pytest.mark.parametrize("temperature, sampling, tree", [
    (0.0, "coupled", False), (0.0, "coupled", True), (0.8, "coupled", False), (0.8, "coupled", True),
    (0.8, "rejection", False),
])
def test_one_transfer_per_verify_step(target, temperature, sampling, tree):
    ar = selfspec.load(target, "ar", self_test=False)
    ref = ar.generate(PROMPT, max_new_tokens=12, temperature=temperature, seed=3, sampling=sampling).token_ids
    g = selfspec.load(target, "ar", self_test=False)
    reads = HostReads(target.model)
    g.drafter = drafter = Uncounted(ScriptedDrafter(ref, 3, 2, VOCAB, tree=tree), reads)
    with reads:
        out = g.generate(PROMPT, max_new_tokens=12, temperature=temperature, seed=3, sampling=sampling)
    per_step = [b - a for a, b in zip(drafter.at_propose, drafter.at_propose[1:])]
    assert len(per_step) >= 2 and set(per_step) == {1}, (per_step, reads.where)
    if sampling == "coupled":
        assert out.token_ids == ref


def test_a_rejection_sampled_tree_walks_on_the_host(target):
    """The negative control: a tree under rejection sampling still reads per tried child (only
    chains are one transfer), so the count does see more than one read in a step."""
    g = selfspec.load(target, "ar", self_test=False)
    reads = HostReads(target.model)
    g.drafter = drafter = Uncounted(ScriptedDrafter(prompt_ids(2, 40), 3, 2, VOCAB, tree=True), reads)
    with reads:
        g.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=3, sampling="rejection")
    per_step = [b - a for a, b in zip(drafter.at_propose, drafter.at_propose[1:])]
    assert max(per_step) > 1
