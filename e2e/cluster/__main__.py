"""python -m e2e.cluster build | up [--detach] | down: the local cluster from a shell (from the repo root).

`up` starts a cluster and holds it until Ctrl-C or SIGTERM; with --detach it keeps running in the background
and `down` stops it. State, logs and the admin kubeconfig live in the cluster's folder (--dir, default
$KVFLEET_CACHE/clusters/<name>).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from images.build import missing_images, pod_images

from .attached import READY_MARKER
from .binaries import ensure_binaries
from .cluster import ClusterConfig, LocalCluster, default_cache_dir, describe
from .fake_nodes import NodeShape
from .processes import Ledger, process_start_ticks, stop_group

SUPERVISOR_FILE = "supervisor.json"


def cluster_dir(args: argparse.Namespace) -> Path:
    return Path(args.dir) if args.dir else default_cache_dir() / "clusters" / args.name


def _stop_requested(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def up(args: argparse.Namespace) -> int:
    directory = cluster_dir(args)
    missing = missing_images() if args.images else []
    if missing:
        print(f"not built: {', '.join(missing)}; run `make images` first", file=sys.stderr)
        return 1
    if args.detach:
        return detach(args, directory)
    config = ClusterConfig(
        nodes=args.nodes,
        node_shape=NodeShape(gpus=args.gpus_per_node),
        pod_runner=not args.no_pod_runner,
        container_images=pod_images() if args.images else {},
    )
    (directory / READY_MARKER).unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, _stop_requested)
    try:
        with LocalCluster(directory, config) as cluster:
            info = describe(cluster)
            (directory / READY_MARKER).write_text(json.dumps(info, indent=1))
            print(json.dumps(info, indent=1), flush=True)
            print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
            print("cluster running; Ctrl-C stops it", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping the cluster", file=sys.stderr, flush=True)
    finally:
        (directory / READY_MARKER).unlink(missing_ok=True)
    return 0


def detach(args: argparse.Namespace, directory: Path) -> int:
    """Starts `up` in the background and returns once the cluster is ready (or has failed)."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / SUPERVISOR_FILE).exists():
        down(args)  # a cluster of this name already runs (or died): replace it
    ensure_binaries()  # shows build progress here rather than in the background log
    argv = [sys.executable, "-m", "e2e.cluster", "up", "--dir", str(directory), "--nodes", str(args.nodes)]
    argv += ["--gpus-per-node", str(args.gpus_per_node)] + (["--no-pod-runner"] if args.no_pod_runner else [])
    argv += ["--images"] if args.images else []
    log_path = directory / "supervisor.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    ticks = process_start_ticks(process.pid)
    (directory / SUPERVISOR_FILE).write_text(json.dumps({"pid": process.pid, "start_ticks": ticks}))
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if (directory / READY_MARKER).exists():
            print((directory / READY_MARKER).read_text(), flush=True)
            print(f"export KUBECONFIG={directory / 'admin.kubeconfig'}", flush=True)
            return 0
        if process.poll() is not None:
            break
        time.sleep(0.5)
    print(
        f"the cluster did not become ready; log {log_path}:\n{log_path.read_text()[-4000:]}", file=sys.stderr
    )
    down(args)
    return 1


def down(args: argparse.Namespace) -> int:
    """Stops a detached cluster: its supervisor by PID, then anything its ledger still lists."""
    directory = cluster_dir(args)
    supervisor = directory / SUPERVISOR_FILE
    if supervisor.exists():
        entry = json.loads(supervisor.read_text())
        if process_start_ticks(entry["pid"]) == entry["start_ticks"]:
            stop_group(entry["pid"], grace_seconds=90.0)
        supervisor.unlink()
    leftovers = Ledger(directory / "processes.json").stop_all()
    if leftovers:
        print(f"stopped leftover processes: {', '.join(leftovers)}", file=sys.stderr)
    print(f"cluster in {directory} stopped", file=sys.stderr)
    return 0


def build(args: argparse.Namespace) -> int:
    print(ensure_binaries(args.names))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the control plane's binaries (once; cached)")
    build_parser.add_argument("names", nargs="*", help="binaries to build (default: all)")
    build_parser.set_defaults(run=build)
    for name, run, help_text in [("up", up, "start a cluster"), ("down", down, "stop a detached cluster")]:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--name", default="default", help="cluster name (its folder under the cache)")
        sub.add_argument("--dir", default=None, help="cluster folder (overrides --name)")
        sub.set_defaults(run=run)
        if name == "up":
            sub.add_argument("--nodes", type=int, default=4)
            sub.add_argument("--gpus-per-node", type=int, default=8)
            sub.add_argument("--no-pod-runner", action="store_true", help="kwok fakes every pod, none runs")
            sub.add_argument(
                "--images",
                action="store_true",
                help="run kvfleet's pods from the images `make images` built (podman), not as processes",
            )
            sub.add_argument("--detach", action="store_true", help="run in the background until `down`")
            sub.add_argument(
                "--timeout", type=float, default=300.0, help="seconds --detach waits for readiness"
            )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("KVFLEET_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(name)s: %(message)s",
    )
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
