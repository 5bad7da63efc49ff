"""The OpenAI routes with the official client: chat and completions, streamed and not, greedy
text equal to ``selfspec generate``, stop strings, seeds, models, the ``selfspec`` extension."""

from __future__ import annotations

import json

import openai
import pytest

from selfspec.cli import main

from .conftest import KEY, METHOD_FLAGS, client, http

PROMPT = "w5 w6 w7 w5 w6 w7 w5 w6"  # repeats: prompt lookup finds drafts


def cli_generate(capsys, chat_dir, prompt: str, n: int, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["generate", "--model", str(chat_dir), *METHOD_FLAGS, "--kernels", "stock", "--json",
                 "--max-new-tokens", str(n), *extra, prompt]) == 0
    return json.loads(capsys.readouterr().out)


def test_chat_greedy_equals_selfspec_generate_streamed_and_not(server, chat_dir, capsys):
    c = client(server)
    ref = cli_generate(capsys, chat_dir, PROMPT, 24)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert choice.finish_reason == ("length" if ref["new_tokens"] == 24 else "stop")
    assert r.usage.completion_tokens == ref["new_tokens"] and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = choice.model_extra["selfspec"]
    assert ext["method"] == "pld" and ext["lossless"] is True and ext["steps"] == ref["steps"]
    assert ext["tau"] == pytest.approx(ref["mean_accepted"], abs=1e-3)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")

    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref["text"]
    last = [ch for ch in chunks if ch.choices][-1]
    assert last.choices[0].finish_reason == choice.finish_reason
    assert last.choices[0].model_extra["selfspec"]["steps"] == ref["steps"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref["new_tokens"]
    assert all(ch.choices[0].finish_reason is None for ch in chunks if ch.choices and ch is not last)


def test_completions_greedy_equals_generate_no_chat_streamed_and_not(server, chat_dir, capsys):
    c = client(server)
    ref = cli_generate(capsys, chat_dir, PROMPT, 20, "--no-chat")
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref["text"] and r.object == "text_completion"
    assert r.usage.completion_tokens == ref["new_tokens"]
    assert r.choices[0].model_extra["selfspec"]["lossless"] is True
    pieces = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == ref["text"]
    assert len(pieces) > 2 and pieces[-1].choices[0].finish_reason in ("stop", "length")


def test_the_model_card_names_the_selfspec_version(server):
    import selfspec

    r = http().get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    card = r.json()["data"][0]
    assert r.status_code == 200 and card["selfspec"]["version"] == selfspec.__version__ and card["selfspec"]["method"]


def test_raw_sse_framing(server):
    """`data: {json}` events, each a blank-line-terminated event, then `data: [DONE]`."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with http().stream("POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and "\n" not in e
        json.loads(e[len("data: "):])


def test_stop_strings_end_the_text_before_them(server, chat_dir, capsys):
    c = client(server)
    full = cli_generate(capsys, chat_dir, PROMPT, 16, "--no-chat")["text"].split()
    stop = " " + full[3]
    want = cli_generate(capsys, chat_dir, PROMPT, 16, "--no-chat", "--stop", stop)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == want["text"] and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(p.choices[0].text for p in c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == want["text"]


def test_seeded_sampling_reproduces_and_top_k_extension(server):
    c = client(server)
    kw = dict(model="tiny", prompt="w9 w8", max_tokens=16, temperature=0.9, top_p=0.95)
    a = c.completions.create(seed=3, **kw).choices[0].text
    assert c.completions.create(seed=3, **kw).choices[0].text == a
    assert c.completions.create(seed=3, extra_body={"top_k": 5}, **kw).choices[0].text
    texts = {c.completions.create(seed=s, **kw).choices[0].text for s in range(4, 8)}
    assert len(texts | {a}) > 1


def test_max_completion_tokens_default_and_token_id_prompt(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "w3"},
                                                          {"role": "user", "content": "w4 w5"}],
                                  max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = c.completions.create(model="tiny", prompt=[5, 6, 7], temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 32  # the server's --max-tokens
    # content parts, model omitted (the served one)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w4 w5"}]}], "max_tokens": 3}
    ok = http().post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["model"] == "tiny"


def test_models_and_unknown_model(server, chat_dir):
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["selfspec"]["method"] == "pld"
    assert c.models.retrieve("tiny").id == "tiny"
    # the path it was loaded from is an alias
    r = c.completions.create(model=str(chat_dir), prompt="w5", max_tokens=2, temperature=0)
    assert r.model == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "w5"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_temperatures_too_small_to_divide_by_are_greedy(server):
    """As in vLLM, temperature < 1e-5 decodes greedily (1 / 1e-300 would overflow the logits)."""
    c = client(server)
    greedy = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    for sampling in ("coupled", "rejection"):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1e-300,
                                 extra_body={"sampling": sampling})
        assert r.choices[0].text == greedy
