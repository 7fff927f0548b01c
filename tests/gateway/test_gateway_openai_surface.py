"""The whole OpenAI surface of a replica through the real gateway, with the official openai SDK: the Responses
API, embeddings, vLLM's pooling, score and rerank routed with the completions' flow control, and every error
the gateway answers itself in OpenAI's shape; and Anthropic's Messages API with the official anthropic client,
its errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from gateway_harness import WAIT_S, FakeReplica, model, queued, replicas, running_gateway, wait_until
from kvfleet.contract.errors import MESSAGES_PATH, BadRequestError
from kvfleet.gateway.discovery import ClientKey
from kvfleet.gateway.requests import CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, parse_request

SCORE_PATHS = ("/v1/score", "/score")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
# Milliseconds a request may wait in the queue: past while a replica is held busy.
DEADLINE = {"x-kvfleet-deadline-ms": "50"}


def client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


async def post(url: str, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}{path}", json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.json()


def answered_by(replicas_: list[FakeReplica], name: str, field: str, value: Any) -> dict[str, Any]:
    """The body the replica named `name` received with `field` equal to `value` (it must have)."""
    replica = next(replica for replica in replicas_ if replica.name == name)
    return next(body for body in replica.received if body.get(field) == value)


def test_every_endpoint_of_a_replica_is_routed_renamed_and_retried_before_its_first_byte() -> None:
    """Round robin over a replica that answers 503 and two that serve: every request is answered by a serving
    one, which got the client's body with the model as the replicas serve it."""

    async def scenario() -> None:
        async with replicas(FakeReplica("busy", status=503), FakeReplica("a"), FakeReplica("bb")) as fleet:
            busy = fleet[0]
            config = model("team/llama", *fleet, served_name="llama", policy="round-robin")
            async with running_gateway({"team/llama": config}) as (_, _, url):
                sdk = client(url)
                plain = await sdk.responses.create(model="team/llama", input="plain", max_output_tokens=4)
                sent = answered_by(fleet, plain.output_text, "input", "plain")
                assert sent == {"model": "llama", "input": "plain", "max_output_tokens": 4}

                stream = await sdk.responses.create(model="team/llama", input="streamed", stream=True)
                events = [event async for event in stream]
                assert [event.type for event in events][-1] == "response.completed"
                text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
                assert answered_by(fleet, text, "input", "streamed")["stream"] is True

                inputs = ["one", "two"]
                embedded = await sdk.embeddings.create(
                    model="team/llama", input=inputs, encoding_format="float"
                )
                replica = next(
                    r for r in fleet[1:] if any(body.get("input") == inputs for body in r.received)
                )
                assert [item.embedding for item in embedded.data] == [
                    [float(ord(c)) for c in replica.name]
                ] * 2
                status, pooled = await post(url, "/pooling", {"model": "team/llama", "input": "pooled"})
                name = "".join(chr(int(code)) for code in pooled["data"][0]["embedding"])
                assert status == 200 and answered_by(fleet, name, "input", "pooled") == {
                    "model": "llama",
                    "input": "pooled",
                }

                for path in SCORE_PATHS:
                    for first, second in (("text_1", "text_2"), ("queries", "documents")):
                        body = {"model": "team/llama", first: path, second: ["x", "y"]}
                        status, scored = await post(url, path, body)
                        assert status == 200 and len(scored["data"]) == 2
                        name = "a" if scored["data"][0]["score"] == 1 else "bb"
                        assert answered_by(fleet, name, first, path) == {**body, "model": "llama"}
                for path in RERANK_PATHS:
                    body = {"model": "team/llama", "query": path, "documents": ["x"]}
                    status, reranked = await post(url, path, body)
                    assert status == 200
                    name = "a" if reranked["results"][0]["relevance_score"] == 1 else "bb"
                    assert answered_by(fleet, name, "query", path) == {**body, "model": "llama"}

        requests = 4 + 2 * len(SCORE_PATHS) + len(RERANK_PATHS)
        assert busy.received and sum(len(replica.received) for replica in fleet[1:]) == requests

    asyncio.run(scenario())


def test_the_other_endpoints_wait_in_the_queue_by_tier_behind_the_key_and_within_their_deadline() -> None:
    key = ClientKey(hashlib.sha256(b"tenant-key").digest())

    async def scenario() -> None:
        async with replicas(FakeReplica("r", gated=True)) as (replica,):
            config = model("m", replica, max_in_flight=1, client_key=key)
            async with running_gateway({"m": config}) as (gateway, _, url):
                auth = {"Authorization": "Bearer tenant-key"}
                with pytest.raises(openai.AuthenticationError):
                    await client(url, api_key="wrong").embeddings.create(model="m", input="x")
                assert replica.received == []

                requests = [
                    ("/v1/embeddings", {"input": "busy", "priority": "critical"}),
                    ("/v1/responses", {"input": "batch", "priority": "batch"}),
                    ("/rerank", {"query": "high", "documents": ["d"], "priority": "high"}),
                    ("/v1/score", {"text_1": "critical", "text_2": "t", "priority": "critical"}),
                ]
                tasks = []
                for path, body in requests:
                    tasks.append(asyncio.create_task(post(url, path, {"model": "m", **body}, **auth)))
                    await wait_until(lambda: len(replica.received) + queued(gateway, "m") == len(tasks))
                late = await post(url, "/v1/embeddings", {"model": "m", "input": "late"}, **auth, **DEADLINE)
                assert (late[0], late[1]["error"]["code"]) == (429, "deadline_exceeded")
                for _ in requests:
                    replica.permits.release()
                answers = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
                assert [status for status, _ in answers] == [200] * len(requests)
                order = [
                    body.get("input", body.get("query", body.get("text_1"))) for body in replica.received
                ]
                assert order == ["busy", "critical", "high", "batch"]

    asyncio.run(scenario())


def test_the_gateways_own_errors_are_openai_errors_the_sdk_raises_with_their_message() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}) as (_, _, url),
        ):
            sdk = client(url)
            with pytest.raises(openai.NotFoundError) as raised:
                await sdk.get("/nothing/here", cast_to=object)
            assert "/v1/nothing/here" in raised.value.message
            with pytest.raises(openai.NotFoundError) as raised:
                await sdk.embeddings.create(model="other", input="x")
            assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]

            with pytest.raises(openai.BadRequestError) as refused:
                await sdk.responses.create(model="m", input="more", previous_response_id="resp_r")
            assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
            assert "stored responses" in refused.value.message
            for call in (sdk.responses.retrieve, sdk.responses.delete):
                with pytest.raises(openai.BadRequestError) as refused:
                    await call("resp_r")
                assert "stored responses" in refused.value.message
            assert replica.received == []

            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/v1/embeddings") as answer:
                    assert answer.status == 405 and answer.headers["Allow"] == "POST"
                    error = (await answer.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"} and "POST" in error["message"]
                async with session.get(f"{url}/version") as answer:
                    assert await answer.json() == {"version": importlib.metadata.version("kvfleet")}
                async with session.get(f"{url}/health") as health:
                    for method in ("GET", "POST"):
                        async with session.request(method, f"{url}/ping") as ping:
                            assert (ping.status, await ping.json()) == (health.status, await health.json())

    asyncio.run(scenario())


def test_a_request_aiohttp_cannot_parse_is_an_openai_error() -> None:
    async def scenario() -> None:
        async with running_gateway({}) as (_, _, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
            head, _, body = (await asyncio.wait_for(reader.read(), WAIT_S)).partition(b"\r\n\r\n")
            writer.close()
            assert head.split(b" ")[1] == b"400" and b"application/json" in head
            assert json.loads(body)["error"]["type"] == "invalid_request_error"

    asyncio.run(scenario())


def test_a_conversation_is_routed_on_the_same_text_through_chat_and_the_responses_api() -> None:
    """The replica runs a response as the chat completion of its instructions and input: a prefix-aware policy
    sends both to the replica caching the conversation."""
    turns = [("user", "hi"), ("assistant", "hello"), ("user", "and then?")]
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}]
        + [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in turns],
    }
    items = [{"type": "message", "role": role, "content": text} for role, text in turns]
    response = {"model": "m", "instructions": "be brief", "input": items}
    as_chat, as_response = (
        parse_request(path, json.dumps(body).encode(), {})
        for path, body in ((CHAT_PATH, chat), (RESPONSES_PATH, response))
    )
    assert as_response.prompt_text == as_chat.prompt_text


def test_conversations_to_embed_are_routed_on_their_first_as_the_chat_is() -> None:
    """vLLM's conversation embeddings, as `messages` or an input of messages, one or a batch, on
    /v1/embeddings and /pooling: routed on the text a chat of the same messages is."""
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = parse_request(CHAT_PATH, json.dumps({"model": "m", "messages": conversation}).encode(), {})
    for path in ("/v1/embeddings", "/pooling"):
        for fields in ({"messages": conversation}, {"input": conversation}, {"input": [conversation, [{}]]}):
            routed = parse_request(path, json.dumps({"model": "m", **fields}).encode(), {})
            assert routed.prompt_text == chat.prompt_text


def test_a_completion_of_prompt_embeddings_alone_is_routed_on_them() -> None:
    """vLLM's prompt_embeds without a prompt: the same embeddings go the same way, others another."""
    routed = [
        parse_request(COMPLETIONS_PATH, json.dumps({"model": "m", **fields}).encode(), {}).prompt_text
        for fields in ({"prompt_embeds": "AAAA"}, {"prompt": "", "prompt_embeds": ["AAAA"]}, {"prompt": "x"})
    ]
    assert routed == ["AAAA", "AAAA", "x"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {}, "input"),
        (COMPLETIONS_PATH, {}, "prompt"),
        ("/v1/embeddings", {"input": []}, "input"),
        (RESPONSES_PATH, {"input": []}, "input"),
        (RESPONSES_PATH, {"input": ["text"]}, "input[0]"),
        ("/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/score", {"queries": 1, "documents": "x"}, "queries"),
        ("/score", {"queries": "q", "text_2": "x"}, "queries"),
        ("/v1/rerank", {"documents": ["x"]}, "query"),
    ],
)
def test_a_body_routing_cannot_read_is_refused_naming_its_field(
    path: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse_request(path, json.dumps({"model": "m", **body}).encode(), {})
    assert refused.value.param == param


def test_anthropics_messages_api_is_routed_behind_the_key_and_answers_errors_in_its_shape() -> None:
    """The official anthropic client through the gateway: its messages (streamed or not) and counts routed
    and renamed, the gateway's own refusals in Anthropic's shape; and a key sent as x-api-key (as Anthropic's
    API takes it) checked and forwarded, and a replica's broken stream ending in Anthropic's error event."""
    key = ClientKey(hashlib.sha256(b"tenant-key").digest())

    async def scenario() -> None:
        async with replicas(FakeReplica("a"), FakeReplica("dies", die_after_first_chunk=True)) as fleet:
            served, dying = fleet
            configs = {
                "team/llama": model("team/llama", served, served_name="llama", client_key=key),
                "broken": model("broken", dying, client_key=key),
            }
            async with (
                running_gateway(configs) as (_, _, url),
                anthropic.AsyncAnthropic(base_url=url, api_key="tenant-key", max_retries=0) as sdk,
                anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0) as stranger,
            ):
                asked = [{"role": "user", "content": "plain"}]
                message = await sdk.messages.create(model="team/llama", max_tokens=4, messages=asked)  # type: ignore[arg-type]
                assert message.content[0].text == "a"  # type: ignore[union-attr]
                assert served.received[-1] == {"model": "llama", "max_tokens": 4, "messages": asked}
                async with sdk.messages.stream(model="team/llama", max_tokens=4, messages=asked) as stream:  # type: ignore[arg-type]
                    assert [text async for text in stream.text_stream] == ["a"]
                counted = await sdk.messages.count_tokens(model="team/llama", messages=asked)  # type: ignore[arg-type]
                assert counted.input_tokens == 1 and served.received[-1]["model"] == "llama"

                with pytest.raises(anthropic.NotFoundError) as missing:
                    await sdk.messages.create(model="other", max_tokens=4, messages=asked)  # type: ignore[arg-type]
                assert missing.value.body == {  # type: ignore[comparison-overlap]
                    "type": "error",
                    "error": {"type": "not_found_error", "message": "the model 'other' does not exist"},
                }
                with pytest.raises(anthropic.AuthenticationError) as refused:
                    await stranger.messages.create(model="team/llama", max_tokens=4, messages=asked)  # type: ignore[arg-type]
                assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]

                async with aiohttp.ClientSession() as session:
                    body = {"model": "broken", "max_tokens": 4, "messages": asked, "stream": True}
                    headers = {"x-api-key": "tenant-key"}
                    async with session.post(f"{url}/v1/messages", json=body, headers=headers) as answer:
                        events = (await answer.text()).split("\n\n")
                # The key reached the replica as the client sent it (the service forwards keys).
                sent = {name.lower(): value for name, value in dying.headers[-1].items()}
                assert sent["x-api-key"] == "tenant-key"
                last = [event for event in events if event][-1]
                assert last.startswith("event: error\ndata: ")
                error = json.loads(last.removeprefix("event: error\ndata: "))
                assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"

    asyncio.run(scenario())


def test_a_conversation_is_routed_on_the_same_text_through_chat_and_the_messages_api() -> None:
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, *conversation]}
    blocks = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}, conversation[1]]
    messages = {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": blocks,
    }
    routed = parse_request(MESSAGES_PATH, json.dumps(messages).encode(), {})
    assert routed.prompt_text == parse_request(CHAT_PATH, json.dumps(chat).encode(), {}).prompt_text
    with pytest.raises(BadRequestError) as refused:
        parse_request(MESSAGES_PATH, json.dumps({"model": "m", "messages": []}).encode(), {})
    assert refused.value.param == "messages"
