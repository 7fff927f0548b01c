"""Where an API server takes LoRA adapters from, and what serving many of them costs /metrics: folders only
under --allowed-local-lora-path (symlinks followed before the check), hub adapters only of
--allowed-lora-hub-orgs, and at most MAX_SERVED_ADAPTERS names, whose series leave /metrics with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.operator.scrape import DEFAULT_MAX_PAGE_BYTES
from kvfleet.runtime.lora.errors import LoRAAdapterError
from kvfleet.runtime.lora.make_adapter import make_adapter
from kvfleet.runtime.metrics import ServerMetrics
from kvfleet.runtime.serving.lora_adapters import MAX_SERVED_ADAPTERS, AdapterSources, LoRAAdapters

OUTSIDE = "adapters are read only from under --allowed-local-lora-path"


@pytest.fixture(scope="module")
def adapter_root(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The allowed root, and an adapter outside it."""
    root = tmp_path_factory.mktemp("root")
    make_adapter(tiny_llama, root / "inside", rank=4)
    outside = make_adapter(tiny_llama, tmp_path_factory.mktemp("elsewhere") / "outside", rank=4)
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    # A folder inside whose weights are a link to another folder's.
    (root / "file-link-out").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "file-link-out" / name).symlink_to(outside / name)
    return root, outside


def _adapters(
    tiny_llama: Path, root: Path, tmp_path: Path, hub_orgs: frozenset[str] | None = None
) -> LoRAAdapters:
    sources = AdapterSources(local_root=root, hub_orgs=hub_orgs)
    return LoRAAdapters(str(tiny_llama), ("tiny",), max_rank=8, download_dir=str(tmp_path), sources=sources)


def test_local_adapters_come_only_from_under_the_root(
    tiny_llama: Path, adapter_root: tuple[Path, Path], tmp_path: Path
) -> None:
    root, outside = adapter_root
    adapters = _adapters(tiny_llama, root, tmp_path)
    escape = Path("..") / outside.relative_to(root.parent)
    for source in [str(outside), "link-out", "file-link-out", str(escape), "/etc"]:
        with pytest.raises(LoRAAdapterError, match=OUTSIDE):
            adapters.add("bad", source)
    relative = adapters.add("relative", "inside")
    absolute = adapters.add("absolute", str(root / "inside"))
    assert relative.lora_path == absolute.lora_path == str((root / "inside").resolve())


def test_hub_adapters_come_only_from_allowed_orgs(
    tiny_llama: Path, adapter_root: tuple[Path, Path], tmp_path: Path
) -> None:
    adapters = _adapters(tiny_llama, adapter_root[0], tmp_path, hub_orgs=frozenset({"acme"}))
    with pytest.raises(LoRAAdapterError, match="only from --allowed-lora-hub-orgs"):
        adapters.add("hub", "hf://someone-else/adapter")
    assert not any(tmp_path.iterdir()), "nothing was fetched"


def test_served_names_are_bounded_and_their_series_leave_metrics_with_them(
    tiny_llama: Path, adapter_root: tuple[Path, Path], tmp_path: Path
) -> None:
    """Each served name has series in /metrics; past about 1,850 names the page outgrew what the operator
    reads, and unloaded names kept their counters."""
    adapters = _adapters(tiny_llama, adapter_root[0], tmp_path)
    metrics = ServerMetrics("tiny")
    metrics.set_lora_adapters_source(
        lambda: {served.lora.lora_name: served.lora.lora_int_id for served in adapters.loaded}
    )
    # The longest names an adapter may have, each with a request counted (and its tokens' series).
    names = [f"{index:03d}-".ljust(128, "x") for index in range(MAX_SERVED_ADAPTERS)]
    for name in names:
        adapters.add(name, "inside")
        metrics.track("standard", 3, name)
    with pytest.raises(LoRAAdapterError, match=f"serves {MAX_SERVED_ADAPTERS} adapters already"):
        adapters.add("one-more", "inside")
    page = metrics.render()
    assert len(page) < DEFAULT_MAX_PAGE_BYTES / 2, len(page)

    for name in names:
        adapters.remove(name)
        metrics.forget_lora(name)
    assert names[0].encode() not in metrics.render()
