"""Multi-turn chat offline: conversations that carry their whole history in every request.

Each user sends a turn, waits for the answer, and sends the next at once: the prompt of turn t is the shared
system prompt, every earlier user message and every earlier answer (the tokens the model generated), then
the new message. All users start together. The same conversations run with prefix caching on and off, and
each run reports the prefill tokens the model computed and the time to first token of each turn, from the
request's arrival at the engine to its first token. Greedy decoding with a fixed answer length makes both
runs hold the same conversations, which the benchmark checks.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class MultiTurnSettings:
    num_users: int = 32
    num_turns: int = 10
    system_prompt_len: int = 64
    user_message_len: int = 48
    answer_len: int = 32
    seed: int = 0


@dataclass
class MultiTurnRun:
    prefix_caching: bool
    seconds: float
    prompt_tokens: int
    prefill_tokens_computed: int
    # Where the cached tokens came from: the device's prefix cache, and the host tier (in tokens).
    device_hit_tokens: int
    host_hit_tokens: int
    # Per turn (index 0 is turn 1): each user's time to first token, in seconds.
    ttft_by_turn: list[list[float]]
    answers: dict[tuple[int, int], list[int]] = field(repr=False)

    def median_ttft(self, turn: int) -> float:
        return statistics.median(self.ttft_by_turn[turn])


@dataclass
class MultiTurnReport:
    settings: MultiTurnSettings
    cached: MultiTurnRun
    uncached: MultiTurnRun

    @property
    def prefill_saved(self) -> float:
        return 1 - self.cached.prefill_tokens_computed / self.uncached.prefill_tokens_computed


def _messages(settings: MultiTurnSettings, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each user's messages, random token ids past the special ones."""
    rng = random.Random(settings.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(16, vocab_size) for _ in range(count)]

    system = tokens(settings.system_prompt_len)
    messages = [
        [tokens(settings.user_message_len) for _ in range(settings.num_turns)]
        for _ in range(settings.num_users)
    ]
    return system, messages


def run_conversations(llm: LLM, settings: MultiTurnSettings, *, prefix_caching: bool) -> MultiTurnRun:
    engine = llm.llm_engine
    system, messages = _messages(settings, engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=settings.answer_len, ignore_eos=True)
    histories = [list(system) for _ in range(settings.num_users)]
    ttft_by_turn: list[list[float]] = [[] for _ in range(settings.num_turns)]
    answers: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = 0
    before = engine.stats

    def send(user: int, turn: int) -> None:
        nonlocal prompt_tokens
        histories[user] += messages[user][turn]
        prompt_tokens += len(histories[user])
        engine.add_request(f"user{user}-turn{turn}", list(histories[user]), params)

    start = time.monotonic()
    for user in range(settings.num_users):
        send(user, 0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished:
                continue
            user, turn = _ids(output)
            answer = output.outputs[0].token_ids
            answers[user, turn] = list(answer)
            ttft_by_turn[turn].append(_ttft(output))
            histories[user] += answer
            if turn + 1 < settings.num_turns:
                send(user, turn + 1)
    after = engine.stats
    host_blocks = after.kv_offload_prefix_blocks_loaded - before.kv_offload_prefix_blocks_loaded
    return MultiTurnRun(
        prefix_caching=prefix_caching,
        seconds=time.monotonic() - start,
        prompt_tokens=prompt_tokens,
        prefill_tokens_computed=after.num_prefill_tokens_computed - before.num_prefill_tokens_computed,
        device_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
        host_hit_tokens=host_blocks * engine.config.block_size,
        ttft_by_turn=ttft_by_turn,
        answers=answers,
    )


def _ids(output: RequestOutput) -> tuple[int, int]:
    user, turn = output.request_id.removeprefix("user").split("-turn")
    return int(user), int(turn)


def _ttft(output: RequestOutput) -> float:
    metrics = output.metrics
    if metrics is None or metrics.first_token_time is None:
        raise RuntimeError(f"request {output.request_id} finished without a first-token time")
    return metrics.first_token_time - metrics.arrival_time


def run_multi_turn(
    model_path: str,
    settings: MultiTurnSettings,
    *,
    engine_options: dict,
    log: Callable[[str], None],
) -> MultiTurnReport:
    runs = {}
    for prefix_caching in (True, False):
        llm = LLM(model_path, **{**engine_options, "enable_prefix_caching": prefix_caching})
        log(f"warming up (prefix caching {'on' if prefix_caching else 'off'})")
        llm.generate(
            [[16] * 32] * 4, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        log(f"{settings.num_users} users x {settings.num_turns} turns")
        runs[prefix_caching] = run_conversations(llm, settings, prefix_caching=prefix_caching)
        del llm
    cached, uncached = runs[True], runs[False]
    if cached.answers != uncached.answers:
        raise RuntimeError("the conversations differ with prefix caching on and off")
    return MultiTurnReport(settings, cached, uncached)
