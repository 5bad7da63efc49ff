"""The request models (pydantic) without a server: what a valid body becomes, and that every
problem names its field and code as OpenAI does (the server-side cases: test_validation.py)."""

from __future__ import annotations

import pytest

from selfspec.serve.requests import ApiError, CompletionBody, parse_request

MSG = [{"role": "user", "content": "w5"}]


def test_a_valid_body_is_normalised():
    r = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}, *MSG],
                       "max_tokens": 64.0, "max_completion_tokens": 9, "temperature": 1e-9, "top_k": -1,
                       "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                       "user": "someone", "metadata": {"k": "v"}}, chat=True)
    assert r.prompt == [{"role": "system", "content": "ab"}, {"role": "user", "content": "w5"}]
    assert r.max_tokens == 9 and r.temperature == 0.0 and r.top_k == 0 and r.stop == ("x",)
    assert r.stream and r.include_usage and r.sampling == "coupled" and r.top_p == 1.0
    assert parse_request({"prompt": ["w5 w6"]}, chat=False).prompt == "w5 w6"  # a batch of one
    assert parse_request({"prompt": [3, 4]}, chat=False).prompt == [3, 4]
    d = parse_request({"prompt": "w5"}, chat=False)
    assert (d.temperature, d.max_tokens, d.stream, d.seed, d.ignore_eos) == (1.0, None, False, None, False)


@pytest.mark.parametrize("body,param,code", [
    ({"messages": MSG, "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": MSG, "temperature": float("nan")}, "temperature", "invalid_value"),
    ({"messages": MSG, "stream_options": [1], "stream": True}, "stream_options", "invalid_type"),
    ({"messages": MSG, "stream_options": {"include_usage": "y"}, "stream": True}, "stream_options.include_usage",
     "invalid_type"),
    ({"messages": MSG, "logit_bias": {"5": 1}}, "logit_bias", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "invalid_value"),
    ({"messages": [MSG[0], {"role": "bot", "content": "x"}]}, "messages[1].role", "invalid_value"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required"),
    ({}, "messages", "missing_required"),
])
def test_each_problem_names_its_field_and_code(body, param, code):
    with pytest.raises(ApiError) as e:
        parse_request(body, chat=True)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message
    assert f"'{param}'" in e.value.message or f"{param} " in e.value.message or param == "messages[0].content"


def test_the_schema_is_a_pydantic_model():
    schema = CompletionBody.model_json_schema()
    assert {"messages", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream", "sampling"} <= set(
        schema["properties"])
