"""The Hugging Face Hub as a source of weights: `hf://org/name[@revision]` URIs, downloads into a folder, and
models named by their Hub id, fetched into the Hugging Face cache as vLLM fetches them.

Torch-free: the operator validates the same URIs that the runtime fetches.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^{_PART}/{_PART}$")
_HF_URI = re.compile(rf"^hf://(?P<org>{_PART})/(?P<name>{_PART})(@(?P<revision>[A-Za-z0-9._/-]+))?$")
# Weights, configs and tokenizer files: what loading a model or an adapter reads, without training leftovers.
WEIGHT_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]
# What a tokenizer named apart from its model reads: the same, but for the weights.
TOKENIZER_FILE_PATTERNS = [pattern for pattern in WEIGHT_FILE_PATTERNS if pattern != "*.safetensors"]


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


def is_hub_id(model: str) -> bool:
    """`org/name`, as the Hub names repositories (a local path of that shape is looked for first)."""
    return _HUB_ID.match(model) is not None


def resolve_model(
    model: str,
    revision: str | None,
    *,
    allow_patterns: list[str] = WEIGHT_FILE_PATTERNS,
    cache_dir: str | None = None,
    token: str | None = None,
) -> str:
    """The local folder of `model`: `model` itself unless it names no path here and is a Hub id, which is
    then fetched into `cache_dir` or else the Hugging Face cache (HF_HOME, HF_HUB_CACHE) at `revision`, with
    huggingface_hub's progress bars, or read from it alone under HF_HUB_OFFLINE=1, with `token` (else
    HF_TOKEN's). Raises HubError in one line."""
    if Path(model).exists() or not is_hub_id(model):
        return model
    return str(_snapshot(HubRepository(model, revision), None, allow_patterns, cache_dir, token))


def download(repository: HubRepository, dest: str | Path, *, must_contain: str) -> Path:
    """Fetch the repository's weight files into `dest`; an already complete `dest` is left as it is.

    Honours HF_TOKEN, HF_HOME and HF_ENDPOINT. `must_contain` names the file that makes the folder what the
    caller expects (config.json for a model, adapter_config.json for a LoRA adapter).
    """
    path = _snapshot(repository, dest, WEIGHT_FILE_PATTERNS)
    if not (path / must_contain).is_file():
        raise HubError(f"{repository.repo_id} has no {must_contain}")
    return path


def _snapshot(
    repository: HubRepository,
    local_dir: str | Path | None,
    allow_patterns: list[str],
    cache_dir: str | None = None,
    token: str | None = None,
) -> Path:
    """snapshot_download, into `local_dir` or else the cache (`cache_dir`, or the Hugging Face cache), its
    failures told in one line."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name, revision = repository.repo_id, repository.revision or constants.DEFAULT_REVISION
    if local_dir is not None:
        where = str(local_dir)
    else:
        where = "the Hugging Face cache " + (cache_dir or constants.HF_HUB_CACHE)
    try:
        with _quiet_requests():
            path = snapshot_download(
                name,
                revision=revision,
                cache_dir=cache_dir,
                local_dir=local_dir,
                allow_patterns=allow_patterns,
                token=token,
            )
    except GatedRepoError:
        reason = (
            f"the repository is gated on {constants.ENDPOINT}: accept its terms there and set HF_TOKEN (or "
            "--hf-token)"
        )
    except RepositoryNotFoundError:
        reason = (
            f"no repository of that name on {constants.ENDPOINT} (a private one needs HF_TOKEN or --hf-token)"
        )
    except RevisionNotFoundError:
        reason = f"the repository has no revision {revision!r} on {constants.ENDPOINT}"
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            reason = f"HF_HUB_OFFLINE is set and {where} holds no complete copy at revision {revision!r}"
        else:
            cause = exc.__cause__ or exc
            reason = (
                f"{constants.ENDPOINT} cannot be reached ({_first_line(cause)}) and {where} holds no copy"
            )
    except (HfHubHTTPError, OSError) as exc:
        reason = _first_line(exc)
    else:
        return Path(path)
    raise HubError(f"cannot download {name}: {reason}")


@contextlib.contextmanager
def _quiet_requests() -> Iterator[None]:
    """Keeps httpx's line a request out of the log while huggingface_hub's progress bars tell the download."""
    requests = logging.getLogger("httpx")
    level = requests.level
    requests.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        requests.setLevel(level)


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
