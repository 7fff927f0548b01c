"""Guardrails through real servers: rules, a guard model (another server, and the same one) whose verdict is
forced with logit_bias, a hook, the guard down; block, redact and flag; streamed windows on the wire; the
openai SDK's moderations and content_filter errors. And what must not get past them: logprobs of blocked or
redacted answers, text in tools and tool calls, looser tiers claimed by the client, remote checkers that
answer a byte at a time or without end."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from kvfleet.runtime.bench.safety import local_hook, logit_bias_against
from local_http import QuietHandler, serving
from ports import free_port
from server_checks import finished_count, openai_error, wait_idle

if TYPE_CHECKING:
    from servers import ServerProcess

PROMPT = [{"role": "user", "content": "Tell me a story about the sea."}]
MAX_TOKENS = 48
LONG_MAX_TOKENS = 1024
WINDOW = 4
REFUSAL = "Refused by policy."
MARKER_CATEGORY = "test/marker"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# How long the hook takes over a text that asks for it ("slowly").
HOOK_DELAY_S = 3.0


# "safe": nothing may begin with "u". "unsafe\nS9": nothing with "s" (so "un..." at the first branch), no
# digit but 9 after "S", and no "," after it: the verdict ends there.
def _safe_bias(model: Path) -> dict[str, float]:
    return logit_bias_against(model, "u")


def _unsafe_s9_bias(model: Path) -> dict[str, float]:
    return logit_bias_against(model, "s12345678,")


def _chat(server: ServerProcess, tier: str = "standard", **body: Any) -> httpx.Response:
    payload = {"messages": PROMPT, "max_tokens": MAX_TOKENS, **GREEDY, **body}
    headers = {**server.headers(), "x-kvfleet-priority": tier}
    return httpx.post(f"{server.url}/v1/chat/completions", json=payload, headers=headers, timeout=120)


def _stream(server: ServerProcess, tier: str = "standard", **body: Any) -> list[dict[str, Any]]:
    """The events of a streamed chat, read raw off the wire."""
    return _events(server, "chat/completions", tier, messages=PROMPT, **body)


def _events(server: ServerProcess, route: str, tier: str, **body: Any) -> list[dict[str, Any]]:
    payload = {"max_tokens": MAX_TOKENS, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    payload.update(body)
    headers = {**server.headers(), "x-kvfleet-priority": tier}
    events = []
    url = f"{server.url}/v1/{route}"
    with httpx.stream("POST", url, json=payload, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        events.append(json.loads(line.removeprefix("data: ")))
    return events


def _content(events: list[dict[str, Any]]) -> str:
    return "".join(choice["delta"].get("content") or "" for e in events for choice in e["choices"])


def _finish_reason(events: list[dict[str, Any]]) -> str | None:
    reasons = [choice["finish_reason"] for e in events for choice in e["choices"] if choice["finish_reason"]]
    assert len(reasons) == 1, reasons
    return reasons[0]


def _refused(response: httpx.Response) -> dict[str, Any]:
    """The error of an input the policy refused."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "content_filter"
    return error


def _findings(server: ServerProcess, checker: str, category: str, direction: str, action: str) -> float:
    labels = (
        f'action="{action}",category="{category}",checker="{checker}",direction="{direction}",'
        f'model_name="{server.model_name}"'
    )
    prefix = f"kvfleet:safety_findings_total{{{labels}}} "
    text = httpx.get(f"{server.url}/metrics").text
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


@pytest.fixture(scope="module")
def guard(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A plain server of the tiny model: the guard model of the guarded servers, and the unguarded
    reference."""
    return start_server()


@dataclass(frozen=True)
class Reference:
    """The unguarded greedy answer to PROMPT, and a marker: the text of one of its tokens, past the first two
    windows, that appears nowhere before that token."""

    text: str
    marker: str
    marker_token: int

    @property
    def released_before_marker(self) -> int:
        """Tokens of the windows before the one that holds the marker."""
        return self.marker_token // WINDOW * WINDOW


@pytest.fixture(scope="module")
def reference(guard: ServerProcess) -> Reference:
    answer = _chat(guard, logprobs=True).json()["choices"][0]
    tokens = [entry["token"] for entry in answer["logprobs"]["content"]]
    for index in range(2 * WINDOW, len(tokens) - WINDOW):
        candidate = tokens[index].strip()
        before = "".join(tokens[:index])
        if (
            re.fullmatch(r"[A-Za-z]{3,}", candidate)
            and candidate not in before
            and "\ufffd" not in before + tokens[index]
        ):
            return Reference(answer["message"]["content"], candidate, index)
    raise AssertionError(f"no token of the answer can serve as a marker: {tokens}")


@pytest.fixture(scope="module")
def ruled(
    start_server: Callable[..., ServerProcess], tiny_llama: Path, reference: Reference
) -> ServerProcess:
    """Rules (a blocklist, PII, and the marker as the platform's own pattern) and the server's own model as
    the guard, forced to answer "safe". Standard requests are blocked, critical ones redacted, batch ones
    flagged: the platform lets clients pick these looser tiers."""
    config = {
        "input": ["rules", "guard"],
        "output": ["rules", "guard"],
        "windowTokens": WINDOW,
        "refusal": REFUSAL,
        "rules": {
            "blocklist": ["bomb recipe"],
            "patterns": [{"category": MARKER_CATEGORY, "regex": re.escape(reference.marker)}],
        },
        # The guard's deadline is not under test here: room for a first call on a busy machine.
        "guard": {"endpoint": "self", "extraBody": {"logit_bias": _safe_bias(tiny_llama)}, "timeout": 30},
        "tiers": {"critical": {"action": "redact"}, "batch": {"action": "flag"}},
        "allowLooserTiers": True,
    }
    return start_server("--safety-config", json.dumps(config))


@pytest.fixture(scope="module")
def guarded(
    start_server: Callable[..., ServerProcess], tiny_llama: Path, guard: ServerProcess
) -> ServerProcess:
    """Output judged by the guard server, forced to answer "unsafe" in S9 (Indiscriminate Weapons). Inputs of
    the high tier are judged instead; batch requests are only flagged, critical ones redacted."""
    config = {
        "output": ["guard"],
        "windowTokens": WINDOW,
        "refusal": REFUSAL,
        # The guard's deadline is not under test here: room for a first call on a busy machine.
        "guard": {
            "endpoint": f"{guard.url}/v1",
            "extraBody": {"logit_bias": _unsafe_s9_bias(tiny_llama)},
            "timeout": 30,
        },
        "tiers": {
            "high": {"input": ["guard"], "output": []},
            "batch": {"action": "flag"},
            "critical": {"action": "redact"},
        },
        "allowLooserTiers": True,
    }
    return start_server("--safety-config", json.dumps(config))


def _judge(body: dict[str, Any]) -> dict[str, Any]:
    if "slowly" in body["text"]:
        time.sleep(HOOK_DELAY_S)
    if "flag it at zero" in body["text"]:
        return {"flagged": True, "categories": {"hook/custom": 0.0}}
    flagged = "forbidden" in body["text"]
    return {"flagged": flagged, "categories": {"hook/custom": 1.0 if flagged else 0.0}}


@pytest.fixture(scope="module")
def hook_url() -> Iterator[str]:
    with local_hook(_judge) as url:
        yield url


def _guard_down_config(fail_open: bool, **extra: Any) -> str:
    # Nothing listens on a fresh free port: the guard is down.
    guard = {"endpoint": f"http://127.0.0.1:{free_port()}/v1", "failOpen": fail_open, "timeout": 2}
    return json.dumps({"input": ["guard"], "guard": guard, **extra})


# ---- rules and the same server as guard -------------------------------------------------------------


def test_a_blocked_input_raises_the_sdks_bad_request_with_content_filter(ruled: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{ruled.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=ruled.model_name, messages=[{"role": "user", "content": "Give me a bomb recipe"}]
        )
    assert raised.value.code == "content_filter"
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["categories"] == ["blocklist"]
    assert error["message"].startswith(REFUSAL) and "blocklist (rules)" in error["message"]
    wait_idle(ruled)


def test_prompt_embeddings_are_refused_where_the_input_is_checked(ruled: ServerProcess) -> None:
    """The checks read text, which embeddings are not: they would pass unread."""
    body = {"model": ruled.model_name, "prompt_embeds": "AAAA", "max_tokens": 1}
    response = httpx.post(f"{ruled.url}/v1/completions", json=body, headers=ruled.headers(), timeout=60)
    error = openai_error(response, 400)
    assert error["param"] == "prompt_embeds" and "input checks" in error["message"]


def test_moderations_through_the_sdk(ruled: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{ruled.url}/v1", api_key="unused", max_retries=0)
    moderation = client.moderations.create(
        model=ruled.model_name, input=["write to jane@example.com", "a calm sea at dawn"]
    )
    flagged, clean = moderation.results
    assert flagged.flagged and not clean.flagged
    # OpenAI's categories are the SDK's fields; kvfleet's own come as extra ones.
    assert flagged.categories.model_extra["pii/email"] is True
    assert flagged.category_scores.model_extra["pii/email"] == 0.6
    assert clean.categories.model_extra.get("pii/email") is None
    assert flagged.categories.violence is False and flagged.category_scores.violence == 0.0
    assert moderation.id.startswith("modr-")


def test_streamed_output_stops_before_the_window_that_holds_the_marker(
    ruled: ServerProcess, reference: Reference
) -> None:
    aborted = finished_count(ruled, "abort")
    # Far more tokens than the reference: the engine is still generating when the marker's window is
    # checked, however the guard's calls lag behind it, so the request must end by an abort.
    events = _stream(ruled, max_tokens=LONG_MAX_TOKENS)
    sent = _content(events)
    assert reference.marker not in sent
    # Nothing of the flagged window went out: only whole windows before it, then the refusal.
    assert sent.endswith(REFUSAL)
    answer = sent.removesuffix(REFUSAL)
    assert reference.text.startswith(answer)
    assert events[-1]["usage"]["completion_tokens"] == reference.released_before_marker
    assert _finish_reason(events) == "content_filter"
    wait_idle(ruled)
    assert finished_count(ruled, "abort") == aborted + 1


def test_streamed_windows_hold_back_at_most_the_window(ruled: ServerProcess, reference: Reference) -> None:
    # Flagged only (batch): every window goes out, each at most WINDOW tokens after it was generated.
    events = _stream(ruled, tier="batch")
    assert _content(events) == reference.text
    assert _finish_reason(events) == "length"
    deltas = [
        choice["delta"]["content"]
        for e in events
        for choice in e["choices"]
        if choice["delta"].get("content")
    ]
    assert len(deltas) == MAX_TOKENS // WINDOW
    assert _findings(ruled, "rules", MARKER_CATEGORY, "output", "flag") >= 1


def _echoed(events: list[dict[str, Any]]) -> tuple[str, list[str], list[float | None]]:
    """A streamed completion's text, tokens and their logprobs, joined."""
    choices = [choice for event in events for choice in event["choices"]]
    logprobs = [choice["logprobs"] for choice in choices if choice["logprobs"]]
    return (
        "".join(choice["text"] for choice in choices),
        [token for entry in logprobs for token in entry["tokens"]],
        [logprob for entry in logprobs for logprob in entry["token_logprobs"]],
    )


def test_a_streamed_echo_leads_its_first_window_with_the_prompts_logprobs(
    ruled: ServerProcess, guard: ServerProcess
) -> None:
    """The prompt's logprobs come with the first token, which the window holds back: they go out with it,
    as the unguarded server streams them (flagged only, the text is the model's)."""
    body = {"prompt": "Tell me a story about the sea.", "max_tokens": 2 * WINDOW, "logprobs": 1, "echo": True}
    text, tokens, logprobs = _echoed(_events(ruled, "completions", "batch", **body))
    unguarded_text, unguarded_tokens, unguarded_logprobs = _echoed(
        _events(guard, "completions", "batch", **body)
    )
    assert text == unguarded_text and text.startswith(body["prompt"])
    assert tokens == unguarded_tokens
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(unguarded_logprobs[1:], abs=1e-5)
    assert len(tokens) > 2 * WINDOW


def test_an_unstreamed_output_is_checked_whole(ruled: ServerProcess, reference: Reference) -> None:
    choice = _chat(ruled).json()["choices"][0]
    assert choice["message"]["content"] == REFUSAL
    assert choice["finish_reason"] == "content_filter"
    flagged = _chat(ruled, tier="batch").json()["choices"][0]
    assert flagged["message"]["content"] == reference.text
    assert flagged["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_redaction_of_output(ruled: ServerProcess, reference: Reference, stream: bool) -> None:
    expected = reference.text.replace(reference.marker, f"[REDACTED:{MARKER_CATEGORY}]")
    if stream:
        events = _stream(ruled, tier="critical")
        text, finish_reason = _content(events), _finish_reason(events)
    else:
        choice = _chat(ruled, tier="critical").json()["choices"][0]
        text, finish_reason = choice["message"]["content"], choice["finish_reason"]
    assert text == expected
    assert finish_reason == "length"


def test_redaction_of_input_is_what_the_model_sees(ruled: ServerProcess) -> None:
    said = [{"role": "user", "content": "Card 4111 1111 1111 1111, mail jane@example.com. Hi!"}]
    seen = [{"role": "user", "content": "Card [REDACTED:pii/card], mail [REDACTED:pii/email]. Hi!"}]
    usage = _chat(ruled, tier="critical", messages=said, max_tokens=1).json()["usage"]
    tokenized = httpx.post(f"{ruled.url}/tokenize", json={"messages": seen}).json()
    assert usage["prompt_tokens"] == tokenized["count"]
    assert _chat(ruled, messages=said, max_tokens=1).status_code == 400


def _answers(server: ServerProcess, tier: str) -> list[Any]:
    """The answer to PROMPT with logprobs, as every route gives it: chat and completions (the chat's prompt
    as token ids), streamed and not."""
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": PROMPT}).json()["tokens"]
    headers = {**server.headers(), "x-kvfleet-priority": tier}
    completion = {"prompt": prompt, "max_tokens": MAX_TOKENS, **GREEDY, "logprobs": 1}
    url = f"{server.url}/v1/completions"
    return [
        _chat(server, tier=tier, logprobs=True).json(),
        _stream(server, tier=tier, logprobs=True),
        httpx.post(url, json=completion, headers=headers, timeout=120).json(),
        _events(server, "completions", tier, **completion),
    ]


@pytest.mark.parametrize("tier", ["standard", "critical"])
def test_logprobs_go_with_a_blocked_or_redacted_answer(
    ruled: ServerProcess, reference: Reference, tier: str
) -> None:
    # Flagged only (batch), the answer and its logprobs hold the marker on every route.
    assert all(reference.marker in json.dumps(answer) for answer in _answers(ruled, "batch"))
    # Blocked (standard) or redacted (critical), nothing the client gets spells it out.
    assert reference.marker not in REFUSAL
    answers = _answers(ruled, tier)
    for answer in answers:
        assert reference.marker not in json.dumps(answer)
    chat = answers[0]
    assert chat["choices"][0]["logprobs"] is None
    # A blocked answer is not sent, nor counted; a redacted one still is.
    assert chat["usage"]["completion_tokens"] == (0 if tier == "standard" else MAX_TOKENS)


def _tool(description: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"query": {"type": "string"}}}
    return {
        "type": "function",
        "function": {"name": "lookup", "description": description, "parameters": parameters},
    }


def test_input_checks_read_everything_the_template_renders(ruled: ServerProcess) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "x"}'}}
    hidden_in_call = {"function": {"name": "lookup", "arguments": '{"query": "bomb recipe"}'}}
    conversation = [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [{**call, **hidden_in_call}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Nothing found."},
        {"role": "user", "content": "Go on."},
    ]
    hidden = [
        {"tools": [_tool("Explains any bomb recipe.")], "tool_choice": "none"},
        {"messages": conversation},
    ]
    for body in hidden:
        assert _refused(_chat(ruled, max_tokens=1, **body))["categories"] == ["blocklist"]
        # Only message text can be redacted: the tier that redacts refuses it too.
        _refused(_chat(ruled, tier="critical", max_tokens=1, **body))
    clean_call = [conversation[0], {**conversation[1], "tool_calls": [call]}, *conversation[2:]]
    for tier in ("standard", "critical"):
        assert (
            _chat(ruled, tier, max_tokens=1, tools=[_tool("Finds a recipe.")], tool_choice="none").status_code
            == 200
        )
        assert _chat(ruled, tier, max_tokens=1, messages=clean_call).status_code == 200


def test_logs_and_metrics_hold_no_text(ruled: ServerProcess) -> None:
    _chat(ruled, messages=[{"role": "user", "content": "bomb recipe for jane@example.com"}], max_tokens=1)
    assert "jane@example.com" not in ruled.log_path.read_text()
    metrics = httpx.get(f"{ruled.url}/metrics").text
    assert "jane@example.com" not in metrics and "bomb" not in metrics
    assert _findings(ruled, "rules", "pii/email", "input", "block") >= 1


# ---- another server as guard -----------------------------------------------------------------------


def test_the_guard_blocks_an_input_with_its_category(guarded: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=guarded.model_name, messages=PROMPT, extra_headers={"x-kvfleet-priority": "high"}
        )
    assert raised.value.code == "content_filter"
    assert raised.value.body["categories"] == ["illicit/violent"]  # type: ignore[index]
    assert _findings(guarded, "guard", "illicit/violent", "input", "block") == 1
    wait_idle(guarded)


@pytest.mark.parametrize("tier", ["standard", "critical"])
def test_the_guard_blocks_output_before_any_token(guarded: ServerProcess, tier: str) -> None:
    # Redaction (critical) cannot take out a verdict on the whole text: it blocks too.
    events = _stream(guarded, tier=tier)
    assert _content(events) == REFUSAL
    assert _finish_reason(events) == "content_filter"
    assert events[-1]["usage"]["completion_tokens"] == 0
    choice = _chat(guarded, tier=tier).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (REFUSAL, "content_filter")
    wait_idle(guarded)


def test_a_flagging_tier_lets_the_guarded_output_through(
    guarded: ServerProcess, reference: Reference
) -> None:
    before = _findings(guarded, "guard", "illicit/violent", "output", "flag")
    assert _content(_stream(guarded, tier="batch")) == reference.text
    assert _chat(guarded, tier="batch").json()["choices"][0]["message"]["content"] == reference.text
    assert _findings(guarded, "guard", "illicit/violent", "output", "flag") > before


# ---- the guard down, and a hook ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooked(
    start_server: Callable[..., ServerProcess], hook_url: str, tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    """Input judged by a guard that is down (failing open) and by the hook (failing closed). The batch tier
    leaves the hook out, and the platform does not let clients pick it for that."""
    config = _guard_down_config(
        True,
        input=["guard", "hook"],
        hook={"url": hook_url, "failOpen": False},
        tiers={"batch": {"input": ["guard"]}},
    )
    store = tmp_path_factory.mktemp("batch-store")
    return start_server("--safety-config", config, "--batch-store", str(store))


def test_guard_down_fails_open_and_the_hook_still_judges(hooked: ServerProcess) -> None:
    assert _chat(hooked, max_tokens=2).status_code == 200
    refused = _chat(hooked, messages=[{"role": "user", "content": "something forbidden"}], max_tokens=2)
    assert refused.status_code == 400
    assert refused.json()["error"]["categories"] == ["hook/custom"]
    assert 'checker="guard",model_name="tiny",outcome="open"' in httpx.get(f"{hooked.url}/metrics").text


def test_a_client_gone_while_its_input_is_checked_frees_its_request(hooked: ServerProcess) -> None:
    # The request runs while the hook takes its time; the client leaves before the verdict.
    aborted, finished = finished_count(hooked, "abort"), finished_count(hooked, "length")
    slow = {"messages": [{"role": "user", "content": "answer slowly"}], "max_tokens": 1900, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{hooked.url}/v1/chat/completions", json={**slow, **GREEDY}, timeout=1.0)
    wait_idle(hooked, timeout=HOOK_DELAY_S + 20)
    assert (finished_count(hooked, "abort"), finished_count(hooked, "length")) == (aborted + 1, finished)
    assert _chat(hooked, max_tokens=2).status_code == 200
    assert "Traceback" not in hooked.log_path.read_text()


def test_a_hook_answer_flagged_counts_whatever_its_scores(hooked: ServerProcess) -> None:
    refused = _chat(hooked, messages=[{"role": "user", "content": "flag it at zero"}], max_tokens=2)
    assert _refused(refused)["categories"] == ["hook"]
    assert _chat(hooked, max_tokens=2).status_code == 200


def test_a_client_cannot_pick_a_looser_tier(hooked: ServerProcess) -> None:
    forbidden = [{"role": "user", "content": "something forbidden"}]
    # The batch tier leaves the hook out: claimed by the header or the priority field (name or number), it
    # still gets the default tier's policy, which runs the hook.
    assert _refused(_chat(hooked, "batch", messages=forbidden, max_tokens=2))["categories"] == ["hook/custom"]
    for priority in ("batch", 3):
        refused = _chat(hooked, messages=forbidden, max_tokens=2, priority=priority)
        assert _refused(refused)["categories"] == ["hook/custom"]
    assert _chat(hooked, "batch", max_tokens=2).status_code == 200
    # Batch API lines run in the batch tier: the same.
    client = openai.OpenAI(base_url=f"{hooked.url}/v1", api_key="unused", max_retries=0, timeout=60)
    lines = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": hooked.model_name, "messages": messages, "max_tokens": 2},
        }
        for name, messages in (("forbidden", forbidden), ("plain", PROMPT))
    ]
    upload = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("lines.jsonl", upload), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    (failed,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert failed["custom_id"] == "forbidden"
    assert failed["response"]["body"]["error"]["categories"] == ["hook/custom"]


def test_guard_down_fails_closed(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--safety-config", _guard_down_config(False))
    refused = _chat(server, max_tokens=2)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "content_filter"
    assert refused.json()["error"]["categories"] == ["checker_unavailable"]
    wait_idle(server)


def test_a_bad_safety_config_stops_the_server_with_its_reason(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server("--safety-config", '{"input": ["hook"]}', wait=False)
    assert server.process.wait(60) == 2
    assert "runs the 'hook' checker, which is not configured" in server.log_path.read_text()


# ---- checkers on other servers that drip or flood ---------------------------------------------------------

REMOTE_TIMEOUT_S = 2.0
# Far longer than any deadline: a drip never ends by itself within a test.
DRIP_SECONDS = 30.0
FLOOD_BYTES = 256 << 20


# The bytes of each dripped or flooded answer sent, by "<behaviour> <path>".
_SENT: dict[str, int] = {}


class _RemoteCheckers(QuietHandler):
    """A guard model's server (`/v1/chat/completions`, answering "safe" and a newline, as servers without the
    guard's regex do) and a hook (`/hook`, answering "not flagged"). A text that names "drip <path>" gets
    its answer one byte at a time, every 0.25 s; one that names "flood <path>" gets an endless answer."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        is_guard = self.path.endswith("/chat/completions")
        text = body["messages"][0]["content"] if is_guard else body["text"]
        behaviour = next((name for name in ("drip", "flood") if f"{name} {self.path}" in text), None)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if behaviour is not None:
            self._send_chunked(
                f"{behaviour} {self.path}", self._drip() if behaviour == "drip" else self._flood()
            )
            return
        answer = (
            {"choices": [{"message": {"role": "assistant", "content": "safe\n"}}]}
            if is_guard
            else {"flagged": False, "categories": {}}
        )
        content = json.dumps(answer).encode()
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def _send_chunked(self, key: str, chunks: Iterator[bytes]) -> None:
        """Sends `chunks` until they end or the client goes."""
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True
        _SENT[key] = 0
        with contextlib.suppress(OSError):
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                _SENT[key] += len(chunk)

    @staticmethod
    def _drip() -> Iterator[bytes]:
        started = time.monotonic()
        while time.monotonic() - started < DRIP_SECONDS:
            yield b" "
            time.sleep(0.25)

    @staticmethod
    def _flood() -> Iterator[bytes]:
        chunk = b" " * (1 << 20)
        for _ in range(FLOOD_BYTES // len(chunk)):
            yield chunk


@pytest.fixture(scope="module")
def remote_checkers() -> Iterator[str]:
    with serving(_RemoteCheckers) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def remote(start_server: Callable[..., ServerProcess], remote_checkers: str) -> ServerProcess:
    """Input judged by the remote guard (failing closed) and hook (failing open), each within 2 s."""
    config = {
        "input": ["guard", "hook"],
        "guard": {"endpoint": f"{remote_checkers}/v1", "timeout": REMOTE_TIMEOUT_S, "failOpen": False},
        "hook": {"url": f"{remote_checkers}/hook", "timeout": REMOTE_TIMEOUT_S, "failOpen": True},
    }
    return start_server("--safety-config", json.dumps(config))


def _timed_chat(server: ServerProcess, text: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = _chat(server, messages=[{"role": "user", "content": text}], max_tokens=2)
    return response, time.monotonic() - started


def test_a_guard_verdict_with_a_trailing_newline_is_one(remote: ServerProcess) -> None:
    assert _chat(remote, max_tokens=2).status_code == 200
    assert "kvfleet:safety_checker_unavailable_total{" not in httpx.get(f"{remote.url}/metrics").text


@pytest.mark.parametrize("behaviour", ["drip", "flood"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/hook"])
def test_a_remote_checker_is_cut_off_at_its_deadline_and_size(
    remote: ServerProcess, behaviour: str, path: str
) -> None:
    response, seconds = _timed_chat(remote, f"Answer this: {behaviour} {path}")
    # Within the deadline, with a loaded machine's margin.
    assert seconds < REMOTE_TIMEOUT_S + 6.0
    if behaviour == "flood":
        # Read up to the cap (1 MiB), then dropped: what was sent beyond it is what the sockets buffered.
        assert _SENT[f"flood {path}"] < 32 << 20
    # The guard fails closed, the hook open.
    if path == "/hook":
        assert response.status_code == 200, response.text
    else:
        assert _refused(response)["categories"] == ["checker_unavailable"]
    assert _chat(remote, max_tokens=2).status_code == 200
