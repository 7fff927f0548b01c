"""What crosses the socket between API server processes and the EngineCore process.

Each side sends msgpack-encoded tagged structs over one ZeroMQ ROUTER/DEALER pair: an API server (a DEALER
whose identity is its client index) sends Hello once, then AddRequest, AbortRequests, RemoveLoRA,
ResetPrefixCache, Sleep and WakeUp; the core
answers Hello with Ready (or Failed, if the model could not be loaded) and after every step sends each client
one EngineCoreOutputs with that client's outputs and the scheduler's stats. Sleep and WakeUp are answered
with UtilityDone, once every client has been sent the stats that show the engine's new sleep level.
"""

from __future__ import annotations

import msgspec
from kvfleet.runtime.core.outputs import EngineCoreOutput, SchedulerStats
from kvfleet.runtime.lora.request import LoRARequest
from kvfleet.runtime.multimodal.inputs import MultiModalFeature
from kvfleet.runtime.sampling_params import SamplingParams


class Hello(msgspec.Struct, tag="hello", array_like=True):
    client_index: int


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """One sequence to generate: a request with n > 1 arrives as n of these, with their own ids."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    deadline: float | None = None
    lora_request: LoRARequest | None = None
    # The prompt's images and audio clips, preprocessed, in prompt order; their placeholder tokens are in
    # prompt_token_ids.
    mm_features: list[MultiModalFeature] = []
    # vLLM's: a tenant's salt keeps its prompts' prefix-cache blocks apart from everyone else's.
    cache_salt: str | None = None
    # A continuation's: the output tokens this sequence already delivered (from another replica). They are
    # computed with the prompt and count as output (max_tokens, penalties, the seed's draws, the grammar).
    resumed_token_ids: list[int] = []


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class RemoveLoRA(msgspec.Struct, tag="remove_lora", array_like=True):
    """An adapter its API server no longer serves: its weights leave the engine."""

    lora_int_id: int


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget every cached prefix block, on the device and in the host tier."""


class Sleep(msgspec.Struct, tag="sleep", array_like=True):
    """vLLM's sleep mode (see EngineCore.sleep); answered once the engine is asleep."""

    call_id: int
    level: int
    mode: str


class WakeUp(msgspec.Struct, tag="wake_up", array_like=True):
    """Take back what sleep freed: the tags ("weights", "kv_cache") named, or everything (None)."""

    call_id: int
    tags: list[str] | None


class UtilityDone(msgspec.Struct, tag="utility_done", array_like=True):
    """The answer to a Sleep or WakeUp: error_kind (an EngineError kind, see errors.py) None when it
    succeeded."""

    call_id: int
    error_kind: str | None = None
    message: str = ""


class EngineInfo(msgspec.Struct, array_like=True):
    """What the front end needs to know about the loaded engine."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    attention_backend: str
    device: str
    dtype: str
    # The model's hidden size: the width of prompt embeddings.
    hidden_size: int


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo
    # Seconds by phase of the core process's start (startup_phases.py), for the API server's /metrics.
    startup_phases: dict[str, float] = {}


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class RequestError(msgspec.Struct, array_like=True):
    """A request the core finished without an answer; `kind` is an EngineError kind (see errors.py)."""

    request_id: str
    kind: str
    message: str


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    stats: SchedulerStats
    outputs: list[EngineCoreOutput] = []
    errors: list[RequestError] = []
    # Requests scheduled for the first time in this step, and when the step was scheduled (monotonic).
    started: list[str] = []
    step_time: float = 0.0


ToCore = Hello | AddRequest | AbortRequests | RemoveLoRA | ResetPrefixCache | Sleep | WakeUp
FromCore = Ready | Failed | EngineCoreOutputs | UtilityDone


def to_core_decoder() -> msgspec.msgpack.Decoder[ToCore]:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder[FromCore]:
    return msgspec.msgpack.Decoder(FromCore)
