"""A request with n > 1 is n sequences, each scheduled on its own: their ids and seeds."""

from __future__ import annotations

import dataclasses

from kvfleet.runtime.engine.messages import AddRequest
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.sampling_params import SamplingParams


def sequence_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{index}" for index in range(n)]


def sequence_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    eos_token_id: int | None,
    arrival_time: float,
    priority: int = 0,
    timeout: float | None = None,
    lora_request: LoRARequest | None = None,
    mm_features: list[MultiModalFeature] | None = None,
    cache_salt: str | None = None,
) -> list[AddRequest]:
    """One AddRequest per sequence; sequence i of a seeded request draws from seed + i."""
    deadline = arrival_time + timeout if timeout is not None else None
    requests = []
    for index, sequence_id in enumerate(sequence_ids(request_id, params.n)):
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
            )
        )
    return requests
