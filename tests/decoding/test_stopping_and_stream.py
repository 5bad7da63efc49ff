"""EOS inside an accepted block, stop strings, max_new_tokens, streaming and seeded sampling."""

import torch

import selfspec
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.models.loading import load_model

from ..conftest import VOCAB, prompt_ids
from .test_greedy_equivalence import hf_greedy


def test_eos_inside_accepted_block_truncates(tiny_dir):
    target = load_model(str(tiny_dir))
    p = prompt_ids(11, 6)
    free = hf_greedy(target.model, p, 20)
    eos = free[6]  # make the 7th generated token an end-of-sequence token
    target.model.generation_config.eos_token_id = eos
    ref = hf_greedy(target.model, p, 20)
    assert ref == free[: free.index(eos) + 1]
    g = selfspec.load(target, "ar", self_test=False)
    g.drafter = ScriptedDrafter(free, 5, 5, VOCAB)  # the whole block incl. EOS is accepted at once
    r = g.generate(p, max_new_tokens=20)
    assert r.token_ids == ref and r.finish_reason == "stop"  # one vocabulary with the CLI and the server
    assert g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids == free


def test_stop_string_and_streaming(tiny_dir):
    g = selfspec.load(model=str(tiny_dir), method="pld", k=4, auto_k=False)
    full = g.generate("w3 w4 w5", max_new_tokens=16, chat=False, ignore_eos=True)
    words = g.tokenizer.decode(full.token_ids).split()
    stop = words[4]
    r = g.generate("w3 w4 w5", max_new_tokens=16, chat=False, stop=[stop], ignore_eos=True)
    assert r.finish_reason == "stop"
    assert r.token_ids == full.token_ids[: len(r.token_ids)]
    assert stop not in g.tokenizer.decode(r.token_ids[:-1]) and stop in g.tokenizer.decode(r.token_ids)
    assert stop not in r.text  # the text ends before the stop string (OpenAI semantics) ...
    kept = g.generate("w3 w4 w5", max_new_tokens=16, chat=False, stop=[stop], ignore_eos=True, include_stop=True)
    assert kept.token_ids == r.token_ids and kept.text.endswith(stop)  # ... unless include_stop
    assert kept.text.startswith(r.text)
    streamed = "".join(g.stream("w3 w4 w5", max_new_tokens=16, chat=False, stop=[stop], ignore_eos=True))
    assert streamed == r.text
    pieces = list(g.stream("w3 w4 w5", max_new_tokens=16, chat=False, ignore_eos=True))
    assert "".join(pieces) == g.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert g.last_result.token_ids == full.token_ids


def test_a_plain_string_stop_is_one_stop_string(tiny_dir):
    """``stop="w12"`` is the stop string "w12", as ``stop=["w12"]`` and the OpenAI API, not the
    stop strings "w", "1" and "2" (which ended every text at its first character)."""
    from selfspec.config import GenerationConfig

    assert GenerationConfig(stop="rw").stop == ("rw",) and GenerationConfig(stop=["a", "b"]).stop == ("a", "b")
    g = selfspec.load(model=str(tiny_dir), method="pld", k=4, auto_k=False)
    full = g.generate("w3 w4 w5", max_new_tokens=16, chat=False, ignore_eos=True)
    stop = g.tokenizer.decode(full.token_ids).split()[4]
    as_list = g.generate("w3 w4 w5", max_new_tokens=16, chat=False, stop=[stop], ignore_eos=True)
    as_str = g.generate("w3 w4 w5", max_new_tokens=16, chat=False, stop=stop, ignore_eos=True)
    assert as_str.text == as_list.text != "" and as_str.token_ids == as_list.token_ids
    assert "".join(g.stream("w3 w4 w5", max_new_tokens=16, chat=False, stop=stop, ignore_eos=True)) == as_list.text


def test_seeded_sampling_reproduces_and_depends_on_seed(tiny_dir, tiny_draft_dir):
    for method, opts in [("ar", {}), ("pld", {"k": 3, "auto_k": False}),
                         ("draft-model", {"draft_model": str(tiny_draft_dir), "k": 3, "auto_k": False})]:
        g = selfspec.load(model=str(tiny_dir), method=method, **opts)
        kw = dict(max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=40, chat=False, ignore_eos=True)
        a = g.generate("w1 w2 w3", seed=5, **kw).token_ids
        b = g.generate("w1 w2 w3", seed=5, **kw).token_ids
        c = g.generate("w1 w2 w3", seed=6, **kw).token_ids
        assert a == b and a != c, method


def test_sampling_does_not_touch_global_rng(tiny_dir):
    g = selfspec.load(model=str(tiny_dir), method="pld", k=3, auto_k=False)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    g.generate("w1 w2", max_new_tokens=10, temperature=1.0, chat=False)
    assert torch.equal(torch.rand(1), before)


class CountingTokenizer:
    """A tokenizer whose ``decode`` counts the ids it is given (the work of detokenizing)."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_and_stop_check_are_linear_and_exact():
    """Streaming n tokens one at a time decodes O(n) ids in all (was O(n^2)), the pieces join to
    the whole text, and the stop check finds the token that completes a stop string."""
    from selfspec.decoding.text import IncrementalDetokenizer, make_stop_check

    from ..conftest import make_tokenizer

    base = make_tokenizer()
    ids = [5 + (i * 7) % (VOCAB - 10) for i in range(600)]
    tok = CountingTokenizer(base)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == base.decode(ids, skip_special_tokens=True)
    assert tok.decoded < 30 * len(ids)  # a window per push, not the whole text (600 x 300 = 180,000)
    full = base.decode(ids, skip_special_tokens=False)
    stop = base.decode(ids[400:402], skip_special_tokens=False)
    want = next(t for t in range(1, len(ids) + 1) if stop in base.decode(ids[:t], skip_special_tokens=False))
    assert stop in full
    tok2 = CountingTokenizer(base)
    check = make_stop_check(tok2, [stop])
    found = next((r for n in range(1, len(ids) + 1) if (r := check(ids[:n])) is not None), None)
    assert found == want
    assert tok2.decoded < 60 * len(ids) * max(1, len(stop) // 4)
