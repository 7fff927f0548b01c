"""How the pod runner launches a container: as a local process, or from a local image with podman.

A local process gets the pod's view of the host: its program mapped to the executable here, its container
paths mapped to the folders that stand in for its volumes, its listen address bound to the pod's IP, and a
kubeconfig with the pod's ServiceAccount token. A container run from an image gets what a kubelet gives it
(pod_container.py), on the host network bound to the pod's IP, with in-cluster configuration.
"""

from __future__ import annotations

import os
import subprocess
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from images.build import podman, run_limits

from .pod_container import container_command, image_config, podman_run_options
from .pod_dns import PodDNS
from .pod_spec import bind_to_pod_ip, container_argv, container_mounts, cpu_threads, host_path
from .service_accounts import ServiceAccounts

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the host says of how OpenMP workers wait for work (see runtime/__init__.py).
OPENMP_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class Launch:
    """The command that runs a container, its environment and working folder, and the podman container's
    name when it runs from an image (None: a local process)."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    podman_name: str | None = None


class Launcher:
    """Turns a container of a pod, with its resolved environment and volume folders, into a Launch."""

    def __init__(
        self,
        work_dir: Path,
        programs: Mapping[str, str],
        container_images: Mapping[str, str],
        server: str,
        dns: PodDNS | None,
        accounts: ServiceAccounts,
    ) -> None:
        self.work_dir = work_dir
        # The commands the image provides: name -> executable on this host.
        self.programs = dict(programs)
        # Pod images whose containers run from a local image with podman: pod image -> local image.
        self.container_images = dict(container_images)
        self.server = server
        # The cluster DNS that pods' resolvers are pointed at; None: pods use the host's resolver.
        self.dns = dns
        self.accounts = accounts

    def launch(
        self,
        pod: Mapping[str, Any],
        spec: Mapping[str, Any],
        env: dict[str, str],
        volumes: Mapping[str, Path],
        pod_dir: Path,
    ) -> Launch:
        local_image = self.container_images.get(spec.get("image", ""))
        if local_image is not None:
            return self._from_image(pod, spec, local_image, env, volumes, pod_dir)
        return self._as_process(pod, spec, env, volumes, pod_dir)

    def exec_argv(self, launch: Launch, command: Sequence[str]) -> list[str]:
        """An exec probe's or hook's command: inside the container when it runs from an image, else on this
        host with the image's commands mapped to their executables."""
        if launch.podman_name is not None:
            return podman("exec", launch.podman_name, *command)
        argv = list(command)
        if argv and os.path.basename(argv[0]) in self.programs:
            argv[0] = self.programs[os.path.basename(argv[0])]
        return argv

    @staticmethod
    def remove(launch: Launch) -> None:
        """Removes a container run from an image, since a podman client killed after the grace period leaves
        its container running."""
        if launch.podman_name is not None:
            subprocess.run(podman("rm", "--force", "--time", "0", launch.podman_name), capture_output=True)

    def _from_image(
        self,
        pod: Mapping[str, Any],
        spec: Mapping[str, Any],
        image: str,
        env: dict[str, str],
        volumes: Mapping[str, Path],
        pod_dir: Path,
    ) -> Launch:
        meta = pod["metadata"]
        # In-cluster configuration as a kubelet gives it: the ServiceAccount's token, CA and namespace in the
        # projected volume the API server added to the pod, and the API server's address (here its own, since
        # Service IPs lead nowhere on this host).
        api_server = urllib.parse.urlsplit(self.server)
        env = {
            "KUBERNETES_SERVICE_HOST": str(api_server.hostname),
            "KUBERNETES_SERVICE_PORT": str(api_server.port),
            **env,
        }
        config = image_config(image)
        options = podman_run_options(pod["spec"], spec, env, volumes, config.get("User", ""))
        if self.dns is not None and self.dns.applies(pod):
            options += self.dns.podman_options(pod)
        entrypoint, args = container_command(
            spec, env, pod["status"]["podIP"], config.get("Entrypoint") or []
        )
        name = f"kvfleet-pod-{meta['uid'][:13]}-{spec['name']}"
        # The labels a kubelet's container runtime puts on a pod's containers.
        labels = {
            "io.kubernetes.pod.uid": meta["uid"],
            "io.kubernetes.pod.namespace": meta["namespace"],
            "io.kubernetes.pod.name": meta["name"],
            "io.kubernetes.container.name": spec["name"],
        }
        argv = podman(
            "run", "--rm", "--replace", "--name", name, "--network", "host", *run_limits(),
            *(f"--label={key}={value}" for key, value in labels.items()),
            *options, *entrypoint, image, *args,
        )  # fmt: skip
        # The podman client's own environment; the container's is in its options.
        client_env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}
        return Launch(argv=argv, env=client_env, cwd=pod_dir, podman_name=name)

    def _as_process(
        self,
        pod: Mapping[str, Any],
        spec: Mapping[str, Any],
        env: dict[str, str],
        volumes: Mapping[str, Path],
        pod_dir: Path,
    ) -> Launch:
        mounts = container_mounts(spec, volumes)
        argv = container_argv(spec, env, self.programs)
        argv = [argv[0], *(host_path(part, mounts) for part in argv[1:])]
        argv = bind_to_pod_ip(argv, pod["status"]["podIP"])
        if self.dns is not None and self.dns.applies(pod):
            argv = self.dns.process_argv(pod, pod_dir, argv)
        base = self._process_env(pod, spec, pod_dir)
        process_env = base | {name: host_path(value, mounts) for name, value in env.items()}
        for path in (base["HOME"], base["TMPDIR"]):
            Path(path).mkdir(parents=True, exist_ok=True)
        working_dir = spec.get("workingDir")
        cwd = Path(host_path(working_dir, mounts)) if working_dir else pod_dir
        cwd.mkdir(parents=True, exist_ok=True)
        return Launch(argv=argv, env=process_env, cwd=cwd)

    def _process_env(self, pod: Mapping[str, Any], spec: Mapping[str, Any], pod_dir: Path) -> dict[str, str]:
        """What a local process has where a container would have its image's environment and cgroup."""
        env = {
            "PATH": f"{Path(self.programs['kvfleet']).parent}{os.pathsep}{SYSTEM_PATH}",
            "HOME": str(self.work_dir / "home"),
            "TMPDIR": str(self.work_dir / "tmp"),
            "LANG": "C.UTF-8",
            "HOSTNAME": pod["metadata"]["name"],
            "PYTHONUNBUFFERED": "1",
        }
        threads = cpu_threads(spec)
        if threads is not None:
            # What a CPU limit would enforce through the cgroup, told to the thread pools instead.
            env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        # This cluster's nodes share the host's cores: its OpenMP wait policy holds in their pods too.
        env |= {name: os.environ[name] for name in OPENMP_WAITING if name in os.environ}
        kubeconfig = self.accounts.kubeconfig(pod, pod_dir)
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        return env
