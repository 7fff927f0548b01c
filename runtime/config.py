"""Engine options: one dataclass, validated once, exposed as `LLM(...)` keywords and `--kebab-case` flags.

Names follow vLLM's engine arguments so that users can carry their settings over unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, get_args

import click
from kvfleet.contract.engine import DType, SchedulingPolicy
from kvfleet.runtime.generation_config import configured_sampling_defaults, sampling_overrides
from kvfleet.runtime.hub import TOKENIZER_FILE_PATTERNS, resolve_model
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.kv_transfer.factory import check_connector_name
from kvfleet.runtime.list_options import ListOption
from kvfleet.runtime.multimodal.media_sources import IPNetwork, MediaOrigin, parse_networks, parse_origins
from kvfleet.runtime.pooler_config import GENERATE, Convert, PoolerConfig, Runner, pooler_config, served_tasks
from kvfleet.runtime.quantization.config import folder_weight_quantization
from kvfleet.runtime.reasoning import REASONING_PARSERS
from kvfleet.runtime.reasoning.think_tags import END_TAG, START_TAG
from kvfleet.runtime.speculative_config import SpeculativeConfig
from kvfleet.runtime.structured_outputs.config import StructuredOutputsConfig

Device = Literal["auto", "cpu", "cuda"]
# vLLM's load formats kvfleet reads: its checkpoints are safetensors.
LoadFormat = Literal["auto", "safetensors"]
# vLLM's tokenizer modes kvfleet honours: Transformers' tokenizer, its fast one where the folder has it.
TokenizerMode = Literal["auto", "hf"]
# vLLM's: what a request's logprobs hold. raw_* are of the model's logits before any sampling setting;
# processed_* after the penalties, grammar, temperature, min_p, top_k and top_p of each request.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
MODALITIES = ("image", "audio")
DEFAULT_ITEMS_PER_PROMPT = 4


# max_model_len's value for vLLM's auto: the model's context, or what the KV cache holds where it holds less.
AUTO_MAX_MODEL_LEN = -1
# vLLM's shorthand options of speculative_config, and the key each one sets.
_SPEC_SHORTHAND = (
    ("spec_method", "method"),
    ("spec_model", "model"),
    ("spec_tokens", "num_speculative_tokens"),
)
# Options that are positive numbers where set.
_POSITIVE_OR_UNSET = (
    "num_gpu_blocks_override",
    "cpu_kv_cache_space",
    "kv_cache_memory_bytes",
    "kv_offloading_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_num_scheduled_tokens",
    "max_num_active_seqs",
    "stream_interval",
    "max_loras",
    "max_lora_rank",
)


class ReasoningStrings(NamedTuple):
    """The text that opens a reasoning, the text a spent thinking_token_budget writes, and the text the model
    ends a reasoning with itself (the parser's tag; without a parser, the forced end)."""

    start: str
    forced_end: str
    natural_end: str


def _option(help: str, **kwargs: Any) -> Any:
    return field(metadata={"help": help}, **kwargs)


@dataclass
class EngineConfig:
    model: str = _option(
        "A Hugging Face model folder (config.json, safetensors weights, tokenizer), or the id (org/name) of "
        "a Hub repository that is not a path here: fetched into the Hugging Face cache (HF_HOME, "
        "HF_HUB_CACHE; read from it alone under HF_HUB_OFFLINE=1), only its weight, config and tokenizer "
        "files."
    )
    revision: str | None = _option(
        "Branch, tag or commit of a Hub model; its default branch if unset (ignored for a folder).",
        default=None,
    )
    tokenizer: str | None = _option(
        "Tokenizer folder or Hub id (tokenizer files only), if not the model's.", default=None
    )
    tokenizer_revision: str | None = _option(
        "Branch, tag or commit of a Hub tokenizer; by default the revision.", default=None
    )
    chat_template: str | None = _option(
        "Chat template replacing the tokenizer's: a file path or the Jinja text itself.", default=None
    )
    tokenizer_mode: TokenizerMode = _option(
        "vLLM's: how the tokenizer is loaded. auto and hf load it with Transformers; vLLM's slow, mistral "
        "and custom modes are refused.",
        default="auto",
    )
    download_dir: str | None = _option(
        "Where a Hub model (and a Hub tokenizer) is fetched to, in the Hugging Face cache's layout; by "
        "default the Hugging Face cache.",
        default=None,
    )
    hf_token: str | None = _option(
        "vLLM's: the Hugging Face token that downloads of a Hub model and tokenizer send (a private or gated "
        "repository's); by default HF_TOKEN's, which keeps it out of the process list.",
        default=None,
        repr=False,
    )
    load_format: LoadFormat = _option(
        "vLLM's: how the weights are read. kvfleet reads safetensors checkpoints (auto, safetensors); vLLM's "
        "other formats are refused.",
        default="auto",
    )
    dtype: DType = _option("Weights and activations dtype; auto follows config.json.", default="auto")
    quantization: str | None = _option(
        "How the checkpoint's weights are quantized, by vLLM's method name; by default read from the "
        "folder's quantization_config. kvfleet loads compressed-tensors checkpoints (int8 and int4 weights "
        "with channel or group scales, float8 weights) and refuses the other methods by name.",
        default=None,
    )
    generation_config: str = _option(
        "vLLM's: auto|vllm|FOLDER. The sampling defaults of requests that leave them unset (temperature, "
        "top_p, top_k, min_p, repetition_penalty, presence and frequency penalties, and max_new_tokens as "
        "max_tokens), and the end tokens besides the tokenizer's: auto reads the model folder's "
        "generation_config.json, FOLDER another one's (whose max_new_tokens also bounds every request "
        "served), vllm takes no defaults (vLLM's own) and the model folder's end tokens.",
        default="auto",
    )
    override_generation_config: dict[str, Any] | None = _option(
        "vLLM's: sampling defaults over generation_config's, as generation_config.json names them, e.g. "
        '\'{"temperature": 0.5, "max_new_tokens": 256}\'.',
        default=None,
    )
    hf_overrides: dict[str, Any] | None = _option(
        "vLLM's: settings over the model folder's config.json, as a JSON object, e.g. "
        "'{\"max_position_embeddings\": 32768}'. A key replaces the config's value (a dict such as "
        "rope_scaling whole); a nested model config (a text_config with its own model_type) takes the "
        "override's keys into it.",
        default=None,
    )
    runner: Runner = _option(
        "vLLM's: what the server serves. auto: generation and embeddings, from the same engine (vLLM serves "
        "one or the other); generate: generation only; pooling: embeddings only (embeddings, score, "
        "rerank). vLLM's draft is refused.",
        default="auto",
    )
    convert: Convert = _option(
        "vLLM's: how a decoder model is served. embed pools its hidden states into embeddings (with --runner "
        "auto, as --runner pooling); none serves generation only; auto as --runner says. vLLM's classify is "
        "refused.",
        default="auto",
    )
    pooler_config: dict[str, Any] | None = _option(
        "vLLM's: how embeddings are pooled, as JSON over what the folder's sentence-transformers files say: "
        '{"pooling_type": "LAST" | "MEAN" | "CLS", "use_activation": L2-normalized (true), "dimensions": a '
        "Matryoshka model's default size}. By default the last token's hidden state, normalized.",
        default=None,
    )
    device: Device = _option("Where the model runs; auto picks cuda when present.", default="auto")
    use_tqdm_on_load: bool = _option(
        "Show the checkpoint's shards loading on a progress bar (on stderr, one line a shard).", default=True
    )
    block_size: int = _option("Tokens per KV cache block.", default=16)
    num_gpu_blocks_override: int | None = _option(
        "vLLM's: KV cache blocks in the pool, on the CPU as on a GPU; by default sized from the memory "
        "budget. kvfleet's older --num-kv-blocks is taken too.",
        default=None,
    )
    gpu_memory_utilization: float = _option(
        "Fraction of GPU memory the engine may use (weights, activations, KV cache).", default=0.9
    )
    cpu_kv_cache_space: float | None = _option(
        "GiB of host memory for the KV cache on CPU; by default what max_num_seqs sequences of max_model_len "
        "tokens fill, up to 1 GiB.",
        default=None,
    )
    kv_cache_memory_bytes: int | None = _option(
        "vLLM's: bytes of KV cache on each device (on the CPU as on a GPU), in place of what "
        "gpu_memory_utilization or cpu_kv_cache_space would give; num_gpu_blocks_override, where set, still "
        "decides.",
        default=None,
    )
    kv_offloading_size: float | None = _option(
        "GiB of host memory for a second tier of KV blocks: preempted requests' KV waits there instead of "
        "being recomputed.",
        default=None,
    )
    max_num_seqs: int = _option("Most requests in one step's batch.", default=256)
    max_num_batched_tokens: int | None = _option(
        "Token budget of one step (prefill chunks and decodes together).", default=None
    )
    max_num_scheduled_tokens: int | None = _option(
        "vLLM's: the most tokens one step schedules, where fewer than max_num_batched_tokens; by default "
        "max_num_batched_tokens.",
        default=None,
    )
    max_num_active_seqs: int | None = _option(
        "vLLM's: the most requests running at once, where fewer than max_num_seqs (which still sizes the "
        "CPU's KV cache): smaller decode batches. By default max_num_seqs.",
        default=None,
    )
    max_model_len: int | None = _option(
        "Longest context (prompt + output) in tokens; by default the model's. -1 (or auto on the command "
        "line): the model's, or the most tokens the KV cache holds where it holds fewer, as vLLM's auto.",
        default=None,
    )
    stream_interval: int = _option(
        "A stream hands out its new tokens once this many are waiting (its first and its last at once): "
        "fewer, larger events for the server, the network and the clients to carry. A request's "
        "stream_interval may raise it.",
        default=1,
    )
    enable_prefix_caching: bool = _option("Reuse KV blocks of shared prompt prefixes.", default=True)
    enable_chunked_prefill: bool = _option("Split long prompts across steps within the budget.", default=True)
    long_prefill_token_threshold: int = _option(
        "vLLM's: the most prompt tokens one request computes in a step while other requests run or wait, so "
        "that a long prompt leaves the rest of the budget to them (alone it takes the whole budget); 0 for "
        "no limit. Needs chunked prefill.",
        default=0,
    )
    scheduling_policy: SchedulingPolicy = _option("fcfs, or priority (lower value first).", default="fcfs")
    max_num_queued_reqs: int | None = _option(
        "vLLM's: the most requests the API server holds unfinished (waiting or running; one of n sequences "
        "counts n). A request past it gets a 503 at once, which a load balancer or the fleet gateway retries "
        "on another replica. With several API servers each holds its share. By default none.",
        default=None,
    )
    max_num_queued_tokens: int | None = _option(
        "vLLM's: once the prompts of the requests waiting for their first token hold this many tokens, a new "
        "request gets a 503 (a TTFT valve: about the TTFT target times the prefill tokens a second). With "
        "several API servers each holds its share. By default none.",
        default=None,
    )
    enable_sleep_mode: bool = _option(
        "vLLM's sleep mode: the engine can free its KV cache (sleep level 1; the weights stay in host "
        "memory) or its weights too (level 2) while idle, and take them back on wake-up (POST /sleep, "
        "/wake_up).",
        default=False,
    )
    attention_backend: str | None = _option(
        "Attention backend by name; by default the fastest supported one is chosen.", default=None
    )
    seed: int = _option("Seed of the engine's random generator (requests may bring their own).", default=0)
    logprobs_mode: LogprobsMode = _option(
        "vLLM's: what logprobs return. raw_logprobs (log-softmax of the model's logits) and raw_logits are "
        "taken before any sampling setting, within a structured output's grammar; processed_logprobs and "
        "processed_logits after the request's logit_bias, allowed_token_ids, bad_words, penalties, "
        "temperature, min_p, top_k and top_p (tokens those or the grammar rule out "
        "score -9999.0 in answers, as -inf cannot be written in JSON). A prompt's logprobs go through no "
        "sampling setting: its logits in the *_logits modes, their log-softmax in the others.",
        default="raw_logprobs",
    )
    enable_prompt_embeds: bool = _option(
        "vLLM's: prompts may be given as their input embeddings ([tokens, hidden size]; a completion "
        "request's prompt_embeds, a prompt dict's offline) in place of tokens.",
        default=False,
    )
    enable_lora: bool = _option("Serve LoRA adapters on top of the model.", default=False)
    max_loras: int = _option("Most LoRA adapters in one step's batch.", default=1)
    max_lora_rank: int = _option("Highest LoRA rank an adapter may have.", default=16)
    max_cpu_loras: int | None = _option(
        "LoRA adapters kept in host memory (least recently used dropped); by default max_loras.", default=None
    )
    speculative_config: dict[str, Any] | None = _option(
        'Speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", '
        '"model": DIR, "num_speculative_tokens": k}; optional "disable_by_batch_size".',
        default=None,
    )
    spec_method: str | None = _option(
        "vLLM's shorthand: speculative_config's method (ngram or draft_model).", default=None
    )
    spec_model: str | None = _option("vLLM's shorthand: speculative_config's model.", default=None)
    spec_tokens: int | None = _option(
        "vLLM's shorthand: speculative_config's num_speculative_tokens.", default=None
    )
    kv_transfer_config: dict[str, Any] | None = _option(
        'Disaggregated prefill and decode, as vLLM\'s JSON: {"kv_connector": "TcpConnector", "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both", "kv_ip": ADDRESS, "kv_port": PORT, "engine_id": ID, '
        '"kv_load_failure_policy": "recompute" | "fail", "kv_connector_extra_config": {"hold_timeout_s": s, '
        '"load_timeout_s": s, "connect_timeout_s": s, "peer_networks": [CIDR, ...]}}.',
        default=None,
    )
    kv_events_config: dict[str, Any] | None = _option(
        'KV-cache events, as vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": TOPIC, "buffer_steps": batches kept '
        'for replay, "hwm": PUB high-water mark, "max_queue_size": batches waiting to be sent, "encoding": '
        '"map" (recent vLLM\'s, the default) | "array" (earlier vLLM\'s)}. What the '
        "prefix cache stores and evicts (on the device and in the host tier) is published on a ZeroMQ PUB "
        "socket for KV-aware routers; an endpoint with a * host is bound, others are connected to.",
        default=None,
    )
    limit_mm_per_prompt: dict[str, Any] | None = _option(
        'Most multimodal items of each modality in one prompt, as JSON, e.g. \'{"image": 2, "audio": 1}\'; '
        f"by default {DEFAULT_ITEMS_PER_PROMPT} of each.",
        default=None,
    )
    max_image_pixels: int = _option(
        "Most pixels (width x height) of an image a request sends.", default=4096 * 4096
    )
    max_audio_clip_s: float | None = _option(
        "Longest audio clip, in seconds, a request may send; by default, and at most, the audio encoder's "
        "window (the feature extractor's chunk_length, 30 s for Whisper-style encoders).",
        default=None,
    )
    max_num_encoder_input_tokens: int | None = _option(
        "Encoder budget of one step, in placeholder tokens of the items encoded (images, audio clips); by "
        "default the step's token budget. Items past it wait for a later step, so that many items cannot "
        "stall decodes.",
        default=None,
    )
    allowed_media_domains: str | None = _option(
        "Comma-separated origins whose http(s) image URLs the server fetches: host (http and https on their "
        "default ports), host:port or http(s)://host[:port]; by default none (data: URLs only).",
        default=None,
    )
    allowed_local_media_path: str | None = _option(
        "vLLM's: a folder whose files (its subfolders' too, not through a link out of it) file:// image URLs "
        "may name; by default none (file: URLs are refused). Only for trusted clients: a request may read "
        "any image in it.",
        default=None,
    )
    media_fetch_timeout: float = _option(
        "Seconds a media URL's fetch may take in all (name lookup, connection, headers and body) before its "
        "request is refused.",
        default=10.0,
    )
    allowed_media_networks: str | None = _option(
        "Comma-separated networks (CIDRs or addresses) that the hosts of fetched media URLs may resolve to "
        "besides public addresses; by default none, so a host that resolves to a private, loopback, "
        "link-local or other non-public address is refused.",
        default=None,
    )
    structured_outputs_config: dict[str, Any] | None = _option(
        'Structured outputs, as vLLM\'s JSON: {"backend": "auto" | "xgrammar", "disable_any_whitespace": '
        'true, "reasoning_parser": NAME, "disable_fallback": ...}. kvfleet compiles with xgrammar and its '
        "JSON is always compact; vLLM's other backends, disable_additional_properties, enable_in_reasoning "
        "and reasoning parser plugins are refused. A reasoning_parser here is --reasoning-parser's where "
        "that is not given.",
        default=None,
    )
    reasoning_parser: str | None = _option(
        "How answers split into reasoning (a chat message's reasoning_content) and content, and where a "
        "request's thinking_token_budget counts from: qwen3 or deepseek_r1.",
        default=None,
    )
    reasoning_config: dict[str, Any] | None = _option(
        'vLLM\'s JSON: {"reasoning_start_str": ..., "reasoning_end_str": ...}: the text that opens a '
        "reasoning, and the text a request's thinking_token_budget writes once it is spent (by default the "
        "reasoning parser's tags, <think> and </think>).",
        default=None,
    )
    structured_outputs_compile_timeout: float = _option(
        "Seconds a structured-output grammar may take to compile; past them its request alone fails (a 400) "
        "and its compilation is killed.",
        default=30.0,
    )
    tensor_parallel_size: int = _option(
        "Ranks that split every layer (attention heads, MLP columns, vocabulary) between them.", default=1
    )
    pipeline_parallel_size: int = _option("Stages that split the layers between them.", default=1)
    enable_expert_parallel: bool = _option(
        "Mixture-of-experts models: each tensor-parallel rank holds whole experts (a share of them) instead "
        "of a slice of every expert; the experts' outputs are summed over the ranks all the same.",
        default=False,
    )
    distributed_executor_backend: str | None = _option(
        "How ranks run when tensor_parallel_size x pipeline_parallel_size > 1: mp (one worker process per "
        "rank, the default).",
        default=None,
    )
    nnodes: int = _option("Nodes the ranks are spread over, evenly.", default=1)
    node_rank: int = _option(
        "This node's index; node 0 serves the API, the others only their workers and GET /health.", default=0
    )
    master_addr: str = _option("Address of node 0, where the ranks meet.", default="127.0.0.1")
    master_port: int = _option(
        "Port of torch.distributed's rendezvous on node 0 when nnodes > 1 (ranks on one node meet through "
        "a file); the engine core also listens on the next one.",
        default=29501,
    )

    def __post_init__(self) -> None:
        self._merge_spec_shorthand()
        # Hub ids become the cache's folders here, once: every reader of the config sees local paths.
        self.model = resolve_model(
            self.model, self.revision, cache_dir=self.download_dir, token=self.hf_token
        )
        if self.tokenizer is not None:
            self.tokenizer = resolve_model(
                self.tokenizer,
                self.tokenizer_revision or self.revision,
                allow_patterns=TOKENIZER_FILE_PATTERNS,
                cache_dir=self.download_dir,
                token=self.hf_token,
            )
        self.validate()

    def validate(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(bool(self.model), "model must name a model folder")
        self._check_generation_config()
        # Raises ValueError naming the field.
        folder_weight_quantization(self.model, self.quantization, self.hf_overrides)
        for name in _FIELD_TYPES:
            allowed = get_args(_FIELD_TYPES[name])
            require(getattr(self, name) in allowed, f"{name} must be one of {', '.join(allowed)}")
        power_of_two = self.block_size > 0 and self.block_size & (self.block_size - 1) == 0
        require(power_of_two, "block_size must be a power of two")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be 0 or more")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            require(value is None or value >= 0, f"{name} must be 0 or more")
        for name in _POSITIVE_OR_UNSET:
            value = getattr(self, name)
            require(value is None or value > 0, f"{name} must be positive")
        self._check_scheduler_bounds()
        require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras must be at least max_loras",
        )
        speculative = self.speculative()  # raises ValueError naming what is wrong
        if speculative is not None and speculative.method == "draft_model":
            speculative.check_draft_tokenizer(self.tokenizer or self.model)
        self._check_kv_transfer()
        self._check_sleep_mode()
        self.kv_events()  # raises ValueError naming what is wrong
        self.reasoning_strings()  # likewise, and the structured outputs config too
        pooler = self.pooler()  # likewise
        if pooler.refusal is not None and GENERATE not in served_tasks(self.runner, self.convert):
            raise ValueError(f"the server would serve embeddings only, which it cannot: {pooler.refusal}")
        limits = self.limit_mm_per_prompt or {}
        for modality, limit in limits.items():
            require(modality in MODALITIES, f"limit_mm_per_prompt: {modality!r} is not one of {MODALITIES}")
            require(isinstance(limit, int) and limit >= 0, f"limit_mm_per_prompt: {modality} needs a count")
        require(self.max_image_pixels > 0, "max_image_pixels must be positive")
        require(self.media_fetch_timeout > 0, "media_fetch_timeout must be positive")
        self.media_origins()  # raise ValueErrors naming the entry that is wrong
        self.media_networks()
        self._check_media_paths()
        require(
            self.max_audio_clip_s is None or self.max_audio_clip_s > 0, "max_audio_clip_s must be positive"
        )
        require(
            self.max_num_encoder_input_tokens is None or self.max_num_encoder_input_tokens > 0,
            "max_num_encoder_input_tokens must be positive",
        )
        require(
            self.structured_outputs_compile_timeout > 0, "structured_outputs_compile_timeout must be positive"
        )
        require(self.tensor_parallel_size > 0, "tensor_parallel_size must be positive")
        require(self.pipeline_parallel_size > 0, "pipeline_parallel_size must be positive")
        require(
            self.distributed_executor_backend in (None, "mp"),
            f"distributed_executor_backend {self.distributed_executor_backend!r} is not supported; the only "
            "backend is mp (one worker process per rank)",
        )
        require(self.nnodes > 0, "nnodes must be positive")
        require(
            0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, {self.nnodes}) for nnodes={self.nnodes}",
        )
        require(
            self.world_size % self.nnodes == 0,
            f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks do not split evenly "
            f"over nnodes={self.nnodes}",
        )
        require(0 < self.master_port < 65535, "master_port must be a TCP port below 65535")
        require(
            not (self.enable_lora and self.world_size > 1),
            "enable_lora needs tensor_parallel_size = pipeline_parallel_size = 1 (adapters are not sharded)",
        )

    def _merge_spec_shorthand(self) -> None:
        """spec_method, spec_model and spec_tokens into speculative_config, as vLLM merges them; then unset,
        so that a copy of the config (dataclasses.replace) does not merge them again."""
        given = [(name, key) for name, key in _SPEC_SHORTHAND if getattr(self, name) is not None]
        if not given:
            return
        speculative = dict(self.speculative_config or {})
        for name, key in given:
            if key in speculative:
                raise ValueError(f"{name} and speculative_config[{key!r}] are mutually exclusive")
            speculative[key] = getattr(self, name)
            setattr(self, name, None)
        self.speculative_config = speculative

    def _check_scheduler_bounds(self) -> None:
        if not (self.max_model_len in (None, AUTO_MAX_MODEL_LEN) or self.max_model_len > 0):
            raise ValueError("max_model_len must be positive, or -1 (auto)")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ValueError(
                f"max_num_active_seqs ({self.max_num_active_seqs}) cannot be more than max_num_seqs "
                f"({self.max_num_seqs})"
            )

    def _check_media_paths(self) -> None:
        folder = self.allowed_local_media_path
        if folder is not None and not Path(folder).is_dir():
            raise ValueError(f"allowed_local_media_path {folder!r} is not a folder")

    def _check_generation_config(self) -> None:
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(
                f"generation_config must be auto, vllm or a folder, not {self.generation_config!r}"
            )
        try:
            sampling_overrides(self.override_generation_config or {})
        except ValueError as exc:
            raise ValueError(f"override_generation_config: {exc}") from None

    def _check_kv_transfer(self) -> None:
        kv_transfer = self.kv_transfer()  # raises ValueError naming what is wrong
        if kv_transfer is None:
            return
        check_connector_name(kv_transfer.kv_connector)
        if self.world_size > 1:
            raise ValueError(
                "kv_transfer_config needs tensor_parallel_size = pipeline_parallel_size = 1 (KV blocks move "
                "between single-rank replicas)"
            )

    def _check_sleep_mode(self) -> None:
        """Sleep mode frees the memory of the model runners alone: not what a KV connector or a draft model
        holds."""
        if not self.enable_sleep_mode:
            return
        if self.kv_transfer_config is not None:
            raise ValueError("enable_sleep_mode cannot be combined with kv_transfer_config")
        speculative = self.speculative()
        if speculative is not None and speculative.method == "draft_model":
            raise ValueError("enable_sleep_mode cannot be combined with a draft model")

    @property
    def world_size(self) -> int:
        """Ranks that run the model: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def sampling_defaults(self) -> dict[str, Any]:
        """The SamplingParams fields a request that leaves them unset takes: generation_config's, with
        override_generation_config's over them (vLLM's get_diff_sampling_param). Raises ValueError for a
        generation_config.json whose values no request could carry."""
        return configured_sampling_defaults(
            self.generation_config, self.model, self.override_generation_config
        )

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config, or None when speculation is off."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def kv_transfer(self) -> KVTransferConfig | None:
        """The parsed kv_transfer_config, or None when this replica takes no part in disaggregation."""
        if self.kv_transfer_config is None:
            return None
        return KVTransferConfig.parse(self.kv_transfer_config)

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed kv_events_config, or None when it is not given."""
        if self.kv_events_config is None:
            return None
        return KVEventsConfig.parse(self.kv_events_config)

    def pooler(self) -> PoolerConfig:
        """How embeddings are pooled: the folder's pooling with pooler_config over it."""
        return pooler_config(self.model, self.pooler_config, self.hf_overrides)

    def structured_outputs(self) -> StructuredOutputsConfig:
        """The parsed structured_outputs_config (vLLM's defaults where it is not given)."""
        if self.structured_outputs_config is None:
            return StructuredOutputsConfig()
        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def reasoning_parser_name(self) -> str | None:
        """As vLLM has it: reasoning_parser, else the structured outputs config's. Raises ValueError for a
        name that is none of the parsers'."""
        name = self.reasoning_parser or self.structured_outputs().reasoning_parser
        if name is not None and name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
        return name

    def reasoning_strings(self) -> ReasoningStrings | None:
        """Where a reasoning starts and ends: reasoning_config's text, else the reasoning parser's tags; None
        where neither says. Raises ValueError for a reasoning_config of other fields."""
        config = self.reasoning_config or {}
        unknown = sorted(set(config) - {"reasoning_start_str", "reasoning_end_str"})
        if unknown:
            raise ValueError(
                f"reasoning_config: {unknown[0]!r} is not one of reasoning_start_str and reasoning_end_str"
            )
        for name, value in config.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"reasoning_config: {name} must be a non-empty string")
        tags = (START_TAG, END_TAG) if self.reasoning_parser_name() else ("", "")
        start = config.get("reasoning_start_str") or tags[0]
        end = config.get("reasoning_end_str") or tags[1]
        return ReasoningStrings(start, end, tags[1] or end) if start and end else None

    def mm_limits(self) -> dict[str, int]:
        """How many items of each modality one prompt may carry."""
        limits = self.limit_mm_per_prompt or {}
        return {modality: int(limits.get(modality, DEFAULT_ITEMS_PER_PROMPT)) for modality in MODALITIES}

    def media_origins(self) -> tuple[MediaOrigin, ...]:
        """The origins of allowed_media_domains."""
        return parse_origins(self.allowed_media_domains)

    def media_networks(self) -> tuple[IPNetwork, ...]:
        """The networks of allowed_media_networks."""
        return parse_networks(self.allowed_media_networks)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def as_options(self) -> dict[str, Any]:
        """Every option but the model, as `LLM(model, **options)` keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}


_FIELD_TYPES = {
    "dtype": DType,
    "device": Device,
    "scheduling_policy": SchedulingPolicy,
    "load_format": LoadFormat,
    "tokenizer_mode": TokenizerMode,
    "logprobs_mode": LogprobsMode,
    "runner": Runner,
    "convert": Convert,
}


class JsonObject(click.ParamType):
    """An option's JSON object, as vLLM's flags take them."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            self.fail(f"not valid JSON: {error}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("must be a JSON object", param, ctx)
        return parsed


class HumanReadableInt(click.ParamType):
    """vLLM's integers with a unit, as its flags of token counts and bytes take them: 1k or 25.6k (k, m, g, t:
    powers of 1,000), 1K or 2M (K, M, G, T: powers of 1,024, whole numbers only); with `auto`, also auto or
    -1 (-1)."""

    name = "integer"

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if self.auto and text.lower() in ("auto", "-1"):
            return AUTO_MAX_MODEL_LEN
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
        if match is None:
            try:
                return int(text)
            except ValueError:
                self.fail(f"{value!r} is not an integer, nor one with a unit (1k, 25.6k, 1K, 2M)", param, ctx)
        number, unit = match.groups()
        if unit in "kmgt":
            return int(float(number) * 1000 ** ("kmgt".index(unit) + 1))
        if "." in number:
            self.fail(
                f"{value!r}: a binary unit ({unit}) takes a whole number; {number}{unit.lower()}?", param, ctx
            )
        return int(number) * 1024 ** ("KMGT".index(unit) + 1)


_CLICK_TYPES: dict[str, Any] = {
    "dict[str, Any] | None": JsonObject(),
    "int | None": int,
    "str | None": str,
    "float | None": float,
    "int": int,
    "float": float,
    "str": str,
}

F = TypeVar("F", bound=Callable[..., Any])
# Other flags of an option: kvfleet's names before it took vLLM's, still taken from older command lines and
# manifests, and vLLM's own second names.
_OTHER_FLAGS = {
    "num_gpu_blocks_override": ("--num-kv-blocks",),
    "gpu_memory_utilization": ("--device-memory-utilization",),
}
# The options whose flags take vLLM's integers with a unit (HumanReadableInt), as vLLM's do.
_HUMAN_READABLE = {
    "max_num_batched_tokens": HumanReadableInt(),
    "max_num_scheduled_tokens": HumanReadableInt(),
    "kv_cache_memory_bytes": HumanReadableInt(),
    "max_num_queued_tokens": HumanReadableInt(),
    "max_model_len": HumanReadableInt(auto=True),
}


def engine_options(func: F) -> F:
    """Add every EngineConfig field but `model` as a `--kebab-case` option of a click command."""
    for f in reversed(dataclasses.fields(EngineConfig)):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.type == "bool":
            decl = f"{flag}/--no-{f.name.replace('_', '-')}"
            func = click.option(decl, default=f.default, show_default=True, help=help_text)(func)
        elif f.name in _FIELD_TYPES:
            choice = click.Choice(get_args(_FIELD_TYPES[f.name]))
            func = click.option(flag, type=choice, default=f.default, show_default=True, help=help_text)(func)
        else:
            kind = _HUMAN_READABLE.get(f.name) or _CLICK_TYPES[str(f.type)]
            decls = (flag, *_OTHER_FLAGS.get(f.name, ()), f.name)
            func = click.option(*decls, type=kind, default=f.default, show_default=True, help=help_text)(func)
    return func


# The model of `kvfleet run-batch` (`kvfleet serve` also takes it as its argument).
model_option = click.option("--model", required=True, help="Hugging Face model folder or Hub id (org/name).")
# The names `kvfleet serve` and `kvfleet run-batch` answer requests naming the model by, the same way.
served_model_name_option = click.option(
    "--served-model-name",
    cls=ListOption,
    metavar="NAME...",
    help="Model names clients use (the first is the one answers carry; vLLM's list form or repeated); "
    "defaults to the model as given (its path or Hub id).",
)


def engine_config_from_options(model: str, options: dict[str, Any]) -> EngineConfig:
    """Build an EngineConfig from a click command's keyword arguments, ignoring the command's own."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(model=model, **{k: v for k, v in options.items() if k in names and k != "model"})
