"""A request's `kv_transfer_params` (vLLM's protocol), checked on arrival, and the KV digest that pairs the
blocks a prefill replica offers with the one request whose KV they are."""

from __future__ import annotations

import hashlib
import ipaddress
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvfleet.contract.kv_transfer import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
    TP_SIZE,
)
from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.multimodal.media_sources import IPNetwork
from kvfleet.runtime.request import Request

_KNOWN_KEYS = {
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
    REMOTE_BLOCK_IDS,
    REMOTE_REQUEST_ID,
    TP_SIZE,
}


@dataclass(frozen=True)
class RemoteDecode:
    """A prefill call: keep the prompt's blocks for a decode replica to pull."""


@dataclass(frozen=True)
class RemotePrefill:
    """A decode call: the prompt's KV waits on another replica, in these blocks under this transfer id."""

    engine_id: str
    host: str
    port: int
    block_ids: list[int]
    transfer_id: str


KVTransferRequest = RemoteDecode | RemotePrefill


def parse_kv_transfer_params(params: Any) -> KVTransferRequest | None:
    """The call the params make, or None when they ask for nothing; raises InvalidRequestError naming what is
    malformed."""
    if not isinstance(params, dict):
        raise InvalidRequestError("kv_transfer_params must be an object")
    unknown = sorted(set(params) - _KNOWN_KEYS)
    if unknown:
        raise InvalidRequestError(f"kv_transfer_params does not take {', '.join(unknown)}")
    remote_decode = _flag(params, DO_REMOTE_DECODE)
    remote_prefill = _flag(params, DO_REMOTE_PREFILL)
    if remote_decode and remote_prefill:
        raise InvalidRequestError(
            f"kv_transfer_params: {DO_REMOTE_DECODE} and {DO_REMOTE_PREFILL} exclude each other"
        )
    if remote_decode:
        return RemoteDecode()
    if not remote_prefill:
        return None
    missing = [
        key for key in (REMOTE_HOST, REMOTE_PORT, REMOTE_BLOCK_IDS, REMOTE_REQUEST_ID) if key not in params
    ]
    if missing:
        raise InvalidRequestError(f"kv_transfer_params with {DO_REMOTE_PREFILL} needs {', '.join(missing)}")
    host = params[REMOTE_HOST]
    try:
        ipaddress.ip_address(host)
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"kv_transfer_params.{REMOTE_HOST} must be an IP address, got {host!r}"
        ) from None
    port = params[REMOTE_PORT]
    if not _is_int(port) or not 0 < port < 65536:
        raise InvalidRequestError(f"kv_transfer_params.{REMOTE_PORT} must be a TCP port, got {port!r}")
    block_ids = params[REMOTE_BLOCK_IDS]
    if not isinstance(block_ids, list) or not block_ids or not all(_is_int(b) and b >= 0 for b in block_ids):
        raise InvalidRequestError(
            f"kv_transfer_params.{REMOTE_BLOCK_IDS} must be a non-empty list of block ids"
        )
    transfer_id = params[REMOTE_REQUEST_ID]
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= 128:
        raise InvalidRequestError(f"kv_transfer_params.{REMOTE_REQUEST_ID} must be a transfer id string")
    engine_id = params.get(REMOTE_ENGINE_ID, "")
    if not isinstance(engine_id, str):
        raise InvalidRequestError(f"kv_transfer_params.{REMOTE_ENGINE_ID} must be a string")
    tp_size = params.get(TP_SIZE, 1)
    if tp_size != 1 or isinstance(tp_size, bool):
        raise InvalidRequestError(
            f"kv_transfer_params.{TP_SIZE} must be 1 (one rank per replica), got {tp_size!r}"
        )
    return RemotePrefill(engine_id, host, port, list(block_ids), transfer_id)


def check_peer(remote: RemotePrefill, networks: Iterable[IPNetwork]) -> None:
    """Raises InvalidRequestError unless the prefill replica named is in the networks its peers live in."""
    address = ipaddress.ip_address(remote.host)
    if not any(address in network for network in networks if network.version == address.version):
        raise InvalidRequestError(
            f"kv_transfer_params.{REMOTE_HOST} {remote.host} is not in this replica's peer networks"
        )


def prefill_params(
    engine_id: str, host: str, port: int, block_ids: list[int], transfer_id: str
) -> dict[str, Any]:
    """What a prefill call answers: where its blocks wait, for the decode call."""
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        REMOTE_ENGINE_ID: engine_id,
        REMOTE_HOST: host,
        REMOTE_PORT: port,
        REMOTE_BLOCK_IDS: block_ids,
        REMOTE_REQUEST_ID: transfer_id,
        TP_SIZE: 1,
    }


def kv_digest(request: Request) -> bytes:
    """SHA-256 over what decides a prompt's KV besides the model: its adapter (by name, which both replicas
    share, where the adapter's number is each replica's own), its salts (the model's and the tenant's), its
    prompt tokens and its media items. Both sides compute it for their own request; blocks only move between
    requests whose digests agree."""
    hasher = hashlib.sha256(b"kvfleet-kv-digest-1")
    lora = request.lora_request
    hasher.update(b"lora:" + (lora.lora_name.encode() if lora is not None else b""))
    hasher.update(b"\0salt:" + (request.model_salt or b""))
    if request.cache_salt is not None:
        salt = request.cache_salt.encode()
        # Length-prefixed: the tenant chooses these bytes, which must not pass for the tokens that follow.
        hasher.update(b"\0cache_salt:" + len(salt).to_bytes(8, "big") + salt)
    hasher.update(b"\0tokens:" + array("q", request.prompt_token_ids).tobytes())
    for feature in request.mm_features:
        hasher.update(b"\0item:%d:" % feature.offset + feature.identifier)
    return hasher.digest()


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"kv_transfer_params.{key} must be true or false, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
