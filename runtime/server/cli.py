"""`kvfleet serve`: the OpenAI-compatible server a fleet pod runs."""

from __future__ import annotations

import sys
from typing import Any

import click
from kvfleet.runtime.config import engine_config_from_options, engine_options
from kvfleet.runtime.server.priorities import DEFAULT_TIER, TIER_NAMES, TIERS
from kvfleet.runtime.server.state import DEFAULT_MAX_REQUEST_BODY_BYTES


@click.command("serve")
@click.option("--model", required=True, help="Hugging Face model folder to serve.")
@click.option("--served-model-name", default=None, help="Model name clients use; defaults to --model.")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--api-key", default=None, envvar="KVFLEET_API_KEY", help="Require `Authorization: Bearer KEY`."
)
@click.option(
    "--default-priority",
    type=click.Choice(TIER_NAMES),
    default=DEFAULT_TIER,
    show_default=True,
    help="SLA tier of requests that name none (body `priority` or header x-kvfleet-priority).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds in-flight requests get to finish after SIGTERM.",
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
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True, help="Only 1 is supported.")
@click.option("--access-log/--no-access-log", default=False, show_default=True)
@engine_options
def serve(
    model: str,
    served_model_name: str | None,
    host: str,
    port: int,
    api_key: str | None,
    default_priority: str,
    drain_timeout: float,
    max_waiting_requests: int | None,
    request_timeout: float | None,
    max_request_body_bytes: int,
    startup_request_timeout: float,
    api_server_count: int,
    tensor_parallel_size: int,
    access_log: bool,
    **options: Any,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API."""
    if tensor_parallel_size != 1:
        raise click.BadParameter(
            "only 1 is supported: kvfleet runs each model on one device", param_hint="--tensor-parallel-size"
        )
    try:
        config = engine_config_from_options(model, options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    from kvfleet.runtime.server.launcher import ServeOptions, run_server
    from kvfleet.runtime.server.state import ServerSettings

    settings = ServerSettings(
        served_model_name=served_model_name or model,
        api_key=api_key,
        default_priority=TIERS[default_priority],
        request_timeout=request_timeout,
        drain_timeout=drain_timeout,
        max_request_body_bytes=max_request_body_bytes,
    )
    options = ServeOptions(
        settings=settings,
        host=host,
        port=port,
        access_log=access_log,
        max_waiting_requests=max_waiting_requests,
        startup_request_timeout=startup_request_timeout,
        api_server_count=api_server_count,
        # `kvfleet bench static-server` passes its own EngineCore class as the context object.
        core_class=click.get_current_context().obj,
    )
    sys.exit(run_server(config, options))
