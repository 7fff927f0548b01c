"""`kvfleet operator`: run the operator (kopf) with leader election, metrics and a liveness endpoint."""

from __future__ import annotations

import json
import logging
import random
from typing import TYPE_CHECKING

import click
from kvfleet.operator.kube_client import command_api_client, credential_options

if TYPE_CHECKING:
    from kvfleet.operator.context import OperatorContext
    from kvfleet.operator.kube import KubeApi

logger = logging.getLogger(__name__)


@click.command("operator")
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Watch only this namespace (repeatable; globs allowed). Default: every namespace.",
)
@click.option(
    "--standalone",
    is_flag=True,
    help="Run without peering (no leader election): for a single replica, development and tests.",
)
@click.option(
    "--peering-name", default="kvfleet", show_default=True, help="Peering object replicas elect through."
)
@click.option(
    "--priority", type=int, default=None, help="Peering priority; random by default, so replicas never tie."
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    envvar="KVFLEET_METRICS_PORT",
    help="Port of the operator's Prometheus metrics (0: off).",
)
@click.option(
    "--health-port",
    type=click.IntRange(0, 65535),
    default=8081,
    show_default=True,
    help="Port of the liveness endpoint /healthz (0: off).",
)
@click.option(
    "--bind", default="0.0.0.0", show_default=True, help="Address of the metrics and health endpoints."
)
@click.option(
    "--runtime-image",
    envvar="KVFLEET_RUNTIME_IMAGE",
    default=None,
    help="Image of the runtime pods when a resource names none.  [default: kvfleet/runtime:0.1.0]",
)
@click.option(
    "--vllm-image",
    envvar="KVFLEET_VLLM_IMAGE",
    default=None,
    help="Image of the pods of resources with spec.engine.runtime vllm that name none (it runs `vllm "
    "serve`).  [default: vllm/vllm-openai:v0.32.0]",
)
@click.option("--cluster-domain", envvar="KVFLEET_CLUSTER_DOMAIN", default="cluster.local", show_default=True)
@click.option(
    "--priority-class-prefix",
    envvar="KVFLEET_PRIORITY_CLASS_PREFIX",
    default="kvfleet",
    show_default=True,
    help="The SLA tiers' PriorityClasses are <prefix>-<tier>: the chart sets its release's name.",
)
@click.option(
    "--service-monitor-labels",
    envvar="KVFLEET_SERVICE_MONITOR_LABELS",
    default="{}",
    show_default=True,
    help="Labels (a JSON object) of the ServiceMonitor made for each service where prometheus-operator is "
    "installed: what the cluster's Prometheus selects ServiceMonitors by.",
)
@click.option(
    "--kernel-cache-host-path",
    envvar="KVFLEET_KERNEL_CACHE_HOST_PATH",
    default=None,
    help="A node folder the runtime pods share their CPU kernel builds in (a hostPath volume), so that only "
    "a node's first pod compiles them; it must be writable by uid 1000. Unset: each pod builds in its own "
    "scratch volume, unless its image holds them prebuilt.",
)
@click.option(
    "--otlp-traces-endpoint",
    envvar="KVFLEET_OTLP_TRACES_ENDPOINT",
    default=None,
    help="An OpenTelemetry collector every runtime pod sends its requests' spans to, over OTLP (vLLM's "
    "--otlp-traces-endpoint, which both runtimes take); each pod names its InferenceService, namespace and "
    "pod in them. Unset: no spans.",
)
@click.option(
    "--otlp-traces-protocol",
    envvar="KVFLEET_OTLP_TRACES_PROTOCOL",
    type=click.Choice(["grpc", "http/protobuf"]),
    default="grpc",
    show_default=True,
    help="OTLP's protocol to that collector.",
)
@credential_options
@click.option(
    "--api-concurrency",
    type=click.IntRange(1, 256),
    default=32,
    show_default=True,
    help="API calls of the service loops in flight at once; the others wait, Deployment applies first.",
)
@click.option("--scrape-timeout", type=click.FloatRange(0.1, 30), default=1.5, show_default=True)
@click.option(
    "--scrape-max-bytes",
    type=click.IntRange(min=4096),
    envvar="KVFLEET_SCRAPE_MAX_BYTES",
    default=None,
    help="Bytes of a replica's /metrics page read at most; a larger page is cut off there and counts as a "
    "failed scrape.  [default: 1048576 (1 MiB)]",
)
@click.option(
    "--safety-defaults",
    envvar="KVFLEET_SAFETY_DEFAULTS",
    default="{}",
    show_default=True,
    help="The platform's safety policy (JSON, the runtime's --safety-config shape) under every service's "
    "spec.safety.",
)
@click.option(
    "--safety-allow-loosen",
    envvar="KVFLEET_SAFETY_ALLOW_LOOSEN",
    default="",
    help="What spec.safety may loosen of the defaults, comma-separated: level, action, checkers, failOpen, "
    "logContent.",
)
def operator_command(
    namespaces: tuple[str, ...],
    standalone: bool,
    peering_name: str,
    priority: int | None,
    metrics_port: int,
    health_port: int,
    bind: str,
    runtime_image: str | None,
    vllm_image: str | None,
    cluster_domain: str,
    priority_class_prefix: str,
    service_monitor_labels: str,
    kernel_cache_host_path: str | None,
    otlp_traces_endpoint: str | None,
    otlp_traces_protocol: str,
    kubeconfig: str | None,
    kube_context: str | None,
    api_concurrency: int,
    scrape_timeout: float,
    scrape_max_bytes: int | None,
    safety_defaults: str,
    safety_allow_loosen: str,
) -> None:
    """Run the kvfleet operator: InferenceServices in, autoscaled runtime fleets out."""
    import kopf
    import kvfleet.operator.handlers  # noqa: F401  (registers the handlers with kopf)
    import prometheus_client

    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        # kopf logs every handler call and the health endpoint every probe; keep warnings only.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    context = _operator_context(
        kubeconfig=kubeconfig,
        kube_context=kube_context,
        api_concurrency=api_concurrency,
        runtime_image=runtime_image,
        vllm_image=vllm_image,
        cluster_domain=cluster_domain,
        priority_class_prefix=priority_class_prefix,
        service_monitor_labels=service_monitor_labels,
        kernel_cache_host_path=kernel_cache_host_path,
        otlp_traces_endpoint=otlp_traces_endpoint,
        otlp_traces_protocol=otlp_traces_protocol,
        scrape_timeout=scrape_timeout,
        scrape_max_bytes=scrape_max_bytes,
        safety_defaults=safety_defaults,
        safety_allow_loosen=safety_allow_loosen,
    )
    if not standalone:
        _ensure_peering(context.kube, namespaces, peering_name)
    metrics_server = None
    if metrics_port:
        metrics_server, _ = prometheus_client.start_http_server(
            metrics_port, bind, registry=context.metrics.registry
        )
    elected_priority = priority if priority is not None else random.SystemRandom().randint(1, 2**31 - 1)
    logger.info(
        "kvfleet operator starting: %s, %s",
        "namespaces " + ", ".join(namespaces) if namespaces else "all namespaces",
        "standalone" if standalone else f"peering {peering_name!r} with priority {elected_priority}",
    )
    try:
        kopf.run(
            standalone=standalone,
            peering_name=None if standalone else peering_name,
            priority=elected_priority,
            namespaces=list(namespaces),
            clusterwide=not namespaces,
            liveness_endpoint=f"http://{bind}:{health_port}/healthz" if health_port else None,
            memo=kopf.Memo(kvfleet=context),
        )
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()


def _operator_context(
    *,
    kubeconfig: str | None,
    kube_context: str | None,
    api_concurrency: int,
    runtime_image: str | None,
    vllm_image: str | None,
    cluster_domain: str,
    priority_class_prefix: str,
    service_monitor_labels: str,
    kernel_cache_host_path: str | None,
    otlp_traces_endpoint: str | None,
    otlp_traces_protocol: str,
    scrape_timeout: float,
    scrape_max_bytes: int | None,
    safety_defaults: str,
    safety_allow_loosen: str,
) -> OperatorContext:
    """What every handler shares: the cluster's API, the render options and the scrape limits."""
    from kvfleet.operator.context import OperatorContext
    from kvfleet.operator.kube import KubeApi
    from kvfleet.operator.render import DEFAULT_RUNTIME_IMAGE, DEFAULT_VLLM_IMAGE, RenderOptions
    from kvfleet.operator.render_pod import TraceExport
    from kvfleet.operator.safety import SafetyPlatform
    from kvfleet.operator.scrape import DEFAULT_MAX_PAGE_BYTES

    kube = KubeApi(command_api_client(kubeconfig, kube_context, pool_size=api_concurrency))
    try:
        safety = SafetyPlatform.parse(safety_defaults, safety_allow_loosen)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--safety-defaults/--safety-allow-loosen") from None
    options = RenderOptions(
        runtime_image=runtime_image or DEFAULT_RUNTIME_IMAGE,
        vllm_image=vllm_image or DEFAULT_VLLM_IMAGE,
        cluster_domain=cluster_domain,
        priority_class_prefix=priority_class_prefix,
        service_monitor_labels=_labels(service_monitor_labels),
        safety=safety,
        kernel_cache_host_path=kernel_cache_host_path or None,
        # The chart sets the variable empty where it names no collector.
        traces=TraceExport(otlp_traces_endpoint, otlp_traces_protocol) if otlp_traces_endpoint else None,
    )
    return OperatorContext(
        kube=kube,
        render_options=options,
        scrape_timeout_seconds=scrape_timeout,
        scrape_max_page_bytes=DEFAULT_MAX_PAGE_BYTES if scrape_max_bytes is None else scrape_max_bytes,
        api_concurrency=api_concurrency,
    )


def _labels(text: str) -> dict[str, str]:
    try:
        labels = json.loads(text)
    except json.JSONDecodeError as error:
        raise click.BadParameter(str(error), param_hint="--service-monitor-labels") from None
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise click.BadParameter("a JSON object of strings", param_hint="--service-monitor-labels")
    return labels


def _ensure_peering(kube: KubeApi, namespaces: tuple[str, ...], peering_name: str) -> None:
    """The peering objects the replicas elect their leader through: one per namespace, or one for the
    cluster."""
    from kvfleet.operator.kube import KubeError

    try:
        if namespaces:
            for namespace in namespaces:
                kube.ensure_namespaced_peering(namespace, peering_name)
        else:
            kube.ensure_cluster_peering(peering_name)
    except KubeError as error:
        raise click.ClickException(
            f"cannot set up leader election through peering object {peering_name!r}: {error.message}; "
            "install the chart's CRDs, or pass --standalone for a single replica"
        ) from None
