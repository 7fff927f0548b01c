"""Model folders as sentence-transformers saves them, for the embeddings tests, whose oracle is
sentence-transformers itself: a copy of a model with a Pooling module, and a Normalize one if asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def sentence_transformers_folder(model: Path, folder: Path, pooling_mode: str, *, normalize: bool) -> Path:
    """`model` copied to `folder`, pooled by `pooling_mode` (a Pooling config key, e.g.
    pooling_mode_mean_tokens) and L2-normalized where `normalize` says."""
    shutil.copytree(model, folder)
    (folder / "modules.json").write_text(
        json.dumps([TRANSFORMER, POOLING, *([NORMALIZE] if normalize else [])])
    )
    hidden_size = json.loads((folder / "config.json").read_text())["hidden_size"]
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden_size, pooling_mode: True, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        (folder / "2_Normalize").mkdir()
    return folder
