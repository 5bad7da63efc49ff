"""Training conversations: truncated ShareGPT parsing, JSONL, prompt exclusion, loss masks, stdlib code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.train.conversations import (
    Conversation,
    build_examples,
    code_conversations,
    exclude_prompts,
    load_jsonl_conversations,
    load_sharegpt,
    tokenize_conversation,
)

from ..conftest import make_tokenizer

SMOLLM2 = Path.home() / ".cache" / "selfspec" / "models" / "smollm2-135m-instruct"


def _turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


def test_sharegpt_truncated_file_and_roles(tmp_path):
    records = [
        {"id": "a", "conversations": [_turn("human", " Hi "), _turn("gpt", "Hello!")]},
        {"id": "b", "conversations": [_turn("system", "Be nice."), _turn("gpt", "Leading answer, dropped"),
                                      _turn("human", "Q1"), _turn("gpt", "A1"), _turn("human", "Q2 unanswered")]},
        {"id": "c", "conversations": [_turn("human", "only a question")]},
        {"id": "d", "conversations": [_turn("human", "Q"), _turn("gpt", "  ")]},
        {"id": "e", "conversations": [_turn("human", "x"), _turn("gpt", "y")]},
    ]
    text = "[\n" + ",\n".join(json.dumps(r) for r in records)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: len(text) - 7])  # cut inside the last record, as in the real file
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    convs = {c.id: c for c in load_sharegpt(None, path=path)}
    assert set(convs) == {"a", "b"}  # c: no answer; d: empty answer; e: cut off
    assert convs["a"].messages == (("user", "Hi"), ("assistant", "Hello!"))
    assert convs["b"].messages == (("user", "Q1"), ("assistant", "A1"))
    path.write_text(text + "\n]")  # a complete file parses too; the shuffle is seeded
    assert [c.id for c in load_sharegpt(2, seed=1, path=path)] == [c.id for c in load_sharegpt(2, seed=1, path=path)]
    assert len(load_sharegpt(None, path=path)) == 3


def test_jsonl_conversations_and_bad_line(tmp_path):
    good = {"id": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"messages": good["messages"]}) + "\n")
    convs = load_jsonl_conversations(path)
    assert convs[0] == Conversation("x", (("user", "hi"), ("assistant", "yo")))
    assert convs[1].id == "c-3"
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(SelfspecError, match=r"c\.jsonl: line 2"):
        load_jsonl_conversations(path)
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}]}) + "\n")
    with pytest.raises(SelfspecError, match="line 1: message 1 has role 'system'; each line needs 'messages'"):
        load_jsonl_conversations(path)  # says what is wrong with the line, not only what a line needs
    for bad, says in [({"id": 1}, "no 'messages' list"), ({"messages": []}, "'messages' is not a non-empty list"),
                      ({"messages": [{"role": "user", "content": 3}]}, "message 1 has no string 'content'")]:
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(SelfspecError, match=f"line 2: {says}"):
            load_jsonl_conversations(path)


def test_exclude_prompts_both_directions():
    prompt = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    def conv(i, user):
        return Conversation(str(i), (("user", user), ("assistant", "sure")))
    convs = [
        conv(0, "Please:  COMPOSE an engaging travel blog post about a recent\ntrip to Hawaii, highlighting cultural "
                "experiences. Thanks!"),  # contains the prompt (case and whitespace differ)
        conv(1, "an engaging travel blog post about a recent trip to Hawaii"),  # inside the prompt, >= 40 chars
        conv(2, "trip to Hawaii"),  # inside the prompt but short: kept
        conv(3, "Write a poem about the sea."),
    ]
    assert [c.id for c in exclude_prompts(convs, [prompt, "def f(x):\n    return x"])] == ["2", "3"]
    assert exclude_prompts(convs, []) == convs


def _masked(ex) -> list[int]:
    return ex.input_ids[ex.loss_mask].tolist()


@pytest.mark.real_model
def test_loss_mask_with_real_chat_template():
    if not SMOLLM2.is_dir():
        pytest.skip(f"{SMOLLM2} is not there")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    answers = ["Hello!  How are you?\n\nI am fine.", "Paris, of course; `code` and 😀 too."]
    conv = Conversation("t", (("user", "Say Hello!  please"), ("assistant", answers[0]),
                              ("user", "Capital of France?"), ("assistant", answers[1])))
    ex = tokenize_conversation(tok, conv, max_len=4096)
    assert ex.input_ids.dtype == torch.long and ex.loss_mask.dtype == torch.bool
    assert ex.input_ids.shape == ex.loss_mask.shape and ex.input_ids.dim() == 1
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(
        [{"role": r, "content": t} for r, t in conv.messages], tokenize=False)
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    # the masked tokens, run by run, decode to exactly the answers, each followed by <|im_end|>
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    assert [tok.decode(r) for r in runs] == [a + "<|im_end|>" for a in answers]
    # nothing from the system prompt, the user turns or the role headers is masked
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "Say Hello!  please" in unmasked and "Capital of France?" in unmasked and "SmolLM" in unmasked
    assert sum(mask) == len(tok(answers[0], add_special_tokens=False)["input_ids"]) + len(
        tok(answers[1], add_special_tokens=False)["input_ids"]) + 2

    # truncation: cut inside the first answer, and before any answer (None)
    first = mask.index(True)
    short = tokenize_conversation(tok, conv, max_len=first + 3)
    assert len(short.input_ids) == first + 3 and short.loss_mask.sum().item() == 3
    assert tokenize_conversation(tok, conv, max_len=first) is None
    assert [e.id for e in build_examples(tok, [conv, conv], max_len=first + 1, progress=False)] == ["t", "t"]


def test_loss_mask_without_chat_template():
    tok = make_tokenizer()  # word-level, no chat template: plain "User: ...\nAssistant: ...\n"
    assert not getattr(tok, "chat_template", None)
    conv = Conversation("p", (("user", "w1 w2"), ("assistant", "w3 w4 w5"), ("user", "w3"), ("assistant", "w6")))
    ex = tokenize_conversation(tok, conv, max_len=100)
    assert tok.decode(ex.input_ids) == tok.decode(tok("User: w1 w2\nAssistant: w3 w4 w5\nUser: w3\nAssistant: w6\n",
                                                       add_special_tokens=False)["input_ids"])
    assert _masked(ex) == tok("w3 w4 w5 w6", add_special_tokens=False)["input_ids"]
    assert tokenize_conversation(tok, conv, max_len=6).loss_mask.tolist() == [False] * 4 + [True] * 2
    assert tokenize_conversation(tok, conv, max_len=3) is None
    assert tokenize_conversation(tok, Conversation("q", (("user", "w1"),)), max_len=100) is None


def test_code_conversations():
    a = code_conversations(5, seed=3, max_chars=500)
    assert len(a) == 5 and a == code_conversations(5, seed=3, max_chars=500)
    assert a != code_conversations(5, seed=4, max_chars=500)
    for c in a:
        (role_u, user), (role_a, src) = c.messages
        name = c.id.removeprefix("stdlib:")
        assert (role_u, role_a) == ("user", "assistant") and user == f"Write the Python module `{name}`."
        assert 0 < len(src) <= 500 and src.strip()
        assert not {"test", "tests", "idlelib", "lib2to3"} & set(name.split("."))
