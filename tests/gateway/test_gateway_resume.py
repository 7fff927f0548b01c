"""Streams that survive their replica: the real gateway in front of scripted replicas that fail on cue (a
reset connection, a body cut short, a 5xx error frame, a drain hand-back, a stall) and continue a request
from the gateway's `continuation`. What the client gets through failures must be what a replica that never
failed sends it (the oracle: the same request to a replica of its own), but for the one id and creation
time."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import pytest
from gateway_harness import model, running_gateway, wait_until
from kvfleet.gateway.proxy import UpstreamTimeouts
from kvfleet.gateway.splice import EventReader
from scripted_replica import (
    KEEP_ALIVE,
    TOOL_SCRIPT,
    Fault,
    Script,
    ScriptedReplica,
    default_script,
    post,
    scripted,
    sse_chunks,
    token_id,
)

if TYPE_CHECKING:
    from servers import ServerProcess

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 50}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
STOP_SCRIPT = [" a", " ST", "AR", " b", " ST", "OP", " c"]


def body_of(path: str, **fields: Any) -> dict[str, Any]:
    return {**(CHAT if path == CHAT_PATH else COMPLETION), **fields}


async def served(
    path: str,
    body: dict[str, Any],
    *faults: Fault,
    script: Script = default_script,
    roles_on_continuation: bool = False,
    **options: Any,
) -> tuple[Any, Any, list[ScriptedReplica], dict[str, float]]:
    """(what the client got through the gateway, what the oracle answers, the fleet's replicas, the
    gateway's resume metrics): the first replica fails with `faults` (one a request), the others never."""
    first = ScriptedReplica("a", script=script, faults=list(faults))
    others = [
        ScriptedReplica(name, script=script, roles_on_continuation=roles_on_continuation)
        for name in ("b", "c")
    ]
    oracle = ScriptedReplica("oracle", script=script)
    async with scripted(first, *others, oracle) as fleet:
        config = model("m", *fleet[:3], policy="round-robin")
        async with running_gateway({"m": config}, **options) as (gateway, _, url):
            status, got = await post(url, path, body)
            assert status == 200, got
            _, expected = await post(oracle.url, path, body)
            metrics = resume_metrics(gateway.metrics.registry)
    return got, expected, fleet, metrics


def resume_metrics(registry: Any) -> dict[str, float]:
    """The gateway's resumes by cause, tokens replayed and resume latencies observed, of model m."""
    metrics = {
        name: registry.get_sample_value(name, {"model": "m"}) or 0.0
        for name in ("kvfleet_gateway_resumed_tokens_total", "kvfleet_gateway_resume_seconds_count")
    }
    for cause in ("reset", "error", "stall", "drain"):
        labels = {"model": "m", "cause": cause}
        metrics[cause] = registry.get_sample_value("kvfleet_gateway_resumes_total", labels) or 0.0
    return metrics


def by_choice(chunks: list[Any]) -> dict[int | None, list[Any]]:
    """A stream's chunks of each choice in their order, and the others (usage, [DONE]) in theirs: the choices
    of n > 1 interleave as the replica's steps fall, which two runs of one request need not share."""
    grouped: dict[int | None, list[Any]] = {}
    for chunk in chunks:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        grouped.setdefault(choices[0]["index"] if choices and len(choices) == 1 else None, []).append(chunk)
    return grouped


def approx_floats(value: Any) -> Any:
    """`value` with each float compared within float32's rounding and everything else exactly. One request's
    logprobs can differ in their last bits between two runs on a real replica: a prefix-cache hit computes the
    last prompt position's logits in a matmul of another shape, whose sums oneDNN orders differently on some
    CPUs (AVX2 ones). Tokens and text do not differ."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-5, abs=1e-6)
    if isinstance(value, dict):
        return {key: approx_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [approx_floats(item) for item in value]
    return value


def assert_same_stream(raw: bytes, expected_raw: bytes, first_replica: str | None = "a") -> list[Any]:
    """The client's stream is the oracle's, chunk for chunk, under the first replica's id and time."""
    got, expected = sse_chunks(raw), sse_chunks(expected_raw)
    heads = {(chunk["id"], chunk["created"]) for chunk in got if isinstance(chunk, dict)}
    assert len(heads) == 1, heads
    ((stream_id, created),) = heads
    if first_replica is not None:
        assert stream_id.split("-")[1] == first_replica
    relabelled = [{**c, "id": stream_id, "created": created} if isinstance(c, dict) else c for c in expected]
    assert by_choice(got) == approx_floats(by_choice(relabelled))
    assert got.count("[DONE]") == 1 and got[-1] == "[DONE]"
    return got


CASES = [
    pytest.param(CHAT_PATH, Fault("reset", after=0), "reset", {}, id="chat-before-first-token"),
    pytest.param(COMPLETIONS_PATH, Fault("reset", after=0), "reset", {}, id="completion-before-first-token"),
    pytest.param(CHAT_PATH, Fault("reset", after=3), "reset", {"return_token_ids": True}, id="chat-mid"),
    pytest.param(COMPLETIONS_PATH, Fault("eof", after=3), "reset", {}, id="completion-cut-short"),
    pytest.param(CHAT_PATH, Fault("eof", after=99), "reset", {}, id="chat-after-last-token"),
    pytest.param(
        COMPLETIONS_PATH, Fault("eof", after=99), "reset", {"return_token_ids": True}, id="done-lost"
    ),
    pytest.param(COMPLETIONS_PATH, Fault("eof", 99, after_usage=True), "reset", {}, id="after-usage"),
    pytest.param(COMPLETIONS_PATH, Fault("error", after=2), "error", {}, id="completion-error-frame"),
    pytest.param(COMPLETIONS_PATH, Fault("nan", after=2), "error", {}, id="completion-chunk-not-json"),
    pytest.param(CHAT_PATH, Fault("drain", after=4), "drain", {}, id="chat-drained"),
]


@pytest.mark.parametrize(("path", "fault", "cause", "fields"), CASES)
def test_a_stream_is_resumed_with_no_token_lost_or_repeated(
    path: str, fault: Fault, cause: str, fields: dict[str, Any]
) -> None:
    body = body_of(path, **USAGE, **fields)
    got, expected, (first, second, *_), metrics = asyncio.run(served(path, body, fault))
    afresh = path == COMPLETIONS_PATH and fault.after == 0
    # A completion that failed before its first chunk starts afresh elsewhere, under that replica's id.
    chunks = assert_same_stream(got, expected, first_replica="b" if afresh else "a")
    assert metrics[cause] == 1 and sum(metrics[c] for c in ("reset", "error", "stall", "drain")) == 1
    assert metrics["kvfleet_gateway_resume_seconds_count"] == 1
    (upstream,) = first.received
    assert upstream["stream"] is True and upstream["return_token_ids"] is True
    (resumed,) = second.received
    sent_tokens = min(fault.after, len(default_script(body, 0)))
    if afresh:
        assert "continuation" not in resumed, "nothing was sent: the request starts afresh"
    else:
        (choice,) = resumed["continuation"]["choices"]
        assert choice["token_ids"] == [token_id(0, position) for position in range(sent_tokens)]
        assert choice["finished"] is (fault.after == 99)
    replayed = 0 if fault.after == 99 else sent_tokens
    assert metrics["kvfleet_gateway_resumed_tokens_total"] == replayed
    usage = chunks[-2]["usage"]
    assert usage["completion_tokens"] == len(default_script(body, 0))
    assert ("token_ids" in str(chunks)) is bool(fields.get("return_token_ids"))


@pytest.mark.parametrize("roles_on_continuation", [False, True])
def test_n_choices_resume_with_the_finished_one_marked(roles_on_continuation: bool) -> None:
    body = body_of(CHAT_PATH, n=2, return_token_ids=True, **USAGE)
    # Choice 0 has 6 tokens and choice 1 has 9: after 7 steps the first has finished, the second has not.
    got, expected, (_, second, *_), _ = asyncio.run(
        served(CHAT_PATH, body, Fault("reset", after=7), roles_on_continuation=roles_on_continuation)
    )
    chunks = assert_same_stream(got, expected)
    finished, running = second.received[0]["continuation"]["choices"]
    assert finished == {"index": 0, "token_ids": [token_id(0, i) for i in range(6)], "finished": True}
    assert running == {"index": 1, "token_ids": [token_id(1, i) for i in range(7)], "finished": False}
    assert chunks[-2]["usage"]["completion_tokens"] == 6 + 9
    roles = [c for c in chunks[:-1] if c["choices"] and "role" in c["choices"][0].get("delta", {})]
    assert len(roles) == 2, "each choice's role once"


def test_a_chat_stream_that_failed_between_its_roles_gets_the_missing_one() -> None:
    body = body_of(CHAT_PATH, n=2, stream=True)
    got, expected, (_, second, *_), _ = asyncio.run(
        served(CHAT_PATH, body, Fault("reset", after_first_role=True))
    )
    assert_same_stream(got, expected)
    assert second.received[0]["continuation"]["choices"] == [{"index": 0, "token_ids": [], "finished": False}]


@pytest.mark.parametrize(
    ("path", "fields", "fault"),
    [
        (CHAT_PATH, {"logprobs": True, "top_logprobs": 1}, Fault("reset", after=3)),
        (COMPLETIONS_PATH, {"logprobs": 1, "n": 2}, Fault("error", after=4)),
    ],
)
def test_log_probabilities_resume(path: str, fields: dict[str, Any], fault: Fault) -> None:
    got, expected, _, _ = asyncio.run(served(path, body_of(path, stream=True, **fields), fault))
    chunks = assert_same_stream(got, expected)
    assert all(c["choices"][0]["logprobs"] for c in chunks[:-1] if "text" in c["choices"][0])


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize("after", [2, 5])
def test_text_held_for_a_stop_string_across_the_splice(path: str, after: int) -> None:
    """After 2 tokens " ST" is held back (it may begin "STOP"; the next token makes it "STAR"); after 5, the
    second " ST" is (the next makes "STOP"): the replica that resumes sends the one and stops at the other."""
    body = body_of(path, stream=True, stop=["STOP"])
    got, expected, _, _ = asyncio.run(
        served(path, body, Fault("reset", after=after), script=lambda body, choice: STOP_SCRIPT)
    )
    chunks = assert_same_stream(got, expected)
    choices = [c["choices"][0] for c in chunks[:-1]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    assert text == " a STAR b " and choices[-1]["stop_reason"] == "STOP"


def test_a_tool_call_resumes_mid_arguments_announced_once() -> None:
    body = body_of(CHAT_PATH, stream=True, tools=TOOLS)
    got, expected, _, _ = asyncio.run(
        served(CHAT_PATH, body, Fault("reset", after=4), script=lambda body, choice: TOOL_SCRIPT)
    )
    chunks = assert_same_stream(got, expected)
    calls = [call for c in chunks[:-1] for call in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len([call for call in calls if "id" in call]) == 1
    arguments = "".join(call["function"]["arguments"] for call in calls)
    assert (
        arguments == "".join(TOOL_SCRIPT[2:-1]) and chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    )


def test_a_stalled_stream_is_resumed() -> None:
    body = body_of(COMPLETIONS_PATH, **USAGE)
    timeouts = UpstreamTimeouts(stall=0.5)
    got, expected, _, metrics = asyncio.run(
        served(COMPLETIONS_PATH, body, Fault("stall", after=2), upstream_timeouts=timeouts)
    )
    assert_same_stream(got, expected)
    assert metrics["stall"] == 1


def test_a_replicas_keep_alives_reach_a_streaming_client_and_are_no_stall() -> None:
    """Keep-alive comments every 0.1 s, an event every 0.5 s: with a stall timeout of 0.4 s between, the
    stream is not resumed; a streaming client gets every comment, a non-streamed one an answer without."""
    script: Script = lambda body, choice: [" a", " b"]  # noqa: E731

    async def scenario() -> tuple[list[tuple[bytes, bytes]], ScriptedReplica, dict[str, float]]:
        quiet = ScriptedReplica("a", script=script, keep_alives_per_chunk=5, keep_alive_s=0.1)
        oracle = ScriptedReplica("oracle", script=script)
        answers = []
        timeouts = UpstreamTimeouts(stall=0.4)
        async with (
            scripted(quiet, oracle),
            running_gateway({"m": model("m", quiet)}, upstream_timeouts=timeouts) as (gateway, _, url),
        ):
            for stream in (True, False):
                body = body_of(COMPLETIONS_PATH, **(USAGE if stream else {"stream": False}))
                status, got = await post(url, COMPLETIONS_PATH, body)
                assert status == 200, got
                sent = quiet.keep_alives_sent
                _, expected = await post(oracle.url, COMPLETIONS_PATH, body)
                answers.append((got, expected, sent))
            metrics = resume_metrics(gateway.metrics.registry)
        return answers, quiet, metrics

    ((streamed, streamed_oracle, sent), (whole, whole_oracle, _)), quiet, metrics = asyncio.run(scenario())
    assert sent > 0 and streamed.count(KEEP_ALIVE) == sent
    assert_same_stream(streamed, streamed_oracle)
    got, expected = json.loads(whole), json.loads(whole_oracle)
    assert got == {**expected, "id": got["id"], "created": got["created"]}
    assert quiet.keep_alives_sent > sent, "the non-streamed answer's replica stream carried no keep-alives"
    assert metrics["stall"] == 0 and len(quiet.received) == 2


def test_past_the_resume_bound_the_client_gets_an_error_and_done() -> None:
    async def scenario() -> None:
        failing = [ScriptedReplica(name, faults=[Fault("reset", after=1, times=None)]) for name in "abc"]
        async with scripted(*failing, ScriptedReplica("oracle")) as fleet:
            config = model("m", *fleet[:3], policy="round-robin")
            async with running_gateway({"m": config}, max_resumes=2) as (_, _, url):
                status, raw = await post(url, CHAT_PATH, body_of(CHAT_PATH, stream=True))
            _, expected = await post(fleet[3].url, CHAT_PATH, body_of(CHAT_PATH, stream=True))
        assert status == 200
        got, whole = sse_chunks(raw), sse_chunks(expected)
        assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "upstream_failed"
        assert got[-2]["error"]["type"] == "service_unavailable"
        # The role and one token of each of the three replicas, nothing twice.
        relabelled = [{**c, "id": got[0]["id"], "created": got[0]["created"]} for c in whole[:4]]
        assert got[:-2] == relabelled
        assert [len(replica.received) for replica in fleet[:3]] == [1, 1, 1]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("path", "fields", "fault", "script"),
    [
        (CHAT_PATH, {"n": 2, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}, "reset", None),
        (COMPLETIONS_PATH, {"n": 2, "logprobs": 1, "return_token_ids": True}, "error", None),
        (CHAT_PATH, {"tools": TOOLS}, "drain", TOOL_SCRIPT),
        (COMPLETIONS_PATH, {"stop": ["STOP"]}, "eof", STOP_SCRIPT),
    ],
)
def test_a_non_streamed_answer_is_assembled_across_replicas(
    path: str, fields: dict[str, Any], fault: str, script: list[str] | None
) -> None:
    body = body_of(path, **fields)
    script_of: Script = default_script if script is None else lambda body, choice: script
    got_raw, expected_raw, (first, *_), _ = asyncio.run(
        served(path, body, Fault(fault, after=3), script=script_of)  # type: ignore[arg-type]
    )
    got, expected = json.loads(got_raw), json.loads(expected_raw)
    assert first.received[0]["stream_options"] == {"include_usage": True}
    assert got == {**expected, "id": got["id"], "created": got["created"]}
    assert got["id"].split("-")[1] == "a"


def test_a_replica_that_keeps_failing_serves_no_continuation() -> None:
    async def scenario() -> None:
        flaky = ScriptedReplica("flaky", faults=[Fault("reset", after=2, times=None)])
        async with scripted(flaky, ScriptedReplica("b"), ScriptedReplica("c"), ScriptedReplica("o")) as fleet:
            config = model("m", *fleet[:3], policy="round-robin")
            async with running_gateway({"m": config}) as (gateway, _, url):
                for number in range(4):
                    body = body_of(
                        CHAT_PATH, stream=True, messages=[{"role": "user", "content": f"{number}"}]
                    )
                    status, got = await post(url, CHAT_PATH, body)
                    _, expected = await post(fleet[3].url, CHAT_PATH, body)
                    assert status == 200
                    assert_same_stream(got, expected, first_replica=sse_chunks(got)[0]["id"].split("-")[1])
                resets = gateway.metrics.registry.get_sample_value(
                    "kvfleet_gateway_resumes_total", {"model": "m", "cause": "reset"}
                )
        assert flaky.received and flaky.continuations() == []
        assert resets == len(flaky.received)
        assert all(continuation for replica in fleet[1:3] for continuation in replica.continuations())

    asyncio.run(scenario())


def test_a_replica_that_refuses_the_continuation_is_passed_over() -> None:
    async def scenario() -> None:
        first = ScriptedReplica("a", faults=[Fault("reset", after=3)])
        refusing = ScriptedReplica("b", faults=[Fault("refuse")])
        async with scripted(first, refusing, ScriptedReplica("c"), ScriptedReplica("oracle")) as fleet:
            config = model("m", *fleet[:3], policy="round-robin")
            body = body_of(CHAT_PATH, **USAGE)
            async with running_gateway({"m": config}) as (gateway, _, url):
                status, got = await post(url, CHAT_PATH, body)
                metrics = resume_metrics(gateway.metrics.registry)
            _, expected = await post(fleet[3].url, CHAT_PATH, body)
        assert status == 200
        assert_same_stream(got, expected)
        assert refusing.continuations() == fleet[2].continuations() and len(refusing.continuations()) == 1
        assert metrics["reset"] == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [True, False])
def test_an_error_that_is_the_requests_own_is_not_resumed(stream: bool) -> None:
    async def scenario() -> None:
        timing_out = ScriptedReplica("a", faults=[Fault("timeout", after=2)])
        second = ScriptedReplica("b")
        async with (
            scripted(timing_out, second) as fleet,
            running_gateway({"m": model("m", *fleet, policy="round-robin")}) as (_, _, url),
        ):
            status, got = await post(url, COMPLETIONS_PATH, body_of(COMPLETIONS_PATH, stream=stream))
        assert second.received == []
        if stream:
            chunks = sse_chunks(got)
            assert status == 200 and chunks[-1] == "[DONE]" and chunks[-2]["error"]["code"] == "timeout"
            assert "".join(chunk["choices"][0]["text"] for chunk in chunks[:-2]) == " w0.0 w0.1"
        else:
            assert status == 408 and json.loads(got)["error"]["type"] == "timeout_error"

    asyncio.run(scenario())


def test_replicas_that_do_not_resume_get_the_clients_body_and_are_never_sent_a_continuation() -> None:
    """vLLM's replicas would start a continuation again: their streams go to the client as they come."""

    async def scenario() -> None:
        failing = ScriptedReplica("a", faults=[Fault("reset", after=3)])
        second = ScriptedReplica("b")
        body = body_of(CHAT_PATH, stream=True)
        async with scripted(failing, second) as fleet:
            config = model("m", *fleet, policy="round-robin", replicas_resume=False)
            async with running_gateway({"m": config}) as (gateway, _, url):
                status, _ = await post(url, CHAT_PATH, body)
                metrics = resume_metrics(gateway.metrics.registry)
        assert status == 200
        assert failing.received == [body]
        assert second.received == []
        assert metrics["reset"] == 0

    asyncio.run(scenario())


def test_a_finished_stream_leaves_its_connection_for_the_next_request() -> None:
    async def scenario() -> None:
        async with (
            scripted(ScriptedReplica("a", end_after_done_s=0.05)) as (replica,),
            running_gateway({"m": model("m", replica)}) as (gateway, _, url),
        ):
            for path in (CHAT_PATH, COMPLETIONS_PATH, CHAT_PATH):
                assert (await post(url, path, body_of(path, stream=path == CHAT_PATH)))[0] == 200
                # The replica's place is given back once its stream has ended.
                await wait_until(lambda: gateway.fleet.pools["m"].replicas[0].in_flight == 0)
        assert len(set(replica.peers)) == 1, replica.peers

    asyncio.run(scenario())


def test_events_are_read_whole_however_the_bytes_are_cut() -> None:
    events = ['{"id": "x", "choices": []}', '{"text": "aé"}', "[DONE]"]
    raw = "".join(f"data: {event}\n\n" for event in events).replace("\n\n", "\r\n\r\n", 1).encode()
    raw = b": a comment\n\n" + raw.replace(b"data: [DONE]", b"event: end\ndata:[DONE]")
    for size in (1, 2, 3, 7, len(raw)):
        reader = EventReader()
        read = [
            event for start in range(0, len(raw), size) for event in reader.feed(raw[start : start + size])
        ]
        assert read == events, size


REAL_REQUESTS = [
    (
        CHAT_PATH,
        {"messages": [{"role": "user", "content": "Once upon a time"}], "logprobs": True, "top_logprobs": 2},
    ),
    (COMPLETIONS_PATH, {"prompt": "Once upon a time", "n": 2, "logprobs": 2, "return_token_ids": True}),
]


def test_a_real_replicas_answers_are_its_own_through_the_gateway(api_server: ServerProcess) -> None:
    """The runtime's own chunks through the splice and the assembly: a stream is the replica's (without the
    token ids the client did not ask for), and a non-streamed answer is the replica's non-streamed one."""

    async def scenario() -> None:
        headers = api_server.headers()
        async with running_gateway({"tiny": model("tiny", api_server.url)}) as (_, _, url):
            for path, fields in REAL_REQUESTS:
                for stream in (True, False):
                    body = {"model": "tiny", "max_tokens": 8, "temperature": 0.0, "stream": stream, **fields}
                    status, via = await post(url, path, body, headers)
                    assert status == 200, via
                    _, direct = await post(api_server.url, path, body, headers)
                    if stream:
                        assert_same_stream(via, direct, first_replica=None)
                        continue
                    got, expected = json.loads(via), json.loads(direct)
                    assert got == approx_floats({**expected, "id": got["id"], "created": got["created"]})

    asyncio.run(scenario())
