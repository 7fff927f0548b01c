"""The service's guardrails: input checked beside the request's queueing, output checked in windows while
streaming (and whole otherwise), and the errors and finish reasons clients see.

Input checks that block or flag run concurrently with the request: it is queued and prefilled while the
checkers run, and its first output waits for their verdict, so they add to the time to first token only
what they take beyond the queueing and prefill. A blocked input aborts the request (its blocks are freed)
and answers 400 `content_filter`. Redacting input has to happen before the prompt is tokenized, so it
runs first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from kvfleet.contract.errors import BadRequestError, OpenAIError
from kvfleet.contract.tiers import TIERS
from kvfleet.runtime.chat_prompt import chat_prompt_token_ids
from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.errors import EngineError
from kvfleet.runtime.request import PromptTokenLogprobs
from kvfleet.runtime.safety.checker import Checker, CheckerUnavailableError, Direction
from kvfleet.runtime.safety.config import GUARD_SELF, GuardConfig, Policy, SafetyConfig
from kvfleet.runtime.safety.guard import GuardCompletion, GuardModelChecker, http_guard_completion
from kvfleet.runtime.safety.guardrails import Decision, Guardrails, SafetyMetrics, redact
from kvfleet.runtime.safety.hook import HookChecker
from kvfleet.runtime.safety.rules import RuleChecker

if TYPE_CHECKING:
    from kvfleet.runtime.engine.protocol import EngineClient
    from kvfleet.runtime.metrics import ServerMetrics

CONTENT_FILTER = "content_filter"


class ContentFilterError(BadRequestError):
    """A 400 for an input the policy blocks; the error names the categories and explains the refusal."""

    def __init__(self, decision: Decision, refusal: str) -> None:
        super().__init__(f"{refusal} ({decision.explanation(Direction.INPUT)})", code=CONTENT_FILTER)
        self.categories = decision.categories

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["categories"] = self.categories
        return body


class ServerGuardrails(Guardrails):
    """Guardrails with the HTTP client their remote checkers share, closed with the service."""

    def __init__(self, config: SafetyConfig, metrics: ServerMetrics, engine: EngineClient) -> None:
        self._client = httpx.AsyncClient()
        checkers: dict[str, Checker] = {}
        if config.rules is not None:
            checkers["rules"] = RuleChecker(config.rules)
        if config.guard is not None:
            checkers["guard"] = GuardModelChecker(config.guard, self._guard_completion(config.guard, engine))
        if config.hook is not None:
            checkers["hook"] = HookChecker(config.hook, self._client)
        super().__init__(config, checkers, SafetyMetrics(metrics.model_name, metrics.registry))

    def _guard_completion(self, config: GuardConfig, engine: EngineClient) -> GuardCompletion:
        if config.endpoint == GUARD_SELF:
            return _engine_guard_completion(config, engine)
        return http_guard_completion(config, self._client)

    async def aclose(self) -> None:
        await self._client.aclose()


def _engine_guard_completion(config: GuardConfig, engine: EngineClient) -> GuardCompletion:
    """The guard prompt run on this server's own model, in the most urgent tier so that it does not queue
    behind the requests it guards."""
    from kvfleet.runtime.serving.protocol import ChatCompletionRequest, template_messages

    async def complete(messages: list[dict[str, str]], body: dict[str, Any]) -> str:
        try:
            request = ChatCompletionRequest.model_validate({**body, "messages": messages})
            params = request.sampling_params()
        except (ValueError, OpenAIError) as exc:
            raise CheckerUnavailableError(f"the guard request is invalid: {exc}") from None
        conversation = template_messages(request.messages)

        def prompt(tokenizer: Any) -> list[int]:
            return chat_prompt_token_ids(tokenizer, conversation, add_generation_prompt=True)

        async def run() -> str:
            token_ids = await engine.run_tokenizer(prompt)
            pieces = []
            outputs = engine.generate(
                f"guard-{uuid.uuid4().hex}", token_ids, params, priority=TIERS["critical"]
            )
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    pieces.append(output.outputs[0].text)
            return "".join(pieces)

        try:
            async with asyncio.timeout(config.timeout):
                return await run()
        except (EngineError, TimeoutError) as exc:
            raise CheckerUnavailableError(f"this server's model could not judge: {exc!r}") from None

    return complete


@dataclass
class RequestSafety:
    """The guardrails of one request: its tier's policy, the user's text that outputs are judged against,
    and its input's verdict (pending while the request queues)."""

    guardrails: Guardrails
    policy: Policy
    prompt: str | None = None
    input_verdict: asyncio.Task[Decision] | None = None

    @property
    def checks_input(self) -> bool:
        return self.guardrails.checks(self.policy, Direction.INPUT)

    @property
    def checks_output(self) -> bool:
        return self.guardrails.checks(self.policy, Direction.OUTPUT)

    def start_input_check(self, text: str) -> None:
        if self.checks_input:
            self.input_verdict = asyncio.ensure_future(
                self.guardrails.check(self.policy, text, Direction.INPUT)
            )

    async def checked_input(self, text: str) -> Decision:
        """The policy's decision on the input, made before the request runs; a blocked input is refused.
        Its text is the input as the model may see it, redacted where need be."""
        decision = await self.guardrails.check(self.policy, text, Direction.INPUT)
        if decision.blocked:
            raise ContentFilterError(decision, self.policy.refusal)
        return decision

    async def refuse_unredacted(self, rendered: str) -> None:
        """Refuses a conversation whose rendered prompt, its messages redacted, still holds what the policy
        redacts: only message text can be redacted, not what else the template puts in (tools, calls)."""
        decision = await self.checked_input(rendered)
        if decision.text != rendered:
            raise BadRequestError(
                "the conversation holds text the safety policy redacts outside the text of its messages "
                f"(in tools or tool calls): {', '.join(decision.categories)}",
                param="messages",
                code=CONTENT_FILTER,
            )

    @property
    def redacts_input(self) -> bool:
        return self.policy.action == "redact" and self.checks_input

    async def after_input_check(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """`outputs`, started at once; the first is let through once the input's verdict allows it. A
        blocked input closes `outputs`, which aborts the request."""
        verdict = self.input_verdict
        async with contextlib.aclosing(outputs):
            if verdict is None:
                async for item in outputs:
                    yield item
                return
            first = asyncio.ensure_future(anext(outputs))
            try:
                decision = await verdict
                if decision.blocked:
                    raise ContentFilterError(decision, self.policy.refusal)
                item = await first
            except StopAsyncIteration:
                return
            finally:
                # Blocked, failed or cancelled (the client gone): the engine request is aborted by the
                # cancelled wait, before `outputs` is closed.
                verdict.cancel()
                if not first.done():
                    first.cancel()
                    with contextlib.suppress(asyncio.CancelledError, EngineError):
                        await first
                elif not first.cancelled():
                    first.exception()  # an engine error of a request refused anyway is not news
            yield item
            async for item in outputs:
                yield item

    async def output_windows(
        self, outputs: AsyncIterator[RequestOutput], request_ids: list[str], n: int
    ) -> AsyncIterator[RequestOutput]:
        """`outputs` (of the engine requests `request_ids`, n sequences each) held back per sequence until
        `window_tokens` tokens (or the end) are checked. A window that is blocked is never sent: every
        sequence still running ends with finish reason `content_filter`, the blocked one with the refusal
        text, and the request is aborted (closing `outputs` aborts it)."""
        windows = {(request_id, i): _Window() for request_id in request_ids for i in range(n)}
        # Each request's prompt logprobs, until they go out with its first window released.
        prompt_logprobs: dict[str, list[PromptTokenLogprobs | None]] = {}
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                if output.prompt_logprobs is not None:
                    prompt_logprobs[output.request_id] = output.prompt_logprobs
                released = []
                for completion in output.outputs:
                    window = windows[output.request_id, completion.index]
                    window.hold(completion)
                    if window.held_tokens < self.policy.window_tokens and completion.finish_reason is None:
                        continue
                    checked = await self._checked_window(window)
                    if checked is None:
                        for refusal in self._refusals(windows, (output.request_id, completion.index)):
                            yield refusal
                        return
                    released.append(window.release(checked))
                if released:
                    yield _with_outputs(output, released, prompt_logprobs.pop(output.request_id, None))

    async def _checked_window(self, window: _Window) -> str | None:
        """The held text to send (redacted if need be), or None when the window is blocked. The checkers
        see the whole output so far, so that what spans windows is found."""
        sent, held = window.sent_text, window.held_text
        decision = await self.guardrails.check(self.policy, sent + held, Direction.OUTPUT, self.prompt)
        if decision.blocked:
            return None
        if decision.text == sent + held:
            return held
        # Only what is still held can be redacted.
        offset = len(sent)
        spans = [
            dataclasses.replace(f, span=(max(f.span[0], offset) - offset, f.span[1] - offset))
            for f in decision.findings
            if f.span is not None and f.span[1] > offset
        ]
        return redact(held, spans)

    def _refusals(
        self, windows: dict[tuple[str, int], _Window], blocked: tuple[str, int]
    ) -> list[RequestOutput]:
        """The last outputs of a blocked request: each sequence not yet finished ends here."""
        ended: dict[str, list[CompletionOutput]] = {}
        for (request_id, index), window in windows.items():
            if window.finished and (request_id, index) != blocked:
                continue
            text = self.policy.refusal if (request_id, index) == blocked else ""
            ended.setdefault(request_id, []).append(
                CompletionOutput(index, text, [], None, None, finish_reason=CONTENT_FILTER)
            )
        return [
            RequestOutput(request_id, None, [], completions, True)
            for request_id, completions in ended.items()
        ]

    async def checked_text(self, text: str) -> tuple[str, bool]:
        """A whole (non-streamed) output: the text to answer with, and whether the output was blocked (the
        text is then the refusal)."""
        decision = await self.guardrails.check(self.policy, text, Direction.OUTPUT, self.prompt)
        if decision.blocked:
            return self.policy.refusal, True
        return decision.text, False


def sent_tokens(
    token_ids: list[int], logprobs: list[dict[int, float]] | None, *, blocked: bool, redacted: bool
) -> tuple[list[int], list[dict[int, float]] | None]:
    """What of an output's tokens goes to the client with its checked text. Logprobs spell out their tokens,
    so they go only with the text as the model wrote it: a redacted text is sent without them (its tokens
    still count in the usage), and a blocked one, never sent, has no tokens at all."""
    if blocked:
        return [], None
    if redacted:
        return token_ids, None
    return token_ids, logprobs


@dataclass
class _Window:
    """One sequence's output: what has been sent, and the deltas held back until checked."""

    sent_text: str = ""
    held: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False

    @property
    def held_tokens(self) -> int:
        return sum(len(completion.token_ids) for completion in self.held)

    @property
    def held_text(self) -> str:
        return "".join(completion.text for completion in self.held)

    def hold(self, completion: CompletionOutput) -> None:
        self.held.append(completion)

    def release(self, checked_text: str) -> CompletionOutput:
        """The held deltas as one, with the checked (maybe redacted) text of them."""
        held, self.held = self.held, []
        held_text = "".join(completion.text for completion in held)
        self.sent_text += held_text
        last = held[-1]
        self.finished = last.finish_reason is not None
        logprobs = (
            [entry for c in held for entry in c.logprobs or ()] if any(c.logprobs for c in held) else None
        )
        token_ids, logprobs = sent_tokens(
            [token for c in held for token in c.token_ids],
            logprobs,
            blocked=False,
            redacted=checked_text != held_text,
        )
        return CompletionOutput(
            last.index,
            checked_text,
            token_ids,
            last.cumulative_logprob,
            logprobs,
            last.finish_reason,
            last.stop_reason,
        )


def _with_outputs(
    output: RequestOutput,
    completions: list[CompletionOutput],
    prompt_logprobs: list[PromptTokenLogprobs | None] | None,
) -> RequestOutput:
    return RequestOutput(
        output.request_id,
        output.prompt,
        output.prompt_token_ids,
        completions,
        all(c.finish_reason is not None for c in completions) and output.finished,
        output.num_cached_tokens,
        output.metrics,
        prompt_logprobs=prompt_logprobs,
    )
