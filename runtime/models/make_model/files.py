"""Writing a made model's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_weights(path: Path, tensors: dict[str, Any], dtype_name: str | None) -> None:
    """Each tensor cast to `dtype_name`, or as it is with None (a quantized checkpoint's mix of dtypes)."""
    import torch
    from safetensors.torch import save_file

    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
