"""`kvfleet serve`: the OpenAI-compatible server a fleet pod runs."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from kvfleet.contract.tiers import DEFAULT_TIER, TIER_NAMES, TIERS
from kvfleet.runtime.batch.store import (
    DEFAULT_MAX_BATCH_FILE_BYTES,
    DEFAULT_MAX_BATCH_FILES,
    DEFAULT_MAX_BATCH_STORE_BYTES,
)
from kvfleet.runtime.chat_content_format import CONTENT_FORMAT_OPTIONS
from kvfleet.runtime.config import (
    EngineConfig,
    JsonObject,
    engine_config_from_options,
    engine_options,
    served_model_name_option,
)
from kvfleet.runtime.list_options import ListOption
from kvfleet.runtime.quantization.config import kv_cache_dtype_refusal
from kvfleet.runtime.sampling_params import MAX_LOGPROBS
from kvfleet.runtime.server.config_file import read_config_file
from kvfleet.runtime.server.state import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_H11_MAX_HEADER_COUNT,
    DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_SEND_TIMEOUT_S,
)
from kvfleet.runtime.serving.service import DEFAULT_MAX_COMPLETION_TOKENS_PER_PROMPT, DEFAULT_MAX_N
from kvfleet.runtime.startup_phases import STARTUP_PHASES, process_age
from kvfleet.runtime.vllm_flags import VllmCommand

if TYPE_CHECKING:
    from kvfleet.runtime.safety.config import SafetyConfig
    from kvfleet.runtime.server.state import ServerSettings
    from kvfleet.runtime.server.tls import TlsFiles
    from kvfleet.runtime.serving.lora_adapters import LoRAAdapters

_API_KEY_ENV = "KVFLEET_API_KEY"
_SECONDS = click.FloatRange(min=0, min_open=True)
_UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's switch for its Responses API store, and the responses kept when it is on (vLLM keeps every one).
_VLLM_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
_VLLM_STORE_DEFAULT_SIZE = 1024


class _JsonStrings(click.ParamType):
    """vLLM's JSON list of strings, e.g. '["https://app.example"]'."""

    name = "json-list"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            self.fail(f"not valid JSON: {error}", param, ctx)
        if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
            self.fail("must be a JSON list of strings", param, ctx)
        return tuple(parsed)


def _api_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # Click reads an empty variable as unset, which would turn auth off without a word.
    if value is None and os.environ.get(_API_KEY_ENV) is not None:
        value = os.environ[_API_KEY_ENV]
    if value is not None and not value.strip():
        raise click.BadParameter(
            f"the API key is empty (from --api-key or {_API_KEY_ENV}); give a key, or unset both to serve "
            "without one",
            ctx=ctx,
            param=param,
        )
    return value


@click.command("serve", cls=VllmCommand)
@click.argument("model_tag", metavar="[MODEL]", required=False)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=read_config_file,
    help="vLLM's: a YAML file of this command's options by flag name (port: 8000, served-model-name: "
    "[a, b]); flags given here win over it.",
)
@click.option("--model", default=None, help="Model folder or Hub id (org/name), if not given as MODEL.")
@served_model_name_option
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--uds",
    type=click.Path(dir_okay=False),
    default=None,
    help="vLLM's: serve on this Unix domain socket (a stale one is replaced) instead of --host and --port.",
)
@click.option(
    "--api-key",
    default=None,
    envvar=_API_KEY_ENV,
    callback=_api_key,
    help="Require `Authorization: Bearer KEY`.",
)
@click.option(
    "--default-priority",
    type=click.Choice(TIER_NAMES),
    default=DEFAULT_TIER,
    show_default=True,
    help="SLA tier of requests that name none (body `priority` or header x-kvfleet-priority).",
)
@click.option(
    "--max-priority-tier",
    type=click.Choice(TIER_NAMES),
    default=TIER_NAMES[0],
    show_default=True,
    help="The most urgent tier a request may claim; claims above it get 403 (to keep `critical` for the "
    "platform's own traffic).",
)
@click.option(
    "--shutdown-timeout",
    # kvfleet's name for it before vLLM had one, still taken from older manifests.
    "--drain-timeout",
    "shutdown_timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="vLLM's: seconds in-flight requests get to finish after SIGTERM; the rest are then handed back with "
    "a 503 `draining` error (a stream's last event), which the fleet gateway resumes on another replica. 0 "
    "hands them back at once.",
)
@click.option(
    "--max-waiting-requests",
    type=click.IntRange(min=1),
    default=None,
    help="Queue depth beyond which new requests get 429 (the lowest tier is shed first); unbounded if unset.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Default per-request timeout in seconds (a request's `timeout` field overrides it).",
)
@click.option(
    "--max-request-body-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_REQUEST_BODY_BYTES,
    show_default=True,
)
@click.option(
    "--max-n",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_N,
    show_default=True,
    help="The largest n (sequences per prompt) a request may ask for.",
)
@click.option(
    "--max-completion-tokens-per-prompt",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_COMPLETION_TOKENS_PER_PROMPT,
    show_default=True,
    help="The most tokens a request may ask to generate for one prompt: n x max_tokens, where an unset "
    "max_tokens counts as the room the prompt leaves in the context.",
)
@click.option(
    "--header-read-timeout",
    type=_SECONDS,
    default=DEFAULT_HEADER_READ_TIMEOUT_S,
    show_default=True,
    help="Seconds a client has to send a request's headers (from connecting, or the previous response).",
)
@click.option(
    "--h11-max-incomplete-event-size",
    type=click.IntRange(min=1),
    default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    show_default=True,
    help="vLLM's: the most bytes of a request's headers the server buffers before they are whole (400 past "
    "it); vLLM's default is 4 MiB, kvfleet keeps h11's.",
)
@click.option(
    "--h11-max-header-count",
    type=click.IntRange(min=1),
    default=DEFAULT_H11_MAX_HEADER_COUNT,
    show_default=True,
    help="vLLM's: the most headers a request may carry (431 past it).",
)
@click.option(
    "--body-read-timeout",
    type=_SECONDS,
    default=DEFAULT_BODY_READ_TIMEOUT_S,
    show_default=True,
    help="Seconds a client has to send a request's whole body (408 after).",
)
@click.option(
    "--send-timeout",
    type=_SECONDS,
    default=DEFAULT_SEND_TIMEOUT_S,
    show_default=True,
    help="Seconds a response may wait for a client that has stopped reading; then the connection is dropped "
    "and the request aborted.",
)
@click.option(
    "--chat-template-content-format",
    type=click.Choice(CONTENT_FORMAT_OPTIONS),
    default="auto",
    show_default=True,
    help="vLLM's: how the chat template takes a message's content: string (text parts joined by newlines) "
    "or openai (OpenAI's list of parts); auto reads the template, openai where it loops over a message's "
    "content.",
)
@click.option(
    "--sse-keep-alive-interval",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="vLLM's: seconds a chat or completion stream may go without an event before it carries a comment "
    "(`: keep-alive`), so that proxies with read timeouts keep a queued request's, a long prefill's or a "
    "slow step's connection open; a stream not yet open opens then. 0 sends none.",
)
@click.option(
    "--startup-request-timeout",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds a request that arrives while the model loads waits for it before a 503.",
)
@click.option(
    "--api-server-count",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="HTTP server processes sharing the port and the one engine core process.",
)
@click.option(
    "--enable-auto-tool-choice/--no-enable-auto-tool-choice",
    is_flag=True,
    help='Allow tool_choice "auto": the model may call tools in its own format, read by --tool-call-parser.',
)
@click.option(
    "--tool-call-parser",
    default=None,
    help="How calls are read from the output under tool_choice auto: hermes or llama3_json.",
)
@click.option(
    "--batch-store",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of the Batch API's database and files; serves /v1/files and /v1/batches when given.",
)
@click.option(
    "--max-batch-file-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BATCH_FILE_BYTES,
    show_default=True,
    help="The largest batch input file an upload may bring.",
)
@click.option(
    "--max-batch-files",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BATCH_FILES,
    show_default=True,
    help="The most batch input files the store keeps; uploads past it get 400 until some are deleted.",
)
@click.option(
    "--max-batch-store-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BATCH_STORE_BYTES,
    show_default=True,
    help="The most bytes the store's files (inputs and outputs) may take; uploads past it get 400.",
)
@click.option(
    "--lora-modules",
    cls=ListOption,
    metavar="NAME=PATH...",
    help="PEFT LoRA adapters clients call by NAME as their model (needs --enable-lora); vLLM's list form or "
    "repeated.",
)
@click.option(
    "--allow-runtime-lora-updates",
    is_flag=True,
    help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora).",
)
@click.option(
    "--lora-download-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where adapters loaded from hf://org/name[@revision] URIs are fetched to (needs --enable-lora).",
)
@click.option(
    "--allowed-local-lora-path",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Read local adapters only from under this folder (relative paths are taken from it; symlinks that "
    "lead out are refused). Default: any folder the server can read.",
)
@click.option(
    "--allowed-lora-hub-orgs",
    default=None,
    metavar="ORG[,ORG...]",
    help="Fetch hf:// adapters only from these hub organisations. Default: any.",
)
@click.option(
    "--safety-config",
    default=None,
    metavar="JSON|FILE",
    help="Input and output guardrails: a JSON policy, or the path of a JSON file holding one (see "
    "docs/safety.md).",
)
@click.option(
    "--max-stored-responses",
    type=click.IntRange(min=0),
    default=None,
    callback=lambda _context, _param, value: _stored_responses(value),
    help="The most Responses API answers kept in memory (the least recently used go first) for "
    f"previous_response_id and GET /v1/responses/{{id}}. Default: none, as vLLM by default; "
    f"{_VLLM_STORE_DEFAULT_SIZE} where vLLM's {_VLLM_STORE_ENV}=1 turns its store on.",
)
@click.option("--access-log/--no-access-log", default=False, show_default=True)
@click.option(
    "--disable-uvicorn-access-log/--no-disable-uvicorn-access-log",
    is_flag=True,
    help="vLLM's: no access log, whatever --access-log says (kvfleet writes none by default).",
)
@click.option(
    "--disable-access-log-for-endpoints",
    default=None,
    metavar="PATHS",
    help="vLLM's: comma-separated paths the access log leaves out, such as the probes' (/health,/metrics).",
)
@click.option(
    "--disable-log-stats",
    is_flag=True,
    help="Accepted for vLLM's command lines: kvfleet logs no periodic statistics (GET /metrics serves them).",
)
@click.option(
    "--enable-prompt-tokens-details/--no-enable-prompt-tokens-details",
    is_flag=True,
    help="vLLM's: usage counts the prompt tokens the prefix cache held "
    "(prompt_tokens_details.cached_tokens); the Responses API's always does.",
)
@click.option(
    "--enable-force-include-usage/--no-enable-force-include-usage",
    is_flag=True,
    help="vLLM's: every stream ends with its usage, whether or not stream_options asks for it.",
)
@click.option(
    "--exclude-tools-when-tool-choice-none/--no-exclude-tools-when-tool-choice-none",
    is_flag=True,
    help='vLLM\'s: a chat request whose tool_choice is "none" is rendered without its tools (by default the '
    "template still lists them).",
)
@click.option(
    "--return-tokens-as-token-ids/--no-return-tokens-as-token-ids",
    is_flag=True,
    help='vLLM\'s: logprobs name tokens "token_id:N" (for tokens whose text is part of a character), for '
    "requests that leave return_tokens_as_token_ids unset.",
)
@click.option(
    "--enable-request-id-headers/--no-enable-request-id-headers",
    is_flag=True,
    help="vLLM's: every response carries X-Request-Id, the request's own or a new one.",
)
@click.option(
    "--otlp-traces-endpoint",
    metavar="URL",
    help="vLLM's: each request's span (vLLM's llm_request, a child of the caller's traceparent) goes to this "
    "OpenTelemetry collector over OTLP, gRPC or, with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, "
    "HTTP.",
)
@click.option(
    "--enable-server-load-tracking/--no-enable-server-load-tracking",
    is_flag=True,
    help='vLLM\'s: GET /load answers {"server_load": the requests in flight}.',
)
@click.option(
    "--trust-request-chat-template/--no-trust-request-chat-template",
    is_flag=True,
    help="vLLM's: a chat request's own chat_template is rendered (in Transformers' sandbox), instead of "
    "refused with a 400.",
)
@click.option(
    "--log-error-stack/--no-log-error-stack",
    is_flag=True,
    help="vLLM's: every error response is logged with the stack trace of the error it answers.",
)
@click.option(
    "--enable-tokenizer-info-endpoint/--no-enable-tokenizer-info-endpoint",
    is_flag=True,
    help="vLLM's: GET /tokenizer_info answers the tokenizer's configuration (its chat template included).",
)
@click.option(
    "--disable-fastapi-docs/--no-disable-fastapi-docs",
    is_flag=True,
    help="vLLM's: no /openapi.json (kvfleet serves no Swagger or ReDoc pages either way).",
)
@click.option(
    "--max-logprobs",
    type=click.IntRange(0, MAX_LOGPROBS),
    default=MAX_LOGPROBS,
    show_default=True,
    help="The most log probabilities per token a request may ask for (logprobs, top_logprobs).",
)
@click.option(
    "--default-chat-template-kwargs",
    type=JsonObject(),
    default="{}",
    metavar="JSON",
    help="Chat template variables of requests that leave them unset (their chat_template_kwargs), e.g. "
    "'{\"enable_thinking\": false}'.",
)
@click.option(
    "--response-role",
    default="assistant",
    show_default=True,
    help="The role of a chat answer that the generation prompt opens (with add_generation_prompt false, the "
    "answer goes on in the last message's role).",
)
@click.option(
    "--allowed-origins",
    type=_JsonStrings(),
    default='["*"]',
    show_default=True,
    help="CORS: the origins browsers may call the API from, as a JSON list.",
)
@click.option("--allowed-methods", type=_JsonStrings(), default='["*"]', show_default=True, help="CORS.")
@click.option("--allowed-headers", type=_JsonStrings(), default='["*"]', show_default=True, help="CORS.")
@click.option(
    "--allow-credentials/--no-allow-credentials",
    is_flag=True,
    help="CORS: allow credentials (cookies, auth headers).",
)
@click.option(
    "--root-path",
    default="",
    help="The path prefix a path-routing proxy serves the API under; requests are served with or without it.",
)
@click.option(
    "--uvicorn-log-level",
    type=click.Choice(_UVICORN_LOG_LEVELS),
    default=None,
    help="Log level of the HTTP server's own logs; by default --log-level's.",
)
@click.option(
    "--ssl-certfile",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Serve HTTPS with this PEM certificate (its chain after it; the key too, without --ssl-keyfile).",
)
@click.option(
    "--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None, help="Its PEM private key."
)
@click.option(
    "--ssl-ca-certs",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The CA certificates (PEM) that client certificates are checked against.",
)
@click.option(
    "--ssl-cert-reqs",
    type=click.IntRange(ssl.CERT_NONE, ssl.CERT_REQUIRED),
    default=ssl.CERT_NONE,
    show_default=True,
    help="Client certificates, as Python's ssl module numbers them: 0 none asked for, 1 checked where given, "
    "2 required.",
)
@click.option("--ssl-ciphers", default=None, help="The ciphers HTTPS may use (OpenSSL's cipher list format).")
@click.option(
    "--enable-ssl-refresh/--no-enable-ssl-refresh",
    is_flag=True,
    help="Load the certificate, key and CA files again when they change (a renewed certificate), for the "
    "connections made after.",
)
@click.option(
    "--trust-remote-code/--no-trust-remote-code",
    is_flag=True,
    help="Accepted for vLLM's command lines: kvfleet runs its own implementation of each architecture and "
    "never code from the model folder, so an architecture it lacks is refused either way.",
)
@click.option(
    "--model-impl",
    default="auto",
    show_default=True,
    help="Accepted for vLLM's command lines: auto and vllm are kvfleet's own implementation of each "
    "architecture; vLLM's transformers and terratorch are refused by name.",
)
@click.option(
    "--enforce-eager/--no-enforce-eager",
    is_flag=True,
    help="Accepted for vLLM's command lines: the model always runs eagerly (no CUDA graphs).",
)
@click.option(
    "--disable-custom-all-reduce/--no-disable-custom-all-reduce",
    is_flag=True,
    help="Accepted for vLLM's command lines: tensor-parallel ranks always sum with torch.distributed's own "
    "all-reduce (NCCL on GPUs).",
)
@click.option(
    "--disable-cascade-attn/--no-disable-cascade-attn",
    is_flag=True,
    help="Accepted for vLLM's command lines: kvfleet's attention has no cascade path.",
)
@click.option(
    "--no-async-scheduling",
    is_flag=True,
    help="Accepted for vLLM's command lines: each step is scheduled once the previous one's outputs are in.",
)
@click.option(
    "--enable-log-requests/--no-enable-log-requests",
    is_flag=True,
    help="vLLM's: log each admitted request, its parameters at INFO and its prompt's token ids at DEBUG.",
)
@click.option(
    "--max-log-len",
    type=click.IntRange(min=0),
    default=None,
    help="vLLM's: the most prompt token ids a request's log shows (and output characters and token ids, "
    "with --enable-log-outputs); all of them by default.",
)
@click.option(
    "--enable-log-outputs/--no-enable-log-outputs",
    is_flag=True,
    help="vLLM's: log what each request generated, its text and finish reason at INFO and its token ids at "
    "DEBUG (the first --max-log-len of each). Needs --enable-log-requests.",
)
@click.option(
    "--enable-log-deltas/--no-enable-log-deltas",
    default=True,
    show_default=True,
    help="vLLM's: with --enable-log-outputs, a stream's every delta is logged too, not only its whole.",
)
@click.option(
    "--disable-log-requests",
    is_flag=True,
    help="vLLM's older switch: requests are not logged (the default), whatever --enable-log-requests says.",
)
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    help="The KV cache's dtype, by vLLM's names: auto (the model's dtype) is the only one kvfleet keeps; "
    "fp8 and the others are refused with the reason.",
)
@engine_options
def serve(model_tag: str | None, model: str | None, host: str, port: int, **options: Any) -> None:
    """Serve MODEL (a model folder, or a Hub id fetched into the Hugging Face cache first) over an
    OpenAI-compatible HTTP API; with --node-rank above 0, run only this node's share of the ranks and serve
    GET /health."""
    STARTUP_PHASES.add("interpreter", process_age())
    model_name = _model_name(model_tag, model)
    _refuse_what_cannot_be_honoured(options)
    tls = _tls_files(options)
    if TIERS[options["default_priority"]] < TIERS[options["max_priority_tier"]]:
        raise click.BadParameter(
            f"{options['default_priority']!r} is more urgent than --max-priority-tier "
            f"{options['max_priority_tier']!r}",
            param_hint="--default-priority",
        )
    if options["max_stored_responses"] and options["api_server_count"] > 1:
        # Each API server process would keep its own: a follow-up could reach one that never saw it.
        raise click.BadParameter(
            f"stored responses (asked for here or by {_VLLM_STORE_ENV}) need --api-server-count 1",
            param_hint="--max-stored-responses",
        )
    if options["batch_store"] is not None and options["api_server_count"] > 1:
        raise click.BadParameter(
            "the Batch API runs in a single API server process", param_hint="--api-server-count"
        )
    with STARTUP_PHASES.phase("config"):
        # After the checks of the options alone, which a download would only delay.
        model = _model_folder(model_name, options)
        try:
            config = engine_config_from_options(model, options)
            if config.world_size > 1:
                from kvfleet.runtime.executor.executor import check_parallel_config

                check_parallel_config(config)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
    options["reasoning_parser"] = config.reasoning_parser_name()
    if options["reasoning_parser"] is not None:
        _check_reasoning_parser(options["reasoning_parser"], Path(config.tokenizer or config.model))
    if config.node_rank > 0:
        from kvfleet.runtime.executor.node import run_node

        sys.exit(run_node(config, host, port))

    from kvfleet.runtime.server.launcher import ServeOptions, run_server, start_engine_core
    from kvfleet.runtime.server.tokenizer_imports import import_tokenizer_classes

    # Before the server's settings, whose checks import the serving modules and Transformers: the model loads
    # meanwhile.
    core = start_engine_core(
        config,
        api_server_count=options["api_server_count"],
        max_waiting_requests=options["max_waiting_requests"],
        # `kvfleet bench static-server` passes its own EngineCore class as the context object.
        core_class=click.get_current_context().obj,
    )
    try:
        with STARTUP_PHASES.phase("api_server_settings"):
            import_tokenizer_classes()
            settings = _server_settings(model_name, config, options)
            lora_adapters = _lora_adapters(config, settings.served_model_names, options)
        serve_options = ServeOptions(
            settings=settings,
            host=host,
            port=port,
            uds=options["uds"],
            access_log=options["access_log"] and not options["disable_uvicorn_access_log"],
            access_log_excluded_paths=_excluded_paths(options["disable_access_log_for_endpoints"]),
            uvicorn_log_level=options["uvicorn_log_level"],
            startup_request_timeout=options["startup_request_timeout"],
            api_server_count=options["api_server_count"],
            lora_adapters=lora_adapters,
            tls=tls,
        )
    except BaseException:
        core.stop()
        raise
    sys.exit(run_server(config, serve_options, core))


def _excluded_paths(value: str | None) -> frozenset[str]:
    from kvfleet.runtime.server.access_log import parse_paths

    try:
        return parse_paths(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--disable-access-log-for-endpoints") from exc


def _stored_responses(value: int | None) -> int:
    """--max-stored-responses, or what vLLM's environment switch asks for when it is not given."""
    if value is not None:
        return value
    enabled = os.environ.get(_VLLM_STORE_ENV, "").strip().lower() in ("1", "true")
    return _VLLM_STORE_DEFAULT_SIZE if enabled else 0


def _model_name(model_tag: str | None, model: str | None) -> str:
    """The model as given, as MODEL or --model."""
    if model_tag is not None and model is not None and model_tag != model:
        raise click.UsageError(f"MODEL {model_tag!r} and --model {model!r} name different models")
    chosen = model_tag or model
    if chosen is None:
        raise click.UsageError("name the model: kvfleet serve MODEL (or --model MODEL)")
    return chosen


def _model_folder(model: str, options: dict[str, Any]) -> str:
    """The folder of `model` (a Hub id's in the cache, fetched first), once it is known to be one the engine
    can load (with vLLM's hf_overrides): a wrong path, repository or revision ends the command here, in one
    line, before the port opens."""
    from kvfleet.runtime.hub import resolve_model
    from kvfleet.runtime.models.folder import check_model_folder

    try:
        folder = resolve_model(
            model, options["revision"], cache_dir=options["download_dir"], token=options["hf_token"]
        )
        check_model_folder(folder, options["hf_overrides"])
    except ValueError as exc:  # HubError included
        raise click.ClickException(str(exc)) from None
    return folder


def _refuse_what_cannot_be_honoured(options: dict[str, Any]) -> None:
    """vLLM's flags that kvfleet takes, refused at start for the values it cannot honour."""
    if options["enable_log_outputs"] and not options["enable_log_requests"]:
        raise click.BadParameter("needs --enable-log-requests, as vLLM's", param_hint="--enable-log-outputs")
    if options["model_impl"] not in ("auto", "vllm"):
        raise click.BadParameter(
            f"{options['model_impl']!r}: kvfleet runs its own implementation of each architecture (auto or "
            "vllm)",
            param_hint="--model-impl",
        )
    refusal = kv_cache_dtype_refusal(options["kv_cache_dtype"])
    if refusal is not None:
        raise click.BadParameter(refusal, param_hint="--kv-cache-dtype")
    if options["otlp_traces_endpoint"] is not None:
        from kvfleet.runtime.tracing import traces_protocol

        try:
            traces_protocol()
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--otlp-traces-endpoint") from None
    from kvfleet.runtime.generation_config import sampling_overrides

    try:
        sampling_overrides(options["override_generation_config"] or {})
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--override-generation-config") from None
    if options["default_chat_template_kwargs"]:
        _check_template_defaults(options["default_chat_template_kwargs"])


def _tls_files(options: dict[str, Any]) -> TlsFiles | None:
    """The HTTPS the --ssl-* flags ask for, once their files load; None for plain HTTP."""
    if options["ssl_certfile"] is None:
        given = [
            flag
            for flag, value in (
                ("--ssl-keyfile", options["ssl_keyfile"]),
                ("--ssl-ca-certs", options["ssl_ca_certs"]),
                ("--ssl-cert-reqs", options["ssl_cert_reqs"]),
                ("--ssl-ciphers", options["ssl_ciphers"]),
                ("--enable-ssl-refresh", options["enable_ssl_refresh"]),
            )
            if value
        ]
        if given:
            raise click.BadParameter(
                "HTTPS needs --ssl-certfile, the server's certificate", param_hint=given[0]
            )
        return None
    if options["ssl_cert_reqs"] != ssl.CERT_NONE and options["ssl_ca_certs"] is None:
        raise click.BadParameter(
            "a client certificate is checked against --ssl-ca-certs, which is not given",
            param_hint="--ssl-cert-reqs",
        )
    from kvfleet.runtime.server.tls import TlsFiles

    tls = TlsFiles(
        certfile=options["ssl_certfile"],
        keyfile=options["ssl_keyfile"],
        ca_certs=options["ssl_ca_certs"],
        cert_reqs=options["ssl_cert_reqs"],
        ciphers=options["ssl_ciphers"],
        refresh=options["enable_ssl_refresh"],
    )
    refusal = tls.refusal()
    if refusal is not None:
        flag, reason = refusal
        raise click.BadParameter(reason, param_hint=flag)
    return tls


def _check_reasoning_parser(name: str, tokenizer_dir: Path) -> None:
    """The model's tokenizer has the parser's tags (where it is a tokenizer.json: others are checked when the
    server binds the parser); the engine config has checked its name."""
    from kvfleet.runtime.reasoning import reasoning_parser

    tokenizer_file = tokenizer_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return
    from tokenizers import Tokenizer

    try:
        reasoning_parser(name, Tokenizer.from_file(str(tokenizer_file)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--reasoning-parser") from None


def _server_settings(model_name: str, config: EngineConfig, options: dict[str, Any]) -> ServerSettings:
    """The settings of `kvfleet serve`'s options: each option named like a setting gives it, tiers are given
    by name, the safety policy as a file or text, the model's names (by default as given: its path or Hub
    id, as vLLM names it) and the sampling defaults of its folder."""
    from kvfleet.runtime.generation_config import max_tokens_limit
    from kvfleet.runtime.server.state import ServerSettings
    from kvfleet.runtime.serving.tool_calls import TOOL_CALL_PARSERS

    tool_call_parser = options["tool_call_parser"]
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise click.BadParameter(
            f"{tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}",
            param_hint="--tool-call-parser",
        )
    if options["enable_auto_tool_choice"] and tool_call_parser is None:
        raise click.BadParameter(
            "--enable-auto-tool-choice needs --tool-call-parser", param_hint="--enable-auto-tool-choice"
        )
    named = {f.name: options[f.name] for f in dataclasses.fields(ServerSettings) if f.name in options}
    served_model_names = options["served_model_name"] or (model_name,)
    try:
        sampling_defaults = config.sampling_defaults()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--generation-config") from None
    return ServerSettings(
        **{
            **named,
            "served_model_name": served_model_names[0],
            "served_model_aliases": served_model_names[1:],
            "default_priority": TIERS[options["default_priority"]],
            "max_priority_tier": TIERS[options["max_priority_tier"]],
            "enable_log_requests": options["enable_log_requests"] and not options["disable_log_requests"],
            "safety": _safety(options["safety_config"]),
            "default_sampling_params": sampling_defaults,
            "max_tokens_limit": max_tokens_limit(config.generation_config, sampling_defaults),
        }
    )


def _check_template_defaults(defaults: dict[str, Any]) -> None:
    """Template variables only: a name of the rendering's own parameters would fail every chat request."""
    from kvfleet.runtime.chat_prompt import rendering_parameters
    from kvfleet.runtime.server.tokenizer_imports import import_tokenizer_classes

    import_tokenizer_classes()
    from transformers import PreTrainedTokenizerBase

    reserved = sorted(rendering_parameters(PreTrainedTokenizerBase).intersection(defaults))
    if reserved:
        raise click.BadParameter(
            f"{reserved[0]!r} is a parameter of the rendering, not a variable of the template",
            param_hint="--default-chat-template-kwargs",
        )


def _safety(value: str | None) -> SafetyConfig | None:
    if value is None:
        return None
    from kvfleet.runtime.safety.config import parse_safety_config

    try:
        return parse_safety_config(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--safety-config") from None


def _lora_adapters(
    config: EngineConfig, served_model_names: tuple[str, ...], options: dict[str, Any]
) -> LoRAAdapters | None:
    """The adapters to serve from the start, each checked against the model; None without --enable-lora."""
    lora_modules, allow_runtime_updates = options["lora_modules"], options["allow_runtime_lora_updates"]
    download_dir = options["lora_download_dir"]
    local_path, hub_orgs = options["allowed_local_lora_path"], options["allowed_lora_hub_orgs"]
    if not config.enable_lora:
        for flag, given in (
            ("--lora-modules", lora_modules),
            ("--allow-runtime-lora-updates", allow_runtime_updates),
            ("--lora-download-dir", download_dir),
            ("--allowed-local-lora-path", local_path),
            ("--allowed-lora-hub-orgs", hub_orgs),
        ):
            if given:
                raise click.BadParameter("needs --enable-lora", param_hint=flag)
        return None
    # Only here: the adapters' checks import torch, which a server without them never needs.
    from kvfleet.runtime.serving.lora_adapters import AdapterSources, LoRAAdapters, LoRAModule

    if allow_runtime_updates and options["api_server_count"] > 1:
        # Each API server process keeps its own list: one would not know an adapter loaded through another.
        raise click.BadParameter(
            "runtime adapter updates need --api-server-count 1", param_hint="--allow-runtime-lora-updates"
        )
    sources = AdapterSources(
        local_root=Path(local_path) if local_path is not None else None,
        hub_orgs=frozenset(org.strip() for org in hub_orgs.split(",") if org.strip())
        if hub_orgs is not None
        else None,
    )
    adapters = LoRAAdapters(
        config.model,
        served_model_names,
        hf_overrides=config.hf_overrides,
        max_rank=config.max_lora_rank,
        download_dir=download_dir,
        sources=sources,
    )
    for value in lora_modules:
        try:
            module = LoRAModule.parse(value)
            adapters.add(module.name, module.path)
        except ValueError as exc:  # LoRAAdapterError included
            raise click.BadParameter(str(exc), param_hint="--lora-modules") from None
    return adapters
