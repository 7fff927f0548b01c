"""The gateway's deadlines and bounds against clients and replicas that never finish, trickle or flood, each
beside a normal request that completes. The timeouts are set to a second or so; the bounds asserted leave
room for a loaded machine."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web
from gateway_harness import WAIT_S, FakeReplica, model, replicas, running_gateway, wait_until
from kvfleet.gateway.discovery import ClientKey
from kvfleet.gateway.http_protocol import ClientTimeouts
from kvfleet.gateway.proxy import UpstreamTimeouts

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
FAST_CLIENTS = ClientTimeouts(header_read=1.0, body_read=1.0, send=1.0)
FAST_UPSTREAM = UpstreamTimeouts(connect=1.0, first_byte=1.0, idle=1.0, total=30.0, stall=1.0)
# A 1-second deadline met on a loaded 2-core machine; the code before the fix waits for ever.
CUT_OFF_WITHIN_S = 10.0
MIB = 1024 * 1024


async def chat(url: str, body: dict[str, object] = CHAT, **headers: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.read()


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def answer_or_eof(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """What the gateway sends before it closes the connection, and how long that took."""
    started = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit_s)
    return data, time.monotonic() - started


def head(path: str, length: int, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] + [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def reset_peak_rss() -> int:
    """Resets this process's peak RSS (VmHWM) to its current RSS, which it returns in kB."""
    Path("/proc/self/clear_refs").write_text("5")
    return proc_status_kb("VmHWM")


def proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


async def trickled(url: str, opening: bytes, piece: Callable[[int], bytes]) -> tuple[bytes, float]:
    """Sends `opening`, then a piece every 0.2 s; the gateway's answer (not the end of the connection, which
    aiohttp may keep a while, reading what still comes), and how long it took."""
    reader, writer = await connect(url)
    writer.write(opening)

    async def trickle() -> None:
        for index in range(100):
            writer.write(piece(index))
            await asyncio.sleep(0.2)

    trickling = asyncio.create_task(trickle())
    started = time.monotonic()
    try:
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CUT_OFF_WITHIN_S)
        length = int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answer += await asyncio.wait_for(reader.readexactly(length), CUT_OFF_WITHIN_S)
        return answer, time.monotonic() - started
    finally:
        trickling.cancel()
        writer.close()


def error_code(answer: bytes) -> str:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def test_slowloris_headers_get_408_and_idle_connections_are_closed() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}, client_timeouts=FAST_CLIENTS) as (_, _, url),
        ):
            opening = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            slow = asyncio.create_task(
                trickled(url, opening, lambda index: f"X-Slow-{index}: y\r\n".encode())
            )
            reader, writer = await connect(url)  # opens and never sends a byte
            assert (await chat(url))[0] == 200
            answer, took = await slow
            assert answer.startswith(b"HTTP/1.1 408 ") and error_code(answer) == "header_timeout", answer
            assert took < CUT_OFF_WITHIN_S
            idle, took = await answer_or_eof(reader, CUT_OFF_WITHIN_S)
            assert idle == b"" and took < CUT_OFF_WITHIN_S
            writer.close()

    asyncio.run(scenario())


def test_a_trickled_body_gets_408() -> None:
    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}, client_timeouts=FAST_CLIENTS) as (_, _, url),
        ):
            opening = head("/v1/chat/completions", 10_000)
            slow = asyncio.create_task(trickled(url, opening, lambda _: b" "))
            assert (await chat(url))[0] == 200
            answer, took = await slow
            assert answer.startswith(b"HTTP/1.1 408 ") and error_code(answer) == "body_timeout", answer
            assert took < CUT_OFF_WITHIN_S
            assert len(replica.received) == 1

    asyncio.run(scenario())


UPLOADS = 40
UPLOAD_BYTES = 7 * MIB
# Before the fix the gateway held every upload: about UPLOADS x UPLOAD_BYTES (280 MiB).
UPLOAD_GROWTH_ALLOWANCE_MIB = 48


def test_unauthenticated_uploads_are_refused_before_their_bodies_are_read() -> None:
    key = ClientKey(hashlib.sha256(b"tenant-key").digest())
    piece = b" " * (64 * 1024)

    async def upload(url: str) -> bytes:
        """Sends most of an 8 MiB body and never the rest; what the gateway answered."""
        reader, writer = await connect(url)
        try:
            writer.write(head("/v1/chat/completions", 8 * MIB, Authorization="Bearer wrong"))
            for _ in range(UPLOAD_BYTES // len(piece)):
                writer.write(piece)
                await asyncio.wait_for(writer.drain(), CUT_OFF_WITHIN_S)
        except (ConnectionError, TimeoutError):
            pass  # the gateway stopped reading: nothing it holds
        try:
            return await asyncio.wait_for(reader.readuntil(b"\r\n"), CUT_OFF_WITHIN_S)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            return b""
        finally:
            writer.close()

    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica, client_key=key)}) as (gateway, _, url),
        ):
            baseline_kb = reset_peak_rss()
            answers = await asyncio.gather(*(upload(url) for _ in range(UPLOADS)))
            growth_mib = (proc_status_kb("VmHWM") - baseline_kb) / 1024
            assert growth_mib < UPLOAD_GROWTH_ALLOWANCE_MIB, growth_mib
            assert answers == [b"HTTP/1.1 401 Unauthorized\r\n"] * UPLOADS
            assert gateway.body_budget.held == 0
            assert (await chat(url, Authorization="Bearer tenant-key"))[0] == 200
            assert len(replica.received) == 1

    asyncio.run(scenario())


def test_bodies_held_at_once_stay_within_the_budget() -> None:
    budget = 4 * MIB

    async def scenario() -> None:
        async with (
            replicas(FakeReplica("r")) as (replica,),
            running_gateway({"m": model("m", replica)}, max_buffered_body_bytes=budget) as (gateway, _, url),
        ):
            writers = []
            for _ in range(8):
                reader, writer = await connect(url)
                writer.write(head("/v1/chat/completions", 2 * MIB) + b" " * (MIB + 512 * 1024))
                writers.append((reader, writer))
            # The first uploads take the budget; the others are refused, 429, instead of being held.
            refused = 0
            for reader, _ in writers[2:]:
                line = await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)
                refused += line.startswith(b"HTTP/1.1 429 ")
            assert refused >= 5 and gateway.body_budget.held <= budget
            for _, writer in writers:
                writer.close()
            await wait_until(lambda: gateway.body_budget.held == 0)
            assert (await chat(url))[0] == 200
            assert len(replica.received) == 1

    asyncio.run(scenario())


def test_a_replica_that_never_answers_or_stalls_mid_stream_is_cut_off() -> None:
    """A stalled stream is resumed elsewhere: with no other replica of its model within the hold time, the
    client gets the pool's error as the stream's end."""

    async def scenario() -> None:
        async with replicas(
            FakeReplica("mute", gated=True),
            FakeReplica("stall", pause_after_first_chunk=True),
            FakeReplica("ok"),
        ) as (mute, stall, ok):
            stall_model = model("stall", stall, hold_seconds=1.0)
            models = {"mute": model("mute", mute), "stall": stall_model, "m": model("m", ok)}
            async with running_gateway(models, upstream_timeouts=FAST_UPSTREAM) as (gateway, _, url):
                started = time.monotonic()
                silent = asyncio.create_task(chat(url, {**CHAT, "model": "mute"}))
                stalled = asyncio.create_task(chat(url, {**CHAT, "model": "stall", "stream": True}))
                assert (await chat(url))[0] == 200
                status, body = await asyncio.wait_for(silent, CUT_OFF_WITHIN_S)
                assert status == 504 and json.loads(body)["error"]["code"] == "upstream_timeout"
                status, body = await asyncio.wait_for(stalled, CUT_OFF_WITHIN_S)
                events = body.decode().split("\n\n")
                assert status == 200 and "chatcmpl-stall" in events[0]
                assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "no_ready_replica"
                assert events[2] == "data: [DONE]"
                assert time.monotonic() - started < CUT_OFF_WITHIN_S
                # Both replicas learnt that the gateway gave up, and their places are free again.
                await asyncio.wait_for(mute.disconnected.wait(), WAIT_S)
                await asyncio.wait_for(stall.disconnected.wait(), WAIT_S)
                for name in ("mute", "stall"):
                    await wait_until(lambda name=name: gateway.fleet.pools[name].replicas[0].in_flight == 0)

    asyncio.run(scenario())


@asynccontextmanager
async def endless_replica(path: str, content_type: str) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A replica that answers GET or POST `path` with a body that never ends, as fast as it is read: its
    URL, and an event set once a client of it has gone away."""
    gone = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": content_type})
        await response.prepare(request)
        line = (
            b"data: %s\n\n" % json.dumps(_filler_chunk()).encode()
            if path != "/metrics"
            else b"# filler\n" * 8192
        )
        try:
            while True:
                await response.write(line)
        except (asyncio.CancelledError, ConnectionError):
            gone.set()
            raise

    app = web.Application()
    app.router.add_route("*", path, endless)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", gone
    finally:
        await runner.cleanup()


def _filler_chunk() -> dict[str, object]:
    """A chat chunk of 64 KiB of text, as a replica streams it."""
    choice = {"index": 0, "delta": {"content": "x" * 64 * 1024}, "logprobs": None, "finish_reason": None}
    return {"id": "chatcmpl-endless", "object": "chat.completion.chunk", "created": 0, "model": "endless",
            "choices": [choice]}  # fmt: skip


def test_a_client_that_stops_reading_a_stream_is_dropped_and_frees_the_replica() -> None:
    async def scenario() -> None:
        async with (
            endless_replica("/v1/chat/completions", "text/event-stream") as (endless_url, gone),
            replicas(FakeReplica("ok")) as (ok,),
        ):
            models = {"endless": model("endless", endless_url), "m": model("m", ok)}
            async with running_gateway(models, client_timeouts=FAST_CLIENTS) as (gateway, _, url):
                host, port = url.removeprefix("http://").split(":")
                client = socket.socket()
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                client.setblocking(False)
                await asyncio.get_running_loop().sock_connect(client, (host, int(port)))
                reader, writer = await asyncio.open_connection(sock=client)
                body = json.dumps({**CHAT, "model": "endless", "stream": True}).encode()
                writer.write(head("/v1/chat/completions", len(body)) + body)
                assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200 ")
                started = time.monotonic()  # and from now on the client reads nothing
                assert (await chat(url))[0] == 200
                await asyncio.wait_for(gone.wait(), CUT_OFF_WITHIN_S)
                assert time.monotonic() - started < CUT_OFF_WITHIN_S
                await wait_until(lambda: gateway.fleet.pools["endless"].replicas[0].in_flight == 0)
                writer.close()

    asyncio.run(scenario())


# Before the fix a poll read an endless page for its whole 2-second deadline: hundreds of MiB.
METRICS_GROWTH_ALLOWANCE_MIB = 48


def test_an_endless_metrics_page_is_read_no_further_than_the_cap() -> None:
    async def scenario() -> None:
        async with (
            endless_replica("/metrics", "text/plain") as (endless_url, gone),
            replicas(FakeReplica("ok", adapters=["sql-lora"])) as (ok,),
        ):
            models = {"endless": model("endless", endless_url), "m": model("m", ok)}
            baseline_kb = reset_peak_rss()
            async with running_gateway(models, adapter_poll_seconds=0.2) as (gateway, _, url):
                await wait_until(lambda: "sql-lora" in gateway.fleet.pools)
                for _ in range(3):
                    gone.clear()
                    await asyncio.wait_for(gone.wait(), WAIT_S)  # a poll read its cap and hung up
                assert (await chat(url))[0] == 200
            growth_mib = (proc_status_kb("VmHWM") - baseline_kb) / 1024
            assert growth_mib < METRICS_GROWTH_ALLOWANCE_MIB, growth_mib

    asyncio.run(scenario())


def test_hop_by_hop_headers_and_a_clients_forwarded_for_are_not_forwarded() -> None:
    async def scenario() -> None:
        async with replicas(FakeReplica("r")) as (replica,):
            spoofed = {"Connection": "keep-alive, X-Hop", "X-Hop": "secret", "X-Forwarded-For": "6.6.6.6"}
            async with running_gateway({"m": model("m", replica)}) as (_, _, url):
                assert (await chat(url, **spoofed))[0] == 200
            trusted = [ipaddress.ip_network("127.0.0.0/8")]
            async with running_gateway({"m": model("m", replica)}, trusted_proxies=trusted) as (_, _, url):
                assert (await chat(url, **spoofed))[0] == 200
            direct, proxied = replica.headers
            assert "X-Hop" not in direct and direct["X-Forwarded-For"] == "127.0.0.1"
            assert "X-Hop" not in proxied and proxied["X-Forwarded-For"] == "6.6.6.6, 127.0.0.1"

    asyncio.run(scenario())
