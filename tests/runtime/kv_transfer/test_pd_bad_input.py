"""Bad kv_transfer_params and options: refused with a clear message on arrival, or (a transfer the prefill
replica does not know) answered by recompute; and --kv-transfer-config checked once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.messages import AddRequest
from kvfleet.runtime.errors import InvalidRequestError
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from pd_engines import decode, kv_transfer_config, make_llm, prefill, random_prompts, shutdown, stats

PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16


def _remote(**changes: Any) -> dict[str, Any]:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_host": "127.0.0.1",
        "remote_port": 4000,
        "remote_block_ids": [1, 2, 3],
        "remote_request_id": "ab" * 16,
        "tp_size": 1,
    }
    params.update(changes)
    return {key: value for key, value in params.items() if value is not None}


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Iterator[dict[str, LLM]]:
    llms = {
        "producer": make_llm(tiny_llama, "kv_producer"),
        "consumer": make_llm(tiny_llama, "kv_consumer"),
        "plain": make_llm(tiny_llama, None),
    }
    yield llms
    shutdown(*llms.values())


def _refusal(llm: LLM, kv_transfer_params: Any, n: int = 1) -> str:
    """The error the engine core answers the request with."""
    core = llm.llm_engine.engine_core
    params = SamplingParams(n=n, max_tokens=4, extra_args={"kv_transfer_params": kv_transfer_params})
    request_id = f"bad-{time.monotonic_ns()}"
    core.add_request(AddRequest(request_id, PROMPT, params, None, time.monotonic()))
    errors = core.step().errors
    assert [error.request_id for error in errors] == [request_id]
    assert errors[0].kind == InvalidRequestError.kind
    assert not core.has_unfinished_requests()
    return errors[0].message


@pytest.mark.parametrize(
    ("engine", "params", "n", "message"),
    [
        ("consumer", "not an object", 1, "kv_transfer_params must be an object"),
        ("consumer", _remote(do_remote_prefill="yes"), 1, "do_remote_prefill must be true or false"),
        ("consumer", _remote(remote_host=None), 1, "needs remote_host"),
        ("consumer", _remote(remote_block_ids=[1, "2", 3]), 1, "remote_block_ids must be a non-empty list"),
        ("consumer", _remote(remote_port=70000), 1, "remote_port must be a TCP port"),
        ("consumer", _remote(remote_host="decode-0"), 1, "remote_host must be an IP address"),
        ("consumer", {**_remote(), "remote_blocks": [1]}, 1, "does not take remote_blocks"),
        ("consumer", _remote(tp_size=2), 1, "tp_size must be 1"),
        ("consumer", _remote(remote_block_ids=[1, 2]), 1, "names 2 blocks; the prompt of 40 tokens takes 3"),
        ("consumer", _remote(remote_host="8.8.8.8"), 1, "8.8.8.8 is not in this replica's peer networks"),
        ("consumer", _remote(), 2, "one sequence (n=1)"),
        ("consumer", {"do_remote_decode": True}, 1, "role is kv_consumer, which takes no prefill calls"),
        ("producer", _remote(), 1, "role is kv_producer, which takes no decode calls"),
        ("plain", {"do_remote_decode": True}, 1, "started without --kv-transfer-config"),
        ("plain", _remote(), 1, "started without --kv-transfer-config"),
    ],
)
def test_bad_params_are_refused_on_arrival(
    engines: dict[str, LLM], engine: str, params: Any, n: int, message: str
) -> None:
    llm = engines[engine]
    free = llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_free_blocks
    assert message in _refusal(llm, params, n)
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_free_blocks == free


def test_an_unknown_transfer_is_recomputed(
    engines: dict[str, LLM], transformers_greedy: Callable[[list[list[int]]], list[list[int]]]
) -> None:
    producer, consumer = engines["producer"], engines["consumer"]
    prompts = random_prompts(2, [30], seed=9)
    params = prefill(producer, prompts)
    forged = [{**params[0], "remote_request_id": "cd" * 16}, params[1]]
    before = stats(consumer).kv_transfer_fallbacks.get("unknown_transfer", 0)
    assert decode(consumer, prompts, forged) == transformers_greedy(prompts)
    assert stats(consumer).kv_transfer_fallbacks.get("unknown_transfer", 0) - before == 1
    assert stats(consumer).kv_transfer_loads >= 1  # the other request's pull went through untouched


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_buffer_size": 1},
            "does not take kv_buffer_size",
        ),
        ({"kv_connector": "TcpConnector", "kv_role": "decoder"}, "kv_role must be one of"),
        (
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            "'NixlConnector' is not one of TcpConnector",
        ),
        (
            {**kv_transfer_config("kv_both"), "kv_load_failure_policy": "retry"},
            "kv_load_failure_policy must be",
        ),
        (kv_transfer_config("kv_both", hold_ttl=3), "does not take hold_ttl"),
        (kv_transfer_config("kv_both", hold_timeout_s=0), "hold_timeout_s must be positive"),
        (kv_transfer_config("kv_both", peer_networks=["10.0.0.0/33"]), "peer_networks"),
        ({**kv_transfer_config("kv_both"), "kv_ip": "pod-ip"}, "kv_ip must be an IP address"),
    ],
)
def test_bad_options_are_refused(tiny_llama: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_llama), kv_transfer_config=config)


def test_parallel_ranks_are_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_transfer_config needs tensor_parallel_size"):
        EngineConfig(
            model=str(tiny_llama), kv_transfer_config=kv_transfer_config("kv_both"), tensor_parallel_size=2
        )


def test_the_flag_takes_json_text() -> None:
    config = KVTransferConfig.parse(
        '{"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
        '{"load_timeout_s": 3, "peer_networks": ["10.1.0.0/16"]}}'
    )
    assert (config.is_producer, config.is_consumer, config.load_timeout_s) == (False, True, 3.0)
    assert [str(network) for network in config.peer_networks] == ["10.1.0.0/16"]
    assert config.engine_id  # one is made up when none is given
