"""`kvfleet gateway`: the fleet gateway over a static list of replicas or the cluster's InferenceServices."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import signal
from collections.abc import Sequence

import click
from kvfleet.contract.engine import SCHEDULING_POLICIES, SchedulingPolicy, preempts
from kvfleet.contract.kv_events import DEFAULT_EVENTS_PORT, DEFAULT_REPLAY_PORT
from kvfleet.contract.routing import DEFAULT_POLICY, POLICY_NAMES
from kvfleet.gateway.adapters import DEFAULT_ADAPTER_POLL_SECONDS
from kvfleet.gateway.discovery import (
    DEFAULT_HOLD_SECONDS,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PD_THRESHOLD_TOKENS,
    Discovery,
    ModelConfig,
    StaticDiscovery,
)
from kvfleet.gateway.flow import DEFAULT_MAX_QUEUE
from kvfleet.gateway.http_protocol import DEFAULT_CLIENT_TIMEOUTS, ClientTimeouts
from kvfleet.gateway.kv_events import EventEndpoints, default_endpoints
from kvfleet.gateway.kv_index import DEFAULT_MAX_ENTRIES, ENTRY_BYTES
from kvfleet.gateway.prompt_blocks import ModelPrompts
from kvfleet.gateway.proxy import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BUFFERED_BODY_BYTES,
    DEFAULT_UPSTREAM_TIMEOUTS,
    Gateway,
    Network,
    UpstreamTimeouts,
)
from kvfleet.gateway.resumption import DEFAULT_MAX_RESUMES
from kvfleet.gateway.routing import DEFAULT_LOAD_BOUND, DEFAULT_PREFIX_CHARS
from kvfleet.operator.kube_client import command_api_client, credential_options

logger = logging.getLogger(__name__)

_SECONDS = click.FloatRange(min=0, min_open=True)


def _static_models(
    options: tuple[str, ...], defaults: ModelConfig, prefill: tuple[str, ...], decode: tuple[str, ...]
) -> dict[str, ModelConfig]:
    """The models of `--model` options: NAME=URL[,URL...], or a bare NAME whose replicas are the `--prefill`
    and `--decode` URLs (one such model)."""
    disaggregated = [option for option in options if "=" not in option]
    if len(disaggregated) > 1:
        raise click.BadParameter(
            "one --model NAME takes the --prefill and --decode replicas; give the others as NAME=URL",
            param_hint="--model",
        )
    if (prefill or decode) and not disaggregated:
        raise click.BadParameter("name their model with --model NAME", param_hint="--prefill/--decode")
    if disaggregated and not decode:
        raise click.BadParameter(f"--model {disaggregated[0]} needs a decode replica", param_hint="--decode")
    models: dict[str, ModelConfig] = {}
    for option in options:
        name, _, urls = option.partition("=")
        if option in disaggregated:
            config = dataclasses.replace(
                defaults,
                endpoints=_http_urls(decode, "--decode"),
                prefill_endpoints=_http_urls(prefill, "--prefill"),
            )
        else:
            config = dataclasses.replace(defaults, endpoints=_http_urls(urls.split(","), "--model"))
        if not name or not config.endpoints:
            raise click.BadParameter(
                f"{option!r} is not NAME=URL[,URL...] with http(s) URLs", param_hint="--model"
            )
        if name in models:
            raise click.BadParameter(f"the model {name!r} is given twice", param_hint="--model")
        models[name] = dataclasses.replace(config, name=name)
    return models


def _http_urls(values: Sequence[str], option: str) -> tuple[str, ...]:
    """The replicas' base URLs given to `option`."""
    urls = tuple(url.strip().rstrip("/") for url in values if url.strip())
    wrong = [url for url in urls if not url.startswith(("http://", "https://"))]
    if wrong:
        raise click.BadParameter(f"{wrong[0]!r} is not an http(s) URL", param_hint=option)
    return urls


def _event_endpoints(options: tuple[str, ...], rehashed: tuple[str, ...]) -> dict[str, EventEndpoints]:
    """The endpoints of `--kv-events` options (URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]), and which
    replicas' hashes are their engine's own (`--rehash-kv-events`)."""
    endpoints: dict[str, EventEndpoints] = {}
    for option in options:
        url, _, sockets = option.partition("=")
        (replica,) = _http_urls([url], "--kv-events") or ("",)
        parts = [part.strip() for part in sockets.split(",")]
        if not replica or not 1 <= len(parts) <= 2 or not all(p.startswith("tcp://") for p in parts):
            raise click.BadParameter(
                f"{option!r} is not URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]", param_hint="--kv-events"
            )
        endpoints[replica] = EventEndpoints(parts[0], parts[1] if len(parts) == 2 else None)
    for replica in _http_urls(rehashed, "--rehash-kv-events"):
        endpoints[replica] = dataclasses.replace(
            endpoints.get(replica) or default_endpoints(replica), own_hashes=True
        )
    return endpoints


def _local_tokenizers(options: tuple[str, ...]) -> dict[str, ModelPrompts]:
    """The models' prompt preparation read from the folders of `--tokenizer NAME=PATH` options."""
    folders: dict[str, str] = {}
    for option in options:
        name, _, folder = option.partition("=")
        if not name or not folder:
            raise click.BadParameter(f"{option!r} is not NAME=PATH", param_hint="--tokenizer")
        if name in folders:
            raise click.BadParameter(f"the model {name!r} is given twice", param_hint="--tokenizer")
        folders[name] = folder
    try:
        return {name: ModelPrompts(folder) for name, folder in folders.items()}
    except (OSError, ValueError) as error:
        raise click.BadParameter(f"cannot read a tokenizer: {error}", param_hint="--tokenizer") from None


def _networks(value: str) -> tuple[Network, ...]:
    try:
        return tuple(ipaddress.ip_network(part.strip()) for part in value.split(",") if part.strip())
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--forwarded-allow-ips") from None


def _bare_name_namespace(option: str | None, namespaces: tuple[str, ...]) -> str | None:
    if option is not None:
        return option
    return namespaces[0] if len(namespaces) == 1 else None


@click.command("gateway")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME=URL[,URL...] | NAME",
    help="Route NAME to these replicas (repeatable). One model may be given by NAME alone: its replicas are "
    "then those of --prefill and --decode. Without --model, the cluster's InferenceServices are watched.",
)
@click.option(
    "--prefill",
    multiple=True,
    metavar="URL",
    help="A prefill replica of the model given by --model NAME (repeatable): disaggregated prefill and "
    "decode. Prompts with at least --pd-threshold-tokens new tokens on their decode replica are computed "
    "here first, and their KV pulled by the decode replica.",
)
@click.option(
    "--decode",
    multiple=True,
    metavar="URL",
    help="A decode replica of the model given by --model NAME (repeatable; one at least). Requests are "
    "routed to these by the routing policy; each computes the prompts below the threshold itself.",
)
@click.option(
    "--pd-threshold-tokens",
    type=click.IntRange(min=0),
    default=DEFAULT_PD_THRESHOLD_TOKENS,
    show_default=True,
    help="Disaggregated models: a prompt with fewer new tokens than this on its decode replica (its length "
    "less the prefix that replica is taken to cache, at 4 characters a token) skips the prefill replicas. "
    "0: every prompt goes through them.",
)
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Watch only this namespace (repeatable). Default: every namespace.",
)
@click.option(
    "--bare-name-namespace",
    default=None,
    metavar="NAMESPACE",
    help="The namespace whose InferenceServices clients may also name without it (`llama-8b` for "
    "`NAMESPACE/llama-8b`). Default: the one --namespace, when exactly one is given; otherwise clients name "
    "every service's model as NAMESPACE/NAME.",
)
@credential_options
@click.option(
    "--policy",
    type=click.Choice(POLICY_NAMES),
    default=DEFAULT_POLICY,
    show_default=True,
    help="Routing policy of models whose InferenceService names none.",
)
@click.option(
    "--kv-events",
    "kv_events",
    multiple=True,
    metavar="URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]",
    help="precise-prefix: where the replica at URL publishes its KV events, and answers replays "
    f"(repeatable). Default: the replica's host at ports {DEFAULT_EVENTS_PORT} and {DEFAULT_REPLAY_PORT}, "
    "where an InferenceService's replicas publish; name them for replicas that share a host.",
)
@click.option(
    "--rehash-kv-events",
    "rehash_kv_events",
    multiple=True,
    metavar="URL",
    help="precise-prefix: the replica at URL (a vLLM replica) hashes its blocks by its engine's own rule; "
    "the gateway indexes them by their tokens under kvfleet's rule instead (repeatable). Its blocks of LoRA "
    "adapters, images or salted prompts are then not indexed.",
)
@click.option(
    "--kv-index-max-blocks",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_ENTRIES,
    show_default=True,
    help=f"precise-prefix: the (replica, block, medium) entries its index holds at most, about {ENTRY_BYTES} "
    "bytes each; past them the least recently stored are forgotten.",
)
@click.option("--prefix-chars", type=click.IntRange(min=1), default=DEFAULT_PREFIX_CHARS, show_default=True)
@click.option("--load-bound", type=click.FloatRange(min=1.0), default=DEFAULT_LOAD_BOUND, show_default=True)
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_IN_FLIGHT,
    show_default=True,
    help="Requests in flight per replica at most, unless its service sets engine.maxNumSeqs; more wait here.",
)
@click.option(
    "--hold-seconds",
    type=click.FloatRange(min=0),
    default=DEFAULT_HOLD_SECONDS,
    show_default=True,
    help="How long a request waits for a usable replica, unless its service sets activationTimeoutSeconds.",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(SCHEDULING_POLICIES),
    default="fcfs",
    show_default=True,
    help="The --model replicas' own `kvfleet serve --scheduling-policy`: `priority` replicas preempt less "
    "urgent requests for urgent ones; for `fcfs` ones the gateway keeps places free for urgent requests. "
    "An InferenceService's replicas run the policy its spec gives.",
)
@click.option("--max-queue", type=click.IntRange(min=1), default=DEFAULT_MAX_QUEUE, show_default=True)
@click.option(
    "--max-body-bytes", type=click.IntRange(min=1024), default=DEFAULT_MAX_BODY_BYTES, show_default=True
)
@click.option(
    "--max-buffered-body-bytes",
    type=click.IntRange(min=1024),
    default=DEFAULT_MAX_BUFFERED_BODY_BYTES,
    show_default=True,
    help="Bytes of request bodies held at once, all requests together; past them a request gets 429.",
)
@click.option("--max-attempts", type=click.IntRange(min=1), default=DEFAULT_MAX_ATTEMPTS, show_default=True)
@click.option(
    "--max-resumes",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_RESUMES,
    show_default=True,
    help="Times a completion or chat completion whose replica fails mid-stream (its connection broken, a 5xx "
    "error frame, a stall, a drain) is resumed on another replica; past them the client gets an error.",
)
@click.option(
    "--header-read-timeout",
    type=_SECONDS,
    default=DEFAULT_CLIENT_TIMEOUTS.header_read,
    show_default=True,
    help="Seconds a client has to send a request's headers (from connecting, or the previous response): "
    "408 after, and an idle connection is closed.",
)
@click.option(
    "--body-read-timeout",
    type=_SECONDS,
    default=DEFAULT_CLIENT_TIMEOUTS.body_read,
    show_default=True,
    help="Seconds a client has to send a request's whole body (408 after).",
)
@click.option(
    "--send-timeout",
    type=_SECONDS,
    default=DEFAULT_CLIENT_TIMEOUTS.send,
    show_default=True,
    help="Seconds a response may wait for a client that has stopped reading; then the connection is dropped "
    "and the replica's request aborted.",
)
@click.option(
    "--upstream-connect-timeout",
    type=_SECONDS,
    default=DEFAULT_UPSTREAM_TIMEOUTS.connect,
    show_default=True,
    help="Seconds to connect to a replica; past them the request is tried on another.",
)
@click.option(
    "--upstream-first-byte-timeout",
    type=_SECONDS,
    default=DEFAULT_UPSTREAM_TIMEOUTS.first_byte,
    show_default=True,
    help="Seconds a replica has to answer (a non-streamed completion answers when done); 504 after.",
)
@click.option(
    "--upstream-idle-timeout",
    type=_SECONDS,
    default=DEFAULT_UPSTREAM_TIMEOUTS.idle,
    show_default=True,
    help="Seconds a replica's response may go without a byte; then it is cut off.",
)
@click.option(
    "--upstream-stall-timeout",
    type=_SECONDS,
    default=DEFAULT_UPSTREAM_TIMEOUTS.stall,
    show_default=True,
    help="Seconds a completion's or chat completion's stream may go without a chunk; then it is resumed on "
    "another replica.",
)
@click.option(
    "--upstream-timeout",
    type=_SECONDS,
    default=DEFAULT_UPSTREAM_TIMEOUTS.total,
    show_default=True,
    help="Seconds a replica's whole response may take; then it is cut off.",
)
@click.option(
    "--prefill-timeout",
    type=_SECONDS,
    default=DEFAULT_UPSTREAM_TIMEOUTS.prefill,
    show_default=True,
    help="Seconds a prefill replica has to answer a prefill call (at most the first-byte timeout); after "
    "them (or a refused connection, a 5xx or an answer without kv_transfer_params) the decode replica "
    "computes the prompt itself.",
)
@click.option(
    "--forwarded-allow-ips",
    "trusted_proxies",
    default="",
    metavar="IP[/BITS],...",
    help="Proxies in front of the gateway whose X-Forwarded-For is kept (the peer is appended). Anyone "
    "else's is replaced by the peer's address.",
)
@click.option(
    "--adapter-poll-seconds",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_ADAPTER_POLL_SECONDS,
    show_default=True,
    help="How often each replica is asked which LoRA adapters it serves (its /metrics).",
)
@click.option(
    "--tokenizer",
    "tokenizers",
    multiple=True,
    metavar="NAME=PATH",
    help="The folder of model NAME's tokenizer and config files (repeatable), for the policies that route on "
    "a prompt's KV block hashes. A model without one has its files fetched from one of its kvfleet replicas.",
)
@click.option(
    "--otlp-traces-endpoint",
    metavar="URL",
    help="Each request's span (a child of the client's traceparent, the parent of the replicas' spans) goes "
    "to this OpenTelemetry collector over OTLP, gRPC or, with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
    "http/protobuf, HTTP; the spans' service is OTEL_SERVICE_NAME, kvfleet-gateway by default.",
    callback=lambda ctx, param, endpoint: _traces_endpoint(endpoint),
)
@click.option(
    "--sse-keep-alive-interval",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds a streamed completion, chat completion or response may wait for its first token (in the "
    "queue, for a replica woken from zero, for a prefill) before its stream opens and carries a "
    "`: keep-alive` comment each interval, so that load balancers with read timeouts keep it; a failure then "
    "ends the stream. 0 holds it silent.",
)
def gateway_command(
    host: str,
    port: int,
    models: tuple[str, ...],
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    pd_threshold_tokens: int,
    namespaces: tuple[str, ...],
    bare_name_namespace: str | None,
    kubeconfig: str | None,
    kube_context: str | None,
    policy: str,
    kv_events: tuple[str, ...],
    rehash_kv_events: tuple[str, ...],
    kv_index_max_blocks: int,
    prefix_chars: int,
    load_bound: float,
    max_in_flight: int,
    hold_seconds: float,
    scheduling_policy: SchedulingPolicy,
    max_queue: int,
    max_body_bytes: int,
    max_buffered_body_bytes: int,
    max_attempts: int,
    max_resumes: int,
    header_read_timeout: float,
    body_read_timeout: float,
    send_timeout: float,
    upstream_connect_timeout: float,
    upstream_first_byte_timeout: float,
    upstream_idle_timeout: float,
    upstream_stall_timeout: float,
    upstream_timeout: float,
    prefill_timeout: float,
    trusted_proxies: str,
    adapter_poll_seconds: float,
    tokenizers: tuple[str, ...],
    otlp_traces_endpoint: str | None,
    sse_keep_alive_interval: float,
) -> None:
    """Run the kvfleet fleet gateway: one OpenAI endpoint for every model."""
    defaults = ModelConfig(
        name="",
        endpoints=(),
        policy=policy,  # type: ignore[arg-type]  (click checked the choice)
        prefix_chars=prefix_chars,
        load_bound=load_bound,
        max_in_flight=max_in_flight,
        hold_seconds=hold_seconds,
        replicas_preempt=preempts(scheduling_policy),
        pd_threshold_tokens=pd_threshold_tokens,
    )
    gateway = Gateway(
        _discovery(models, prefill, decode, defaults, kubeconfig, kube_context, namespaces),
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        max_attempts=max_attempts,
        max_resumes=max_resumes,
        adapter_poll_seconds=adapter_poll_seconds,
        max_buffered_body_bytes=max_buffered_body_bytes,
        client_timeouts=ClientTimeouts(header_read_timeout, body_read_timeout, send_timeout),
        upstream_timeouts=UpstreamTimeouts(
            upstream_connect_timeout,
            upstream_first_byte_timeout,
            upstream_idle_timeout,
            upstream_timeout,
            prefill_timeout,
            upstream_stall_timeout,
        ),
        trusted_proxies=_networks(trusted_proxies),
        bare_name_namespace=_bare_name_namespace(bare_name_namespace, namespaces),
        kv_events_endpoints=_event_endpoints(kv_events, rehash_kv_events),
        kv_index_max_entries=kv_index_max_blocks,
        tokenizers=_local_tokenizers(tokenizers),
        otlp_traces_endpoint=otlp_traces_endpoint,
        sse_keep_alive_interval=sse_keep_alive_interval,
    )
    asyncio.run(_serve(gateway, host, port))


def _discovery(
    models: tuple[str, ...],
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    defaults: ModelConfig,
    kubeconfig: str | None,
    kube_context: str | None,
    namespaces: tuple[str, ...],
) -> Discovery:
    """The replicas given on the command line, or else the InferenceServices of the cluster's namespaces."""
    if models or prefill or decode:
        return StaticDiscovery(_static_models(models, defaults, prefill, decode))
    return _kubernetes_discovery(kubeconfig, kube_context, namespaces, defaults)


def _traces_endpoint(endpoint: str | None) -> str | None:
    """`--otlp-traces-endpoint`, refused where OpenTelemetry's settings name a protocol no exporter speaks."""
    if endpoint is not None:
        from kvfleet.runtime.tracing import traces_protocol

        try:
            traces_protocol()
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return endpoint


def _kubernetes_discovery(
    kubeconfig: str | None, kube_context: str | None, namespaces: tuple[str, ...], defaults: ModelConfig
) -> Discovery:
    from kvfleet.gateway.kube import KubernetesDiscovery

    # Only the credentials are used: the discovery makes its own connections, on the event loop.
    configuration = command_api_client(kubeconfig, kube_context, pool_size=1).configuration
    return KubernetesDiscovery(configuration, namespaces, defaults)


async def _serve(gateway: Gateway, host: str, port: int) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    runner = await gateway.start(host, port)
    logger.info("kvfleet gateway listening on %s:%d", host, port)
    try:
        await stopping.wait()
    finally:
        await runner.cleanup()
