"""The core invariant: greedy token ids of every method equal ``transformers`` ``generate`` and
``ar``, for drafts that are all accepted, none accepted, and right for exactly j tokens, on every
kernels backend (``generate`` runs the same model, its linear layers on that backend)."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.tree import DraftTree
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.kernels.compact import available as compact_available
from selfspec.models.loading import load_model

from ..conftest import TEST_DEVICE, VOCAB, prompt_ids
from .wrapped import Wrapped

MAX_NEW = 23  # not a multiple of the draft depth: max_new_tokens is hit mid-draft
K = 4


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    dev = next(model.parameters()).device
    out = model.generate(torch.tensor([ids], device=dev), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                    device=dev),
                         do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    return out[0, len(ids):].tolist()


class InvariantChecker(Wrapped):
    """Wraps a drafter and asserts, at every proposal, the loop invariant: the target cache
    holds exactly the committed tokens except the pending one."""

    def __init__(self, inner):
        super().__init__(inner)
        self.checks = 0

    def propose(self, state, budget=None):
        assert state.cache.get_seq_length() == len(state.ids) - 1
        self.checks += 1
        return self.inner.propose(state, budget)


BACKENDS = [(f, k) for f in ("llama", "qwen2") for k in ("stock", "onednn", "int8", "compiled", "compact")]


def _backend(p: tuple[str, str], marks=()):
    return pytest.param(p, id=f"{p[0]}-{p[1]}", marks=marks)


# Every method runs on every backend; the default tier keeps `stock` and leaves the `onednn`,
# `int8` and `compiled` cases of the methods to the `matrix` tier (CI's second command). `ar` and
# the scripted drafter, which exercise the loop itself, run on the eager backends in the default
# tier (``@ALL_BACKENDS``, which overrides the fixture's params); on `compiled`, whose every block
# size is a compile of a minute or so, in the matrix tier (the default tier's compiled cases are
# in ``tests/models/test_compiled_step.py``).
ALL_BACKENDS = pytest.mark.parametrize(
    "target", [_backend(p, pytest.mark.matrix if p[1] == "compiled" else ()) for p in BACKENDS], indirect=True)


@pytest.fixture(scope="module", params=[_backend(p, () if p[1] == "stock" else pytest.mark.matrix) for p in BACKENDS])
def target(request, tiny_dir, tiny_qwen_dir, tiny_gguf_dir, tiny_qwen_gguf_dir):
    family, kernels = request.param
    if kernels in ("onednn", "int8", "compact") and TEST_DEVICE != "cpu":  # `compiled` runs on every device
        pytest.skip(f"the {kernels} kernels run on the CPU only")
    if kernels == "compact":  # its kernel reads GGUF blocks: the tiny models with GGUF-rounded weights
        reason = compact_available(torch.device("cpu"), torch.float32)
        if reason:
            pytest.skip(reason)
        path = tiny_gguf_dir if family == "llama" else tiny_qwen_gguf_dir
    else:
        path = tiny_dir if family == "llama" else tiny_qwen_dir
    t = load_model(str(path), device=TEST_DEVICE, kernels=kernels)
    assert t.backend == kernels
    return t


PROMPTS = [prompt_ids(s, n) for s, n in [(0, 1), (1, 5), (2, 17), (3, 40)]]


@pytest.fixture(scope="module")
def references(target):
    return [hf_greedy(target.model, p, MAX_NEW) for p in PROMPTS]


@ALL_BACKENDS
def test_ar_matches_generate(target, references):
    g = selfspec.load(target, "ar")
    for p, ref in zip(PROMPTS, references):
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        assert r.mean_accepted == 1.0
        assert r.steps == r.new_tokens


@ALL_BACKENDS
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("j", range(K + 1))
def test_scripted_right_for_exactly_j(target, references, j, tree):
    g = selfspec.load(target, "ar", self_test=False)
    for p, ref in zip(PROMPTS, references):
        checker = InvariantChecker(ScriptedDrafter(ref, K, j, VOCAB, tree=tree))
        g.drafter = checker
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        assert checker.checks > 0
        if ref[-1] != 2 and len(ref) == MAX_NEW:  # no early EOS: accepted counts are exact
            full_steps = r.committed_per_step[1:-1]
            assert all(c == min(j, K) + 1 for c in full_steps), full_steps


@ALL_BACKENDS
def test_all_accepted_gives_k_plus_one(target, references):
    g = selfspec.load(target, "ar", self_test=False)
    ref = references[2]
    g.drafter = ScriptedDrafter(ref, K, K, VOCAB)
    r = g.generate(PROMPTS[2], max_new_tokens=MAX_NEW)
    assert r.acceptance_by_depth[:K] == [1.0] * K
    assert r.mean_accepted > 3


@pytest.mark.parametrize("k", [1, 3, 6])
def test_pld_matches_generate(target, references, k):
    g = selfspec.load(target, "pld", k=k, auto_k=False, self_test=False)
    for p, ref in zip(PROMPTS, references):
        assert g.generate(p, max_new_tokens=MAX_NEW).token_ids == ref


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_matches_generate(target, references, draft, tiny_draft_dir):
    own = target.path  # the target's own directory (the GGUF-rounded one on compact)
    g = selfspec.load(target, "draft-model", draft_model=str(own if draft == "self" else tiny_draft_dir),
                      k=3, auto_k=False, self_test=False)
    g.drafter = InvariantChecker(g.drafter)
    for p, ref in zip(PROMPTS, references):
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        if draft == "self":  # the draft is the target: every draft is accepted
            assert all(a == 1.0 for a in r.acceptance_by_depth)


@pytest.fixture
def flat_cost(target):
    """The target's cached cost profile made flat (T(q) = T(1) for every q), so that every
    cost-sized method drafts whatever the machine's speed: a cost-sized case that drafted nothing
    would only test ``ar``. The profile is the one the drafters load (same key, same cache)."""
    from selfspec.core import store
    from selfspec.core.cost import CostProfile

    key = target.cost_key
    qs = tuple(range(1, 301))  # every block size a method asks to have measured (SPACE, msn trees)
    flat = CostProfile(qs, (0.01,) * len(qs), 256, key, (0.01,) * len(qs), (0.0,) * len(qs), 3)
    assert store.write(key, flat, "cost profile") is not None
    return flat


def drafted(results) -> int:
    """Verify steps that checked at least one drafted token, over ``results``."""
    return sum(sum(1 for d in r.drafted_per_step if d > 0) for r in results)


@pytest.mark.parametrize("method", ["pld", "draft-model"])
def test_auto_k_budget_stays_lossless(target, references, method, tiny_draft_dir, flat_cost):
    opts = {"draft_model": str(tiny_draft_dir)} if method == "draft-model" else {}
    g = selfspec.load(target, method, self_test=False, **opts)
    assert g.drafter.sizer.profile is not None
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    assert drafted(results) > 0, "the cost-sized budget drafted nothing: this case tested ar only"


SKIP_SETS = {  # (attention, mlp) on 3-layer models
    "none": ((), ()),  # the draft is the target: every draft accepted
    "random": ((0, 2), (1,)),
    "all": ((0, 1, 2), (0, 1, 2)),  # the draft is embedding + LM head: (almost) nothing accepted
}


@pytest.mark.parametrize("exit_rule", ["cost", "gamma"])
@pytest.mark.parametrize("skip", list(SKIP_SETS))
def test_self_spec_matches_generate(target, references, skip, exit_rule):
    attn, mlp = SKIP_SETS[skip]
    g = selfspec.load(target, "self-spec", skip_attention=attn, skip_mlp=mlp, draft_exit=exit_rule, k=K,
                      auto_k=False, self_test=False)
    g.drafter = InvariantChecker(g.drafter)
    for p, ref in zip(PROMPTS, references):
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        if skip == "none" and exit_rule == "cost":  # fixed k, no exit: all K drafts verified and accepted
            assert r.acceptance_by_depth == [1.0] * K


def test_self_spec_with_cost_budget_matches_generate(target, references, flat_cost):
    g = selfspec.load(target, "self-spec", skip_attention=(1,), skip_mlp=(2,), self_test=False)
    assert g.drafter.sizer.profile is not None
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    assert drafted(results) > 0, "the cost-sized budget drafted nothing: this case tested ar only"


EAGLE_CASES = {
    "eagle2-fixed-tree": ("eagle2", dict(head="random:0", total_tokens=10, top_k=3, depth=3, min_prob=0.0)),
    "hass-cost-sized-tree": ("hass", dict(head="random:1", top_k=4, depth=2, min_prob=0.0)),
    "hass-chain": ("hass", dict(head="random:2", total_tokens=4, top_k=1, depth=4, min_prob=0.0)),
}


@pytest.mark.parametrize("case", list(EAGLE_CASES))
def test_eagle_heads_match_generate(target, references, case):
    """Untrained heads: drafts are (almost) all rejected; the trees (expanded to full depth:
    ``min_prob=0``) still verify losslessly."""
    method, opts = EAGLE_CASES[case]
    g = selfspec.load(target, method, self_test=False, **opts)
    g.drafter = InvariantChecker(g.drafter)
    for p, ref in zip(PROMPTS, references):
        assert g.generate(p, max_new_tokens=MAX_NEW).token_ids == ref


def test_eagle_oracle_pool_all_accepted(target, references):
    """The expansion hook gets an oracle whose best path is the reference continuation (with a
    decoy sibling at every depth): every drafted depth is accepted, and catch-up, rerank, commit
    and the head's feature bookkeeping still run for real."""
    from selfspec.drafters.eagle import Pool

    depth = 3
    g = selfspec.load(target, "eagle2", head="random:0", total_tokens=2 * (depth + 1) + 1, top_k=2, depth=depth,
                      self_test=False)
    ctx: dict = {}

    def oracle(h_last, position, state, sizer):
        fut = ctx["ref"][len(state.ids) - ctx["plen"]:]
        scores, tokens, parents = [], [], []
        parent = -1
        for i, tok in enumerate(fut[: depth + 1]):
            scores += [-0.1 * (i + 1), -9.0 - i]
            tokens += [tok, (tok + 1) % VOCAB]
            parents += [parent, parent]
            parent = len(tokens) - 2
        return Pool(torch.tensor(scores), torch.tensor(tokens), torch.tensor(parents))

    g.drafter.expansion = oracle
    for p, ref in zip(PROMPTS, references):
        ctx["plen"], ctx["ref"] = len(p), ref
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        assert all(a == 1.0 for a in r.acceptance_by_depth)
        assert r.mean_accepted > 3.0


SDSAT_ADAPTIVE = str(VOCAB - 1)  # random models: any id serves as the adaptive token (drafts are poor)


@pytest.mark.parametrize("opts", [dict(k=1), dict(k=3), dict(k=8), dict()], ids=["k1", "k3", "k8", "cost-sized"])
def test_sdsat_matches_generate(target, references, opts, flat_cost):
    g = selfspec.load(target, "sdsat", adaptive_ids=SDSAT_ADAPTIVE, self_test=False, **opts)
    g.drafter = InvariantChecker(g.drafter)
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    assert drafted(results) > 0, "nothing was drafted: this case tested ar only"


@pytest.mark.parametrize("j", range(K + 1))
def test_sdsat_drafts_right_for_exactly_j(target, references, j):
    """The draft step's adaptive-token outputs are replaced by drafts whose first j tokens are the
    reference continuation: each verify step accepts exactly j (fewer only where max_new_tokens
    cuts the chain), and the ids are still those of ``generate``."""
    g = selfspec.load(target, "sdsat", adaptive_ids=SDSAT_ADAPTIVE, k=K, self_test=False)
    d = g.drafter
    ctx: dict = {}

    def oracle_tree(state, logits):
        gen = state.ids[ctx["plen"]:]
        fut = ctx["ref"][len(gen):]
        drafts = fut[:j] + [(t + 1) % VOCAB for t in fut[j:K]]
        return DraftTree.chain([state.pending] + drafts)

    d._verify_tree = oracle_tree
    for p, ref in zip(PROMPTS, references):
        ctx["plen"], ctx["ref"] = len(p), ref
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        steps = [(c, dep) for c, dep in zip(r.committed_per_step[1:], r.drafted_per_step[1:]) if dep > 0]
        assert steps and all(c == min(j, dep) + 1 for c, dep in steps[:-1])  # the last may stop at EOS


@pytest.mark.parametrize("opts", [dict(k=1), dict(k=5), dict()], ids=["k1", "k5", "cost-sized"])
def test_space_matches_generate(target, references, opts, flat_cost):
    g = selfspec.load(target, "space", mask_id=VOCAB - 1, self_test=False, **opts)
    g.drafter = InvariantChecker(g.drafter)
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    assert drafted(results) > 0, "nothing was drafted: this case tested ar only"


@pytest.mark.parametrize("j", range(K + 1))
def test_space_drafts_right_for_exactly_j(target, references, j):
    """The mask group's candidates are replaced by candidates whose first j tokens are the
    reference continuation: each step verifying candidates accepts exactly j (fewer only where
    max_new_tokens cuts them), and the ids are still those of ``generate``."""
    g = selfspec.load(target, "space", mask_id=VOCAB - 1, k=K, self_test=False)
    d = g.drafter
    ctx: dict = {}
    observe = d.observe

    def oracle_observe(state, proposal, verdict, out):
        observe(state, proposal, verdict, out)
        fut = ctx["ref"][len(state.ids) - ctx["plen"]:]
        d.cands = fut[:j] + [(t + 1) % VOCAB for t in fut[j:K]]

    d.observe = oracle_observe
    for p, ref in zip(PROMPTS, references):
        ctx["plen"], ctx["ref"] = len(p), ref
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        steps = [(c, dep) for c, dep in zip(r.committed_per_step[1:], r.drafted_per_step[1:]) if dep > 0]
        assert steps and all(c == min(j, dep) + 1 for c, dep in steps[:-1])


@pytest.mark.parametrize("opts", [dict(m=1, auto_m=False), dict(m=4, auto_m=False), dict()], ids=["m1", "m4", "auto"])
def test_jacobi_matches_generate(target, references, opts, flat_cost):
    g = selfspec.load(target, "jacobi", self_test=False, **opts)
    g.drafter = InvariantChecker(g.drafter)
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    assert drafted(results) > 0, "nothing was drafted: this case tested ar only"


@pytest.mark.parametrize("j", range(K + 1))
def test_jacobi_guesses_right_for_exactly_j(target, references, j):
    """Guesses whose first j tokens are the reference continuation: every step accepts exactly j
    (fewer only where max_new_tokens cuts the chain), and the ids are still those of ``generate``."""
    g = selfspec.load(target, "jacobi", m=K, auto_m=False, self_test=False)
    d = g.drafter
    ctx: dict = {}
    propose = d.propose

    def oracle_propose(state, budget):
        fut = ctx["ref"][len(state.ids) - ctx["plen"]:]
        d.guesses = fut[:j] + [(t + 1) % VOCAB for t in fut[j:K]]
        return propose(state, budget)

    d.propose = oracle_propose
    for p, ref in zip(PROMPTS, references):
        ctx["plen"], ctx["ref"] = len(p), ref
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        steps = [(c, dep) for c, dep in zip(r.committed_per_step[1:], r.drafted_per_step[1:]) if dep > 0]
        assert steps and all(c == min(j, dep) + 1 for c, dep in steps[:-1])


@pytest.mark.parametrize("opts", [dict(tree_size=1), dict(tree_size=12), dict(tree_size=68), dict(),
                                  dict(tree_size=20, retrieval=False)],
                         ids=["n1", "n12", "n68", "auto", "no-retrieval"])
def test_msn_matches_generate(target, references, opts, flat_cost):
    g = selfspec.load(target, "msn", self_test=False, **opts)
    g.drafter = InvariantChecker(g.drafter)
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    assert drafted(results) > 0, "nothing was drafted: this case tested ar only"


@pytest.mark.parametrize("j", range(K + 1))
def test_msn_tree_right_for_exactly_j(target, references, j):
    """The top-1 slot of depths 1..j holds the reference continuation, every other slot a wrong
    token: each step accepts exactly j along the rank-0 path (fewer where max_new_tokens cuts it)."""
    g = selfspec.load(target, "msn", tree_size=68, retrieval=False, self_test=False)
    d = g.drafter
    ctx: dict = {}
    candidates = d.candidates

    def oracle_candidates(ids):
        cand = candidates(ids)
        fut = ctx["ref"][len(ids) - ctx["plen"]:]
        for depth, row in enumerate(cand):
            wrong = (fut[depth] + 1) % VOCAB if depth < len(fut) else 0
            row[:] = [wrong] * len(row)
            if depth < min(j, len(fut)):
                row[0] = fut[depth]
        return cand

    d.candidates = oracle_candidates
    for p, ref in zip(PROMPTS, references):
        ctx["plen"], ctx["ref"] = len(p), ref
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        steps = [(c, dep) for c, dep in zip(r.committed_per_step[1:], r.drafted_per_step[1:]) if dep > 0]
        assert steps and all(c == min(j, dep) + 1 for c, dep in steps[:-1])


# -- reduced draft vocabularies and int8 draft passes (issue 21): drafts change, output never does

def _reduced_cases():
    return {
        # the subset holds every reference token: self-spec with nothing skipped drafts right
        "self-spec-covering": ("self-spec", dict(skip_attention=(), skip_mlp=(), k=K, auto_k=False), "covering"),
        # the subset holds no reference token: every draft is wrong
        "self-spec-disjoint": ("self-spec", dict(skip_attention=(), skip_mlp=(), k=K, auto_k=False), "disjoint"),
        "self-spec-skip-int8": ("self-spec", dict(skip_attention=(1,), skip_mlp=(2,), k=K, auto_k=False,
                                                  draft_kernels="int8"), "half"),
        "self-spec-int8-full-vocab": ("self-spec", dict(skip_attention=(), skip_mlp=(), k=K, auto_k=False,
                                                        draft_kernels="int8", draft_vocab=0), None),
        "self-spec-skip-bf16": ("self-spec", dict(skip_attention=(1,), skip_mlp=(2,), k=K, auto_k=False,
                                                  draft_kernels="bf16"), "half"),
        "hass-reduced": ("hass", dict(head="random:1", total_tokens=10, top_k=3, depth=3, min_prob=0.0), "half"),
    }


@pytest.mark.parametrize("case", list(_reduced_cases()))
def test_reduced_draft_vocab_and_int8_drafts_match_generate(target, references, case):
    from selfspec.models.draft_vocab import always_ids

    from ..conftest import write_draft_ranking

    method, opts, subset = _reduced_cases()[case]
    if opts.get("draft_kernels") == "int8" and TEST_DEVICE != "cpu":
        pytest.skip("int8 drafts run on the CPU only")
    used = sorted({t for ref in references for t in ref})
    if subset == "covering":
        ranking = used
    elif subset == "disjoint":
        ranking = [t for t in range(VOCAB) if t not in used]
    else:
        ranking = list(range(0, VOCAB, 2))
    size = len(ranking) if subset else 0
    write_draft_ranking(target.name, VOCAB, ranking)
    if subset:
        opts = {**opts, "draft_vocab": size}
    g = selfspec.load(target, method, self_test=False, **opts)
    vocab = getattr(g.drafter.lm_head, "vocab", None)
    assert (vocab is None) == (subset is None)
    if opts.get("draft_kernels") in ("int8", "bf16") and target.backend != opts["draft_kernels"]:
        assert g.drafter.layers is not None and g.drafter.layers.extra_bytes > 0
    # on the compiled backend the whole-model int8 draft with its own LM head runs through its own compiled
    # one-token step; every other draft runs eagerly
    compiled_draft = target.backend == "compiled" and case == "self-spec-int8-full-vocab"
    draft_step = getattr(g.drafter, "draft_step", None)
    assert (draft_step is not None) == compiled_draft
    g.drafter = InvariantChecker(g.drafter)
    for p, ref in zip(PROMPTS, references):
        r = g.generate(p, max_new_tokens=MAX_NEW)
        assert r.token_ids == ref
        if subset == "disjoint" and not set(always_ids(target.model, target.tokenizer)) & set(ref):
            assert not set(vocab.ids.tolist()) & set(ref)
            assert r.acceptance_by_depth[0] == 0.0
        if subset == "covering" and target.backend == "stock":
            assert r.acceptance_by_depth == [1.0] * K
    if compiled_draft:
        assert set(draft_step.compile_s) == {(1, 512, False)}  # compiled at load, drafted through, one shape
