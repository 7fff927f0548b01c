"""A request with n > 1 is n sequences, each scheduled on its own: their ids and seeds, and what a
continuation brings of each."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvfleet.runtime.engine.messages import AddRequest
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ResumedSequence:
    """What a sequence of a continuation already delivered elsewhere: its output tokens, and whether it
    finished there (then it is not run again)."""

    token_ids: list[int]
    finished: bool = False


def sequence_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{index}" for index in range(n)]


def sequence_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    eos_token_id: int | None,
    other_end_token_ids: tuple[int, ...] = (),
    arrival_time: float,
    priority: int = 0,
    timeout: float | None = None,
    lora_request: LoRARequest | None = None,
    mm_features: list[MultiModalFeature] | None = None,
    cache_salt: str | None = None,
    resumed: Mapping[int, ResumedSequence] | None = None,
) -> list[AddRequest]:
    """One AddRequest per sequence still to run (`resumed`, by sequence index: what a continuation brings);
    sequence i of a seeded request draws from seed + i. The model's `other_end_token_ids` end each sequence
    as stop tokens do (their id its stop reason), as in vLLM, unless it ignores the end of sequence."""
    deadline = arrival_time + timeout if timeout is not None else None
    resumed = resumed or {}
    missing = [token_id for token_id in other_end_token_ids if token_id not in params.stop_token_ids]
    if missing and not params.ignore_eos:
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])
    requests = []
    for index, sequence_id in enumerate(sequence_ids(request_id, params.n)):
        already = resumed.get(index)
        if already is not None and already.finished:
            continue
        sequence_params = params
        if params.n > 1:
            seed = params.seed + index if params.seed is not None else None
            sequence_params = dataclasses.replace(params, n=1, seed=seed)
        requests.append(
            AddRequest(
                request_id=sequence_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=sequence_params,
                eos_token_id=eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                deadline=deadline,
                lora_request=lora_request,
                mm_features=mm_features or [],
                cache_salt=cache_salt,
                resumed_token_ids=list(already.token_ids) if already is not None else [],
            )
        )
    return requests
