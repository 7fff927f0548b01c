"""The server describes its routes in /openapi.json, and schemathesis, generating requests from that
description (valid and not), gets no 5xx from a real server."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from servers import ServerProcess

# Generation stays short whatever the fuzzer asks for: a 64-token context, few sequences, few tokens each.
# Rules check input and output, so that the fuzzer meets the guardrails and /v1/moderations too.
FUZZED_SERVER_ARGS = (
    *("--max-model-len", "64", "--max-n", "4", "--max-completion-tokens-per-prompt", "64"),
    *("--safety-config", '{"level": "high", "input": ["rules"], "output": ["rules"], "rules": {}}'),
)
# Per operation; about 450 cases in all.
MAX_EXAMPLES = 40
ROUTES = {
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
    ("get", "/v1/models"),
    ("get", "/health"),
    ("get", "/ping"),
    ("post", "/ping"),
    ("get", "/version"),
    ("get", "/ready"),
    ("get", "/metrics"),
    ("get", "/kvfleet/tokenizer"),
    ("post", "/v1/load_lora_adapter"),
    ("post", "/v1/unload_lora_adapter"),
    ("post", "/v1/moderations"),
    ("post", "/reset_prefix_cache"),
    ("post", "/v1/responses"),
    ("post", "/v1/messages"),
    ("post", "/v1/messages/count_tokens"),
    ("post", "/v1/embeddings"),
    ("post", "/pooling"),
    ("post", "/v1/score"),
    ("post", "/v1/rerank"),
}


@pytest.fixture(scope="module")
def fuzzed_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(*FUZZED_SERVER_ARGS)


def test_openapi_documents_every_route_with_its_body(fuzzed_server: ServerProcess) -> None:
    document = httpx.get(f"{fuzzed_server.url}/openapi.json", timeout=30).json()
    routes = {(method, path) for path, methods in document["paths"].items() for method in methods}
    assert routes == ROUTES
    # Clients generated from the document name a method by its operation id.
    operation_ids = [
        route["operationId"] for methods in document["paths"].values() for route in methods.values()
    ]
    assert len(operation_ids) == len(set(operation_ids))
    schemas = document["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
        ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
        ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest"),
        ("/v1/moderations", "ModerationRequest"),
        ("/v1/responses", "ResponsesRequest"),
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
        ("/v1/embeddings", "EmbeddingRequest"),
        ("/pooling", "PoolingRequest"),
        ("/v1/score", "ScoreRequest"),
        ("/v1/rerank", "RerankRequest"),
    ]:
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    assert {"prompt", "max_tokens", "n", "seed", "priority"} <= set(
        schemas["CompletionRequest"]["properties"]
    )
    # A prompt, or vLLM's prompt_embeds in its place.
    assert (
        "required" not in schemas["CompletionRequest"]
        and "prompt_embeds" in schemas["CompletionRequest"]["properties"]
    )
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]


def test_fuzzed_requests_get_no_server_error(fuzzed_server: ServerProcess, tmp_path: Path) -> None:
    # The schemathesis command, as a user runs it; a fixed seed keeps the cases the same from run to run.
    command = [sys.executable, "-P", "-m", "schemathesis.cli", "run", f"{fuzzed_server.url}/openapi.json"]
    command += ["--checks", "not_a_server_error", "--phases", "fuzzing", "--max-examples", str(MAX_EXAMPLES)]
    command += ["--workers", "1", "--seed", "0", "--no-color"]
    # The first request with a grammar starts a compile process, which imports xgrammar and Transformers:
    # seconds idle, past schemathesis' default 10 s limit on a busy 2-core machine. Latency is not checked
    # here.
    command += ["--request-timeout", "60"]
    completed = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", completed.stdout)
    assert generated is not None and generated[1] == generated[2], completed.stdout[-2000:]
    assert 100 <= int(generated[1]) <= 600, "a few hundred cases"
