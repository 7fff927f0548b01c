"""A model's rotary position embedding settings as config.json gives them, and what they add to the
prefix cache's keys. Free of torch: a router computes the same block hashes as the engine."""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Their angles depend on the sequence's length as well as on the position (see RotaryEmbedding).
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def rope_cache_salt(rope: dict[str, Any], num_prompt_tokens: int) -> bytes | None:
    """What besides the tokens a prompt's KV depends on, for the prefix cache: with a length-dependent rope
    type, a prompt past the original length is rotated for its own length (`dynamic`) or with the long
    factors (`longrope`), so its blocks must not meet those of shorter prompts. None: only tokens count."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in LENGTH_DEPENDENT_ROPE_TYPES:
        return None
    if num_prompt_tokens <= rope["original_max_position_embeddings"]:
        return None
    return b"longrope:long" if rope_type == "longrope" else b"dynamic:%d" % num_prompt_tokens


def rope_parameters(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The rope settings with Transformers' defaults filled in, so that the layers read them directly."""
    # Transformers 5 writes `rope_parameters`; older checkpoints carry `rope_theta` and `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported; supported: {supported}")
    max_positions = int(raw.get("max_position_embeddings", 2048))
    if rope_type == "dynamic":
        # Transformers scales dynamic NTK from max_position_embeddings, whatever the parameters say.
        rope["original_max_position_embeddings"] = max_positions
    elif rope_type in ("yarn", "longrope", "llama3"):
        # Phi-3 style configs keep the pretraining length beside the rope parameters; it then wins.
        if raw.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = int(raw["original_max_position_embeddings"])
        rope.setdefault("original_max_position_embeddings", max_positions)
    if rope_type in ("yarn", "longrope") and rope.get("factor") is None:
        rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    required = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "longrope": ("short_factor", "long_factor"),
    }.get(rope_type, ())
    missing = [key for key in required if rope.get(key) is None]
    if missing:
        raise ValueError(f"{source}: rope_type {rope_type!r} needs {', '.join(missing)}")
    return rope
