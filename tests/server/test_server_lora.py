"""LoRA adapters through the official openai SDK against a real server, checked against Hugging Face PEFT:
adapters named at start and loaded at run time, listed in /v1/models, unloaded (then 404), bad ones refused
while other requests run on."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
import torch
from kvfleet.runtime.lora.make_adapter import make_adapter
from kvfleet.runtime.lora.request import source_digest
from peft import PeftModel
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from server_checks import RequestBeside, openai_error
from transformers import AutoModelForCausalLM, AutoTokenizer

if TYPE_CHECKING:
    from servers import ServerProcess

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "first": make_adapter(tiny_llama, root / "first", rank=8, seed=1),
        "second": make_adapter(
            tiny_llama, root / "second", rank=16, seed=2, target_modules=("q_proj", "v_proj")
        ),
        "too-big": make_adapter(tiny_llama, root / "too-big", rank=32, seed=3),
    }


@pytest.fixture(scope="module")
def lora_server(start_server: Callable[..., ServerProcess], adapters: dict[str, Path]) -> ServerProcess:
    return start_server(
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"first={adapters['first']}",
        "--allow-runtime-lora-updates",
        "--allowed-local-lora-path",
        str(adapters["first"].parent),
        api_key="lora-key",
    )


@pytest.fixture(scope="module")
def client(lora_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{lora_server.url}/v1", api_key=lora_server.api_key, max_retries=0, timeout=60
    )


def _peft_text(base: Path, adapter: Path | None) -> str:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    output = model.eval().generate(
        torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return AutoTokenizer.from_pretrained(base).decode(output[0, len(PROMPT) :])


def _complete(client: openai.OpenAI, model: str) -> str:
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert completion.model == model
    return completion.choices[0].text


def _post(server: ServerProcess, route: str, body: dict, *, key: str | None = "use") -> httpx.Response:
    headers = server.headers() if key == "use" else ({"Authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_models_lists_adapters_with_their_parent_and_no_path(
    client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    models = client.models.list()
    cards = {model.id: model for model in models.data}
    assert set(cards) == {"tiny", "first"}
    assert cards["first"].model_extra["parent"] == "tiny"
    assert cards["first"].model_extra["root"] == "first"
    assert cards["first"].model_extra["source_digest"] == source_digest(str(adapters["first"]))
    assert adapters["first"].parent.name not in models.model_dump_json()


def test_adapter_and_base_answers_match_peft(
    client: openai.OpenAI, tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    assert _complete(client, "first") == _peft_text(tiny_llama, adapters["first"])
    assert _complete(client, "tiny") == _peft_text(tiny_llama, None)


def test_load_use_unload_then_404(
    client: openai.OpenAI, lora_server: ServerProcess, tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    with pytest.raises(openai.NotFoundError):
        _complete(client, "second")
    loaded = _post(
        lora_server, "load_lora_adapter", {"lora_name": "second", "lora_path": str(adapters["second"])}
    )
    assert loaded.status_code == 200, loaded.text
    assert "second" in {model.id for model in client.models.list().data}
    assert _complete(client, "second") == _peft_text(tiny_llama, adapters["second"])
    # Chat names the adapter the same way, and the answer says which model served it.
    chat = client.chat.completions.create(
        model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0
    )
    assert chat.model == "second"

    unloaded = _post(lora_server, "unload_lora_adapter", {"lora_name": "second"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "second")
    assert "second" not in {model.id for model in client.models.list().data}
    assert openai_error(_post(lora_server, "unload_lora_adapter", {"lora_name": "second"}), 404)


def test_bad_loads_get_4xx_while_a_request_runs(
    lora_server: ServerProcess, tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    with RequestBeside(lora_server) as beside:
        cases = [
            ({"lora_name": "big", "lora_path": str(adapters["too-big"])}, 400, "--max-lora-rank"),
            ({"lora_name": "nowhere", "lora_path": "missing"}, 400, "cannot read"),
            ({"lora_name": "outside", "lora_path": str(tiny_llama)}, 400, "--allowed-local-lora-path"),
            ({"lora_name": "up", "lora_path": "../first"}, 400, "--allowed-local-lora-path"),
            ({"lora_name": "first", "lora_path": str(adapters["second"])}, 400, "already in use"),
            ({"lora_name": "tiny", "lora_path": str(adapters["second"])}, 400, "already in use"),
            (
                {"lora_name": "bad name!", "lora_path": str(adapters["second"])},
                400,
                "not a valid adapter name",
            ),
            ({"lora_name": 3, "lora_path": str(adapters["second"])}, 400, "lora_name"),
            ({"lora_name": "hub", "lora_path": "hf://org/adapter"}, 400, "--lora-download-dir"),
        ]
        for body, status, words in cases:
            error = openai_error(_post(lora_server, "load_lora_adapter", body), status)
            assert words in error["message"] or words == error["param"], error
        assert _post(lora_server, "load_lora_adapter", dict(cases[0][0]), key=None).status_code == 401
        assert beside.running


def test_non_finite_adapters_are_refused_naming_what_and_base_answers_stay_transformers(
    lora_server: ServerProcess,
    client: openai.OpenAI,
    tiny_llama: Path,
    adapters: dict[str, Path],
) -> None:
    """A NaN in one adapter's weights or config would turn every batch it shares to '' or a 500."""
    root = adapters["first"].parent
    nan_weight = make_adapter(tiny_llama, root / "nan-weight", rank=8)
    weights = load_file(nan_weight / "adapter_model.safetensors")
    poisoned = sorted(weights)[0]
    weights[poisoned][0, 0] = float("nan")
    save_file(weights, nan_weight / "adapter_model.safetensors")
    nan_alpha = make_adapter(tiny_llama, root / "nan-alpha", rank=8)
    config = json.loads((nan_alpha / "adapter_config.json").read_text())
    (nan_alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))

    with RequestBeside(lora_server) as beside:
        cases = [
            ("nan-weight", nan_weight, f"{poisoned} holds NaN or infinite values"),
            ("nan-alpha", nan_alpha, "lora_alpha must be a finite number"),
        ]
        for name, path, words in cases:
            error = openai_error(
                _post(lora_server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)}), 400
            )
            assert words in error["message"], error
        assert beside.running
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda model: _complete(client, model), ["tiny", "first", "tiny"]))
    assert answers == [
        _peft_text(tiny_llama, None),
        _peft_text(tiny_llama, adapters["first"]),
        _peft_text(tiny_llama, None),
    ]


def test_unloading_lets_running_requests_finish(
    lora_server: ServerProcess, adapters: dict[str, Path]
) -> None:
    assert (
        _post(
            lora_server, "load_lora_adapter", {"lora_name": "brief", "lora_path": str(adapters["second"])}
        ).status_code
        == 200
    )
    with RequestBeside(lora_server, model="brief") as beside:
        assert _post(lora_server, "unload_lora_adapter", {"lora_name": "brief"}).status_code == 200
        assert beside.running


def test_adapter_requests_are_counted(lora_server: ServerProcess, client: openai.OpenAI) -> None:
    def count(name: str) -> float:
        prefix = f'kvfleet:lora_requests_total{{lora_name="{name}",model_name="tiny"}} '
        text = httpx.get(f"{lora_server.url}/metrics").text
        return next(
            (float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0
        )

    before = count("first")
    _complete(client, "first")
    assert count("first") == before + 1


def test_metrics_list_each_served_adapter_without_the_api_key(
    lora_server: ServerProcess, adapters: dict[str, Path]
) -> None:
    """What the gateway reads to learn where an adapter runs and how its prompts' blocks are hashed: /metrics
    needs no key, /v1/models does. The lora_int_id follows the adapter's files, not its name."""

    def listed() -> dict[str, int]:
        text = httpx.get(f"{lora_server.url}/metrics").text
        return {
            sample.labels["lora_name"]: int(sample.labels["lora_int_id"])
            for family in text_string_to_metric_families(text)
            if family.name == "kvfleet:lora_adapter_info"
            for sample in family.samples
        }

    assert httpx.get(f"{lora_server.url}/v1/models").status_code == 401
    assert "first" in listed() and "listed" not in listed()
    for name in ("listed", "same-files"):
        loaded = _post(
            lora_server, "load_lora_adapter", {"lora_name": name, "lora_path": str(adapters["second"])}
        )
        assert loaded.status_code == 200
    ids = listed()
    assert {"first", "listed", "same-files"} <= set(ids)
    assert ids["listed"] == ids["same-files"] != ids["first"]
    for name in ("listed", "same-files"):
        assert _post(lora_server, "unload_lora_adapter", {"lora_name": name}).status_code == 200
    assert "listed" not in listed() and "first" in listed()


def test_runtime_updates_are_refused_unless_allowed(
    start_server: Callable[..., ServerProcess], adapters: dict[str, Path]
) -> None:
    server = start_server("--enable-lora", f"--lora-modules=first={adapters['first']}")
    error = openai_error(
        _post(
            server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["second"])}, key=None
        ),
        403,
    )
    assert "--allow-runtime-lora-updates" in error["message"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--lora-modules", "a=/tmp"], "needs --enable-lora"),
        (["--allowed-lora-hub-orgs", "acme"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "no-equals-sign"], "name=path"),
        (
            ["--enable-lora", "--allow-runtime-lora-updates", "--api-server-count", "2"],
            "--api-server-count 1",
        ),
    ],
)
def test_serve_refuses_bad_lora_options(tiny_llama: Path, args: list[str], words: str) -> None:
    result = subprocess.run(
        [sys.executable, "-P", "-m", "kvfleet", "serve", "--model", str(tiny_llama), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert words in result.stderr
