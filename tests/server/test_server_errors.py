"""Bad requests get a 4xx with an OpenAI-shaped body, never a 500 or a hung connection; the server keeps
serving others. Raw HTTP, so that nothing on the client side tidies the request up first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from server_checks import openai_error as _error

if TYPE_CHECKING:
    from servers import ServerProcess


@pytest.fixture(scope="module")
def http(api_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.url, headers=api_server.headers(), timeout=30) as client:
        yield client


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def test_malformed_json(http: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = http.post(
            path, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
        )
        error = _error(response, 400)
        assert error["type"] == "invalid_request_error"
        assert "JSON" in error["message"]


def test_unknown_model_is_404(http: httpx.Client) -> None:
    error = _error(http.post("/v1/completions", json=_completion(model="gpt-17")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    _error(http.post("/v1/chat/completions", json=_chat(model="gpt-17")), 404)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"priority": "urgent"}, "priority"),
        ({"timeout": -1}, "timeout"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": []}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, 2, 999999]}, "prompt"),
    ],
)
def test_bad_completion_fields(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    error = _error(http.post("/v1/completions", json=_completion(**fields)), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or (error["param"] or "").startswith(param), error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0",
        ),
        ({"tools": [{"type": "function", "function": {"name": "not a name!"}}]}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_chat_fields(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    error = _error(http.post("/v1/chat/completions", json=_chat(**fields)), 400)
    assert error["param"] == param or (error["param"] or "").startswith(param), error


def test_prompt_too_long(http: httpx.Client) -> None:
    error = _error(http.post("/v1/completions", json=_completion(prompt=[7] * 2100)), 400)
    assert error["code"] == "context_length_exceeded"
    assert "2048" in error["message"]
    error = _error(http.post("/v1/completions", json=_completion(prompt=[7] * 2000, max_tokens=100)), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    long_chat = _chat(messages=[{"role": "user", "content": "word " * 3000}])
    assert _error(http.post("/v1/chat/completions", json=long_chat), 400)["code"] == "context_length_exceeded"


def test_oversized_body_is_413(http: httpx.Client) -> None:
    # The server under test allows 64 KiB.
    big = json.dumps(_completion(prompt="x" * 100_000)).encode()
    error = _error(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413
    )
    assert error["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        # No Content-Length: the limit must hold while the body streams in.
        yield big[:50_000]
        yield big[50_000:]

    response = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    _error(response, 413)


def test_request_timeout_is_408(http: httpx.Client) -> None:
    # As long as the context allows, with a deadline it cannot meet.
    body = _completion(max_tokens=2040, ignore_eos=True, timeout=0.05)
    error = _error(http.post("/v1/completions", json=body), 408)
    assert error["code"] == "timeout"
    # Streamed: the error comes as the last event once tokens have gone out, else as the status.
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code == 200:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "timeout"
            assert any(json.loads(event[len("data: ") :])["choices"][0]["text"] for event in events[:-2])
        else:
            response.read()
            assert _error(response, 408)["code"] == "timeout"


def test_auth(api_server: ServerProcess) -> None:
    url = api_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {api_server.api_key}"}):
        error = _error(httpx.post(f"{url}/v1/completions", json=_completion(), headers=headers), 401)
        assert error["type"] == "authentication_error"
        _error(httpx.get(f"{url}/v1/models", headers=headers), 401)
    # Probes and scrapes need no key.
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    assert "kvfleet:num_requests_waiting" in httpx.get(f"{url}/metrics").text


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _error(http.get("/v1/nothing"), 404)
    _error(http.get("/v1/completions"), 405)


def test_server_still_serves_after_the_errors(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=_completion())
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
