"""A non-streamed answer made of a streamed one: the gateway streams every generation from its replicas (so
that it can resume it on another), and answers a client that did not ask for a stream with the body a replica
would have sent: each choice's text or message (content, reasoning, tool calls merged by index), log
probabilities, finish and stop reasons, and token ids when asked; the usage last."""

from __future__ import annotations

from typing import Any

# A completions choice's log probabilities: lists that a stream sends a piece of in each chunk.
_COMPLETION_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class Assembly:
    """The chunks a client would have been streamed, gathered into the answer."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._calls: dict[int, dict[int, dict[str, Any]]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {name: chunk.get(name) for name in ("id", "created", "model")}
        if "prompt_token_ids" in chunk:
            self.head["prompt_token_ids"] = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            entry = self._choices.setdefault(choice["index"], self._empty(choice["index"]))
            self._add_choice(entry, choice)

    def answer(self, usage_chunk: dict[str, Any] | None) -> dict[str, Any]:
        choices = []
        for index, entry in sorted(self._choices.items()):
            if self.chat:
                entry["message"] = self._message(entry.pop("_content"), entry["message"], index)
            choices.append(entry)
        answer = {
            "id": self.head.get("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.head.get("created"),
            "model": self.head.get("model"),
            "choices": choices,
            "usage": usage_chunk.get("usage") if usage_chunk is not None else None,
        }
        if "prompt_token_ids" in self.head:
            answer["prompt_token_ids"] = self.head["prompt_token_ids"]
        return answer

    def _empty(self, index: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if self.chat:
            entry.update(message={"role": "assistant"}, _content=[])
        else:
            entry["text"] = ""
        return entry

    def _add_choice(self, entry: dict[str, Any], choice: dict[str, Any]) -> None:
        if choice.get("finish_reason") is not None:
            entry["finish_reason"] = choice["finish_reason"]
            entry["stop_reason"] = choice.get("stop_reason")
        if "prompt_token_ids" in choice:
            entry["prompt_token_ids"] = choice["prompt_token_ids"]
        if "token_ids" in choice:
            entry["token_ids"] = entry.get("token_ids", []) + choice["token_ids"]
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            entry["logprobs"] = _merged_logprobs(entry["logprobs"], logprobs, self.chat)
        if not self.chat:
            entry["text"] += choice.get("text") or ""
            return
        delta = choice.get("delta") or {}
        if delta.get("content"):
            entry["_content"].append(delta["content"])
        for name in ("reasoning_content", "reasoning"):
            if delta.get(name):
                entry["message"][name] = (entry["message"].get(name) or "") + delta[name]
        for call in delta.get("tool_calls") or ():
            self._add_call(entry["index"], call)

    def _add_call(self, choice_index: int, delta: dict[str, Any]) -> None:
        calls = self._calls.setdefault(choice_index, {})
        call = calls.get(delta["index"])
        function = delta.get("function") or {}
        if call is None:
            calls[delta["index"]] = {
                "id": delta.get("id"),
                "type": delta.get("type", "function"),
                "function": {"name": function.get("name"), "arguments": function.get("arguments") or ""},
            }
        else:
            call["function"]["arguments"] += function.get("arguments") or ""

    def _message(self, content: list[str], message: dict[str, Any], index: int) -> dict[str, Any]:
        """A chat choice's message: its content (None where only calls or reasoning were said, as a replica
        answers), reasoning and calls."""
        text = "".join(content)
        calls = [call for _, call in sorted(self._calls.get(index, {}).items())]
        said_else = bool(calls) or "reasoning_content" in message
        message = {**message, "content": text if text.strip() or not said_else else None}
        if calls:
            message["tool_calls"] = calls
        return message


def _merged_logprobs(merged: dict[str, Any] | None, piece: dict[str, Any], chat: bool) -> dict[str, Any]:
    if chat:
        return {"content": (merged or {}).get("content", []) + (piece.get("content") or [])}
    merged = merged or {}
    return {name: merged.get(name, []) + (piece.get(name) or []) for name in _COMPLETION_LOGPROB_LISTS}
