"""config.json `architectures` names -> model classes, extensible through the `kvfleet.models` entry points.

A plugin package declares, e.g. in its pyproject.toml:
    [project.entry-points."kvfleet.models"]
    MyForCausalLM = "my_package.model:MyForCausalLM"

A model class is built as `cls(model_config, attention_backend, max_position)` and provides
`forward(input_ids, positions, kv_caches, plan) -> hidden` (positions [3, num_tokens] when the config's
rope has an `mrope_section`: the engine computes them per request), `compute_logits(hidden) -> float32
logits` and `load_weights(iterable of (checkpoint name, tensor))`, like `LlamaForCausalLM`. To run split
between tensor- or pipeline-parallel ranks it also provides `checkpoint_slice(name, shape)` and builds its
shard from `kvfleet.runtime.distributed.parallel.parallel_context()`. A model that takes images or audio
also provides `embed_multimodal(modality, data, unpadded_lengths) -> one [tokens, hidden] tensor per item`
and `embed_input_ids(input_ids)`, and its forward accepts `inputs_embeds` (see `ConditionalGeneration`).
A mixture-of-experts model may report how its routers spread tokens: `expert_load() -> list[MoeLayerLoad]`.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Only named here: `kvfleet serve` reads which architectures exist before it loads torch.
    from torch import nn

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvfleet.models"

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "kvfleet.runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvfleet.runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "kvfleet.runtime.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "kvfleet.runtime.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "kvfleet.runtime.models.moe:MoeForCausalLM",
    "Qwen3MoeForCausalLM": "kvfleet.runtime.models.moe:MoeForCausalLM",
    "LlavaForConditionalGeneration": "kvfleet.runtime.models.llava:LlavaForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": (
        "kvfleet.runtime.models.qwen2_audio:Qwen2AudioForConditionalGeneration"
    ),
    "Qwen2_5OmniThinkerForConditionalGeneration": (
        "kvfleet.runtime.models.qwen2_5_omni:Qwen2_5OmniThinkerForConditionalGeneration"
    ),
}
# Architectures refused with the reason, where another one is what to serve.
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Qwen2_5OmniForConditionalGeneration": (
        "a whole Qwen2.5-Omni (thinker, talker and speech decoder) is not served: kvfleet answers in text, "
        "which is the thinker's part; serve a folder of its thinker alone "
        "(Qwen2_5OmniThinkerForConditionalGeneration)"
    ),
}


class ModelRegistry:
    """Built-in architectures plus those installed packages register; plugins cannot shadow built-ins."""

    def __init__(self, *, load_plugins: bool = True) -> None:
        self._targets: dict[str, str] = dict(_BUILTIN)
        self._classes: dict[str, type[nn.Module]] = {}
        if load_plugins:
            for entry_point in entry_points(group=ENTRY_POINT_GROUP):
                if entry_point.name in _BUILTIN:
                    logger.warning("ignoring plugin %s: %s is built in", entry_point.value, entry_point.name)
                    continue
                self._targets[entry_point.name] = entry_point.value

    @property
    def supported_architectures(self) -> list[str]:
        return sorted(set(self._targets) | set(self._classes))

    def register(self, architecture: str, model_class: type[nn.Module]) -> None:
        self._classes[architecture] = model_class

    def resolve(self, architecture: str) -> type[nn.Module]:
        if architecture in self._classes:
            return self._classes[architecture]
        if architecture not in self._targets:
            raise ValueError(
                f"model architecture {architecture!r} is not supported; supported: "
                + ", ".join(self.supported_architectures)
            )
        module_name, _, attribute = self._targets[architecture].partition(":")
        try:
            model_class = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"cannot load the class for {architecture!r} ({self._targets[architecture]}): {exc}"
            ) from exc
        self._classes[architecture] = model_class
        return model_class
