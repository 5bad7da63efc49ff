"""Every bad request gets an OpenAI-style error with a 4xx status, never a 500 or a traceback;
the API key is needed on every route but /health."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import KEY, client, http, metric

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "w5 w6"}]


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


CASES = [  # (route, body, status, param)
    # wrong types
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [["user", "hi"]]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": 1, "content": "w5"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 2.5}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": [1]}, 400, "top_p"),
    (CHAT, {"messages": MSG, "seed": 1.5}, 400, "seed"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSG, "stop": 5}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ["a", 1]}, 400, "stop"),
    (CHAT, {"messages": MSG, "model": 7}, 400, "model"),
    (CHAT, {"messages": MSG, "n": "1"}, 400, "n"),
    (COMP, {"prompt": 5}, 400, "prompt"),
    (COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMP, {"prompt": {"text": "w5"}}, 400, "prompt"),
    # values
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 100000}, 400, "max_tokens"),  # beyond the 512-token context
    (COMP, {"prompt": "w5 " * 600, "max_tokens": 1}, 400, "prompt"),  # the prompt alone fills the context
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_k": -5}, 400, "top_k"),
    (CHAT, {"messages": MSG, "seed": -1}, 400, "seed"),
    (CHAT, {"messages": MSG, "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "w5"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "tool", "content": "w5"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSG, "n": 2}, 400, "n"),
    (COMP, {"prompt": "   "}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": ["w5", "w6"]}, 400, "prompt"),
    (COMP, {"prompt": [5, 100000]}, 400, "prompt"),  # a token id outside the vocabulary
    (COMP, {"prompt": "w5", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "logprobs": True}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": MSG, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (COMP, {"prompt": "w5", "echo": True}, 400, "echo"),
    (CHAT, {"messages": MSG, "sampling": "nucleus"}, 400, "sampling"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("route,body,status,param", CASES, ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_requests_get_openai_errors(server, route, body, status, param):
    for stream in (False, True):
        if "stream" in body or "stream_options" in body:
            b = body
        else:
            b = {**body, "stream": stream}
        check_error(http().post(server.url + route, json=b, headers=AUTH, timeout=30), status, param)


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "w5"}], "temperature": NaN}',
                                 b'{"messages": [{"role": "user", "content": "w5"}], "top_p": Infinity}',
                                 b'{"messages": [{"role": "user", "content": "w5"}], "temperature": 1e999}',
                                 b'{"messages": [{"role": "user", "content": "w5 \\ud800"}]}',
                                 b'{"messages": [{"role": "user", "content": "w5"}], "stop": "\\udfff"}',
                                 b'{"messages": [', b"not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe{}",
                                 b"[" * 100000])
def test_malformed_json_nan_and_infinity(server, raw):
    r = http().post(server.url + CHAT, content=raw, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    err = check_error(r, 400)
    assert err["type"] == "invalid_request_error"


def test_oversized_body(server):
    big = {"messages": [{"role": "user", "content": "w5 " * 400_000}]}
    check_error(http().post(server.url + CHAT, json=big, headers=AUTH, timeout=30), 413)

    def chunks():  # no Content-Length: counted while read
        for _ in range(40):
            yield b" " * 65536

    check_error(http().post(server.url + CHAT, content=chunks(), headers=AUTH, timeout=30), 413)


def test_unknown_routes_and_methods(server):
    check_error(http().get(server.url + "/v1/nope", headers=AUTH), 404)
    check_error(http().get(server.url + CHAT, headers=AUTH), 405)


def test_openai_client_raises_its_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSG, n=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=MSG, max_tokens=100000)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=MSG, temperature=-1, stream=True)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="w5", top_p=2)


def test_api_key_on_every_route_but_health(server):
    before = metric(server, "requests_total", status="401")
    for route, body in ((CHAT, {"messages": MSG}), (COMP, {"prompt": "w5", "stream": True})):
        check_error(http().post(server.url + route, json=body), 401)  # no key
    for key in ("wrong-key", KEY + "x", KEY[:-1]):
        c = client(server, key=key)
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model="tiny", prompt="w5", max_tokens=2, stream=True)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    for path in ("/metrics", "/v1/models", "/v1/nope"):
        check_error(http().get(server.url + path), 401)
        check_error(http().get(server.url + path, headers={"Authorization": "Bearer nope"}), 401)
    check_error(http().get(server.url + "/v1/models", headers={"Authorization": KEY}), 401)  # no Bearer scheme
    assert http().get(server.url + "/health").json() == {"status": "ok", "active_slots": 0, "max_batch": 1,
                                                         "waiting": 0}
    assert http().get(server.url + "/metrics", headers=AUTH).status_code == 200
    assert metric(server, "requests_total", status="401") == before + 8
    assert client(server).models.list().data[0].id == "tiny"


@pytest.mark.parametrize("prompt", [[5, 100000], [5, -1]])
def test_a_token_id_outside_the_vocabulary_has_an_error_code(server, prompt):
    """Its error code was null."""
    err = check_error(http().post(server.url + COMP, json={"prompt": prompt}, headers=AUTH, timeout=30), 400,
                      "prompt")
    assert err["code"] == "invalid_prompt" and "vocabulary" in err["message"]
