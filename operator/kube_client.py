"""Kubernetes API credentials, shared by the operator and the gateway (which must not need kopf): the command
line's options that name them, and the API client made from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import click

if TYPE_CHECKING:
    from kubernetes import client

Command = TypeVar("Command", bound=Callable[..., object])


def credential_options(command: Command) -> Command:
    """`--kubeconfig` and `--context`, passed on as `kubeconfig` and `kube_context` (see make_api_client)."""
    command = click.option("--context", "kube_context", default=None, help="kubeconfig context.")(command)
    return click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None)(command)


def make_api_client(kubeconfig: str | None, context: str | None, pool_size: int) -> client.ApiClient:
    """An API client from a kubeconfig, or the pod's service account when running in a cluster."""
    # Imported here, so that the commands' --help does not wait for the client library.
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


def command_api_client(kubeconfig: str | None, context: str | None, pool_size: int) -> client.ApiClient:
    """make_api_client for a command: without credentials, it ends with the reason rather than a traceback."""
    from kubernetes import config

    try:
        return make_api_client(kubeconfig, context, pool_size)
    except config.ConfigException as error:
        raise click.ClickException(f"no cluster credentials (in-cluster or kubeconfig): {error}") from None
