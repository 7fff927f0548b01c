"""Kubernetes API credentials, shared by the operator and the gateway (which must not need kopf)."""

from __future__ import annotations

from kubernetes import client, config


def make_api_client(kubeconfig: str | None, context: str | None, pool_size: int) -> client.ApiClient:
    """An API client from a kubeconfig, or the pod's service account when running in a cluster."""
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
