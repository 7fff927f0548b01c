"""The Hugging Face Hub as a source of weights: `hf://org/name[@revision]` URIs and downloads into a folder.

Torch-free: the operator validates the same URIs that the runtime fetches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HF_URI = re.compile(rf"^hf://(?P<org>{_PART})/(?P<name>{_PART})(@(?P<revision>[A-Za-z0-9._/-]+))?$")
# Weights, configs and tokenizer files: what loading a model or an adapter reads, without training leftovers.
WEIGHT_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]


class HubError(ValueError):
    """A URI that names no repository, or a download that failed; the message says which and why."""


@dataclass(frozen=True)
class HubRepository:
    repo_id: str
    # None: the default branch.
    revision: str | None = None


def parse_hf_uri(uri: str) -> HubRepository:
    match = _HF_URI.match(uri)
    if match is None:
        raise HubError(f"{uri!r}: expected hf://<org>/<name>[@<revision>]")
    if ".." in (match["org"], match["name"]):
        raise HubError(f"{uri!r}: '..' is not a repository name")
    return HubRepository(f"{match['org']}/{match['name']}", match["revision"])


def download(repository: HubRepository, dest: str | Path, *, must_contain: str) -> Path:
    """Fetch the repository's weight files into `dest`; an already complete `dest` is left as it is.

    Honours HF_TOKEN, HF_HOME and HF_ENDPOINT. `must_contain` names the file that makes the folder what the
    caller expects (config.json for a model, adapter_config.json for a LoRA adapter).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    name = repository.repo_id
    try:
        path = snapshot_download(
            name, revision=repository.revision, local_dir=dest, allow_patterns=WEIGHT_FILE_PATTERNS
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise HubError(f"cannot download {name}: {exc}") from exc
    if not (Path(path) / must_contain).is_file():
        raise HubError(f"{name} has no {must_contain}")
    return Path(path)
