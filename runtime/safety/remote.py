"""Calls to the checkers that are other services (a guard model's server, a hook), under one deadline for
the whole exchange, from connecting to the answer's last byte, and a cap on the answer's size.

httpx's own timeout bounds each read, not the exchange: a server that sends a byte now and then would hold a
check for as long as it likes. And an answer is read into memory as it comes, so its size needs a bound.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from kvfleet.runtime.safety.checker import CheckerUnavailableError

# Far more than any verdict (a guard's chat completion, a hook's map of scores) takes.
MAX_ANSWER_BYTES = 1 << 20


async def post_json(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    deadline: float,
    what: str,
    headers: dict[str, str] | None = None,
) -> Any:
    """The JSON answer of `url` to `body`. Raises CheckerUnavailableError, naming `what` answered, when
    there is none within `deadline` seconds, the status is not 200, the answer is longer than
    MAX_ANSWER_BYTES or not JSON."""
    try:
        async with asyncio.timeout(deadline):
            async with client.stream("POST", url, json=body, headers=headers, timeout=deadline) as response:
                if response.status_code != 200:
                    raise CheckerUnavailableError(f"{what} answered {response.status_code}")
                content = await _bounded_body(response, what)
    except TimeoutError:
        raise CheckerUnavailableError(f"{what} gave no answer within {deadline:g} s") from None
    except httpx.HTTPError as exc:
        raise CheckerUnavailableError(f"{what} did not answer: {exc!r}") from None
    try:
        return json.loads(content)
    except ValueError:
        raise CheckerUnavailableError(f"the answer of {what} is not JSON") from None


async def _bounded_body(response: httpx.Response, what: str) -> bytes:
    # Counted as decoded: a compressed answer is bounded by what it expands to.
    content = bytearray()
    async for chunk in response.aiter_bytes():
        content += chunk
        if len(content) > MAX_ANSWER_BYTES:
            raise CheckerUnavailableError(f"the answer of {what} is longer than {MAX_ANSWER_BYTES} bytes")
    return bytes(content)
