"""A mixture-of-experts model (a tiny Mixtral) served through the openai SDK, its routing load on /metrics."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from servers import ServerProcess

MODEL_NAME = "tiny"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
_LAYER_SAMPLE = re.compile(r'(kvfleet:moe_\w+)\{layer="(\d+)",model_name="tiny"\} (\S+)')


@pytest.fixture(scope="module")
def mixtral(make_model: Callable[..., Path]) -> Path:
    return make_model("mixtral")


@pytest.fixture(scope="module")
def server(mixtral: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    # Without prefix caching every prompt token runs through the layers, which the test counts.
    return start_server("--no-enable-prefix-caching", model=mixtral)


def _layer_samples(server: ServerProcess) -> dict[str, dict[int, float]]:
    samples: dict[str, dict[int, float]] = {}
    for name, layer, value in _LAYER_SAMPLE.findall(httpx.get(f"{server.url}/metrics", timeout=10).text):
        samples.setdefault(name, {})[int(layer)] = float(value)
    return samples


def test_mixtral_serves_and_reports_its_routing(server: ServerProcess, mixtral: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a harbour."}], max_tokens=6, **GREEDY
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content
    kwargs = {"model": MODEL_NAME, "prompt": "Clouds drift over the harbour", "max_tokens": 5, **GREEDY}
    whole = client.completions.create(**kwargs)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs))
    assert streamed == whole.choices[0].text

    config = json.loads((mixtral / "config.json").read_text())
    top_k, num_experts = config["num_experts_per_tok"], config["num_local_experts"]
    # Each token a layer ran (every prompt token, every output but the last) went to top_k of its experts.
    usages = [chat.usage, whole.usage, whole.usage]
    routed = top_k * sum(usage.prompt_tokens + usage.completion_tokens - 1 for usage in usages)
    layers = set(range(config["num_hidden_layers"]))
    deadline = time.monotonic() + 30
    while True:
        samples = _layer_samples(server)
        counted = samples.get("kvfleet:moe_routed_tokens_total", {})
        if counted == dict.fromkeys(layers, routed) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counted == dict.fromkeys(layers, routed)
    for layer in layers:
        busiest = samples["kvfleet:moe_busiest_expert_tokens_total"][layer]
        assert routed / num_experts <= busiest <= routed
        imbalance = samples["kvfleet:moe_expert_load_imbalance"][layer]
        assert imbalance == pytest.approx(busiest / (routed / num_experts))
