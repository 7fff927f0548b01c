"""Model URIs: where a replica's weights come from and how they reach the pod.

- `hf://org/name[@revision]`: downloaded by an init container into a pod-local volume.
- `pvc://claim/path`: the claim is mounted read-only; the model is `path` inside it.
- `file:///path`: a path inside the pod's filesystem (baked into the image, or, with `model.hostPath`,
  the same path on the node mounted read-only).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Literal

from kvfleet.runtime.hub import HubError, parse_hf_uri

Scheme = Literal["hf", "pvc", "file"]

_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/.*)?$")
_MAX_CLAIM_NAME = 253


class ModelURIError(ValueError):
    """A model URI that names no model the operator can deliver to a pod."""


@dataclass(frozen=True)
class ModelSource:
    scheme: Scheme
    # hf: "org/name"; pvc: the claim name; file: the absolute path.
    location: str
    # hf: the revision (None means the default branch); pvc: the path inside the claim ("" is its root).
    detail: str | None = None


def parse_model_uri(uri: str) -> ModelSource:
    if uri.startswith("hf://"):
        try:
            repository = parse_hf_uri(uri)
        except HubError as error:
            raise ModelURIError(str(error)) from None
        return ModelSource("hf", repository.repo_id, repository.revision)
    if uri.startswith("pvc://"):
        match = _PVC.match(uri)
        if match is None or len(match["claim"]) > _MAX_CLAIM_NAME:
            raise ModelURIError(f"{uri!r}: expected pvc://<claim>/<path> with a valid claim name")
        return ModelSource("pvc", match["claim"], _relative_path(uri, match["path"] or "/"))
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not path.startswith("/") or path == "/":
            raise ModelURIError(f"{uri!r}: expected file:///<absolute path>")
        _reject_parent_steps(uri, path)
        return ModelSource("file", posixpath.normpath(path))
    raise ModelURIError(f"{uri!r}: the scheme must be hf://, pvc:// or file://")


def _relative_path(uri: str, path: str) -> str:
    _reject_parent_steps(uri, path)
    normalized = posixpath.normpath(path).lstrip("/")
    return "" if normalized == "." else normalized


def _reject_parent_steps(uri: str, path: str) -> None:
    # A '..' could climb out of the mounted claim or make two URIs name one folder differently.
    if ".." in path.split("/"):
        raise ModelURIError(f"{uri!r}: the path may not contain '..'")
