"""``coupled`` sampling (the default): the token at text index i is the argmax of the warped
logits plus Gumbel noise keyed by (seed, i). The text is then a function of (seed, prompt) alone:
every method's seeded ids equal ``ar``'s, over repeated requests in one process, in ``stream``
and ``generate``, and across processes; drafts that are all right, none right or right for
exactly j tokens only change how many tokens a step commits. (The distribution itself is tested
in ``tests/statistical/test_coupled_sampling.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import selfspec
from selfspec.core.sampling import GumbelNoise, Warper, perturbed
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.models.loading import load_model

from ..conftest import TEST_DEVICE, VOCAB, prompt_ids

MAX_NEW = 21
SAMPLE = dict(temperature=0.8, top_p=0.95, seed=11, max_new_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [prompt_ids(s, n) for s, n in [(0, 1), (2, 17), (3, 40)]]

METHODS = {
    "pld": dict(k=4, auto_k=False),
    "pld-cost-sized": dict(),
    "jacobi": dict(),
    "msn": dict(),
    "self-spec": dict(skip_attention=(1,), skip_mlp=(2,), k=4, auto_k=False),
    "self-spec-none-skipped": dict(skip_attention=(), skip_mlp=(), k=4, auto_k=False),
    "sdsat": dict(adaptive_ids=str(VOCAB - 1), k=3),
    "space": dict(mask_id=VOCAB - 1, k=3),
    "eagle2": dict(head="random:0", total_tokens=10, top_k=3, depth=3, min_prob=0.0),
    "draft-model-self": dict(k=3, auto_k=False),
    "draft-model-other": dict(k=3, auto_k=False),
}


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(str(tiny_dir), device=TEST_DEVICE, kernels="stock")


@pytest.fixture(scope="module")
def reference(target):
    g = selfspec.load(target, "ar")
    return [g.generate(p, **SAMPLE).token_ids for p in PROMPTS]


def _load(target, case, tiny_dir, tiny_draft_dir):
    opts = dict(METHODS[case])
    method = case
    if case.startswith("draft-model"):
        method = "draft-model"
        opts["draft_model"] = str(tiny_dir if case.endswith("self") else tiny_draft_dir)
    elif case in ("pld-cost-sized",):
        method = "pld"
    elif case.startswith("self-spec"):
        method = "self-spec"
    return selfspec.load(target, method, self_test=False, **opts)


@pytest.mark.parametrize("case", list(METHODS))
def test_seeded_ids_equal_ar(target, reference, case, tiny_dir, tiny_draft_dir):
    g = _load(target, case, tiny_dir, tiny_draft_dir)
    for _ in range(2):  # repeated requests: nothing carried over changes the text
        for p, ref in zip(PROMPTS, reference):
            r = g.generate(p, **SAMPLE)
            assert r.token_ids == ref, case
            assert r.sampling == "coupled" and r.seed == SAMPLE["seed"]
    if case == "draft-model-self":  # the draft is the target and uses the same noise: all accepted
        assert all(a == 1.0 for a in r.acceptance_by_depth)
        assert r.mean_accepted > 2.5


def test_stream_equals_generate(target, reference):
    g = selfspec.load(target, "pld", self_test=False)
    ids = [t for _, new in g.stream_steps(PROMPTS[1], **SAMPLE) for t in new]
    assert ids == reference[1]


def test_seeds_differ_and_temperature_matters(target, reference):
    g = selfspec.load(target, "ar", self_test=False)
    other = g.generate(PROMPTS[2], **{**SAMPLE, "seed": 12}).token_ids
    assert other != reference[2]
    greedy = g.generate(PROMPTS[2], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert greedy.sampling == "greedy" and greedy.seed is None


@pytest.mark.parametrize("j", [0, 2, 4])
def test_scripted_drafts_right_for_exactly_j(target, reference, j):
    """Drafts that are right for exactly j tokens (of the coupled reference): each full step
    commits j + 1, and the text is unchanged."""
    g = selfspec.load(target, "ar", self_test=False)
    for p, ref in zip(PROMPTS, reference):
        g.drafter = ScriptedDrafter(ref, 4, j, VOCAB)
        r = g.generate(p, **SAMPLE)
        assert r.token_ids == ref
        assert all(c == j + 1 for c in r.committed_per_step[1:-1]), r.committed_per_step


def test_no_seed_draws_one_and_reports_it(target):
    g = selfspec.load(target, "ar", self_test=False)
    kw = {k: v for k, v in SAMPLE.items() if k != "seed"}
    a, b = g.generate(PROMPTS[1], **kw), g.generate(PROMPTS[1], **kw)
    assert isinstance(a.seed, int) and isinstance(b.seed, int)
    assert a.seed != b.seed  # 2^-31 chance of a false failure
    assert g.generate(PROMPTS[1], **{**kw, "seed": a.seed}).token_ids == a.token_ids
    assert a.to_dict()["seed"] == a.seed


def test_negative_seed_rejected(target):
    g = selfspec.load(target, "ar", self_test=False)
    with pytest.raises(selfspec.SelfspecError, match="seed"):
        g.generate(PROMPTS[0], temperature=1.0, seed=-1)
    with pytest.raises(selfspec.SelfspecError, match="sampling"):
        g.generate(PROMPTS[0], temperature=1.0, sampling="gumbel")


def test_same_across_processes(tiny_dir, reference):
    code = (
        f"import json, selfspec; g = selfspec.load({str(tiny_dir)!r}, 'pld', kernels='stock', self_test=False); "
        f"print(json.dumps(g.generate({PROMPTS[2]!r}, **{SAMPLE!r}).token_ids))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == reference[2]


@pytest.mark.parametrize("method,opts", [("pld", {}), ("self-spec", dict(skip_attention=(1,), skip_mlp=(2,)))])
def test_rejection_sampling_reproducible_over_requests(target, method, opts):
    """``rejection``: the text depends on the drafts, so the drafter's learned budget state is
    reset before each request and no wall clock sizes a draft: a seed reproduces a sample in a
    fresh generator and over repeated requests."""
    kw = dict(SAMPLE, sampling="rejection")
    g = selfspec.load(target, method, self_test=False, **opts)
    first = [g.generate(p, **kw).token_ids for p in PROMPTS]
    again = [g.generate(p, **kw).token_ids for p in PROMPTS]
    fresh = selfspec.load(target, method, self_test=False, **opts)
    assert first == again == [fresh.generate(p, **kw).token_ids for p in PROMPTS]


def test_gumbel_noise_is_counter_based():
    a, b = GumbelNoise(5), GumbelNoise(5)
    x = a.at(7, 50)
    b.at(3, 50), b.at(9, 50)  # other indices first: no effect
    assert torch.equal(b.at(7, 50), x)
    assert not torch.equal(a.at(8, 50), x)
    assert not torch.equal(GumbelNoise(6).at(7, 50), x)
    assert torch.isfinite(x).all()
    rows = a.rows([7, 8], 50)
    assert rows.shape == (2, 50) and torch.equal(rows[0], x)


def test_perturbed_respects_top_k():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    w = Warper(1.0, top_k=2)
    for i in range(50):
        assert int(perturbed(logits, w, GumbelNoise(0), i).argmax()) in (0, 1)
