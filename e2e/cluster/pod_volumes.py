"""Host folders that stand in for a pod's volumes, filled as a kubelet fills them.

hostPath is the host folder itself; emptyDir a fresh folder; configMap, secret and projected volumes are
written from the API (projected ones with the ServiceAccount token and downward API fields). Volumes of
other kinds are left out, so a container that mounts one fails to start.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .pod_spec import ContainerConfigError, ObjectLookup, referenced_data

# The pod's ServiceAccount token: pod -> token.
TokenSource = Callable[[Mapping[str, Any]], str]


class PodVolumes:
    def __init__(self, lookup: ObjectLookup, token: TokenSource) -> None:
        self.lookup = lookup
        self.token = token

    def materialize(self, pod: Mapping[str, Any], root: Path) -> dict[str, Path]:
        """volume name -> its host folder (for hostPath the host path itself, else a folder under root)."""
        volumes: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes", []):
            folder = self._folder(pod, volume, root / volume["name"])
            if folder is not None:
                volumes[volume["name"]] = folder
        return volumes

    def _folder(self, pod: Mapping[str, Any], volume: Mapping[str, Any], target: Path) -> Path | None:
        namespace = pod["metadata"]["namespace"]
        if "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            return host
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o777)  # as a kubelet makes it: any container user writes it
        elif "configMap" in volume or "secret" in volume:
            kind, source = (
                ("ConfigMap", volume["configMap"]) if "configMap" in volume else ("Secret", volume["secret"])
            )
            ref = {
                "name": source.get("name") or source.get("secretName"),
                "optional": source.get("optional", False),
            }
            data = referenced_data(self.lookup, kind, namespace, ref)
            _write_items(target, data or {}, source.get("items"))
        elif "projected" in volume:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for projection in volume["projected"].get("sources", []):
                self._project(target, pod, projection)
        else:
            return None
        return target

    def _project(self, target: Path, pod: Mapping[str, Any], source: Mapping[str, Any]) -> None:
        namespace = pod["metadata"]["namespace"]
        if "serviceAccountToken" in source:
            (target / source["serviceAccountToken"]["path"]).write_text(self.token(pod))
        elif "configMap" in source or "secret" in source:
            kind, ref = (
                ("ConfigMap", source["configMap"]) if "configMap" in source else ("Secret", source["secret"])
            )
            data = referenced_data(self.lookup, kind, namespace, ref)
            _write_items(target, data or {}, ref.get("items"))
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items", []):
                if "fieldRef" in item:
                    field = item["fieldRef"]["fieldPath"]
                    value = {"metadata.namespace": namespace, "metadata.name": pod["metadata"]["name"]}.get(
                        field
                    )
                    if value is None:
                        raise ContainerConfigError(f"unsupported downwardAPI field {field!r}")
                    (target / item["path"]).write_text(value)


def _write_items(target: Path, data: Mapping[str, str], items: list[dict[str, str]] | None) -> None:
    """The chosen keys (every key when no items are given) as files under target."""
    target.mkdir(parents=True, exist_ok=True)
    chosen = {item["key"]: item["path"] for item in items} if items else {key: key for key in data}
    for key, relative in chosen.items():
        if key in data:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            (target / relative).write_text(data[key])
